"""The store's host stalls (issue 43 item 3): every membership operation fails at its own deadline.

The group's TCPStore is hosted by a process of its own (`harness.StoreHost`), which the tests stop
with SIGSTOP: a host lost without a TCP reset, whose kernel still accepts the store's requests.
With it stopped, dispatch/combine keep working, and `update_ep_member()`, a replacement's
constructor and join, `switch_layout()` and an online EPLB commit each raise `StoreUnavailable`
(naming the store) within their deadline plus one second; once the host resumes (SIGCONT) each of
them succeeds on the same Buffer, and no store worker thread is left behind.
"""
import os
import signal
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.elastic import connect_store, join
from mooncake_ep_switch.launcher.launch import check_outcomes
from tests import harness
from tests.harness import RANK_STATE, outcome_value
from tests.test_membership_faults import _round2, _size2, rank_exit, rank_update

DEADLINE_S = 3.0  # each operation's own deadline while the store is stopped
LATE_S = 1.0  # how far past it an operation may end (the store's grace plus scheduling on a loaded box)
STALLED_RUN_S = 40.0  # a run with the store stopped; before the fix the calls blocked past it


def _run(cluster, function, *args, **kwargs):
    """Run `function` on every rank of `cluster` (store running); its values, raising with any rank's traceback."""
    return check_outcomes(cluster.run(function, *args, timeout_s=90, **kwargs))


def _error_of(function):
    """(seconds, error type name, message) of `function()`, which must raise."""
    started = time.monotonic()
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the test names the type it expects
        return time.monotonic() - started, type(error).__name__, str(error)
    raise AssertionError(f"{function} returned although the store is stopped")


def _check_stalled(outcomes, addr, operation):
    for outcome in outcomes:
        seconds, kind, message = outcome_value(outcome)
        assert kind == "StoreUnavailable", (kind, message)
        assert f"{addr[0]}:{addr[1]}" in message and operation in message, message
        assert seconds <= DEADLINE_S + LATE_S, f"{operation} failed after {seconds:.2f} s, deadline {DEADLINE_S} s"
        print(f"{operation}: StoreUnavailable after {seconds:.2f} s (deadline {DEADLINE_S} s)")


def _store_workers() -> int:
    return sum(t.name.startswith("mep-store-") for t in threading.enumerate())


def rank_workers_end(ctx, timeout_s=30.0):
    """Every store worker a stalled call abandoned ends once the store answers (at most the current lanes' two idle:
    the call lane's and the wait lane's, store_deadline.IDLE_S)."""
    deadline = time.monotonic() + timeout_s
    while _store_workers() > 2:
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.01)
    return True


def rank_start(ctx, addr):
    store = RANK_STATE["store"] = connect_store(*addr)
    buffer = RANK_STATE["buffer"] = Buffer(ctx.group, _size2(), transport="shm", store=store)
    return _round2(ctx, buffer, seed=1)


def rank_connect(ctx, addr):
    RANK_STATE["store"] = connect_store(*addr)
    return True


def rank_update_stalled(ctx, deadline_s=DEADLINE_S):
    """With the store stopped: dispatch/combine work, update_ep_member() fails at its deadline, they still work."""
    buffer = RANK_STATE["buffer"]
    members = [int(r in buffer.members) for r in range(ctx.num_ranks)]  # a joiner has none yet: no round
    if not buffer.joining:
        assert _round2(ctx, buffer, seed=2) == members
    failure = _error_of(lambda: buffer.update_ep_member(timeout_s=deadline_s))
    if not buffer.joining:
        assert _round2(ctx, buffer, seed=3) == members
    return failure


def rank_update_round(ctx):
    view = RANK_STATE["buffer"].update_ep_member(timeout_s=60.0)
    return view.epoch, list(view.ranks), _round2(ctx, RANK_STATE["buffer"], seed=4 + view.epoch)


def test_update_ep_member_fails_at_its_deadline_while_the_store_host_is_stopped():
    with harness.StoreHost() as host, harness.fresh_cluster(2) as cluster:
        assert _run(cluster, rank_start, host.addr) == [[1, 1]] * 2
        host.stop()
        try:
            _check_stalled(cluster.run(rank_update_stalled, timeout_s=STALLED_RUN_S), host.addr, "update_ep_member")
        finally:
            host.resume()
        views = _run(cluster, rank_update_round)
        assert [v[:2] for v in views] == [(1, [0, 1])] * 2 and all(v[2] == [1, 1] for v in views), views
        assert _run(cluster, rank_workers_end) == [True, True]


