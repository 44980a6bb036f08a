"""ElasticBuffer under faults (issue 26): what neither DeepEP V2 nor Mooncake's ElasticBuffer does.

A rank is SIGKILLed before a dispatch, or between a dispatch and its combine, on shared memory and
across pretend hosts over the Transfer Engine: every survivor returns within the deadline, the dead
rank cleared in `active_ranks`, every output exact against the reference that skips it (a rank that
missed its deadline counts as having sent nothing). Then a replacement is re-admitted with
`update_ep_member()` and a round is exact again with it.
"""
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from mooncake_ep_switch import ElasticBuffer
from mooncake_ep_switch.buffer.membership.protocol import View
from mooncake_ep_switch.elastic import join
from mooncake_ep_switch.elastic_buffer.handle import admitted_since, check_usable
from tests import harness
from tests.harness import outcome_value
from tests.netns import make_network  # noqa: F401 - a fixture (network namespaces as hosts)
from tests.elastic_reference import (expected_combine, expected_dispatch, expected_weights, expert_output,
                                     make_inputs, ordered_sum)
from tests.test_elastic_buffer import _same, check_dispatch

NUM_RANKS, DEAD = 4, 2
T, H, K = 10, 128, 4
TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE
RANK_STATE = {}


def _round(ctx, buffer, seed: int, num_ranks: int, kill_point=None, expand=False):
    """One dispatch + combine over the current members; `kill_point` kills rank DEAD before the dispatch or
    between it and the combine. Checks every output against the reference for the ranks each phase heard."""
    R, rank, E = num_ranks, ctx.rank, 4 * num_ranks
    all_inputs = [make_inputs(r, R, T, H, K, E, seed) for r in range(R)]
    mine = all_inputs[rank]
    active = buffer.active_mask()
    if kill_point == "before_dispatch" and rank == DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    recv_x, recv_topk, recv_w, handle, _ = buffer.dispatch(mine.x, topk_idx=mine.topk_idx,
                                                           topk_weights=mine.topk_weights, num_experts=E,
                                                           num_max_tokens_per_rank=T, do_expand=expand,
                                                           active_ranks=active, timeout_us=TIMEOUT_US)
    if kill_point == "between" and rank == DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    heard = [r for r in range(R) if int(active[r])]
    want = expected_dispatch(all_inputs, rank, R, T, E, heard)
    if expand:
        slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
        token, entry = torch.nonzero(slots >= 0, as_tuple=True)
        _same("expanded rows", recv_x[slots[token, entry]], want["x"][token])
    else:
        check_dispatch(recv_x, recv_topk, recv_w, handle, want, False, 1, E // R, R, T, True)
    y_recv = expert_output(want["src_global"], K, H, seed)
    if expand:
        x = torch.zeros(handle.num_expanded_tokens, H, dtype=torch.bfloat16)
        x[slots[token, entry]] = y_recv[token, entry]
    else:
        x = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
    combined, weights, _ = buffer.combine(x, handle, topk_weights=recv_w, bias=mine.bias[0], active_ranks=active,
                                          timeout_us=TIMEOUT_US)
    seconds = time.monotonic() - started
    contributing = [r for r in range(R) if int(active[r])]
    y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, seed)
    _same("combined_x", combined, expected_combine(y_own, mine.topk_idx, E, R, [mine.bias[0]], contributing))
    _same("combined weights", weights, expected_weights(mine.topk_idx, mine.topk_weights, E, R, contributing))
    return {"mask": active.tolist(), "seconds": seconds, "heard": heard, "handle": handle}


def rank_killed(ctx, transport, kill_point, pretend_hosts, expand):
    """Round 1 whole; in round 2 rank DEAD is SIGKILLed at `kill_point`; survivors check everything."""
    if pretend_hosts:
        os.environ["MEP_HOST_ID"] = f"pretend-host-{ctx.rank}"
    try:
        buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport=transport)
    finally:
        os.environ.pop("MEP_HOST_ID", None)
    first = _round(ctx, buffer, 1, ctx.num_ranks, expand=expand)
    first.pop("handle")
    assert first["mask"] == [1] * ctx.num_ranks
    second = _round(ctx, buffer, 2, ctx.num_ranks, kill_point=kill_point, expand=expand)
    third = _round(ctx, buffer, 3, ctx.num_ranks, expand=expand)  # the dead rank stays out, exactly
    second.pop("handle"), third.pop("handle")
    routes = sorted(set(buffer.runtime.peer_routes()) - {"self", None})
    buffer.destroy()
    return {"second": second, "third": third, "routes": routes}


