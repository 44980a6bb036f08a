"""Online EPLB across hosts for real: 2 hosts x 2 ranks in network namespaces (tests/netns.py).

Ranks 0, 1 live on host 0 and ranks 2, 3 on host 1 (`transport="auto"` -> "mooncake": shared memory
inside a host, the Transfer Engine across). Every rank's redundant copy moves (the chunk of
tests/test_eplb_online.py `rank_fault_at_commit`): ranks 0 and 2 stage their new expert from their
host mate (shared memory), ranks 1 and 3 from the other host, read one-sided over the Transfer
Engine. Votes and the decision live in the launcher's store. Every step's rows are checked against
the single-process reference and the moved frames against the checkpoint, bit for bit.

Issue 36's serving through a death (cases (a), (b), (c) of tests/test_eplb_fault_routing.py and
tests/test_eplb_coverage.py, their rank functions and checks) runs here on the Transfer Engine across
hosts: `test_serving_through_a_death_across_hosts`.
"""
import signal
import time

import numpy as np
import pytest

from tests import harness, test_eplb_coverage, test_eplb_fault_routing, test_eplb_online
from tests.harness import outcome_value
from tests.netns import enter_host, make_network  # noqa: F401 - make_network is a fixture

NUM_HOSTS, RANKS_PER_HOST = 2, 2
NUM_RANKS = NUM_HOSTS * RANKS_PER_HOST
TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE  # dispatch/combine and the vote over the Transfer Engine
ACROSS = (1, 3)  # ranks whose new expert is held only on the other host


