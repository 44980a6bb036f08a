"""Elastic recovery: ranks die at chosen points, survivors keep serving, replacements are admitted.

Every case: a full round, a round in which rank(s) die (os._exit or SIGKILL) at a kill point and
survivors return within the deadline with exact partial results, then replacement processes with
the same rank ids join, every rank calls update_ep_member(), and three full rounds are exactly
correct on every rank. Buffer addresses (the region, the zero-copy combine buffers) never change.
Inputs are derived from (rank, round) so that no collective is needed after a failure.
"""
import os
import time

import pytest
import torch

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.elastic import join
from tests import harness
from tests.test_faults import Shape, _check_round, _dispatch_view, _mock_expert
from tests.reference import structured_inputs, token_count

NUM_RANKS = 4
# "cuda": rank processes share one GPU (time-sliced without MPS), so a live peer can be slices late.
TIMEOUT_US_BY_TRANSPORT = {"shm": harness.FAULT_TIMEOUT_US, "mooncake": harness.FAULT_TIMEOUT_US_TE,
                           "collective": harness.FAULT_TIMEOUT_US, "cuda": 3_000_000}
SLACK_S = harness.FAULT_SLACK_S
RECOVERY_TIMEOUT_S = 30.0
_STATE = {}


def _inputs(rank, round_index):
    n = token_count(rank, NUM_RANKS, Shape.tokens)
    return structured_inputs(rank, n, Shape.hidden, Shape.experts, Shape.top_k, seed=500 + round_index,
                             random_values=True)


def _size():
    return Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, NUM_RANKS, Shape.experts)


def _addresses(buffer):
    if buffer.transport == "collective":
        return []
    shape = (Shape.experts // NUM_RANKS, NUM_RANKS * Shape.tokens, Shape.hidden)
    halves = [buffer._impl.combine_buffer(call, shape, "cpu").data_ptr() for call in (0, 1)]
    return [buffer._impl.base] + halves


def _round(ctx, buffer, round_index, active, expect_dead=(), dispatch_dead=None):
    """One dispatch + combine; checks against the references for who took part. On a "cuda" Buffer
    the inputs go to its device and the outputs come back for the checks (tests/test_cuda.py)."""
    all_inputs = [_inputs(r, round_index) for r in range(ctx.num_ranks)]
    mine = all_inputs[ctx.rank]
    dev = buffer.device or "cpu"
    x, topk, weights = mine.x.to(dev), mine.topk_idx.to(dev), mine.weights.to(dev)
    start = time.monotonic()
    timeout_us = TIMEOUT_US_BY_TRANSPORT[buffer.transport]
    recv, count, handle, _, _ = buffer.dispatch(x, topk, active, Shape.tokens, Shape.experts, timeout_us,
                                                use_fp8=False)
    after_dispatch = active.tolist()
    combined, _, _ = buffer.combine(_mock_expert(ctx, recv.cpu()).to(dev), topk, weights, active, timeout_us, handle)
    combined, recv, count, handle = combined.cpu(), recv.cpu(), count.cpu(), (handle[0].cpu(),)  # all in order
    seconds = time.monotonic() - start
    final = active.tolist()
    want = [0 if r in expect_dead else 1 for r in range(ctx.num_ranks)]
    assert final == want, f"mask {final}, expected {want}"
    in_dispatch = after_dispatch if dispatch_dead is None else \
        [0 if r in dispatch_dead else 1 for r in range(ctx.num_ranks)]
    _check_round(ctx, all_inputs, in_dispatch, final, recv, count, handle, combined)
    return seconds


def rank_fail(ctx, transport, dead, kill_point, how):
    """Round 0 whole; in round 1 the `dead` ranks die at `kill_point`; survivors check partial results."""
    if ctx.rank in dead and kill_point == "mid_dispatch":
        os.environ["MEP_FAULT_POINT"] = f"dispatch_after_data:{ctx.rank}:2:{'exit' if how == 'exit' else 'kill'}"
    buffer = Buffer(ctx.group, _size(), disable_p2p=transport == "mooncake", transport=transport)
    os.environ.pop("MEP_FAULT_POINT", None)
    _STATE["buffer"] = buffer
    before = _addresses(buffer)
    _round(ctx, buffer, 0, torch.ones(ctx.num_ranks, dtype=torch.int32))
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    if ctx.rank in dead and kill_point == "before_dispatch":
        harness_die(how)
    if kill_point == "between":
        # Everyone dispatches; the dead ranks die before combine.
        all_inputs = [_inputs(r, 1) for r in range(ctx.num_ranks)]
        mine = all_inputs[ctx.rank]
        start = time.monotonic()
        timeout_us = TIMEOUT_US_BY_TRANSPORT[transport]
        recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts,
                                                    timeout_us, use_fp8=False)
        after_dispatch = active.tolist()
        if ctx.rank in dead:
            harness_die(how)
        combined, _, _ = buffer.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active,
                                        timeout_us, handle)
        seconds = time.monotonic() - start
        want = [0 if r in dead else 1 for r in range(ctx.num_ranks)]
        assert active.tolist() == want
        in_dispatch = _dispatch_view("between", after_dispatch, want, buffer.transport)
        _check_round(ctx, all_inputs, in_dispatch, want, recv, count, handle, combined)
    else:
        # before_dispatch: the dead never send; mid_dispatch: their rows land, their signals never
        # do, so survivors must not read those rows.
        seconds = _round(ctx, buffer, 1, active, expect_dead=dead, dispatch_dead=dead)
    return {"seconds": seconds, "addresses": before}