@pytest.mark.parametrize("transport,pretend_hosts", [("shm", False), ("mooncake", True)], ids=["shm", "te-hosts"])
@pytest.mark.parametrize("kill_point", ["before_dispatch", "between"])
@pytest.mark.parametrize("expand", [False, True], ids=["flat", "expanded"])
def test_a_killed_rank_is_skipped_and_the_rest_is_exact(transport, pretend_hosts, kill_point, expand):
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_killed, transport, kill_point, pretend_hosts, expand, timeout_s=90,
                               failure_grace_s=40)
    assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    without_dead = [0 if r == DEAD else 1 for r in range(NUM_RANKS)]
    for outcome in outcomes:
        if outcome.rank == DEAD:
            continue
        value = outcome_value(outcome)
        assert value["routes"] == (["te"] if pretend_hosts else ["shm"]), value
        assert value["second"]["mask"] == without_dead and value["third"]["mask"] == without_dead, value
        if kill_point == "before_dispatch":
            assert DEAD not in value["second"]["heard"], value
        # Both phases of the fault round within their deadlines (the dead rank costs at most one each).
        assert value["second"]["seconds"] < 2 * TIMEOUT_US / 1e6 + harness.FAULT_SLACK_S, value


# ---------------------------------------------------------------------- a cached handle after a death

