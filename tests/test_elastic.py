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
DIES_IN_UPDATE_S = 12.0  # update_ep_member's deadline where a member dies in it (half of it is waited out)
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
    halves = [buffer._transport.combine_buffer(call, shape, "cpu").data_ptr() for call in (0, 1)]
    return [buffer._transport.base] + halves


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
    # The ranks leave construction at different times (its last store calls after the final barrier: on the etcd
    # store under load each takes 0.3-1.2 s, a member not answering within `request_s` is left for the next); a peer
    # still constructing when a rank's round 0 deadline passes is rightly masked. Round 0 is whole only if every
    # rank starts it together, so they meet first (as Mooncake's tests meet on the CPU group).
    torch.distributed.barrier(group=ctx.group)
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


def rank_recover(ctx, transport, joiners, die_during_update=None, update_s=RECOVERY_TIMEOUT_S):
    """Admit `joiners` (this process is one of them if it has no group) by update_ep_member(timeout_s=update_s)."""
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
    view = buffer.update_ep_member(timeout_s=update_s)
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
# One case runs with the ranks' store on the session's etcd cluster instead of the launcher's TCPStore
# (issue 38: the death seen, the replacement's join and admission through an EtcdStore).
ETCD_CASE = ("shm", "between", "sigkill", (2,))
GRID = [(t,) + case + ("etcd" if (t,) + case == ETCD_CASE else "tcp",) for t in ("shm", "mooncake", "collective")
        for case in CASES if not (t == "collective" and case[0] == "mid_dispatch")]


@pytest.mark.parametrize("transport,kill_point,how,dead,store", GRID,
                         ids=[f"{t}-{k}-{h}-{len(d)}dead" + ("-etcd" if s == "etcd" else "") for t, k, h, d, s in GRID])
def test_fail_then_replace(transport, kill_point, how, dead, store, request):
    with harness.fresh_cluster(NUM_RANKS, store=harness.etcd_store(request, store)) as cluster:
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
        if store == "etcd":  # the records went there (the ranks have no other store)
            assert type(cluster.store).__name__ == "EtcdStore" and cluster.store.num_keys() > 0
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
        # A member that dies after the seal is found missing when the first connect attempt (half the budget) ends:
        # a shorter update_ep_member deadline than RECOVERY_TIMEOUT_S (15 s waited out) keeps the case cheap.
        outcomes = cluster.run(rank_recover, transport, [2], 3, update_s=DIES_IN_UPDATE_S, timeout_s=90,
                               failure_grace_s=60)
        assert not outcomes[3].ok and outcomes[3].exitcode == -9
        views = [o.value["view"] for o in outcomes if o.ok]
        assert views == [[0, 1, 2]] * 3, (views, [o.error for o in outcomes])
        cluster.respawn(3)
        recovered = harness_check(cluster.run(rank_recover, transport, [3], timeout_s=60))
        assert all(v["view"] == [0, 1, 2, 3] for v in recovered)
        harness_check(cluster.run(rank_full_rounds, 20, timeout_s=60))
        harness_check(cluster.run(rank_teardown, timeout_s=60))


def harness_check(outcomes):
    from mooncake_ep_switch.launcher.launch import check_outcomes

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


# ---------------------------------------------------------------- Mooncake's recovery lifecycle (issue 27 item 3)

MOONCAKE_REPLACED = 1


def _lazy_group(ctx):
    """A replacement process's process group, as Mooncake's PG recovery hands one: gloo with lazy
    connections (TORCH_GLOO_LAZY_INIT), so building it needs nobody else; the Buffer never uses it."""
    import torch.distributed as dist

    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("replacement", ctx.store), rank=ctx.rank,
                                world_size=ctx.num_ranks)
    finally:  # the collective fallback's per-view groups connect eagerly, as the members' do (a lazy
        del os.environ["TORCH_GLOO_LAZY_INIT"]  # one meeting eager ones crashes them inside gloo)
    return dist.group.WORLD


def rank_mooncake_build(ctx, transport):
    buffer = _STATE["buffer"] = Buffer(ctx.group, _size(), disable_p2p=transport == "mooncake", transport=transport)
    _round(ctx, buffer, 40, torch.ones(ctx.num_ranks, dtype=torch.int32))
    return True