def _placement(network):
    """Ranks start inside their hosts' namespaces and reach the store over their veths, as on real hosts: a
    rank that connected in the root namespace and moved afterwards could not open another store client
    (the Buffer's bounded store calls use clones of the client)."""
    return network.placement([r // RANKS_PER_HOST for r in range(NUM_RANKS)])


def rank_rebalance_across_hosts(ctx, names, addresses, faulty, how, corrupt_table):
    host = ctx.rank // RANKS_PER_HOST
    enter_host(names[host], addresses[host], host_id=names[host])
    return test_eplb_online.rank_fault_at_commit(ctx, faulty, how, transport="auto", timeout_us=TIMEOUT_US,
                                                 corrupt_table=corrupt_table)


def _run(network, env=None, corrupt_table=None):
    assert test_eplb_online.R == NUM_RANKS
    with harness.fresh_cluster(NUM_RANKS, env=env, network=_placement(network)) as cluster:
        outcomes = cluster.run(rank_rebalance_across_hosts, network.names, network.addresses,
                               *((-1, "none") if env is None else (2, "kill")), corrupt_table, timeout_s=120,
                               failure_grace_s=30)
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    return outcomes


def _check_common(result, rank, expected):
    assert result["transport"] == "mooncake", result["transport"]
    assert [(r[0], r[1], r[3]) for r in result["reports"]] == [(1, expected, 3)], (rank, result["reports"])
    assert result["phy2log"] == (result["target"] if expected == "committed" else result["old"]), f"rank {rank}"
    assert result["frames_ok"] and result["free_frames"] == test_eplb_online.SLOTS_PER_RANK, f"rank {rank}"
    assert not result["in_progress"]
    assert all(result["exact"]), f"rank {rank}: rows differ from the reference {result['exact']}"


def test_online_rebalance_stages_across_hosts_and_commits(make_network):
    network = make_network(NUM_HOSTS)
    values = [outcome_value(o) for o in _run(network)]
    frame_bytes = 2 * (3 * test_eplb_online.INTER * test_eplb_online.HIDDEN)  # gate/up + down, bf16
    layers = test_eplb_online.LAYERS
    for rank, result in enumerate(values):
        _check_common(result, rank, "committed")
        assert result["remote_bytes"] == layers * frame_bytes, (rank, result)  # one slot per layer, from a peer
        # The copies came over the Transfer Engine exactly where no host mate held the expert.
        assert result["te_reads"] == (layers if rank in ACROSS else 0), (rank, result)
        assert result["te_bytes"] == (layers * frame_bytes if rank in ACROSS else 0), (rank, result)


def test_rank_killed_before_voting_across_hosts_aborts_everywhere(make_network):
    """Rank 2 (host 1) is SIGKILLed at the commit step before voting: ranks 0, 1 (the other host)
    and 3 (its host mate) all abort within the deadline, keep the old placement and serve exact rows."""
    network = make_network(NUM_HOSTS)
    began = time.monotonic()
    outcomes = _run(network, env={"MEP_FAULT_POINT": "eplb_before_vote:2:1:kill"})
    assert not outcomes[2].ok and outcomes[2].exitcode == -signal.SIGKILL, outcomes[2]
    for outcome in outcomes:
        if outcome.rank == 2:
            continue
        result = outcome_value(outcome)
        _check_common(result, outcome.rank, "aborted")
        reason = result["reports"][0][2]
        assert "process is gone" in reason or "before a peer decided it" in reason, reason
        assert result["stall_ms"][0] < TIMEOUT_US / 1e3, result["stall_ms"]
    assert time.monotonic() - began < 120


def test_bad_frame_id_from_another_host_aborts_with_a_clear_reason(make_network):
    """Rank 2 publishes frame 10**6 for the slot rank 1 stages from (over the Transfer Engine): rank 1
    refuses it before it becomes an address (a clear staging error, its vote ABORT), every rank aborts
    and keeps serving the old placement with exact rows."""
    network = make_network(NUM_HOSTS)
    values = [outcome_value(o) for o in _run(network, corrupt_table=(2, 0, 1, 10 ** 6))]
    for rank, result in enumerate(values):
        _check_common(result, rank, "aborted")
    reason = values[1]["reports"][0][2]
    assert "staging failed on rank 1: rank 2's frame table names frame 1000000 for layer 0 slot 1" in reason, reason


# ---------------------------------------------------------------- a replacement on the other host

DEAD = 3  # host 1; after its replacement joins, rank 0 stages from it and it stages from rank 1


def _readmit_target():
    """Rank 0's redundant copy becomes expert 7 (held only by rank 3), rank 3's becomes expert 3
    (held only by rank 1): both cross hosts, one of them from the replacement's region."""
    target = test_eplb_online._initial_phy2log()
    per_rank = test_eplb_online.SLOTS_PER_RANK
    target[:, 0 * per_rank + 2] = 7
    target[:, DEAD * per_rank + 2] = 3
    return target


def rank_readmit_setup(ctx, names, addresses):
    """A member (or, with no group, the replacement) enters its host and builds its Buffer; members
    also build their slots (the replacement builds them once admitted)."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join
    from mooncake_ep_switch.reference.moe_block import random_weights

    host = ctx.rank // RANKS_PER_HOST
    enter_host(names[host], addresses[host], host_id=names[host])
    e = test_eplb_online
    size = Buffer.get_ep_buffer_size_hint(e.TOKENS, e.HIDDEN, NUM_RANKS, NUM_RANKS * e.SLOTS_PER_RANK)
    replacement = ctx.group is None
    buffer = Buffer(join(ctx.store, ctx.rank, NUM_RANKS) if replacement else ctx.group, size)
    weights = [random_weights(e.EXPERTS, e.HIDDEN, e.INTER, seed=100 + layer) for layer in range(e.LAYERS)]
    harness.RANK_STATE.update(buffer=buffer, weights=weights, active=buffer.active_mask())
    if not replacement:
        _build_slots()
    return buffer.transport


def _build_slots():
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape

    e, state = test_eplb_online, harness.RANK_STATE
    slots = ExpertSlots(state["buffer"], SlotShape(e.LAYERS, e.EXPERTS, e.SLOTS_PER_RANK, e.HIDDEN, e.INTER),
                        e._initial_phy2log())
    slots.load(state["weights"])
    state["slots"] = slots
    state["rebalancer"] = OnlineRebalancer(slots, timeout_us=TIMEOUT_US, frames_per_step=1)


def rank_readmit_kill(ctx):
    """Rank DEAD is SIGKILLed; the survivors serve one step without it (exact rows)."""
    import os

    state = harness.RANK_STATE
    if ctx.rank == DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    out, ref, _ = test_eplb_online._forward(ctx, state["buffer"], state["weights"], state["slots"], state["active"],
                                            test_eplb_online._inputs(ctx.rank, 0), skip_dead=(DEAD,),
                                            timeout_us=TIMEOUT_US)
    return test_eplb_online._close(out, ref)


def rank_readmit_join(ctx):
    """Every rank: update_ep_member() (members wait for the replacement to ask); the replacement then
    builds its slots, taking the members' placement over and mapping/reading their regions."""
    state = harness.RANK_STATE
    buffer = state["buffer"]
    deadline = time.monotonic() + 60
    while ctx.rank != DEAD and DEAD not in buffer.pending_joiners():
        assert time.monotonic() < deadline, "the replacement never asked to join"
        time.sleep(0.01)
    view = buffer.update_ep_member(timeout_s=60)
    if ctx.rank == DEAD:
        _build_slots()
    state["active"] = buffer.active_mask()
    return list(view.ranks)


def rank_readmit_rebalance(ctx):
    """Rebalance to `_readmit_target()` (commit at step 3) while serving; then tear down."""
    e, state = test_eplb_online, harness.RANK_STATE
    buffer, slots, rebalancer, active = state["buffer"], state["slots"], state["rebalancer"], state["active"]
    target = _readmit_target()
    rebalancer.begin(target, commit_step=3)
    reports, exact = [], []
    for step in range(1, 5):
        reports += rebalancer.step(step, active)
        out, ref, _ = e._forward(ctx, buffer, state["weights"], slots, active, e._inputs(ctx.rank, step),
                                 timeout_us=TIMEOUT_US)
        exact.append(e._close(out, ref))
    result = {"reports": [(r.epoch, r.outcome, r.reason, r.commit_step) for r in reports], "exact": exact,
              "placement": slots.phy2log.tolist() == target.tolist(), "frames_ok": e._frames_match_checkpoint(
                  slots, state["weights"]), "te_reads": slots.te_reads, "remote": [r is not None for r in
                                                                                 slots.region.remote]}
    slots.destroy()
    harness.rank_teardown(ctx)
    return result


def test_replacement_on_the_other_host_is_read_over_the_transfer_engine(make_network):
    """Rank 3 (host 1) dies and a replacement joins on host 1: re-admission refreshes every member's
    remote address of its slots (a new process, a new engine), so a rebalance that stages from the
    replacement (rank 0) and into it (from rank 1) commits everywhere, frames and rows exact."""
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(NUM_RANKS, network=_placement(network)) as cluster:
        assert harness.check_outcomes(cluster.run(rank_readmit_setup, network.names, network.addresses,
                                                  timeout_s=60)) == ["mooncake"] * NUM_RANKS
        outcomes = cluster.run(rank_readmit_kill, timeout_s=60, failure_grace_s=30)
        assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
        assert all(outcome_value(o) for o in outcomes if o.rank != DEAD)
        cluster.respawn(DEAD)
        harness.check_outcomes(cluster.run(rank_readmit_setup, network.names, network.addresses, ranks=[DEAD],
                                           timeout_s=60))
        views = harness.check_outcomes(cluster.run(rank_readmit_join, timeout_s=90))
        assert views == [list(range(NUM_RANKS))] * NUM_RANKS
        results = harness.check_outcomes(cluster.run(rank_readmit_rebalance, timeout_s=90))
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    layers = test_eplb_online.LAYERS
    for rank, result in enumerate(results):
        assert [(r[0], r[1], r[3]) for r in result["reports"]] == [(1, "committed", 3)], (rank, result["reports"])
        assert result["placement"] and result["frames_ok"] and all(result["exact"]), (rank, result)
        assert result["te_reads"] == (layers if rank in (0, DEAD) else 0), (rank, result)
        assert result["remote"] == [r // RANKS_PER_HOST != rank // RANKS_PER_HOST for r in range(NUM_RANKS)]


# ---------------------------------------------------------------- an abandoned staging read (issue 28 item 2)

SLOW_READER, SLOW_HOLDER = 1, 3  # rank 1 (host 0) stages expert 7 from rank 3 (host 1) over a slow link
SLOW_RATE = "256kbit"  # host 1's egress: a 192 KiB frame takes ~6 s, far past the read deadline
SLOW_TIMEOUT_US = 1_500_000


def rank_slow_setup(ctx, names, addresses):
    """Enter the host, build Buffer + slots (a rebalancer whose reads and votes have 1.5 s), one exact step."""
    e, state = test_eplb_online, harness.RANK_STATE
    host = ctx.rank // RANKS_PER_HOST
    enter_host(names[host], addresses[host], host_id=names[host])
    buffer, weights, slots, _ = e._setup(ctx, transport="auto", timeout_us=TIMEOUT_US)
    from mooncake_ep_switch.eplb.online import OnlineRebalancer

    rebalancer = OnlineRebalancer(slots, timeout_us=SLOW_TIMEOUT_US, frames_per_step=1)
    state.update(buffer=buffer, weights=weights, slots=slots, rebalancer=rebalancer, active=buffer.active_mask())
    out, ref, _ = e._forward(ctx, buffer, weights, slots, state["active"], e._inputs(ctx.rank, 0),
                             timeout_us=TIMEOUT_US)
    return e._close(out, ref)


def rank_slow_rebalances(ctx):
    """With host 1's link slow: rebalance 1 moves rank 1's redundant copy to expert 7, held only on host 1:
    the read misses its deadline and every rank aborts, the read still in flight. Rebalance 2 at once moves
    the same slot to expert 0, copied from rank 0 (shared memory) into a free frame, and commits. Rank 1
    then waits until the abandoned read has finished (it lands somewhere) and reports whether its frames
    still hold exactly the checkpoint's experts."""
    e, state = test_eplb_online, harness.RANK_STATE
    slots, rebalancer = state["slots"], state["rebalancer"]
    slot = SLOW_READER * e.SLOTS_PER_RANK + 2
    reports = []
    for step, (expert, commit_step) in zip((1, 3), ((7, 2), (0, 4))):
        target = slots.phy2log.copy()
        target[:, slot] = expert
        rebalancer.begin(target, commit_step=commit_step)
        for at in (step, step + 1):
            reports += rebalancer.step(at, state["active"])
    te = slots.region.te
    abandoned = te.num_abandoned
    deadline = time.monotonic() + 40
    while te.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"reports": [(r.epoch, r.outcome, r.reason) for r in reports], "abandoned": abandoned,
            "left": te.num_abandoned, "phy2log": slots.phy2log[:, slot].tolist(),
            "frames_ok": e._frames_match_checkpoint(slots, state["weights"])}


def rank_slow_serve(ctx):
    """The link is fast again: two steps on the new placement, every row checked; frames once more."""
    e, state = test_eplb_online, harness.RANK_STATE
    exact = []
    for step in (5, 6):
        out, ref, _ = e._forward(ctx, state["buffer"], state["weights"], state["slots"], state["active"],
                                 e._inputs(ctx.rank, step), timeout_us=TIMEOUT_US)
        exact.append(e._close(out, ref))
    frames_ok = e._frames_match_checkpoint(state["slots"], state["weights"])
    state["slots"].destroy()
    harness.rank_teardown(ctx)
    return {"exact": exact, "frames_ok": frames_ok}


def test_abandoned_staging_read_never_lands_in_a_committed_frame(make_network):
    """Issue 28 item 2: a staging read over the Transfer Engine that misses its deadline aborts its chunk
    and frees its frame, but stays in flight inside the engine. Before the fix the next rebalance staged
    another expert into that very frame (the last one freed), committed, and the old read then landed in
    it: a slot committed as expert 0 served expert 7's weights, with no error. Now a free frame an
    abandoned read may still land in is skipped until the engine has finished that read."""
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(NUM_RANKS, network=_placement(network)) as cluster:
        assert all(harness.check_outcomes(cluster.run(rank_slow_setup, network.names, network.addresses,
                                                      timeout_s=90)))
        network.set_rate(1, SLOW_RATE, spare_store=True)  # the data path is slow, not the store
        try:
            results = harness.check_outcomes(cluster.run(rank_slow_rebalances, timeout_s=120))
        finally:
            network.set_rate(1, "")
        served = harness.check_outcomes(cluster.run(rank_slow_serve, timeout_s=90))
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    reader = results[SLOW_READER]
    assert reader["abandoned"] >= 1 and reader["left"] == 0, reader  # the read was abandoned, then finished
    for rank, result in enumerate(results):
        outcomes = [(epoch, outcome) for epoch, outcome, _ in result["reports"]]
        assert outcomes == [(1, "aborted"), (2, "committed")], (rank, result["reports"])
        assert result["phy2log"] == [0] * test_eplb_online.LAYERS, (rank, result)
        assert result["frames_ok"], (rank, result)
    assert "staging failed on rank 1" in reader["reports"][0][2], reader["reports"]  # the read missed its deadline
    for rank, result in enumerate(served):
        assert result["frames_ok"] and all(result["exact"]), (rank, result)


# ---------------------------------------------------------------- serving through a death across hosts (issue 36)

COVERAGE_HOSTS = [0, 1, 0, 1]  # DEAD (3) on host 1 with rank 1; the coverage epoch's VICTIM (2) on host 0 with rank 0


def _check_case_a_can_tell(survivors):
    """Case (a) is told apart: at the step after the death, routing by the unmasked rows (the entries sent to
    DEAD's copies skipped) misses the full reference on at least two survivors, so `check_coverage`'s full
    reference there holds only because the survivors routed around DEAD."""
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.reference.moe_block import random_weights, reference_forward
    from tests.reference import calc_diff

    f = test_eplb_fault_routing
    weights = random_weights(f.EXPERTS, f.HIDDEN, f.INTER, seed=300)  # layer 0's (test_eplb_coverage._setup)
    rows = build_dispatch_map(np.asarray(f.PLACEMENT, dtype=np.int64), f.R, f.R)
    told = []
    for o in survivors:
        x = f._inputs(o.rank, 3)
        on_dead = {e for e in range(f.EXPERTS) if int(rows[o.rank][0][e]) // f.SLOTS_PER_RANK == f.DEAD}
        old = reference_forward(x, weights, f.TOP_K, skip_experts=on_dead)
        told.append(calc_diff(reference_forward(x, weights, f.TOP_K), old) > 100 * f.LIMIT)
        step3 = o.value["steps"][2][0]
        assert step3["skip"] == [] and step3["lost"] == 0 and step3["diff_full"] < f.LIMIT, (o.rank, step3)
    assert sum(told) >= 2, f"the placement should make survivors route to DEAD at step 3: {told}"


def test_serving_through_a_death_across_hosts(make_network, tmp_path):
    """Issue 36's cases on the Transfer Engine across namespace hosts (4 ranks on 2 hosts, COVERAGE_HOSTS; shm
    inside a host, the Transfer Engine across), one network for both runs:

    * (a) and (b), `test_eplb_coverage.rank_coverage`: DEAD is SIGKILLed at step 2. Layer 0, where every
      expert of DEAD has a live copy, equals the full single-process reference from the step after the
      death on, no entry lost (and the unmasked routing would have missed it); layer 1, whose expert
      SOLE_EXPERT lived on DEAD only, equals the reference without it until the coverage epoch (weights from
      the loader) commits, then the full reference; every survivor commits the one epoch and the events
      come in order (`check_coverage`).
    * (c), `rank_fault_in_coverage_epoch`: DEAD is SIGKILLed, the survivors begin a coverage epoch at once
      and VICTIM is SIGKILLed after voting GO: the other two survivors (one per host) commit that epoch and
      end on the same placement (`check_one_decision`); in a second run VICTIM is stopped (SIGSTOP) before
      voting: the three survivors, VICTIM resumed after the decision too, abort it and keep the placement.
    """
    c = test_eplb_coverage
    network = make_network(NUM_HOSTS)
    placement = network.placement(COVERAGE_HOSTS)
    death_file = str(tmp_path / "death")
    with harness.fresh_cluster(c.R, network=placement) as cluster:
        outcomes = cluster.run(c.rank_coverage, death_file, "mooncake", timeout_s=180, failure_grace_s=60)
        processes = list(cluster.processes)
    c.check_coverage(outcomes, death_file, "mooncake across namespace hosts")
    survivors = [o for o in outcomes if o.rank != c.DEAD]
    for o in survivors:  # shm inside a host, the Transfer Engine across
        expected = ["self" if peer == o.rank else "shm" if COVERAGE_HOSTS[peer] == COVERAGE_HOSTS[o.rank] else "te"
                    for peer in range(c.R)]
        assert o.value["routes"] == expected, (o.rank, o.value["routes"])
    _check_case_a_can_tell(survivors)
    point = "eplb_after_vote"
    with harness.fresh_cluster(c.R, env={"MEP_FAULT_POINT": f"{point}:{c.VICTIM}:1:kill"},
                               network=placement) as cluster:
        outcomes = cluster.run(c.rank_fault_in_coverage_epoch, "kill", "mooncake", timeout_s=120, failure_grace_s=60)
        processes += list(cluster.processes)
    c.check_one_decision(outcomes, point, "kill", "committed")
    assert not outcomes[c.VICTIM].ok and outcomes[c.VICTIM].exitcode == -signal.SIGKILL, outcomes[c.VICTIM]
    point = "eplb_before_vote"  # VICTIM frozen before its vote: the vote's deadline, no process end to see
    with harness.fresh_cluster(c.R, env={"MEP_FAULT_POINT": f"{point}:{c.VICTIM}:1:stop"},
                               network=placement) as cluster:
        outcomes = cluster.run(c.rank_fault_in_coverage_epoch, "stop", "mooncake", timeout_s=120, failure_grace_s=60)
        processes += list(cluster.processes)
    c.check_one_decision(outcomes, point, "stop", "aborted")
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