def harness_die(how):
    from tests.test_faults import _die

    _die(how)


def rank_recover(ctx, transport, joiners, die_during_update=None):
    """Admit `joiners` (this process is one of them if it has no group), then three full rounds."""
    if die_during_update is not None and ctx.rank == die_during_update:
        os.environ["MEP_FAULT_POINT"] = f"update_after_ready:{ctx.rank}:*:kill"
    if ctx.group is None:  # a replacement process
        ticket = join(ctx.store, ctx.rank, ctx.num_ranks)
        buffer = Buffer(ticket, _size(), disable_p2p=transport == "mooncake", transport=transport)
        _STATE["buffer"] = buffer
    else:
        buffer = _STATE["buffer"]
        buffer._fault = None if die_during_update != ctx.rank else __import__(
            "mooncake_ep_switch.faults", fromlist=["FaultPoint"]).FaultPoint.parse(os.environ["MEP_FAULT_POINT"])
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not set(joiners) <= set(buffer.pending_joiners()):
            assert time.monotonic() < deadline, "joiners never showed up"
            time.sleep(0.01)
    started = time.monotonic()
    view = buffer.update_ep_member(timeout_s=RECOVERY_TIMEOUT_S)
    seconds = time.monotonic() - started
    return {"view": list(view.ranks), "epoch": view.epoch, "seconds": seconds}


def rank_full_rounds(ctx, first_round, rounds=3):
    buffer = _STATE["buffer"]
    for round_index in range(first_round, first_round + rounds):
        _round(ctx, buffer, round_index, buffer.active_mask())
    return {"addresses": _addresses(buffer), "transport": buffer.transport}


def rank_teardown(ctx):
    buffer = _STATE.pop("buffer", None)
    if buffer is not None:
        buffer.destroy()
    return True


CASES = [
    ("before_dispatch", "exit", (2,)),
    ("between", "sigkill", (2,)),
    ("mid_dispatch", "sigkill", (2,)),
    ("mid_dispatch", "exit", (1,)),
    ("before_dispatch", "sigkill", (1, 2)),
]


# MEP_FAULT_POINT's mid-dispatch hook is one-sided only (a collective has no "data before signal").
GRID = [(t,) + case for t in ("shm", "mooncake", "collective") for case in CASES
        if not (t == "collective" and case[0] == "mid_dispatch")]