def rank_mooncake_recovery(ctx, transport, how):
    """Mooncake's own test: the replaced rank builds a plain `Buffer(group, bytes)` (in the same process,
    dropping the one it had, or in a new process after the old one was SIGKILLed) while every other rank
    calls `update_ep_member()`; then everyone dispatches with an all-ones `active_ranks`, exactly."""
    earlier = None
    if ctx.rank == MOONCAKE_REPLACED:
        group = ctx.group if how == "same_process" else _lazy_group(ctx)
        earlier = _STATE.pop("buffer", None)
        started = time.monotonic()
        buffer = _STATE["buffer"] = Buffer(group, _size(), disable_p2p=transport == "mooncake", transport=transport)
        seconds = time.monotonic() - started
        assert buffer.members == tuple(range(ctx.num_ranks)) and not buffer.joining
    else:
        buffer = _STATE["buffer"]
        started = time.monotonic()
        buffer.update_ep_member()
        seconds = time.monotonic() - started
    refused = None
    if earlier is not None:  # the Buffer the replacement took over is left out: its calls refuse
        mine = _inputs(ctx.rank, 41)
        try:
            earlier.dispatch(mine.x, mine.topk_idx, torch.ones(ctx.num_ranks, dtype=torch.int32), Shape.tokens,
                             Shape.experts, 1_000_000)
        except Exception as error:  # noqa: BLE001 - the test checks which
            refused = f"{type(error).__name__}: {error}"
        del earlier  # as Mooncake's test rebinds its variable
    for round_index in range(42, 45):
        _round(ctx, buffer, round_index, torch.ones(ctx.num_ranks, dtype=torch.int32))
    return {"seconds": seconds, "epoch": buffer.epoch, "members": list(buffer.members), "refused": refused,
            "prefix": buffer.membership.prefix}


MOONCAKE_GRID = [(t, how) for t in ("shm", "mooncake", "collective") for how in ("same_process", "new_process")]


@pytest.mark.parametrize("transport,how", MOONCAKE_GRID, ids=[f"{t}-{h}" for t, h in MOONCAKE_GRID])
def test_mooncake_recovery_a_plain_new_buffer_is_admitted(transport, how):
    """Issue 27 item 3. Before, the replaced rank's `Buffer(group, bytes)` started a generation of its
    own (or waited in a collective nobody else entered), the others' update_ep_member() sealed a view
    without it, and their next dispatch with all-ones `active_ranks` was refused. Now it is admitted
    into the group's Buffer by that update_ep_member(), as `elastic.join()` is."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        harness_check(cluster.run(rank_mooncake_build, transport, timeout_s=60))
        if how == "new_process":
            os.kill(cluster.processes[MOONCAKE_REPLACED].pid, 9)
            cluster.processes[MOONCAKE_REPLACED].join(10)
            cluster.respawn(MOONCAKE_REPLACED)
        results = harness_check(cluster.run(rank_mooncake_recovery, transport, how, timeout_s=90))
        harness_check(cluster.run(rank_teardown, timeout_s=60))
        processes = list(cluster.processes)
    assert not any(p.is_alive() for p in processes)
    assert {r["epoch"] for r in results} == {1}, results
    assert all(r["members"] == list(range(NUM_RANKS)) for r in results), results
    assert len({r["prefix"] for r in results}) == 1, results  # one Buffer of the group, not a second one
    if how == "same_process":
        refused = results[MOONCAKE_REPLACED]["refused"]
        assert refused is not None and "not a member" in refused, refused
    assert max(r["seconds"] for r in results) < 20, results


def rank_second_buffer_alone(ctx):
    """Rank 1 alone builds a second Buffer beside its live one while the others do nothing: after the
    connect timeout it is refused with an error naming the ranks, and nothing changed (its counter
    is set back; its first Buffer still serves, below)."""
    from mooncake_ep_switch.buffer.membership.protocol import MembershipError

    os.environ["MEP_CONNECT_TIMEOUT_S"] = "2"
    try:
        started = time.monotonic()
        with pytest.raises(MembershipError, match=r"ranks \[0, 2, 3\] neither built"):
            Buffer(ctx.group, _size(), transport="shm")
        return time.monotonic() - started
    finally:
        del os.environ["MEP_CONNECT_TIMEOUT_S"]


def rank_second_buffer_everywhere(ctx):
    first = _STATE["buffer"]
    second = Buffer(ctx.group, _size(), transport="shm")
    for index, buffer in enumerate((first, second, first)):
        _round(ctx, buffer, 50 + index, torch.ones(ctx.num_ranks, dtype=torch.int32))
    prefixes = (first.membership.prefix, second.membership.prefix)
    second.destroy()
    return prefixes


def test_a_second_buffer_nobody_else_builds_is_refused_and_changes_nothing():
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        harness_check(cluster.run(rank_mooncake_build, "shm", timeout_s=60))
        (seconds,) = harness_check(cluster.run(rank_second_buffer_alone, ranks=[1], timeout_s=60))
        assert 2.0 <= seconds < 10, seconds
        prefixes = harness_check(cluster.run(rank_second_buffer_everywhere, timeout_s=90))
        harness_check(cluster.run(rank_teardown, timeout_s=60))
    assert len(set(prefixes)) == 1 and prefixes[0][0] != prefixes[0][1], prefixes  # every rank: Buffers #1 and #2


# ---------------------------------------------------------------- which plain Buffer(group) is a replacement (review)


def rank_update_alone(ctx):
    """Rank 1 alone calls update_ep_member(): no quorum, it raises, and its readiness stays in the store."""
    from mooncake_ep_switch.buffer.membership.protocol import MembershipError

    with pytest.raises(MembershipError):
        _STATE["buffer"].update_ep_member(timeout_s=1.0)
    return True


def test_a_stale_update_does_not_make_a_second_buffer_a_replacement():
    """A member's update_ep_member() that raised leaves its readiness record behind; every rank then
    builds a second Buffer of the group. That is a new Buffer on every rank (the members' heartbeat, not
    a leftover record, says they are updating)."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        harness_check(cluster.run(rank_mooncake_build, "shm", timeout_s=60))
        harness_check(cluster.run(rank_update_alone, ranks=[1], timeout_s=60))
        prefixes = harness_check(cluster.run(rank_second_buffer_everywhere, timeout_s=90))
        harness_check(cluster.run(rank_teardown, timeout_s=60))
    assert len(set(prefixes)) == 1 and prefixes[0][0] != prefixes[0][1], prefixes


