"""A whole pretend host lost with the etcd store (issue 38 item 3): 3 hosts x 2 ranks, an etcd member per host.

Every host is a network namespace (tests/netns.py); the ranks' store is a 3-member etcd cluster with one
member on each host (`LocalCluster(store="etcd", network=...)`), the leader moved to host A first. Every
process of host A is SIGKILLed (its two ranks and the etcd leader; host 0 with rank 0, or host 1 without
it): the four survivors serve the next round exactly without them (shm inside a host, the Transfer Engine
across), replacements started on host A join through the two etcd members left and are admitted, and every
rank's rounds are exact again. Before the replacements come, one of the two members left is stopped too (no
quorum): the survivors' rounds stay exact, update_ep_member() fails at its deadline with StoreUnavailable
naming the etcd store and a switch of the weights is refused naming the dead ranks (they cannot be sealed out;
before, it went into gloo with them); the admission after it is resumed shows it works again. Then, still on
two etcd members, an online EPLB chunk is staged on every rank (every redundant copy read from another host
over the Transfer Engine, the replacements' copies taken over from the members' placement) and the quorum is
lost again in the middle of its vote: rank 0 votes GO and stops one of the two members left, the others vote
after it. Every rank's commit step raises StoreUnavailable naming the etcd store at the rebalancer's
timeout_us, rounds exact around it, nothing adopted; still without quorum, every rank's TP<->EP switch (all six
alive and members: its gloo group of the epoch is built through etcd) raises StoreUnavailable naming the etcd
store at its own deadline, weights bit-exact and unmoved. Resumed, rank 0's GO is in etcd and no decision, and
the chunk commits at the next step on every rank (one outcome). Then the same TP<->EP switch of the unified
weights built before the death completes both ways (gloo collectives on the "mooncake" transport, on a group
of the current view built through etcd; one rank enters it late, after its peers read its rendezvous key),
weights bit-exact against the checkpoint. Last, tests/test_etcd_ballots.py's checks across the hosts: host A's
etcd member restarted and made the leader, rank 0 SIGKILLs it (two members left: a quorum) in the middle of a
decision, a new UnifiedWeights' first switch (its group of the view built through etcd during the election;
host 0's case) or an EPLB vote (rank 0's GO in, the five others vote after the kill; host 1's case): one
decision everywhere (completed / committed on every rank), weights, placements and frames exact.
"""
import contextlib
import os
import signal
import time

import torch

import numpy as np
import pytest

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.elastic import join
from tests import harness
from tests.harness import RANK_STATE, outcome_value
from tests.netns import make_network  # noqa: F401 - make_network is a fixture
from tests.reference import expected_combine, expected_routing, structured_inputs, token_count
from tests.test_etcd_ballots import TIMEOUT_US as BALLOT_TIMEOUT_US
from tests.test_etcd_ballots import rebalance_with_leader_killed, switch_with_leader_killed
from tests.test_faults import _mock_expert
from tests.test_store_stall import LATE_S, _error_of, rank_workers_end