@pytest.mark.parametrize("transport,kill_point,how,dead", GRID,
                         ids=[f"{t}-{k}-{h}-{len(d)}dead" for t, k, h, d in GRID])
def test_fail_then_replace(transport, kill_point, how, dead):
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_fail, transport, dead, kill_point, how, timeout_s=60, failure_grace_s=30)
        survivors = [r for r in range(NUM_RANKS) if r not in dead]
        for outcome in outcomes:
            if outcome.rank in dead:
                assert not outcome.ok and outcome.exitcode in (17, 3, -9), outcome
            else:
                assert outcome.ok, outcome.error
                assert outcome.value["seconds"] < TIMEOUT_US_BY_TRANSPORT[transport] / 1e6 + SLACK_S, outcome.value
        before = {o.rank: o.value["addresses"] for o in outcomes if o.ok}
        failed_at = time.monotonic()
        for rank in dead:
            cluster.respawn(rank)
        recovered = harness_check(cluster.run(rank_recover, transport, list(dead), timeout_s=60))
        assert all(v["view"] == list(range(NUM_RANKS)) for v in recovered)
        assert len({v["epoch"] for v in recovered}) == 1
        after = harness_check(cluster.run(rank_full_rounds, 10, timeout_s=60))
        interruption = time.monotonic() - failed_at
        for rank in survivors:
            assert after[rank]["addresses"] == before[rank], "buffer addresses moved across recovery"
        harness_check(cluster.run(rank_teardown, timeout_s=60))
        processes = list(cluster.processes)
    assert not any(p.is_alive() for p in processes)
    assert interruption < 60


@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_rank_dies_during_update_ep_member(transport):
    """Rank 2 dies; while it is re-admitted, rank 3 dies inside update_ep_member (after its
    readiness was sealed into the view); survivors agree again without it, then rank 3 is
    replaced too and the full group serves exact rounds."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_fail, transport, (2,), "before_dispatch", "exit", timeout_s=60, failure_grace_s=30)
        assert [o.ok for o in outcomes] == [True, True, False, True]
        cluster.respawn(2)
        outcomes = cluster.run(rank_recover, transport, [2], 3, timeout_s=90, failure_grace_s=60)
        assert not outcomes[3].ok and outcomes[3].exitcode == -9
        views = [o.value["view"] for o in outcomes if o.ok]
        assert views == [[0, 1, 2]] * 3, views
        cluster.respawn(3)
        recovered = harness_check(cluster.run(rank_recover, transport, [3], timeout_s=60))
        assert all(v["view"] == [0, 1, 2, 3] for v in recovered)
        harness_check(cluster.run(rank_full_rounds, 20, timeout_s=60))
        harness_check(cluster.run(rank_teardown, timeout_s=60))


def harness_check(outcomes):
    from mooncake_ep_switch.launch import check_outcomes

    return check_outcomes(outcomes)


def rank_collective_shrink(ctx):
    """Collective fallback: rank 2 dies between calls; survivors move to a group over themselves."""
    buffer = Buffer(ctx.group, _size(), transport="collective")
    _STATE["buffer"] = buffer
    _round(ctx, buffer, 0, torch.ones(ctx.num_ranks, dtype=torch.int32))
    if ctx.rank == 2:
        os._exit(3)
    view = buffer.update_ep_member(timeout_s=10)  # rank 2 never answers: sealed without it
    assert list(view.ranks) == [0, 1, 3], view
    seconds = _round(ctx, buffer, 1, buffer.active_mask(), expect_dead=(2,), dispatch_dead=(2,))
    return {"seconds": seconds}


def test_collective_fallback_shrinks_then_readmits():
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_collective_shrink, timeout_s=60, failure_grace_s=30)
        assert [o.ok for o in outcomes] == [True, True, False, True], [o.error for o in outcomes]
        cluster.respawn(2)
        recovered = harness_check(cluster.run(rank_recover, "collective", [2], timeout_s=60))
        assert all(v["view"] == [0, 1, 2, 3] for v in recovered)
        after = harness_check(cluster.run(rank_full_rounds, 30, timeout_s=60))
        assert {a["transport"] for a in after} == {"collective"}
        harness_check(cluster.run(rank_teardown, timeout_s=60))


# ---------------------------------------------------------------- two Buffers of one EP group (issue 28 item 5)

TWO_DEAD = 2


def rank_two_buffers(ctx):
    """Every rank builds Buffers A and B of the same group (an engine with two models); a round on each."""
    buffers = _STATE["two"] = [Buffer(ctx.group, _size(), transport="shm") for _ in range(2)]
    for index, buffer in enumerate(buffers):
        _round(ctx, buffer, 20 + index, torch.ones(ctx.num_ranks, dtype=torch.int32))
    if ctx.rank == TWO_DEAD:
        os.kill(os.getpid(), 9)
    return [b.membership.prefix for b in buffers]


def rank_two_rejoin(ctx):
    """The replacement builds Buffer(join(...)) twice, as the dead rank built A then B, and joins each;
    the survivors admit it in A, then in B, each when it shows up as pending there. Then a round on
    each Buffer with every rank (exact), and what each joined Buffer's keys are."""
    if ctx.group is None:
        buffers = _STATE["two"] = [Buffer(join(ctx.store, ctx.rank, ctx.num_ranks), _size(), transport="shm")
                                   for _ in range(2)]
        views = [list(b.update_ep_member(timeout_s=RECOVERY_TIMEOUT_S).ranks) for b in buffers]
    else:
        buffers, views = _STATE["two"], []
        for buffer in buffers:
            deadline = time.monotonic() + 20
            while TWO_DEAD not in buffer.pending_joiners():
                assert time.monotonic() < deadline, f"the replacement never showed up in {buffer.membership.prefix}"
                time.sleep(0.01)
            views.append(list(buffer.update_ep_member(timeout_s=RECOVERY_TIMEOUT_S).ranks))
    for index, buffer in enumerate(buffers):
        _round(ctx, buffer, 30 + index, buffer.active_mask())
    prefixes = [b.membership.prefix for b in buffers]
    for buffer in buffers:
        buffer.destroy()
    return {"views": views, "prefixes": prefixes}