def rank_build_replacement(ctx, connect_timeout_s):
    """A replacement's constructor (join ticket) with the connect timeout `connect_timeout_s`."""
    os.environ["MEP_CONNECT_TIMEOUT_S"] = str(connect_timeout_s)
    try:
        RANK_STATE["buffer"] = Buffer(join(RANK_STATE["store"], ctx.rank, ctx.num_ranks, keep_prefix=True),
                                      _size2(), transport="shm")
    finally:
        del os.environ["MEP_CONNECT_TIMEOUT_S"]
    return True


def rank_build_stalled(ctx):
    return _error_of(lambda: rank_build_replacement(ctx, DEADLINE_S))


def test_replacement_construction_and_join_fail_at_their_deadline_while_the_store_host_is_stopped():
    with harness.StoreHost() as host, harness.fresh_cluster(2) as cluster:
        _run(cluster, rank_start, host.addr)
        cluster.run(rank_exit, ranks=[1], timeout_s=30)
        cluster.respawn(1)
        assert outcome_value(cluster.run(rank_update, 10.0, ranks=[0])[0])["view"] == [0]
        cluster.run(rank_connect, host.addr, ranks=[1])
        host.stop()
        try:  # the constructor: its deadline is the connect timeout
            _check_stalled(cluster.run(rank_build_stalled, ranks=[1], timeout_s=STALLED_RUN_S), host.addr,
                           "Buffer construction")
        finally:
            host.resume()
        assert outcome_value(cluster.run(rank_build_replacement, 60.0, ranks=[1])[0])
        host.stop()
        try:  # the join (the replacement's update_ep_member) and the member's update_ep_member
            _check_stalled(cluster.run(rank_update_stalled, timeout_s=STALLED_RUN_S), host.addr, "update_ep_member")
        finally:
            host.resume()
        outcomes = cluster.run(rank_update, 60.0, wait_for_joiners=(1,), timeout_s=90)
        assert [outcome_value(o).get("view") for o in outcomes] == [[0, 1]] * 2, outcomes
        assert _run(cluster, rank_round_both) == [[1, 1]] * 2
        assert _run(cluster, rank_workers_end) == [True, True]


def rank_round_both(ctx):
    return _round2(ctx, RANK_STATE["buffer"], seed=11)


# ---------------------------------------------------------------------- switch_layout
def rank_start_switch(ctx, addr):
    rank_start(ctx, addr)
    return _add_unified()


def _add_unified():
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape
    from tests.test_switch_weights import E, H, I

    unified = RANK_STATE["unified"] = UnifiedWeights(RANK_STATE["buffer"], WeightShape(E, H, I), 2)
    RANK_STATE["full"] = [random_weights(E, H, I, seed=30 + layer) for layer in range(2)]
    unified.load_full(RANK_STATE["full"])
    return unified.layout


def _check_weights(ctx, layout):
    from tests.test_switch_weights import _expected_shard

    unified = RANK_STATE["unified"]
    assert unified.layout == layout, unified.layout
    for layer, full in enumerate(RANK_STATE["full"]):
        want, got = _expected_shard(full, layout, ctx.rank, ctx.num_ranks), unified.view(layer)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer}"


def rank_switch_stalled(ctx, deadline_s=DEADLINE_S):
    from mooncake_ep_switch.switch.switcher import switch_layout

    failure = _error_of(lambda: switch_layout(RANK_STATE["buffer"], "tp", weights=RANK_STATE["unified"],
                                              timeout_us=int(deadline_s * 1e6)))
    _check_weights(ctx, "ep")  # nothing moved: still the source layout, intact
    return failure


def rank_switch(ctx):
    from mooncake_ep_switch.switch.switcher import switch_layout

    report = switch_layout(RANK_STATE["buffer"], "tp", weights=RANK_STATE["unified"], timeout_us=30_000_000)
    assert report.outcome == "completed", report
    _check_weights(ctx, "tp")
    return report.layout


def test_switch_layout_fails_at_its_deadline_while_the_store_host_is_stopped():
    with harness.StoreHost() as host, harness.fresh_cluster(2) as cluster:
        assert _run(cluster, rank_start_switch, host.addr) == ["ep", "ep"]
        host.stop()
        try:
            _check_stalled(cluster.run(rank_switch_stalled, timeout_s=STALLED_RUN_S), host.addr, "switch_layout")
        finally:
            host.resume()
        assert _run(cluster, rank_switch) == ["tp", "tp"]
        assert _run(cluster, rank_workers_end) == [True, True]


# ---------------------------------------------------------------------- collective TP all-reduce of a new view
def _all_reduce_exact(ctx, reduce, timeout_us):
    """A TP all-reduce of 3 rows whose exact float32 sum is known; True when it is."""
    x = torch.full((3, 128), float(ctx.rank + 1))
    out = reduce.all_reduce(x, torch.ones(ctx.num_ranks, dtype=torch.int32), timeout_us, float32_result=True)
    return torch.equal(out, torch.full((3, 128), float(sum(range(1, ctx.num_ranks + 1)))))


