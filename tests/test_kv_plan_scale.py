"""The KV switch's metadata decoding and plans, vectorised, against the one-page-at-a-time reference.

`switch.kv_meta.decode_meta` and `switch.kv_plan.Planner` must give what tests/kv_plan_reference.py gives on
every state: the same moves in the same order, owners, new page tables, free and reserved units, and the same
refusal (its reason too) when a state does not fit or the ranks disagree.
"""
import numpy as np
import pytest

from mooncake_ep_switch.layouts import EP, TP
from mooncake_ep_switch.switch.kv_cache import KVCacheConfig
from mooncake_ep_switch.switch.kv_meta import KVRequest, RankMeta, decode_meta, encode_meta
from mooncake_ep_switch.switch.kv_plan import Planner
from tests.kv_plan_reference import ReferencePlanner, reference_decode_meta
from tests.kv_workloads import ep_metas, serving_metas, tp_metas


def _same_plan(got, want) -> None:
    assert got.refused == want.refused
    assert (got.source, got.target) == (want.source, want.target)
    assert got.moves.dtype == np.int64 and got.moves.shape == want.moves.shape
    assert np.array_equal(got.moves, want.moves)
    assert got.owner == want.owner
    assert got.new_requests == want.new_requests and list(got.new_requests) == list(want.new_requests)
    for name in ("new_free", "reserved"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == np.bool_ and np.array_equal(a, b), name


def _plans(config, ranks, metas, target):
    source = EP if target == TP else TP
    for rank in range(ranks):
        yield (Planner(config, ranks, rank, source).plan(metas, target),
               ReferencePlanner(config, ranks, rank, source).plan(metas, target))


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("seed", range(12))
def test_ep_to_tp_plans_match_the_reference(ranks, seed):
    rng = np.random.default_rng(seed * 10 + ranks)
    units = ranks * int(rng.integers(8, 40))
    metas = ep_metas(rng, ranks, units, int(rng.integers(0, 8)), share=0.4, busy=float(rng.choice([0.0, 0.3, 0.8])))
    config = KVCacheConfig(1, ranks, 8, 4, units)
    for got, want in _plans(config, ranks, metas, TP):
        _same_plan(got, want)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("seed", range(12))
def test_tp_to_ep_plans_match_the_reference(ranks, seed):
    rng = np.random.default_rng(seed * 10 + ranks + 1000)
    units = ranks * int(rng.integers(8, 40))
    metas = tp_metas(rng, ranks, units, int(rng.integers(0, 10)), share=0.5, busy=float(rng.choice([0.0, 0.2, 0.6])))
    config = KVCacheConfig(1, ranks, 8, 4, units)
    for got, want in _plans(config, ranks, metas, EP):
        _same_plan(got, want)


def _tp_case(rng, ranks=3, units=48):
    metas = tp_metas(rng, ranks, units, 6, share=0.6, busy=0.0)
    return metas, KVCacheConfig(1, ranks, 8, 4, units)


@pytest.mark.parametrize("how", ["layout", "other-requests", "other-tokens", "fewer-pages", "sharing", "capacity",
                                 "sharing-then-layout"])
def test_refusals_match_the_reference(how):
    """Each way the ranks' states can disagree, or not fit, is refused with the reference's reason."""
    rng = np.random.default_rng(7)
    metas, config = _tp_case(rng)
    while not any(len(set(r.pages)) < len(r.pages) or r.pages for r in metas[1].requests.values()):
        metas, config = _tp_case(rng)
    one = dict(metas[1].requests)
    rid = sorted(one)[-1]
    req = one[rid]
    if how == "layout":
        metas[2] = RankMeta(EP, metas[2].requests, metas[2].free)
    elif how == "other-requests":
        one[rid + 100] = one.pop(rid)
    elif how == "other-tokens":
        one[rid] = KVRequest(req.num_tokens, req.prompt_len + 1, req.pages)
    elif how == "fewer-pages":
        one[rid] = KVRequest(req.num_tokens, req.prompt_len, req.pages[:-1])
    elif how in ("sharing", "sharing-then-layout"):  # two requests' first pages: one page on rank 1 only
        if how == "sharing-then-layout":  # and rank 2 in another layout: rank 1's fault is named, as rank by rank
            metas[2] = RankMeta(EP, metas[2].requests, metas[2].free)
        first, second = sorted(one)[:2]
        one[second] = KVRequest(one[second].num_tokens, one[second].prompt_len,
                                (one[first].pages[0],) + one[second].pages[1:])
    elif how == "capacity":
        metas = [RankMeta(m.layout, m.requests, np.zeros_like(m.free)) for m in metas]
    if how not in ("layout", "capacity"):
        metas[1] = RankMeta(TP, one, metas[1].free)
    for got, want in _plans(config, 3, metas, EP):
        assert want.refused, how
        _same_plan(got, want)


def test_a_request_on_two_owners_is_refused_as_the_reference():
    rng = np.random.default_rng(3)
    metas = ep_metas(rng, 2, 32, 4)
    while not (metas[0].requests and metas[1].requests):
        metas = ep_metas(rng, 2, 32, 4)
    moved = dict(metas[1].requests)
    moved[min(metas[0].requests)] = next(iter(moved.values()))
    metas[1] = RankMeta(EP, moved, metas[1].free)
    for got, want in _plans(KVCacheConfig(1, 2, 8, 4, 32), 2, metas, TP):
        assert "is on ranks" in want.refused
        _same_plan(got, want)


@pytest.mark.parametrize("layout", [EP, TP])
@pytest.mark.parametrize("seed", range(8))
def test_decoded_metadata_matches_the_reference(layout, seed):
    rng = np.random.default_rng(seed + (0 if layout == EP else 100))
    ranks, units = 4, 64
    make = ep_metas if layout == EP else tp_metas
    config = KVCacheConfig(1, ranks, 8, 4, units)
    for meta in make(rng, ranks, units, 8, share=0.5):
        data = encode_meta(meta, config)
        got, want = decode_meta(data, config, ranks), reference_decode_meta(data, config, ranks)
        assert got.layout == want.layout and got.requests == want.requests and np.array_equal(got.free, want.free)
        assert list(got.requests) == list(want.requests)


def _corruptions(data: np.ndarray, rng: np.random.Generator):
    """Damaged copies of an encoded state: one to three words set to a random, extreme or shifted value, or cut
    short (several faults: the one a record-by-record walk meets first must be named)."""
    for _ in range(150):
        bad = data.copy()
        for at in rng.integers(0, data.size, size=int(rng.integers(1, 4))).tolist():
            bad[at] = int(rng.choice([-1, 0, 1, 2, 3, 1 << 40, int(bad[at]) + 1, int(bad[at]) - 1, 7, 99]))
        yield bad
    for cut in (1, 3, data.size // 2):
        yield data[:-cut]


@pytest.mark.parametrize("layout", [EP, TP])
def test_corrupt_metadata_is_refused_exactly_when_the_reference_refuses_it(layout):
    """Every damaged state: both refuse it with the same ValueError ("metadata: ..."), or both decode it to the same
    state."""
    rng = np.random.default_rng(11 if layout == EP else 12)
    ranks, units = 2, 32
    config = KVCacheConfig(1, ranks, 8, 4, units)
    make = ep_metas if layout == EP else tp_metas
    metas = [m for m in make(rng, ranks, units, 6, share=0.5) if m.requests]
    refused = 0
    for bad in _corruptions(encode_meta(metas[0], config), rng):
        try:
            want = reference_decode_meta(bad, config, ranks)
        except ValueError as error:
            with pytest.raises(ValueError) as got:
                decode_meta(bad, config, ranks)
            assert str(got.value) == str(error) and str(error).startswith("metadata: ")
            refused += 1
            continue
        got = decode_meta(bad, config, ranks)
        assert got.requests == want.requests and np.array_equal(got.free, want.free) and got.layout == want.layout
    assert refused > 60


@pytest.mark.parametrize("layout, target", [(EP, TP), (TP, EP)])
def test_serving_scale_plans_match_the_reference(layout, target):
    """Larger states (R=4, 64 requests of 256 tokens, 1024 pages): same plan as the reference."""
    ranks = 4
    metas, units = serving_metas(layout, ranks, 64, 256)
    config = KVCacheConfig(1, ranks, 8, 16, units)
    for rank in (0, ranks - 1):
        _same_plan(Planner(config, ranks, rank, layout).plan(metas, target),
                   ReferencePlanner(config, ranks, rank, layout).plan(metas, target))


def test_the_plan_benchmark_script_runs():
    """scripts/kv_plan_bench.py at a small shape: a row for decoding, for each plan (both ways checked equal), for
    the copy blocks and for every peer's blocks in one pass (checked equal to the per-peer ones)."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "scripts/kv_plan_bench.py", "--ranks", "2", "3", "--requests", "12",
                          "--tokens", "70", "--repeat", "1", "--layers", "3", "--kv-heads", "6"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.findall(r"KVPLAN (decode|plan tp->ep|plan ep->tp|copy blocks|every peer's).* R=(\d) .*ours [\d.]+ ms "
                       r"reference [\d.]+ ms", run.stdout)
    kinds = ("decode", "plan tp->ep", "plan ep->tp", "copy blocks", "every peer's")
    assert sorted(found) == sorted((what, r) for what in kinds for r in "23"), run.stdout


@pytest.mark.parametrize("sending", [True, False])
def test_moves_by_peer_splits_as_one_filter_per_peer(sending):
    """`kv_plan.moves_by_peer`: for every peer, exactly the rows a filter on (rank, peer) selects, in plan order."""
    from mooncake_ep_switch.switch.kv_plan import moves_by_peer

    rng = np.random.default_rng(5)
    moves = rng.integers(0, 4, size=(500, 5)).astype(np.int64)
    moves[:, 1] = np.arange(500)  # tells the rows apart
    for rank in range(4):
        parts = moves_by_peer(moves, rank, sending, 4)
        for peer in range(4):
            src, dst = (rank, peer) if sending else (peer, rank)
            assert np.array_equal(parts[peer], moves[(moves[:, 0] == src) & (moves[:, 2] == dst)])
    assert [part.shape for part in moves_by_peer(np.zeros((0, 5), dtype=np.int64), 0, sending, 3)] == [(0, 5)] * 3