NUM_HOSTS, RANKS_PER_HOST = 3, 2
R = NUM_HOSTS * RANKS_PER_HOST
RANK_HOSTS = [r // RANKS_PER_HOST for r in range(R)]
T, H, E, K = 16, 128, 12, 4
LAYERS, SLOTS, INTER = 1, 3, 48  # EPLB slots: 2 primaries and 1 redundant copy per rank; INTER % R == 0 (TP)
TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE  # survivors reach host 0's ranks over the Transfer Engine
# A round with every rank alive never waits out its deadline, but it must not mask a live rank that is late: the
# first round starts as each rank finishes building its slots and weights, seconds apart at load 19 (the
# repetition loop once saw ranks 2 and 4 masked by a 4 s deadline there).
ALL_LIVE_TIMEOUT_US = 60_000_000


def _inputs(rank, round_index):
    return structured_inputs(rank, token_count(rank, R, T), H, E, K, seed=900 + round_index, random_values=True)


def _round(ctx, buffer, round_index, dead=()):
    """One dispatch + combine from a full mask; the dead end masked, rows and outputs exact without them (the
    deadline: TIMEOUT_US when some are dead, else ALL_LIVE_TIMEOUT_US)."""
    all_inputs = [_inputs(r, round_index) for r in range(R)]
    mine = all_inputs[ctx.rank]
    active = torch.ones(R, dtype=torch.int32)
    timeout_us = TIMEOUT_US if dead else ALL_LIVE_TIMEOUT_US
    started = time.monotonic()
    recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, T, E, timeout_us, use_fp8=False)
    combined, _, _ = buffer.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active, timeout_us,
                                    handle)
    seconds = time.monotonic() - started
    want = [0 if r in dead else 1 for r in range(R)]
    assert active.tolist() == want, f"mask {active.tolist()}, expected {want}"
    routing = expected_routing([inp.topk_idx for inp in all_inputs], want, ctx.rank, E // R)
    assert count.tolist() == [len(pairs) for pairs in routing], "recv_count"
    for local, pairs in enumerate(routing):
        for row, (source, token) in enumerate(pairs):
            assert int(handle[0][local, row]) == token
            assert torch.equal(recv[local, row], all_inputs[source].x[token]), f"row {row} of expert {local}"
    expected = expected_combine(mine.x, mine.topk_idx, mine.weights, {r: bool(want[r]) for r in range(R)}, E // R)
    assert torch.equal(combined, expected), "combined output differs from the reference"
    return seconds


def _initial_phy2log():
    """[LAYERS, R * SLOTS]: rank r holds experts 2r, 2r + 1 and a copy of 2r + 2 (rank r + 1's)."""
    return np.asarray([[e for r in range(R) for e in (2 * r, 2 * r + 1, (2 * r + 2) % E)]] * LAYERS, dtype=np.int64)


def _checkpoint(layers=LAYERS, inter=INTER):
    from mooncake_ep_switch.reference.moe_block import random_weights

    return [random_weights(E, H, inter, seed=700 + layer) for layer in range(layers)]


def _build_slots(buffer):
    """ExpertSlots + OnlineRebalancer (a replacement takes the members' placement over), then UnifiedWeights
    (the same order on a replacement: it takes the members' layout)."""
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape

    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    slots = ExpertSlots(buffer, SlotShape(LAYERS, E, SLOTS, H, INTER), _initial_phy2log())
    slots.load(_checkpoint())
    RANK_STATE.update(slots=slots, rebalancer=OnlineRebalancer(slots, timeout_us=TIMEOUT_US, frames_per_step=1))
    unified = RANK_STATE["unified"] = UnifiedWeights(buffer, WeightShape(E, H, INTER), 2)  # gloo switches here
    unified.load_full(_checkpoint(layers=2))  # a replacement's: in the members' layout


def rank_start(ctx):
    """A Buffer over the etcd store (transport auto: shm inside a host, TE across) and its expert slots; one
    exact round."""
    buffer = RANK_STATE["buffer"] = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(T, H, R, E))
    _build_slots(buffer)
    _round(ctx, buffer, 0)
    return {"store": ctx.store_addr, "transport": buffer.transport, "routes": list(buffer._transport.routes)}


def rank_serve_without(ctx, dead):
    """A round right after host 0's death: the dead masked, exact without them."""
    return _round(ctx, RANK_STATE["buffer"], 1, dead=dead)


QUORUM_DEADLINE_S = 2.0  # update_ep_member's deadline while the two etcd members left are one


def rank_quorum_lost(ctx, dead):
    """With one of the two etcd members left stopped: rounds exact around update_ep_member(), which raises
    StoreUnavailable at its deadline; (seconds, error type, message). Then a TP<->EP switch of the weights (gloo
    collectives), with the dead still members (not sealed out): refused naming them once seen dead, nothing
    moved; (outcome, layout, reason)."""
    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer = RANK_STATE["buffer"]
    _round(ctx, buffer, 2, dead=dead)
    failure = _error_of(lambda: buffer.update_ep_member(timeout_s=QUORUM_DEADLINE_S))
    _round(ctx, buffer, 3, dead=dead)
    deadline = time.monotonic() + 30
    while not set(dead) <= set(buffer.dead_peers()):
        assert time.monotonic() < deadline, f"dead peers seen: {buffer.dead_peers()}, expected {dead}"
        time.sleep(0.01)
    report = switch_layout(buffer, "tp", weights=RANK_STATE["unified"], timeout_us=30_000_000)
    return failure, (report.outcome, report.layout, report.reason)


def rank_admit(ctx, joiners):
    """Replacements join through the store; survivors admit them once both are waiting."""
    if ctx.group is None:
        ticket = join(ctx.store, ctx.rank, ctx.num_ranks)
        RANK_STATE["buffer"] = Buffer(ticket, Buffer.get_ep_buffer_size_hint(T, H, R, E))
    else:
        deadline = time.monotonic() + 60
        while not set(joiners) <= set(RANK_STATE["buffer"].pending_joiners()):
            assert time.monotonic() < deadline, "the replacements never showed up"
            time.sleep(0.01)
    view = RANK_STATE["buffer"].update_ep_member(timeout_s=60)
    if ctx.group is None:  # the members' update_ep_member() waits for the replacement's slot regions
        _build_slots(RANK_STATE["buffer"])
    return list(view.ranks), view.epoch


def rank_full_rounds(ctx):
    buffer = RANK_STATE["buffer"]
    for round_index in (10, 11):
        _round(ctx, buffer, round_index)
    return True


def rank_rebalance_begin(ctx):
    """Every rank's redundant copy becomes the expert of the rank two further on (another host: a Transfer
    Engine read, from a replacement's slots for two of them), one chunk to commit at step 2; staged at step 1."""
    rebalancer = RANK_STATE["rebalancer"]
    rebalancer.begin(_rebalanced_phy2log(), commit_step=2)
    return rebalancer.step(1, RANK_STATE["buffer"].active_mask())


def _rebalanced_phy2log():
    target = _initial_phy2log()
    target[:, SLOTS - 1::SLOTS] = [[(2 * r + 5) % E for r in range(R)]] * LAYERS
    return target


def _frames_ok(slots):
    return all(torch.equal(slots.expert(layer, local)[0], weights.gate_up[expert])
               and torch.equal(slots.expert(layer, local)[1], weights.down[expert])
               for layer, weights in enumerate(_checkpoint()) for local, expert in enumerate(slots.local_experts(layer)))


MARK_WAIT_S = 60.0


def rank_rebalance_stalled(ctx, member_pid, marker):
    """At the chunk's commit step rank 0 votes GO and then SIGSTOPs etcd member `member_pid` (with host A's member
    killed: no quorum); the other ranks vote after that. Every rank's commit step raises StoreUnavailable at the
    rebalancer's timeout_us (rank 0 waiting for the votes, the others voting), rounds exact around it; nothing
    adopted (the old placement serves, its frames intact, the chunk still queued). (seconds since the vote or
    the stop, error type, message)."""
    buffer, slots, rebalancer = RANK_STATE["buffer"], RANK_STATE["slots"], RANK_STATE["rebalancer"]
    _round(ctx, buffer, 12)
    vote, since = slots.ballot.vote, []

    def vote_around_the_stop(epoch, *args, **kwargs):
        if ctx.rank != 0:
            deadline = time.monotonic() + MARK_WAIT_S
            while not os.path.exists(marker):
                assert time.monotonic() < deadline, "rank 0 never stopped the etcd member"
                time.sleep(0.005)
            since.append(time.monotonic())
        vote(epoch, *args, **kwargs)
        if ctx.rank == 0:  # its vote is in etcd: the quorum goes
            harness.stop_process(member_pid)
            since.append(time.monotonic())
            with open(marker, "w") as flag:
                flag.write("stopped")

    slots.ballot.vote = vote_around_the_stop
    try:
        _, kind, message = _error_of(lambda: rebalancer.step(2, buffer.active_mask()))
    finally:
        del slots.ballot.vote
    assert since, (kind, message)
    seconds = time.monotonic() - since[0]
    assert slots.phy2log.tolist() == _initial_phy2log().tolist() and rebalancer.in_progress, slots.phy2log
    assert _frames_ok(slots), "a frame that serves changed"
    _round(ctx, buffer, 13)
    # Still without quorum, every member alive: the TP<->EP switch that rank_switch makes once it is back. Its
    # group of this epoch is built through etcd (gloo's rendezvous): StoreUnavailable at its own deadline.
    from mooncake_ep_switch.switch.switcher import switch_layout

    unified = RANK_STATE["unified"]
    switch = _error_of(lambda: switch_layout(buffer, "tp", weights=unified, timeout_us=SWITCH_QUORUM_US))
    assert unified.layout == "ep" and _unified_exact(ctx, unified, "ep"), "the refused switch moved weights"
    _round(ctx, buffer, 14)
    return seconds, kind, message, switch


SWITCH_QUORUM_US = 2_000_000  # the switch's timeout_us while the quorum is lost


def _unified_exact(ctx, unified, layout):
    """Whether every layer's view of `unified` holds this rank's part of the checkpoint in `layout`, bit for bit."""
    for layer, weights in enumerate(_checkpoint(layers=2)):
        if layout == "ep":
            local = E // R
            want = (weights.gate_up[ctx.rank * local:(ctx.rank + 1) * local],
                    weights.down[ctx.rank * local:(ctx.rank + 1) * local])
        else:
            lo, hi = ctx.rank * INTER // R, (ctx.rank + 1) * INTER // R
            want = (torch.cat([weights.gate_up[:, lo:hi], weights.gate_up[:, INTER + lo:INTER + hi]], dim=1),
                    weights.down[:, :, lo:hi])
        got = unified.view(layer)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return False
    return True


def rank_rebalance_commit(ctx):
    """The quorum back: rank 0's vote is in etcd, the chunk undecided; it commits at the next step on every
    rank (rank 0 votes again)."""
    slots, rebalancer = RANK_STATE["slots"], RANK_STATE["rebalancer"]
    before = slots.ballot.records([0])[0][:2], slots.ballot.decisions([1])
    # Each store step gets the ballots' 15 s from here on: this phase checks that the commit goes through once the
    # store answers, not how fast. A store just back from an election, with the stalled phase's abandoned requests
    # landing, once took over 4 s (TIMEOUT_US) to answer rank 0's vote read beside 2 CPU hogs (issue 43's loop).
    rebalancer.timeout_us = BALLOT_TIMEOUT_US
    reports = [(r.epoch, r.outcome, r.reason) for r in rebalancer.step(3, RANK_STATE["buffer"].active_mask())]
    rank_workers_end(ctx)  # the store workers the stalled calls abandoned end
    return {"before": before, "reports": reports, "frames_ok": _frames_ok(slots), "te_reads": slots.te_reads,
            "placement": slots.phy2log.tolist() == _rebalanced_phy2log().tolist()}


# The last rank's delay into rank_switch's first switch. The rendezvous of the switch without quorum left keys that
# landed once the quorum returned (its abandoned store calls went through): peers that read the late rank's stale
# address went into gloo with a listener long closed and failed at the group's 30 s timeout (96 s instead of 34 s).
LATE_ENTRY_S = 1.0


def rank_switch(ctx):
    """EP -> TP -> EP on the UnifiedWeights built before host A's death (the replacements': after their
    admission). On the "mooncake" transport they switch with gloo collectives, on a group of the current view
    built through the etcd store at the first switch of the epoch (the constructor's group names the dead
    processes; a replacement has none), the last rank entering late; the first is the switch that failed without
    quorum (rank_rebalance_stalled). Every view bit-exact against the checkpoint. One more exact round."""
    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, unified = RANK_STATE["buffer"], RANK_STATE["unified"]
    outcomes = []
    if ctx.rank == R - 1:  # enters late, as a loaded rank would: its peers read its rendezvous key first
        time.sleep(LATE_ENTRY_S)
    for target in ("tp", "ep"):
        report = switch_layout(buffer, target, weights=unified, timeout_us=30_000_000)
        outcomes.append((report.outcome, report.layout))
        assert _unified_exact(ctx, unified, target), f"weights in {target}"
    RANK_STATE.pop("unified").destroy()
    _round(ctx, buffer, 20)
    return outcomes


def rank_leader_killed(ctx, decision, leader_pid, marker):
    """test_etcd_ballots' checks across the hosts, then tear down: rank 0 SIGKILLs the etcd leader `leader_pid`
    (two members left: a quorum) in the middle of `decision`. "switch": a new UnifiedWeights EP -> TP -> EP, killed
    as it enters (its group of the view meets through etcd during the election); "vote": the slots back to the
    initial placement (ballot epoch 2: rank 0's GO in, then the kill, the five others vote after it), then to the
    rebalanced one again. The result of `switch_with_leader_killed` / `rebalance_with_leader_killed`."""
    buffer = RANK_STATE["buffer"]
    if decision == "switch":
        result = switch_with_leader_killed(ctx, buffer, E, INTER, leader_pid, marker, timeout_us=30_000_000)
    else:
        slots, rebalancer = RANK_STATE["slots"], RANK_STATE["rebalancer"]
        rebalancer.timeout_us = BALLOT_TIMEOUT_US  # the vote wait: the election fits in it on a loaded box
        result = rebalance_with_leader_killed(ctx, slots, rebalancer, buffer.active_mask(), _checkpoint(),
                                              [_initial_phy2log(), _rebalanced_phy2log()], first_step=4,
                                              kill_epoch=2, leader_pid=leader_pid, marker=marker)
    _round(ctx, buffer, 21)
    RANK_STATE.pop("slots").destroy()
    harness.rank_teardown(ctx)
    return result


def _quorum_back(etcd, host_a, phase, what):
    """Wait until both running members answer /health (which needs a leader), then print how long it took.

    The quorum back means a leader again: the resumed member and the one left hold an election first, seconds on a
    loaded box, and a phase started at once met it with its 4 s store deadlines (CI beside 2 CPU hogs: the online
    EPLB commit's vote read). Each phase is asked of a store that answers; the phases without a quorum test the
    deadlines. (Once rank 0's own vote, before it stopped a member, also ran out of its 4 s, with admission and
    rounds done through the store just before: if that recurs after this wait, the store was slow, not electing.)"""
    since = time.monotonic()
    etcd.wait_healthy([i for i in range(NUM_HOSTS) if i != host_a], 30.0)
    phase(f"{what} (a leader after {time.monotonic() - since:.1f} s)")


@contextlib.contextmanager
def _member_logs_on_failure(etcd):
    """Print the tail of every etcd member's log when the block fails (what the cluster went through: elections,
    ReadIndex retries, slow applies), then let the failure go on."""
    try:
        yield
    except BaseException:
        for index in range(etcd.count):
            print(f"--- etcd member m{index} log (tail) ---\n{etcd.log(index, tail_bytes=12000)}")
        raise


@pytest.mark.parametrize("host_a", [0, 1], ids=["rank0-and-leader", "leader-not-rank0"])
def test_a_whole_host_lost_with_the_etcd_leader(make_network, host_a, tmp_path):
    dead_ranks = [r for r in range(R) if RANK_HOSTS[r] == host_a]
    network = make_network(NUM_HOSTS)
    began = time.monotonic()

    def phase(name):
        print(f"host {host_a}: {name} done at {time.monotonic() - began:.1f} s")

    with harness.fresh_cluster(R, network=network.placement(RANK_HOSTS), store="etcd") as cluster, \
            _member_logs_on_failure(cluster.etcd):
        etcd = cluster.etcd
        assert cluster.store is None and etcd.endpoints == [f"{a}:2379" for a in network.addresses]
        started = [outcome_value(o) for o in cluster.run(rank_start, timeout_s=120)]
        url = started[0]["store"][0]
        assert all(s["store"] == (url, None) for s in started) and url.startswith("etcd://"), started
        assert all(s["transport"] == "mooncake" for s in started)
        assert started[2]["routes"] == ["te", "te", "self", "shm", "te", "te"]
        phase("started")
        etcd.move_leader(host_a)
        assert etcd.leader() == host_a
        for rank in dead_ranks:  # every process of host A: its ranks and its etcd member, the leader
            os.kill(cluster.processes[rank].pid, signal.SIGKILL)
        etcd.kill(host_a)
        for rank in dead_ranks:
            cluster.processes[rank].join(10)
        survivors = [r for r in range(R) if r not in dead_ranks]
        seconds = [outcome_value(o) for o in cluster.run(rank_serve_without, dead_ranks, ranks=survivors,
                                                         timeout_s=60)]
        assert max(seconds) < TIMEOUT_US / 1e6 + harness.FAULT_SLACK_S, seconds
        phase("host lost, survivors served")
        stopped = etcd.leader()  # quorum lost across hosts: one of the two members left stops
        harness.stop_process(etcd.processes[stopped].pid)
        try:
            failures = [outcome_value(o) for o in cluster.run(rank_quorum_lost, dead_ranks, ranks=survivors,
                                                              timeout_s=60)]
        finally:
            os.kill(etcd.processes[stopped].pid, signal.SIGCONT)
        for (elapsed, kind, message), (outcome, layout, reason) in failures:
            assert kind == "StoreUnavailable" and "etcd://" in message and "update_ep_member" in message, message
            assert elapsed <= QUORUM_DEADLINE_S + LATE_S, (elapsed, message)
            assert (outcome, layout) == ("refused", "ep") and f"ranks {dead_ranks} are dead" in reason, reason
        phase("quorum window")
        _quorum_back(etcd, host_a, phase, "quorum back after the window")
        for rank in dead_ranks:  # host A back without its etcd member: the replacements use the two left
            cluster.respawn(rank)
        views = [outcome_value(o) for o in cluster.run(rank_admit, dead_ranks, timeout_s=120)]
        assert all(v == (list(range(R)), views[0][1]) for v in views), views
        assert all(outcome_value(o) for o in cluster.run(rank_full_rounds, timeout_s=120))
        phase("admitted, full rounds")
        assert all(outcome_value(o) == [] for o in cluster.run(rank_rebalance_begin, timeout_s=120))
        _quorum_back(etcd, host_a, phase, "the store answers before the stop")  # rank 0's vote goes in first
        stopped = next(i for i in range(NUM_HOSTS) if i not in (host_a, etcd.leader()))  # rank 0 stops it
        try:
            failures = [outcome_value(o) for o in cluster.run(rank_rebalance_stalled, etcd.processes[stopped].pid,
                                                              str(tmp_path / "member-stopped"), timeout_s=90)]
        finally:
            os.kill(etcd.processes[stopped].pid, signal.SIGCONT)
        for elapsed, kind, message, (switch_s, switch_kind, switch_message) in failures:
            assert kind == "StoreUnavailable" and "etcd://" in message and "online EPLB commit" in message, message
            assert elapsed <= TIMEOUT_US / 1e6 + LATE_S, (elapsed, message)
            assert switch_kind == "StoreUnavailable" and "etcd://" in switch_message, switch_message
            assert "switch_layout" in switch_message and switch_s <= SWITCH_QUORUM_US / 1e6 + LATE_S, switch_message
        assert (tmp_path / "member-stopped").exists()
        print(f"online EPLB commit without quorum: StoreUnavailable after {[round(f[0], 2) for f in failures]} s "
              f"(timeout_us {TIMEOUT_US / 1e6} s): {failures[0][2]}; switch_layout: StoreUnavailable after "
              f"{[round(f[3][0], 2) for f in failures]} s (timeout_us {SWITCH_QUORUM_US / 1e6} s)")
        _quorum_back(etcd, host_a, phase, "quorum back")
        rebalanced = [outcome_value(o) for o in cluster.run(rank_rebalance_commit, timeout_s=120)]
        for rank, result in enumerate(rebalanced):
            assert result["before"] == ([1, 1], {1: None}), (rank, result)  # rank 0's GO in, nobody decided
            assert result["reports"] == [(1, "committed", "")], (rank, result["reports"])
            assert result["placement"] and result["frames_ok"], (rank, result)
            assert result["te_reads"] == LAYERS, (rank, result)  # the new copy is held only on another host
        phase("rebalanced")
        switched = [outcome_value(o) for o in cluster.run(rank_switch, timeout_s=120)]
        assert switched == [[("completed", "tp"), ("completed", "ep")]] * R, switched
        phase("switched")
        assert etcd.leader() != host_a
        # The etcd leader killed in the middle of a decision, across the hosts: host A's member back and made the
        # leader (killing it leaves two: a quorum), rank 0 kills it (host 0's case: its own host's member).
        etcd.restart(host_a)
        etcd.move_leader(host_a)
        decision, marker = ("switch" if host_a == 0 else "vote"), tmp_path / "leader-killed"
        try:
            results = [outcome_value(o) for o in cluster.run(rank_leader_killed, decision, etcd.processes[host_a].pid,
                                                             str(marker), timeout_s=120)]
            assert marker.exists()
            assert etcd.leader() != host_a
        finally:
            etcd.kill(host_a)  # reaps the killed member
        if decision == "switch":
            assert results == [[("completed", "tp", ""), ("completed", "ep", "")]] * R, results
        for rank, result in enumerate(results if decision == "vote" else []):
            assert [r[0] for r in result] == [[(2, "committed", "")], [(3, "committed", "")]], (rank, result)
            assert all(placed and frames for _, placed, frames in result), (rank, result)
        phase(f"leader killed in a {decision}")