def test_replacement_of_a_rank_with_two_buffers_lands_in_each():
    """Issue 28 item 5: 4 ranks each build Buffers A and B of one group; rank 2 is SIGKILLed; its
    replacement builds `Buffer(join(...))` twice. Before, both joiners took the newest generation (B's):
    A's survivors never saw a pending joiner, and the two joiners raced for rank 2 in B. Now the
    replacement's first joined Buffer lands in A and its second in B, each admitted there, and a round
    on each Buffer is exact on every rank."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_two_buffers, timeout_s=60, failure_grace_s=20)
        assert not outcomes[TWO_DEAD].ok and outcomes[TWO_DEAD].exitcode == -9, outcomes[TWO_DEAD]
        prefixes = [o.value for o in outcomes if o.ok]
        assert len(prefixes) == NUM_RANKS - 1 and all(p == prefixes[0] for p in prefixes), prefixes
        assert prefixes[0][0] != prefixes[0][1], prefixes
        cluster.respawn(TWO_DEAD)
        results = harness_check(cluster.run(rank_two_rejoin, timeout_s=90))
        processes = list(cluster.processes)
    assert not any(p.is_alive() for p in processes)
    for rank, result in enumerate(results):
        assert result["views"] == [list(range(NUM_RANKS))] * 2, (rank, result)
        assert result["prefixes"] == prefixes[0], (rank, result)  # A joined A, B joined B


def test_join_buffer_index_is_checked():
    from mooncake_ep_switch.elastic import join as make_ticket

    with pytest.raises(ValueError, match="buffer_index"):
        make_ticket(object(), 0, 2, buffer_index=0)
    with pytest.raises(TypeError, match="buffer_index"):
        make_ticket(object(), 0, 2, buffer_index="1")
    assert make_ticket(object(), 0, 2, buffer_index=2).buffer_index == 2