def rank_start_all_reduce(ctx, addr):
    """A TPAllReduce on the Transfer Engine's Buffer (the collective path over a group of the view built through
    the store; the collective transport's fallback group is the Buffer's own), then a new view (epoch 1): its
    group is not built yet."""
    from mooncake_ep_switch.switch.tp_collective import TPAllReduce

    store = RANK_STATE["store"] = connect_store(*addr)
    buffer = RANK_STATE["buffer"] = Buffer(ctx.group, _size2(), transport="mooncake", disable_p2p=True, store=store)
    reduce = RANK_STATE["reduce"] = TPAllReduce(buffer, 4, 128)
    assert _all_reduce_exact(ctx, reduce, int(DEADLINE_S * 1e6))  # epoch 0: the constructor's group
    return buffer.update_ep_member(timeout_s=60.0).epoch


def rank_all_reduce_stalled(ctx):
    return _error_of(lambda: _all_reduce_exact(ctx, RANK_STATE["reduce"], int(DEADLINE_S * 1e6)))


def rank_all_reduce(ctx):
    # The last rank comes 1 s late, so that its peer reads its rendezvous key first: a stale one (the stalled
    # attempt's, landed at the resume) would send the peer to a closed listener until the group's timeout.
    if ctx.rank == ctx.num_ranks - 1:
        time.sleep(1.0)
    return _all_reduce_exact(ctx, RANK_STATE["reduce"], 30_000_000)


def test_a_collective_all_reduce_of_a_new_view_fails_at_its_deadline_while_the_store_host_is_stopped():
    """Its group of the new view is built through the store: by the caller's timeout_us (before: the store's)."""
    with harness.StoreHost() as host, harness.fresh_cluster(2) as cluster:
        assert _run(cluster, rank_start_all_reduce, host.addr) == [1, 1]
        host.stop()
        try:
            _check_stalled(cluster.run(rank_all_reduce_stalled, timeout_s=STALLED_RUN_S), host.addr, "all_reduce")
        finally:
            host.resume()
        assert _run(cluster, rank_all_reduce) == [True, True]  # the next attempt meets under keys of its own
        assert _run(cluster, rank_workers_end) == [True, True]


# ---------------------------------------------------------------------- online EPLB commit
EPLB_LAYERS, EPLB_EXPERTS, EPLB_SLOTS, EPLB_HIDDEN, EPLB_INTER = 1, 4, 3, 256, 128
OLD_PLACEMENT = [[0, 1, 2, 2, 3, 0]]  # rank 0: experts 0, 1 and a copy of 2; rank 1: 2, 3 and a copy of 0
NEW_PLACEMENT = [[0, 1, 3, 2, 3, 1]]  # the redundant copies move: 3 to rank 0, 1 to rank 1
COMMIT_STEP = 3


def rank_start_eplb(ctx, addr):
    rank_start(ctx, addr)
    return _add_slots(ctx, DEADLINE_S)


def _add_slots(ctx, deadline_s):
    """Expert slots in OLD_PLACEMENT and a rebalancer to NEW_PLACEMENT staged up to its commit step."""
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    shape = SlotShape(EPLB_LAYERS, EPLB_EXPERTS, EPLB_SLOTS, EPLB_HIDDEN, EPLB_INTER)
    slots = RANK_STATE["slots"] = ExpertSlots(RANK_STATE["buffer"], shape, np.asarray(OLD_PLACEMENT), spare_frames=3)
    RANK_STATE["weights"] = [random_weights(EPLB_EXPERTS, EPLB_HIDDEN, EPLB_INTER, seed=40)]
    slots.load(RANK_STATE["weights"])
    # Every rank's frames are loaded before any rank stages from them (a peer's frame read before the peer
    # loaded it is staged as garbage: this test's frame check failed 1 run in ~10 under load without it).
    dist.barrier(group=ctx.group)
    rebalancer = RANK_STATE["rebalancer"] = OnlineRebalancer(slots, timeout_us=int(deadline_s * 1e6),
                                                             frames_per_step=1)
    rebalancer.begin(np.asarray(NEW_PLACEMENT), commit_step=COMMIT_STEP)
    for step in range(COMMIT_STEP):  # staging before the commit step
        assert rebalancer.step(step) == []
    return True


def _frames_hold(slots, weights):
    for local_slot, expert in enumerate(slots.local_experts(0)):
        gate_up, down = slots.expert(0, local_slot)
        if not (torch.equal(gate_up, weights[0].gate_up[expert]) and torch.equal(down, weights[0].down[expert])):
            return False
    return True


