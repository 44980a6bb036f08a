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