def rank_rebuild_everywhere(ctx):
    """Every rank destroys its Buffer and builds a new one (Buffer #2 of the group)."""
    _STATE.pop("buffer").destroy()
    buffer = _STATE["buffer"] = Buffer(ctx.group, _size(), transport="shm")
    _round(ctx, buffer, 60, torch.ones(ctx.num_ranks, dtype=torch.int32))
    return buffer.membership.prefix


def rank_replaced_at_once(ctx, replaced, how):
    """`replaced` ranks build a plain Buffer(group) (after destroying theirs, or in a new process) while
    the others update theirs; then a round with every rank, exact."""
    if ctx.rank in replaced:
        if how == "destroyed":
            _STATE.pop("buffer").destroy()
        group = ctx.group if ctx.group is not None else _lazy_group(ctx)
        buffer = _STATE["buffer"] = Buffer(group, _size(), transport="shm")
    else:
        buffer = _STATE["buffer"]
        buffer.update_ep_member()
    _round(ctx, buffer, 61, torch.ones(ctx.num_ranks, dtype=torch.int32))
    return buffer.membership.prefix


@pytest.mark.parametrize("how", ["destroyed", "new_process"])
def test_two_replacements_at_once_land_in_the_buffer_the_members_update(how):
    """The group destroyed and rebuilt its Buffer (the live one is Buffer #2); ranks 1 and 2 are replaced
    at once, by a plain Buffer(group) after destroying theirs or in new processes, while ranks 0 and 3
    update theirs. Both land in Buffer #2 (not #1, where no member is left), and afterwards every rank
    builds a second Buffer of the group as usual (the counters were set back exactly). Before, a
    destroyed Buffer's replacement could publish the same pid and fd number as the region it replaced,
    and the members kept their mapping of the dead region (every round masked it)."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        harness_check(cluster.run(rank_mooncake_build, "shm", timeout_s=60))
        live = harness_check(cluster.run(rank_rebuild_everywhere, timeout_s=90))
        if how == "new_process":
            for rank in (1, 2):
                os.kill(cluster.processes[rank].pid, 9)
                cluster.processes[rank].join(10)
                cluster.respawn(rank)
        prefixes = harness_check(cluster.run(rank_replaced_at_once, (1, 2), how, timeout_s=90))
        assert prefixes == live, (prefixes, live)
        if how == "destroyed":  # (new processes share no working process group with the others)
            again = harness_check(cluster.run(rank_second_buffer_everywhere, timeout_s=90))
            assert len(set(again)) == 1 and again[0][0] == live[0] and again[0][1] != live[0], again
        harness_check(cluster.run(rank_teardown, timeout_s=60))


def rank_restart(ctx):
    """A whole group restarted on the store of the earlier one: every rank a new process building a plain
    Buffer(group) at once."""
    buffer = _STATE["buffer"] = Buffer(_lazy_group(ctx), _size(), transport="shm")
    _round(ctx, buffer, 62, torch.ones(ctx.num_ranks, dtype=torch.int32))
    return buffer.membership.prefix


def test_a_whole_group_restarted_on_the_same_store_builds_new_buffers():
    """Every rank's counter is past 0 and no process built anything yet (a torchrun restart whose store
    outlived the workers): every rank sees the others build, and all build a new Buffer (#2)."""
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        harness_check(cluster.run(rank_mooncake_build, "shm", timeout_s=60))
        for rank in range(NUM_RANKS):
            os.kill(cluster.processes[rank].pid, 9)
        for rank in range(NUM_RANKS):
            cluster.processes[rank].join(10)
            cluster.respawn(rank)
        prefixes = harness_check(cluster.run(rank_restart, timeout_s=90))
        harness_check(cluster.run(rank_teardown, timeout_s=60))
    assert len(set(prefixes)) == 1 and prefixes[0].endswith("/g2"), prefixes