def rank_commit_stalled(ctx):
    slots, rebalancer = RANK_STATE["slots"], RANK_STATE["rebalancer"]
    failure = _error_of(lambda: rebalancer.step(COMMIT_STEP))
    assert slots.phy2log.tolist() == OLD_PLACEMENT and rebalancer.in_progress  # undecided: the old placement serves
    assert _frames_hold(slots, RANK_STATE["weights"])
    return failure


def rank_commit(ctx):
    slots, rebalancer = RANK_STATE["slots"], RANK_STATE["rebalancer"]
    reports = rebalancer.step(COMMIT_STEP + 1)  # the chunk stayed queued: it commits now
    assert [r.outcome for r in reports] == ["committed"], reports
    assert slots.phy2log.tolist() == NEW_PLACEMENT and not rebalancer.in_progress
    assert _frames_hold(slots, RANK_STATE["weights"])
    return True


def test_online_eplb_commit_fails_at_its_deadline_while_the_store_host_is_stopped():
    with harness.StoreHost() as host, harness.fresh_cluster(2) as cluster:
        assert _run(cluster, rank_start_eplb, host.addr) == [True, True]
        host.stop()
        try:
            _check_stalled(cluster.run(rank_commit_stalled, timeout_s=STALLED_RUN_S), host.addr, "online EPLB commit")
        finally:
            host.resume()
        assert _run(cluster, rank_commit) == [True, True]
        assert _run(cluster, rank_workers_end) == [True, True]


ETCD_DEADLINE_S = 1.5  # update_ep_member's deadline while the etcd cluster has no quorum


def rank_start_etcd(ctx, url):
    """A Buffer whose membership lives on the etcd store at `url` (the runtime unchanged, issue 38)."""
    store = RANK_STATE["store"] = connect_store(url, timeout_s=30)
    RANK_STATE["buffer"] = Buffer(ctx.group, _size2(), transport="shm", store=store)
    return _round2(ctx, RANK_STATE["buffer"], seed=1)


def rank_start_etcd_all(ctx, url):
    """`rank_start_etcd` plus unified weights and expert slots staged up to their commit step."""
    served = rank_start_etcd(ctx, url)
    _add_unified()
    _add_slots(ctx, ETCD_DEADLINE_S)
    return served


def rank_stalled_all(ctx):
    """With no quorum: (seconds, error type, message) of update_ep_member, switch_layout and the EPLB commit."""
    return [rank_update_stalled(ctx, ETCD_DEADLINE_S), rank_switch_stalled(ctx, ETCD_DEADLINE_S),
            rank_commit_stalled(ctx)]


def rank_destroy_structures(ctx):
    RANK_STATE.pop("slots").destroy()
    RANK_STATE.pop("unified").destroy()
    return harness.rank_teardown(ctx)


def test_an_etcd_store_without_quorum_fails_each_operation_at_its_deadline_and_serving_goes_on(etcd_cluster):
    """The group's store is a 3-member etcd cluster; two members are stopped (no quorum): dispatch/combine
    go on, update_ep_member(), switch_layout() and an online EPLB commit each raise StoreUnavailable naming
    the etcd store within their deadline, nothing moved (source layout, old placement); with the members
    resumed the same Buffers agree on the next view, switch and commit. Shared ranks, R=2."""
    prefix = f"stall-{os.getpid()}-{time.monotonic_ns()}"
    url = etcd_cluster.url(prefix) + "?job=test-store-stall&request_s=1"
    cluster = harness.cluster(2)
    try:
        assert _run(cluster, rank_start_etcd_all, url) == [[1, 1]] * 2
        leader = etcd_cluster.leader()
        stopped = [leader, (leader + 1) % 3]
        for index in stopped:
            harness.stop_process(etcd_cluster.processes[index].pid)
        try:
            outcomes = cluster.run(rank_stalled_all, timeout_s=STALLED_RUN_S)
        finally:
            for index in stopped:
                os.kill(etcd_cluster.processes[index].pid, signal.SIGCONT)
        for outcome in outcomes:
            for (seconds, kind, message), operation in zip(outcome_value(outcome), (
                    "update_ep_member", "switch_layout", "online EPLB commit")):
                assert kind == "StoreUnavailable" and "etcd://" in message and prefix in message, (kind, message)
                assert operation in message and seconds <= ETCD_DEADLINE_S + LATE_S, (seconds, message)
                print(f"{operation}: StoreUnavailable after {seconds:.2f} s (deadline {ETCD_DEADLINE_S} s)")
        views = _run(cluster, rank_update_round)
        assert [v[:2] for v in views] == [(1, [0, 1])] * 2 and all(v[2] == [1, 1] for v in views), views
        assert _run(cluster, rank_switch) == ["tp", "tp"]
        assert _run(cluster, rank_commit) == [True, True]
    finally:
        check_outcomes(cluster.run(rank_destroy_structures))