def rank_cached_after_death(ctx, transport):
    """Issue 43 item 5: rank DEAD is SIGKILLed between a dispatch and its combine; the survivors combine, then
    dispatch again with the same handle (V2's cached layout) and combine it again. On the collective
    fallback the death moves the membership epoch inside the combine (the survivors agree on a view
    without the dead rank); the handle must stay usable there as on shared memory, the dead rank masked:
    the cached rows from it zero, every other row and every combined output exact without it."""
    R, rank, E = ctx.num_ranks, ctx.rank, 4 * ctx.num_ranks
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport=transport)
    _round(ctx, buffer, 1, R)
    second = _round(ctx, buffer, 2, R, kill_point="between")  # its combine is exact without DEAD (_round checks)
    handle = second["handle"]
    all_inputs = [make_inputs(r, R, T, H, K, E, 2) for r in range(R)]
    mine = all_inputs[rank]
    active = torch.tensor(second["mask"], dtype=torch.int32)  # the mask the survivor kept using
    recv_x, recv_topk, recv_w, again, _ = buffer.dispatch(mine.x, topk_weights=mine.topk_weights, handle=handle,
                                                          active_ranks=active, timeout_us=TIMEOUT_US)
    assert again is handle
    want = expected_dispatch(all_inputs, rank, R, T, E, range(R))  # the handle's layout: DEAD's rows included
    from_dead = (torch.div(want["src_global"], T, rounding_mode="floor") == DEAD).unsqueeze(1)
    _same("cached recv_x", recv_x, torch.where(from_dead, torch.zeros_like(want["x"]), want["x"]))
    _same("cached recv_topk_idx", recv_topk, want["local"])
    _same("cached recv_topk_weights", recv_w, torch.where(from_dead, torch.zeros_like(want["weights"]),
                                                          want["weights"]))
    dispatch_mask = active.tolist()
    y_recv = expert_output(want["src_global"], K, H, 2)
    partial = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
    combined, weights, _ = buffer.combine(partial, handle, topk_weights=recv_w, bias=mine.bias[0],
                                          active_ranks=active, timeout_us=TIMEOUT_US)
    contributing = [r for r in range(R) if int(active[r])]
    y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, 2)
    _same("cached combined_x", combined, expected_combine(y_own, mine.topk_idx, E, R, [mine.bias[0]], contributing))
    _same("cached combined weights", weights, expected_weights(mine.topk_idx, mine.topk_weights, E, R, contributing))
    epoch = buffer.runtime.epoch
    buffer.destroy()
    return {"second": second["mask"], "dispatch": dispatch_mask, "combine": active.tolist(), "epoch": epoch}


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_a_cached_handle_serves_the_survivors_after_a_death(transport):
    """Issue 43 item 5: on the collective fallback a cached re-dispatch after a death was refused ("expected a
    handle of membership epoch 1 ... update_ep_member() ran since its dispatch", which nobody called); the
    transports now agree: the handle serves the survivors, the dead rank masked, every output exact."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_cached_after_death, transport, timeout_s=120, failure_grace_s=40)
    assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    without_dead = [0 if r == DEAD else 1 for r in range(NUM_RANKS)]
    for outcome in outcomes:
        if outcome.rank != DEAD:
            value = outcome_value(outcome)
            assert value["second"] == value["dispatch"] == value["combine"] == without_dead, value
            # The collective fallback moved to a view without DEAD; shared memory only masks it.
            assert value["epoch"] == (1 if transport == "collective" else 0), value


class _Views:
    """A `Membership` stand-in: the sealed views by epoch (epoch 0 is every rank)."""

    def __init__(self, views):
        self.views = views

    def view(self, epoch):
        return View(epoch, tuple(self.views[epoch]))


def test_a_handle_is_refused_once_a_view_admitted_a_rank():
    """The rule behind the test above: epochs that only lost ranks keep a handle; an epoch that let a rank in
    (a replacement, or a rank left out and back: a new process without the handle) or an update_ep_member()
    of this buffer refuses it, by name."""
    membership = _Views({0: [0, 1, 2, 3], 1: [0, 1, 3], 2: [0, 1, 2, 3], 3: [0, 1, 2]})
    assert admitted_since(membership, 0, 1) == [] and admitted_since(membership, 2, 3) == []
    assert admitted_since(membership, 0, 2) == [2] and admitted_since(membership, 1, 3) == [2]
    assert admitted_since(None, 0, 0) == []
    owner = object()
    handle = SimpleNamespace(route=SimpleNamespace(owner=owner, epoch=0, generation=0))
    check_usable(handle, owner, 0, SimpleNamespace(epoch=1, membership=membership))
    assert handle.route.epoch == 1  # checked once for epoch 1
    with pytest.raises(ValueError, match=r"handle: .*ranks \[2\] were admitted since \(epoch 2\)"):
        check_usable(handle, owner, 0, SimpleNamespace(epoch=2, membership=membership))
    with pytest.raises(ValueError, match=r"handle: .*update_ep_member\(\) ran since its dispatch"):
        check_usable(handle, owner, 1, SimpleNamespace(epoch=1, membership=membership))
    with pytest.raises(ValueError, match=r"handle: .*one of another buffer"):
        check_usable(handle, object(), 0, SimpleNamespace(epoch=1, membership=membership))


# ---------------------------------------------------------------------- a replacement re-admitted

def rank_start(ctx, transport):
    RANK_STATE["buffer"] = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                         transport=transport)
    RANK_STATE["transport"] = transport
    result = _round(ctx, RANK_STATE["buffer"], 1, 2)
    RANK_STATE["old_handle"] = result["handle"]
    return result["mask"]


def rank_exit(ctx):
    os._exit(3)


ALONE_S = 6.0  # rank 1 exited between calls, unknown to rank 0: its update waits half of this for it, then seals alone


def rank_alone(ctx):
    """The survivor moves on alone: a view of itself, then an exact round without the dead rank."""
    buffer = RANK_STATE["buffer"]
    view = list(buffer.update_ep_member(timeout_s=ALONE_S).ranks)
    old = RANK_STATE.pop("old_handle")  # a handle from before update_ep_member(): refused, nothing moves
    with pytest.raises(ValueError, match=r"handle: expected a handle of membership epoch"):
        buffer.combine(torch.zeros(old.num_recv_tokens, H, dtype=torch.bfloat16), old)
    return {"view": view, "round": _round(ctx, buffer, 2, 2)["mask"]}


def rank_admit(ctx, transport):
    """The replacement builds its ElasticBuffer from a join ticket; everyone agrees on the next view."""
    buffer = RANK_STATE.get("buffer")
    if buffer is None:
        buffer = RANK_STATE["buffer"] = ElasticBuffer(join(ctx.store, ctx.rank, ctx.num_ranks),
                                                      num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                                      transport=transport)
    else:
        deadline = time.monotonic() + 60
        while 1 not in buffer.pending_joiners():
            assert time.monotonic() < deadline, "the replacement never showed up as pending"
            time.sleep(0.01)
    return list(buffer.update_ep_member(timeout_s=60.0).ranks)


def rank_round(ctx, seed, expand):
    return _round(ctx, RANK_STATE["buffer"], seed, 2, expand=expand)["mask"]


def rank_close(ctx):
    RANK_STATE.pop("buffer").destroy()
    return True


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_replacement_is_readmitted_then_exact(transport):
    with harness.fresh_cluster(2) as cluster:
        assert harness.check_outcomes(cluster.run(rank_start, transport)) == [[1, 1]] * 2
        cluster.run(rank_exit, ranks=[1], timeout_s=30)
        cluster.respawn(1)  # the process only: it does nothing until told
        alone = outcome_value(cluster.run(rank_alone, ranks=[0], timeout_s=60)[0])
        assert alone == {"view": [0], "round": [1, 0]}, alone
        views = harness.check_outcomes(cluster.run(rank_admit, transport, timeout_s=120))
        assert views == [[0, 1]] * 2
        for seed, expand in ((3, False), (4, True)):
            assert harness.check_outcomes(cluster.run(rank_round, seed, expand)) == [[1, 1]] * 2
        harness.check_outcomes(cluster.run(rank_close))


# ---------------------------------------------------------------------- a Buffer beside it

def rank_side_by_side(ctx, transport):
    """A Buffer and an ElasticBuffer of one group, calls interleaved (Buffer dispatch, ElasticBuffer
    dispatch, Buffer combine, ElasticBuffer combine), then rank DEAD is SIGKILLed and both serve on:
    each exact, each masking the dead rank by itself."""
    from tests.test_faults import Shape, _buffer, _check_round, _gather_rounds, _mock_expert

    plain = _buffer(ctx, transport)
    elastic = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport=transport,
                            disable_p2p=transport == "mooncake")
    rounds = _gather_rounds(ctx, 2)
    R, rank, E = ctx.num_ranks, ctx.rank, 4 * ctx.num_ranks
    masks = []
    for round_index, all_inputs in enumerate(rounds):
        if round_index == 1 and rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        mine = all_inputs[rank]
        active = torch.ones(R, dtype=torch.int32)
        recv, count, handle, _, _ = plain.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts,
                                                   TIMEOUT_US, use_fp8=False)
        ours = [make_inputs(r, R, T, H, K, E, 20 + round_index) for r in range(R)]
        e_active = torch.ones(R, dtype=torch.int32)
        recv_x, _, recv_w, e_handle, _ = elastic.dispatch(ours[rank].x, topk_idx=ours[rank].topk_idx,
                                                          topk_weights=ours[rank].topk_weights, num_experts=E,
                                                          active_ranks=e_active, timeout_us=TIMEOUT_US)
        in_dispatch = active.tolist()
        combined, _, _ = plain.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active, TIMEOUT_US,
                                       handle)
        _check_round(ctx, all_inputs, in_dispatch, active.tolist(), recv, count, handle, combined)
        heard = [r for r in range(R) if int(e_active[r])]
        want = expected_dispatch(ours, rank, R, T, E, heard)
        _same("elastic recv_x", recv_x, want["x"])
        y_recv = expert_output(want["src_global"], K, H, 20 + round_index)
        partial = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
        e_combined, _, _ = elastic.combine(partial, e_handle, topk_weights=recv_w, active_ranks=e_active,
                                           timeout_us=TIMEOUT_US)
        contributing = [r for r in range(R) if int(e_active[r])]
        y_own = expert_output(rank * T + torch.arange(ours[rank].x.size(0)), K, H, 20 + round_index)
        _same("elastic combined", e_combined, expected_combine(y_own, ours[rank].topk_idx, E, R, [], contributing))
        masks.append((active.tolist(), e_active.tolist()))
    plain.destroy()
    elastic.destroy()
    return masks


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_buffer_and_an_elastic_buffer_of_one_group(transport):
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_side_by_side, transport, timeout_s=90, failure_grace_s=40)
    without_dead = [0 if r == DEAD else 1 for r in range(NUM_RANKS)]
    for outcome in outcomes:
        if outcome.rank != DEAD:
            assert outcome_value(outcome) == [([1] * NUM_RANKS,) * 2, (without_dead,) * 2], outcome


# ---------------------------------------------------------------------- a source late at the first dispatch

LATE_TIMEOUT_US = harness.FAULT_TIMEOUT_US


def rank_late_then_back(ctx):
    """Rank 1 is late for a dispatch (rank 0 masks it and its layout has none of rank 1's tokens), then both
    reuse the handle with fresh all-ones masks: rank 0 cannot place rank 1's rows nor make partials for
    tokens it never received, so it clears rank 1 (no zero row is ever passed off as its partial); rank 1
    then clears rank 0 at its combine deadline. Every output exact for the ranks each mask keeps."""
    R, rank, E = ctx.num_ranks, ctx.rank, 8
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport="shm")
    all_inputs = [make_inputs(r, R, T, H, K, E, 61) for r in range(R)]
    mine = all_inputs[rank]
    if rank == 1:
        time.sleep(LATE_TIMEOUT_US / 1e6 + 0.5)
    active = torch.ones(R, dtype=torch.int32)
    recv_x, _, recv_w, handle, _ = buffer.dispatch(mine.x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights,
                                                   num_experts=E, active_ranks=active, timeout_us=LATE_TIMEOUT_US)
    first_mask = active.tolist()
    heard = [r for r in range(R) if int(active[r])]
    want = expected_dispatch(all_inputs, rank, R, T, E, heard)
    _same("recv_x", recv_x, want["x"])
    again = torch.ones(R, dtype=torch.int32)
    cached_x, _, _, _, _ = buffer.dispatch(mine.x, handle=handle, active_ranks=again, timeout_us=LATE_TIMEOUT_US)
    _same("cached recv_x", cached_x, want["x"])  # the handle's layout: the same rows
    cached_mask = again.tolist()
    y_recv = expert_output(want["src_global"], K, H, 61)
    partial = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
    combine_mask = torch.ones(R, dtype=torch.int32)
    combined, weights, _ = buffer.combine(partial, handle, topk_weights=recv_w, active_ranks=combine_mask,
                                          timeout_us=LATE_TIMEOUT_US)
    contributing = [r for r in range(R) if int(combine_mask[r])]
    y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, 61)
    _same("combined_x", combined, expected_combine(y_own, mine.topk_idx, E, R, [], contributing))
    _same("weights", weights, expected_weights(mine.topk_idx, mine.topk_weights, E, R, contributing))
    buffer.destroy()
    return {"first": first_mask, "cached": cached_mask, "combine": combine_mask.tolist()}


def test_a_source_late_at_the_dispatch_is_never_summed_as_zero():
    with harness.fresh_cluster(2) as cluster:
        values = harness.check_outcomes(cluster.run(rank_late_then_back, timeout_s=90))
    assert values[0] == {"first": [1, 0], "cached": [1, 0], "combine": [1, 0]}, values
    assert values[1]["combine"] == [0, 1], values  # rank 0 sent it nothing for its tokens: cleared at the deadline


# ---------------------------------------------------------------------- two hosts as network namespaces

HOST_OF = [0, 0, 1, 1]  # ranks 0, 1 on host 0 and 2, 3 on host 1 (tests/netns.py): shm inside, TE across


def test_v2_grid_across_namespace_hosts(make_network):
    """The V2 grid on 2 hosts x 2 ranks, each host a network namespace: same-host peers over shared memory,
    the others over the Transfer Engine on the veths; every output bit-exact against the reference."""
    from tests.test_elastic_buffer import rank_v2_grid

    network = make_network(2)
    with harness.fresh_cluster(4, network=network.placement(HOST_OF)) as cluster:
        values = harness.check_outcomes(cluster.run(rank_v2_grid, "auto", 12, 256, 6, 16, 17, timeout_s=600))
    assert all(value["cases"] == 24 and value["transport"] == "mooncake" for value in values), values
    assert all(value["routes"] == ["shm", "te"] for value in values), values


def test_a_rank_killed_across_namespace_hosts(make_network):
    """Rank DEAD (host 1) SIGKILLed between a dispatch and its combine: the survivors on both hosts exact
    without it, within the deadlines."""
    network = make_network(2)
    with harness.fresh_cluster(4, network=network.placement(HOST_OF)) as cluster:
        outcomes = cluster.run(rank_killed, "auto", "between", False, False, timeout_s=120, failure_grace_s=60)
    assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    without_dead = [0 if r == DEAD else 1 for r in range(NUM_RANKS)]
    for outcome in outcomes:
        if outcome.rank != DEAD:
            value = outcome_value(outcome)
            assert value["routes"] == ["shm", "te"], value
            assert value["second"]["mask"] == without_dead and value["third"]["mask"] == without_dead, value
