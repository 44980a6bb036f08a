"""Unit tests of the logical -> physical dispatch maps against independent references."""
from collections import Counter

import numpy as np
import pytest
import torch

from mooncake_ep_switch.eplb import (
    build_dispatch_map,
    logical_to_physical,
    placement_from_phy2log,
    place_experts,
    spread_to_physical,
)


def test_every_entry_points_at_a_copy_of_its_expert():
    rng = np.random.default_rng(0)
    weight = rng.zipf(1.5, (3, 32)).astype(float)
    placement = place_experts(weight, 48, 4, 2, 8)
    dispatch = build_dispatch_map(placement, num_gpus=8, ranks_per_host=4)
    assert dispatch.shape == (8, 3, 32) and dispatch.dtype == torch.int64
    table = placement.phy2log.numpy()
    for rank in range(8):
        for layer in range(3):
            assert (table[layer, dispatch[rank, layer].numpy()] == np.arange(32)).all()


def test_local_then_host_then_spread():
    # 8 GPUs, 4 per host, 2 slots per GPU. Expert 0 has copies on GPUs 0 and 1 (host 0).
    phy2log = np.array([[0, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    dispatch = build_dispatch_map(phy2log, num_gpus=8, ranks_per_host=4)[:, 0, 0].numpy()
    slot_gpu = dispatch // 2
    assert slot_gpu[0] == 0 and slot_gpu[1] == 1  # own copy
    assert set(slot_gpu[2:4].tolist()) == {0, 1}  # same host, one rank each
    users = Counter(slot_gpu.tolist())
    assert users[0] == users[1] == 4  # host 1's ranks split evenly too
    # A single-copy expert: everyone uses it.
    assert (build_dispatch_map(phy2log, 8, 4)[:, 0, 5].numpy() == 6).all()


def test_same_host_copy_preferred_over_remote():
    # 4 GPUs, 2 per host, 2 slots per GPU; expert 0 on GPU 1 (host 0) and GPU 3 (host 1).
    phy2log = np.array([[1, 2, 0, 3, 4, 5, 0, 6]])
    dispatch = build_dispatch_map(phy2log, num_gpus=4, ranks_per_host=2)[:, 0, 0].numpy()
    assert (dispatch // 2).tolist() == [1, 1, 3, 3]


def test_logical_to_physical_keeps_minus_one_and_matches_a_loop():
    rng = np.random.default_rng(1)
    row = rng.permutation(16)
    topk = rng.integers(-1, 16, (10, 3))
    expected = [[row[v] if v >= 0 else -1 for v in line] for line in topk.tolist()]
    out = logical_to_physical(torch.as_tensor(topk), torch.as_tensor(row))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    assert out.tolist() == expected
    assert logical_to_physical(topk.astype(np.int32), row).tolist() == expected


def test_spread_uses_every_copy_evenly():
    phy2log = np.array([[0, 1, 0, 2, 0, 3, 4, 5]])  # expert 0: slots 0, 2, 4
    placement = placement_from_phy2log(phy2log, num_logical=6, num_gpus=4)
    topk = np.zeros((30, 1), dtype=np.int64)
    out = spread_to_physical(topk, placement.log2phy[0], placement.logcnt[0], source_rank=2)
    table = placement.phy2log.numpy()[0]
    assert (table[out.ravel()] == 0).all()
    assert sorted(Counter(out.ravel().tolist()).values()) == [10, 10, 10]
    mixed = spread_to_physical(np.array([[-1, 3]]), placement.log2phy[0], placement.logcnt[0])
    assert mixed[0, 0] == -1 and table[mixed[0, 1]] == 3


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: build_dispatch_map(np.zeros((1, 8), dtype=np.int64), 4, 3), ValueError, "ranks_per_host: expected a divisor of num_gpus=4, got 3"),
        (lambda: build_dispatch_map(np.array([[0, 2, 0, 2]]), 2, 1), ValueError, "has none of expert 1"),
        (lambda: build_dispatch_map(np.zeros((1, 6), dtype=np.int64), 4, 2), ValueError, "slot count divisible by num_gpus=4"),
        (lambda: logical_to_physical(np.array([[0, 5]]), np.arange(4)), ValueError, "topk_idx: expected values < 4, got a maximum of 5"),
        (lambda: logical_to_physical(np.array([[0, -2]]), np.arange(4)), ValueError, "topk_idx: expected values >= -1"),
        (lambda: logical_to_physical(torch.zeros(2, 2), np.arange(4)), TypeError, "topk_idx: expected an int32 or int64 tensor"),
        (lambda: logical_to_physical(np.zeros(2, dtype=np.int64), np.arange(4)), ValueError, "topk_idx: expected 2 dimensions"),
    ],
)
def test_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _placement_with(bad_id):
    placement = placement_from_phy2log(np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), num_logical=4, num_gpus=4)
    table = placement.phy2log.clone()
    table[0, 5] = bad_id
    return placement._replace(phy2log=table)


@pytest.mark.parametrize(
    "call, error, match",
    [
        # A corrupted id would size a [G, L, max + 1] map: 2^34 -> 128 GiB before it was caught.
        (lambda: build_dispatch_map(np.array([[0, 1, 2, 1 << 34]]), 2, 1), ValueError,
         r"phy2log: expected logical experts < 4 .* got a maximum of 17179869184"),
        (lambda: build_dispatch_map(np.array([[0, 1, 2, -1]]), 2, 1), ValueError, "phy2log: expected values >= 0"),
        (lambda: build_dispatch_map(_placement_with(1 << 34), 4, 2), ValueError,
         "phy2log: expected values < 4, got a maximum of 17179869184"),
        (lambda: build_dispatch_map(_placement_with(-1), 4, 2), ValueError, "phy2log: expected values >= 0"),
        (lambda: build_dispatch_map(np.zeros((1, 4), dtype=np.int64), 0, 1), ValueError, "num_gpus: expected an int >= 1"),
        (lambda: build_dispatch_map(np.zeros((1, 4), dtype=np.int64), 8, 1), ValueError,
         "phy2log: expected a slot count divisible by num_gpus=8"),
        (lambda: build_dispatch_map(np.zeros((1, 4), dtype=np.int64), 2, 0), ValueError, "ranks_per_host: expected an int >= 1"),
    ],
    ids=["bare-2^34", "bare-negative", "placement-2^34", "placement-negative", "zero-gpus", "more-gpus-than-slots",
         "zero-ranks-per-host"],
)
def test_corrupt_or_senseless_sizes_fail_fast(call, error, match):
    import time

    started = time.monotonic()
    with pytest.raises(error, match=match):
        call()
    assert time.monotonic() - started < 1.0


def test_recorder_remap_refuses_ids_outside_the_slots():
    import time

    from mooncake_ep_switch.eplb import ExpertLoadRecorder

    recorder = ExpertLoadRecorder(1, 4, 2)
    old = np.array([[0, 1, 2, 3]])
    started = time.monotonic()
    with pytest.raises(ValueError, match="new_phy2log: expected values < 4, got a maximum of 17179869184"):
        recorder.remap(old, np.array([[0, 1, 2, 1 << 34]]))
    assert time.monotonic() - started < 1.0
    recorder.remap(old, np.array([[3, 2, 1, 0]]))  # still usable


# ---------------------------------------------------------------------------------------------
# Serving through a death: the maps with a mask (issue 36 item 1)
# ---------------------------------------------------------------------------------------------

def _copies_by_loop(table, num_logical, alive, slots_per_rank):
    """{(layer, expert): [live slots ascending]}, by plain loops."""
    result = {}
    for layer, row in enumerate(table.tolist()):
        for expert in range(num_logical):
            result[(layer, expert)] = [s for s, e in enumerate(row) if e == expert and alive[s // slots_per_rank]]
    return result


def _random_case(seed):
    rng = np.random.default_rng(seed)
    weight = rng.zipf(1.4, (4, 24)).astype(float)
    placement = place_experts(weight, 48, 4, 2, 8)  # 8 GPUs of 6 slots, 24 redundant copies
    alive = np.ones(8, dtype=np.int32)
    alive[rng.choice(8, size=int(rng.integers(1, 4)), replace=False)] = 0
    return placement, alive


@pytest.mark.parametrize("seed", range(6))
def test_masked_map_uses_live_copies_only_and_reports_the_lost(seed):
    from mooncake_ep_switch.eplb import live_copies

    placement, alive = _random_case(seed)
    table = placement.phy2log.numpy()
    base = build_dispatch_map(placement, num_gpus=8, ranks_per_host=4).numpy()
    masked = build_dispatch_map(placement, num_gpus=8, ranks_per_host=4, active_ranks=torch.from_numpy(alive)).numpy()
    copies = _copies_by_loop(table, 24, alive, 6)
    live = live_copies(placement, 8, alive)
    lost = 0
    for (layer, expert), slots in copies.items():
        assert bool(live.lost[layer, expert]) == (not slots)
        assert int(live.logcnt[layer, expert]) == len(slots)
        assert live.log2phy[layer, expert, :len(slots)].tolist() == slots
        for rank in range(8):
            got = int(masked[rank, layer, expert])
            if not slots:
                assert got == -1
            elif base[rank, layer, expert] in slots:
                assert got == base[rank, layer, expert], "a live choice must be kept"
            else:
                assert got in slots
        lost += not slots
    assert 0 < lost < 24 * 4  # every seed masks a rank holding the only copy of some expert


@pytest.mark.parametrize("seed", range(6))
def test_masked_map_spreads_the_load_evenly_over_live_copies(seed):
    placement, alive = _random_case(seed)
    base = build_dispatch_map(placement, 8, 4).numpy()
    masked = build_dispatch_map(placement, 8, 4, active_ranks=alive).numpy()
    copies = _copies_by_loop(placement.phy2log.numpy(), 24, alive, 6)
    sources = [r for r in range(8) if alive[r]]
    checked = 0
    for (layer, expert), slots in copies.items():
        if len(slots) < 2:
            continue
        kept = Counter(int(base[r, layer, expert]) for r in sources if base[r, layer, expert] in slots)
        after = Counter(int(masked[r, layer, expert]) for r in sources)
        before_spread = max(kept[s] for s in slots) - min(kept[s] for s in slots)
        spread = max(after[s] for s in slots) - min(after[s] for s in slots)
        assert spread <= max(1, before_spread), (layer, expert, slots, kept, after)
        assert sum(after.values()) == len(sources)
        checked += len(sources) != sum(kept.values())  # some source had to move
    assert checked, "the case should move some source onto a multi-copy expert"


def test_masked_map_of_the_all_live_mask_is_the_unmasked_map():
    placement, _ = _random_case(0)
    everyone = np.ones(8, dtype=bool)
    assert torch.equal(build_dispatch_map(placement, 8, 4, active_ranks=everyone), build_dispatch_map(placement, 8, 4))


def test_logical_to_physical_maps_an_expert_without_live_copy_to_minus_one():
    row = np.array([4, -1, 2, 0])
    out = logical_to_physical(np.array([[0, 1], [-1, 3], [1, 2]]), row)
    assert out.tolist() == [[4, -1], [-1, 0], [-1, 2]]


def test_spread_over_live_copies_only():
    # 4 ranks x 2 slots; expert 0 on slots 0 (rank 0), 2 (rank 1), 6 (rank 3); expert 3 only on slot 7 (rank 3).
    phy2log = np.array([[0, 1, 0, 2, 1, 2, 0, 3]])
    placement = placement_from_phy2log(phy2log, num_logical=4, num_gpus=4)
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    topk = np.stack([np.zeros(40, dtype=np.int64), np.full(40, 3)], axis=1)
    out = spread_to_physical(topk, placement.log2phy[0], placement.logcnt[0], source_rank=1, active_ranks=mask,
                             slots_per_rank=2)
    assert sorted(Counter(out[:, 0].tolist()).items()) == [(0, 20), (2, 20)]  # rank 3's copy gets nothing
    assert (out[:, 1] == -1).all()  # expert 3: no live copy
    # Without a mask: all three copies.
    plain = spread_to_physical(topk[:, :1], placement.log2phy[0], placement.logcnt[0])
    assert sorted(Counter(plain[:, 0].tolist())) == [0, 2, 6]


def test_rerouted_entries_spread_evenly_over_live_copies():
    from mooncake_ep_switch.eplb.live import compact_live, lost_entries, reroute_entries, slot_ok
    from mooncake_ep_switch.eplb.policy.tables import replica_tables

    # 4 ranks x 2 slots: expert 0 on slots 0 (rank 0), 2 (rank 1), 6 (rank 3); expert 3 only on slot 7.
    table = np.array([0, 1, 0, 2, 1, 2, 0, 3])
    alive = np.array([True, True, True, False])
    log2phy, _ = replica_tables(table[None], 4, 3)
    live, count = compact_live(log2phy[0], alive, 2)
    row = np.array([6, 1, -1, 7])  # this rank's map: experts 0 and 3 on rank 3, expert 2 on no slot
    topk = np.array([[0, 3]] * 30 + [[1, -1]] * 2 + [[2, 1]] * 4)
    physical = np.where(topk >= 0, row[np.maximum(topk, 0)], -1)
    ok = slot_ok(alive, 2)
    out = reroute_entries(topk, physical.copy(), row, live, count, ok, first_token=5)
    assert sorted(Counter(out[:30, 0].tolist()).items()) == [(0, 15), (2, 15)]
    assert (out[:30, 1] == -1).all() and out[30:32].tolist() == [[1, -1]] * 2
    assert sorted(Counter(out[32:, 0].tolist()).items()) == [(3, 2), (5, 2)]  # a -1 row entry with live copies
    assert lost_entries(topk, out, ok) == 30
    assert lost_entries(topk, physical, ok) == 64  # unrouted: 0 and 3 on rank 3, 2 on no slot
    assert lost_entries(topk, physical, slot_ok(np.ones(4, dtype=bool), 2)) == 4


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: build_dispatch_map(np.arange(8)[None], 4, 2, active_ranks=np.ones(3, dtype=np.int32)), ValueError,
         r"active_ranks: expected shape \[4\], got numpy.ndarray of shape \[3\]"),
        (lambda: build_dispatch_map(np.arange(8)[None], 4, 2, active_ranks=torch.ones(4)), TypeError,
         "active_ranks: expected an integer or bool dtype, got torch.Tensor of shape \\[4\\] and dtype torch.float32"),
        (lambda: build_dispatch_map(np.arange(8)[None], 4, 2, active_ranks=[1, 1, 1, 0]), TypeError,
         "active_ranks: expected a torch.Tensor or numpy.ndarray, got list"),
        (lambda: build_dispatch_map(np.arange(8)[None], 4, 2, active_ranks=np.array([1, 2, 1, 1])), ValueError,
         "active_ranks: expected 0 \\(masked\\) or 1 \\(live\\) entries, got 1..2"),
        (lambda: spread_to_physical(np.zeros((1, 1), dtype=np.int64), np.array([[0]]), np.array([1]),
                                    active_ranks=np.ones(2, dtype=np.int32)), ValueError,
         "active_ranks: expected together with slots_per_rank"),
        (lambda: spread_to_physical(np.zeros((1, 1), dtype=np.int64), np.array([[0]]), np.array([1]),
                                    active_ranks=np.ones((2, 2), dtype=np.int32), slots_per_rank=1), ValueError,
         r"active_ranks: expected shape \[2\]"),
        (lambda: spread_to_physical(np.zeros((1, 1), dtype=np.int64), np.array([[5]]), np.array([1]),
                                    active_ranks=np.ones(2, dtype=np.int32), slots_per_rank=2), ValueError,
         "log2phy_row: expected slots < 4"),
    ],
    ids=["short", "float", "list", "two", "no-slots-per-rank", "2d", "slot-past-mask"],
)
def test_bad_masks_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_live_copies_refuses_a_bad_mask():
    from mooncake_ep_switch.eplb import live_copies

    with pytest.raises(ValueError, match=r"active_ranks: expected shape \[2\]"):
        live_copies(np.array([[0, 1, 1, 0]]), 2, np.ones(4, dtype=np.int32))
