"""Coverage restored online (issue 36 items 2 and 4): a coverage epoch while a rank is dead, and the events.

R=4 ranks serve two MoE layers on physical experts with `fault_aware=True`, on shared memory, the
Transfer Engine, the collective fallback (the slots on a second, shm, Buffer) and the emulated CUDA
device (the placement of test_eplb_fault_routing: layer 1 holds expert SOLE_EXPERT on rank DEAD
only). DEAD is SIGKILLed at step 2. The engine's policy here is the documented one (docs/recovery.md, "Events"): when its
subscription shows `ExpertsUncovered`, it begins a coverage epoch (`eplb.coverage.restore_coverage`)
that commits at the next step; the uncovered expert's weights come from the loader (no live rank
holds it). Checked on every survivor:

* outputs: the full reference before the death; the reference without SOLE_EXPERT in layer 1 from
  the call after the death is known until the coverage epoch commits (layer 0 full: every expert
  of DEAD has a live copy); the full reference for both layers from the commit step on, with no
  entry lost;
* one decision: every survivor commits the same epoch and ends on the same placement, which gives
  SOLE_EXPERT a copy on a survivor and leaves DEAD's slots as they were;
* events, in order: PeerMasked(DEAD, "dead"), ExpertsUncovered({1: (SOLE_EXPERT,)}), CoverageRestored
  (on the collective fallback after RankLeftOut, the view the call that met the death agreed; the
  slots, on the shm Buffer, follow the collective Buffer's masks and report to its subscribers);
* bad placements (an expert with no copy at all / none on a live rank / a change to a dead rank's
  slot) are refused naming `new_phy2log`, nothing changed.

A second death (or a freeze) during the coverage epoch yields one decision on every survivor (shared
memory: a kill before or after the vote, a freeze before it; the collective fallback and the emulated CUDA
device: a kill after the vote, a freeze before it; the Transfer Engine: a kill after the vote, and across
hosts a freeze before it too, tests/test_hosts_eplb.py); a replacement shows JoinerPending
then JoinerAdmitted. The time from the death to full coverage is printed (docs/benchmarks.md).
"""
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import RANK_STATE, outcome_value, rank_teardown
from tests.reference import calc_diff
from tests.test_cuda import _use_device, on_device
from tests.test_eplb_fault_routing import (DEAD, EXPERTS, HIDDEN, INTER, LAYERS, LIMIT, PLACEMENT, R, SLOTS_PER_RANK,
                                           SOLE_EXPERT, TOKENS, TOP_K, _inputs)

TIMEOUT_US = harness.FAULT_TIMEOUT_US
# The collective masks no live rank by a deadline (its calls block; timeout_us bounds the view change after a
# death), and no case below waits it out: a long one costs nothing and keeps the vote safe at any load.
TIMEOUTS = {"shm": harness.FAULT_TIMEOUT_US, "mooncake": harness.FAULT_TIMEOUT_US_TE, "cuda": 3_000_000,
            "collective": 4 * harness.FAULT_TIMEOUT_US}
STEPS = 5
# A SIGKILLed process's end reaches a survivor's peer watcher (its exit, the pidfd or the watch connection's
# end, the probe that confirms it) well within this on a loaded 2-core machine (0.10-0.22 s measured).
DEATH_SEEN_S = 1.0


def _setup(ctx, timeout_us=TIMEOUT_US, transport="shm"):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, ctx.num_ranks, R * SLOTS_PER_RANK)
    buffer = Buffer(ctx.group, size, transport=transport)
    # On the collective fallback the slots' frames sit on a second (shm) Buffer (test_eplb_fault_routing); their
    # coverage events follow the collective Buffer's masks and reach its subscribers (`events=`).
    holder = Buffer(ctx.group, size, transport="shm") if transport == "collective" else buffer
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=300 + layer) for layer in range(LAYERS)]
    slots = ExpertSlots(holder, SlotShape(LAYERS, EXPERTS, SLOTS_PER_RANK, HIDDEN, INTER),
                        np.asarray(PLACEMENT, dtype=np.int64), spare_frames=1, events=buffer)
    slots.load(weights)
    rebalancer = OnlineRebalancer(slots, timeout_us=timeout_us, frames_per_step=1)
    loads = []

    def loader(layer, expert):  # the checkpoint
        loads.append((layer, expert))
        return weights[layer].gate_up[expert], weights[layer].down[expert]

    return buffer, holder, weights, slots, rebalancer, loader, loads


def _teardown(buffer, holder, slots):
    slots.destroy()
    buffer.destroy()
    if holder is not buffer:
        holder.destroy()


def _bad_placements(slots, rebalancer):
    """Each refused begin(): (message or None); and whether anything changed."""
    alive = np.ones(R, dtype=np.int32)
    alive[DEAD] = 0
    no_copy = slots.phy2log.copy()
    no_copy[1, DEAD * SLOTS_PER_RANK] = 1  # expert 6's only slot now holds 1: no copy of 6 at all
    dead_slot = slots.phy2log.copy()
    dead_slot[0, DEAD * SLOTS_PER_RANK + 1] = 0  # a change on the dead rank (and 6 has no live copy)
    before = (slots.phy2log.copy(), slots.chunk_epoch, len(slots.free_frames))
    errors = []
    for target, live in ((no_copy, None), (slots.phy2log.copy(), alive), (dead_slot, alive)):
        try:
            rebalancer.begin(target, 3, live=live)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    unchanged = (np.array_equal(before[0], slots.phy2log) and before[1:] == (slots.chunk_epoch,
                 len(slots.free_frames)) and not rebalancer.in_progress)
    return errors, unchanged


def rank_coverage(ctx, death_file, transport):
    from mooncake_ep_switch.buffer.events import CoverageRestored, ExpertsUncovered
    from mooncake_ep_switch.eplb.coverage import restore_coverage
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    _use_device()
    timeout_us = TIMEOUTS[transport]
    buffer, holder, weights, slots, rebalancer, loader, loads = _setup(ctx, timeout_us, transport)
    device = buffer.device or torch.device("cpu")  # the "cuda" transport's tokens and routers on its device
    routers = [w.router.to(device) for w in weights]
    subscription = buffer.subscribe()
    try:
        bad, unchanged = _bad_placements(slots, rebalancer)
        routes = buffer.peer_routes()
        active = buffer.active_mask()
        rows = build_dispatch_map(slots.phy2log, R, R)[ctx.rank]
        dist.barrier(group=ctx.group)
        events, steps, reports, restored_at, met_at = [], [], [], None, None
        for step in range(1, STEPS + 1):
            if step == 2 and ctx.rank == DEAD:
                with open(death_file, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            new = list(subscription)
            events += new
            # The engine's policy: cover at the next step.
            if any(isinstance(e, ExpertsUncovered) for e in new):
                restore_coverage(rebalancer, active, step + 1, loader)
            done = rebalancer.step(step, active)
            reports += done
            if any(r.outcome == "committed" for r in done):
                restored_at = time.time()
                rows = build_dispatch_map(slots.phy2log, R, R)[ctx.rank]  # a committed placement: a new map
            x = _inputs(ctx.rank, step)
            layers = []
            for layer in range(LAYERS):
                masked_before = not int(active[DEAD])
                lost_before = int(slots.lost_contributions[layer])
                out, _ = physical_ep_forward(buffer, x.to(device), routers[layer], slots, layer, TOP_K, TOKENS,
                                             active, rows[layer].to(device), timeout_us=timeout_us, fault_aware=True)
                out = out.cpu()
                if not int(active[DEAD]) and not masked_before:  # met the death: the unmasked row's skips
                    met_at = time.time() if met_at is None else met_at
                    skip = {e for e in range(EXPERTS) if int(rows[layer][e]) // SLOTS_PER_RANK == DEAD}
                elif masked_before and layer == 1 and not any(r.outcome == "committed" for r in reports):
                    skip = {SOLE_EXPERT}
                else:
                    skip = set()
                expected = reference_forward(x, weights[layer], TOP_K, skip_experts=skip)
                full = reference_forward(x, weights[layer], TOP_K)
                layers.append({"skip": sorted(skip), "diff": calc_diff(out, expected), "diff_full": calc_diff(out, full),
                               "lost": int(slots.lost_contributions[layer]) - lost_before})
            steps.append(layers)
        events += list(subscription)
        restored = [e for e in events if isinstance(e, CoverageRestored)]
        return {"bad": bad, "unchanged": unchanged, "steps": steps, "phy2log": slots.phy2log.tolist(),
                "reports": [(r.epoch, r.outcome, r.reason, r.commit_step, r.loaded_bytes, r.remote_bytes)
                            for r in reports],
                "events": [(type(e).__name__, e) for e in events], "loads": loads,
                "restored_at": restored_at, "seconds": restored[0].seconds if restored else None,
                "stall_ms": [r.stall_ms for r in reports], "frame_bytes": slots.frame_bytes, "routes": routes,
                "met_at": met_at}
    finally:
        subscription.close()
        _teardown(buffer, holder, slots)


@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective", "emulated cuda"])
def test_coverage_epoch_while_a_rank_is_dead_restores_the_full_reference(tmp_path, transport):
    # "emulated cuda": the "cuda" transport on the emulated device (tests/emulated_device.py), as
    # test_eplb_fault_routing runs case (a) there.
    death_file = str(tmp_path / "death")
    transport = transport.split()[-1]
    runner = on_device(rank_coverage, True) if transport == "cuda" else (rank_coverage,)
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(*runner, death_file, transport, timeout_s=180, failure_grace_s=60)
    check_coverage(outcomes, death_file, transport)


def check_coverage(outcomes, death_file, transport):
    """The checks of a `rank_coverage` run (the module's docstring; tests/test_hosts_eplb.py runs it across
    hosts); prints the time from the death to full coverage after `transport` (its name: "collective" has
    its own first event)."""
    assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    died = float(open(death_file).read())
    survivors = [o for o in outcomes if o.rank != DEAD]
    for o in survivors:
        assert o.ok, o.error
    placements = {str(o.value["phy2log"]) for o in survivors}
    assert len(placements) == 1, "survivors ended on different placements"
    final = np.asarray(survivors[0].value["phy2log"])
    assert (final[1][:DEAD * SLOTS_PER_RANK] == SOLE_EXPERT).sum() == 1, final  # a copy on a survivor
    assert np.array_equal(final[:, DEAD * SLOTS_PER_RANK:], np.asarray(PLACEMENT)[:, DEAD * SLOTS_PER_RANK:])
    figures = []
    for o in survivors:
        result = o.value
        where = f"rank {o.rank}"
        bad = result["bad"]
        assert all(b is not None and b.startswith("new_phy2log:") for b in bad), bad
        assert "none of expert 6" in bad[0] and "on the live ranks" in bad[1] and "live excludes" in bad[2], bad
        assert result["unchanged"], f"{where}: a refused begin() changed something"
        committed = [r for r in result["reports"] if r[1] == "committed"]
        assert [r[0] for r in result["reports"]] == [committed[0][0]] and committed[0][3] == 4, (where,
                                                                                                  result["reports"])
        mine = o.rank
        assert committed[0][4] == result["frame_bytes"] * sum(
            1 for s in range(SLOTS_PER_RANK) if final[1][mine * SLOTS_PER_RANK + s] == SOLE_EXPERT
            and PLACEMENT[1][mine * SLOTS_PER_RANK + s] != SOLE_EXPERT), (where, committed)
        for step, layers in enumerate(result["steps"], start=1):
            for layer, value in enumerate(layers):
                at = f"{where} step {step} layer {layer}: {value}"
                assert value["diff"] < LIMIT, at
                if step == 3 and layer == 1:  # the death is known, the epoch not committed: masked reference
                    assert value["skip"] == [SOLE_EXPERT] and value["lost"] > 0, at
                if step >= 4 or step == 1:  # committed at step 3's successor: the full reference, nothing lost
                    assert value["skip"] == [] and value["diff_full"] < LIMIT and value["lost"] == 0, at
        kinds = [name for name, _ in result["events"]]
        if transport == "collective":  # the call that met the death agreed a view without DEAD first
            assert kinds[0] == "RankLeftOut" and result["events"][0][1].ranks == (DEAD,), (where, result["events"])
            del result["events"][0], kinds[0]
        assert kinds == ["PeerMasked", "ExpertsUncovered", "CoverageRestored"], (where, result["events"])
        masked, uncovered, restored = (e for _, e in result["events"])
        assert masked.rank == DEAD, masked
        if masked.reason == "stalled" and transport != "collective":
            # The truth when DEAD still ran (behind the others on a loaded machine) until its process could no
            # longer end and be seen within this survivor's deadline: its wait ended at met_at. A death that came
            # sooner is one the peer watcher must have seen ("dead"); then this fails with the figures.
            before = result["met_at"] - died
            assert before < DEATH_SEEN_S, (f"{where}: {masked}, but DEAD died {before:.3f} s before the masking call "
                                           f"returned (at its deadline): its end went unseen")
            print(f"\n{where}: DEAD masked as stalled; it died {-before:+.3f} s after the masking call's deadline")
        else:
            assert masked.reason in (("dead", "cut") if transport == "collective" else ("dead",)), (where, masked)
        assert uncovered.layers == {1: (SOLE_EXPERT,)} and uncovered.ranks == (DEAD,), uncovered
        assert restored.layers == (1,) and restored.epoch == committed[0][0], restored
        figures.append((result["restored_at"] - died, result["seconds"], max(result["stall_ms"])))
    assert sum(len(o.value["loads"]) for o in survivors) == 1, "one survivor loads SOLE_EXPERT from the checkpoint"
    print(f"\n{transport}: death -> full coverage (weights from the loader), per survivor: "
          + ", ".join(f"{total * 1e3:.0f} ms (uncovered -> restored {seen * 1e3:.0f} ms, commit stall {stall:.1f} ms)"
                      for total, seen, stall in figures))


def test_slots_refuse_an_events_buffer_of_another_rank_or_type():
    """`ExpertSlots(events=...)`: a Buffer of this rank only, refused by name before anything is built."""
    from types import SimpleNamespace

    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape

    buffer = SimpleNamespace(rank=0, num_ranks=R, transport="shm")
    shape = SlotShape(LAYERS, EXPERTS, SLOTS_PER_RANK, HIDDEN, INTER)
    with pytest.raises(TypeError, match=r"^events: expected None or a Buffer .* got object$"):
        ExpertSlots(buffer, shape, PLACEMENT, events=object())
    other = SimpleNamespace(rank=1, num_ranks=R, subscribe=lambda callback=None: None)
    with pytest.raises(ValueError, match=rf"^events: expected a Buffer of rank 0 of {R} ranks .* got rank 1 of {R}$"):
        ExpertSlots(buffer, shape, PLACEMENT, events=other)


def rank_fault_in_coverage_epoch(ctx, how, transport="shm"):
    """DEAD is SIGKILLed; the survivors see it end and begin a coverage epoch at once; rank VICTIM dies
    or freezes before voting in it (MEP_FAULT_POINT). Returns the epoch's reports and the placement."""
    from mooncake_ep_switch.eplb.coverage import restore_coverage

    _use_device()
    buffer, holder, _, slots, rebalancer, loader, _ = _setup(ctx, TIMEOUTS[transport], transport)
    try:
        pids = [None] * ctx.num_ranks
        dist.all_gather_object(pids, os.getpid(), group=ctx.group)
        if ctx.rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        died = time.monotonic()  # within the scheduling slack of the kill: every rank left the gather
        deadline = time.monotonic() + 30
        while DEAD not in buffer.dead_peers():
            assert time.monotonic() < deadline, "the peer watcher never saw DEAD end"
            time.sleep(0.01)
        active = buffer.active_mask()
        active[DEAD] = 0  # as a dispatch that met the death would have set it
        restore_coverage(rebalancer, active, 1, loader)
        reports = rebalancer.step(1, active)
        covered_s = time.monotonic() - died
        if how == "stop" and ctx.rank == 0:  # decided: let the frozen rank go on and adopt the decision
            harness.wait_stopped(pids[VICTIM], 60.0)
            os.kill(pids[VICTIM], signal.SIGCONT)
        return {"reports": [(r.epoch, r.outcome, r.reason) for r in reports], "phy2log": slots.phy2log.tolist(),
                "covered_s": covered_s, "loaded_bytes": sum(r.loaded_bytes for r in reports),
                "free_frames": len(slots.free_frames), "in_progress": rebalancer.in_progress}
    finally:
        _teardown(buffer, holder, slots)


VICTIM = 2


@pytest.mark.parametrize("point, how, outcome, transport", [
    (None, "none", "committed", "shm"),  # no second fault: the time from the death to full coverage
    ("eplb_before_vote", "kill", "aborted", "shm"),
    ("eplb_after_vote", "kill", "committed", "shm"),
    ("eplb_before_vote", "stop", "aborted", "shm"),
    ("eplb_after_vote", "kill", "committed", "mooncake"),  # the Transfer Engine's peer watcher and deadlines
    ("eplb_after_vote", "kill", "committed", "collective"),  # the collective Buffer's watcher; slots on shm
    ("eplb_before_vote", "stop", "aborted", "emulated cuda"),  # device frames, the cuda transport's watcher
    ("eplb_before_vote", "stop", "aborted", "collective"),
    ("eplb_after_vote", "kill", "committed", "emulated cuda"),
])
def test_rank_killed_or_stopped_during_the_coverage_epoch_yields_one_decision(point, how, outcome, transport):
    env = {"MEP_FAULT_POINT": f"{point}:{VICTIM}:1:{how}"} if point else None
    transport = transport.split()[-1]
    runner = on_device(rank_fault_in_coverage_epoch, True) if transport == "cuda" else (rank_fault_in_coverage_epoch,)
    with harness.fresh_cluster(R, env=env) as cluster:
        outcomes = cluster.run(*runner, how, transport, timeout_s=120, failure_grace_s=60)
    check_one_decision(outcomes, point, how, outcome)


def check_one_decision(outcomes, point, how, outcome):
    """The checks of a `rank_fault_in_coverage_epoch` run with VICTIM faulted at `point` (`how`): every
    survivor reports the one expected `outcome` of epoch 1 and ends on the same placement."""
    assert not outcomes[DEAD].ok
    alive = [o for o in outcomes if o.rank != DEAD and (how != "kill" or o.rank != VICTIM)]
    for o in alive:
        assert o.ok, o.error
    assert {str(o.value["phy2log"]) for o in alive} == {str(alive[0].value["phy2log"])}, "placements differ"
    for o in alive:
        result = o.value
        assert [(r[0], r[1]) for r in result["reports"]] == [(1, outcome)], (o.rank, result["reports"])
        assert result["free_frames"] == 1 and not result["in_progress"], (o.rank, result)
    covered = (np.asarray(alive[0].value["phy2log"])[1][:DEAD * SLOTS_PER_RANK] == SOLE_EXPERT).any()
    assert covered == (outcome == "committed")
    if point is None:
        assert sum(o.value["loaded_bytes"] > 0 for o in alive) == 1  # the loader, on the rank taking the copy
        print("\ndeath -> full coverage (SIGKILL, peer watcher, coverage epoch committing at once, weights from "
              "the loader): " + ", ".join(f"rank {o.rank} {o.value['covered_s'] * 1e3:.0f} ms" for o in alive))


def rank_subscribe(ctx):
    from mooncake_ep_switch import Buffer

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, 128, ctx.num_ranks, 4), transport="shm")
    RANK_STATE["buffer"] = buffer
    RANK_STATE["events"] = buffer.subscribe()
    return True


def rank_exit(ctx):
    os._exit(3)  # the process ends (a SIGKILL leaves the harness's cluster marked broken for respawn)


def rank_member_update(ctx, wait_for_joiner, update_s=30.0):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join

    buffer = RANK_STATE.get("buffer")
    if buffer is None:  # the replacement
        buffer = RANK_STATE["buffer"] = Buffer(join(ctx.store, ctx.rank, ctx.num_ranks),
                                               Buffer.get_ep_buffer_size_hint(8, 128, ctx.num_ranks, 4),
                                               transport="shm")
    deadline = time.monotonic() + 60
    while wait_for_joiner and ctx.rank == 0 and 1 not in buffer.pending_joiners():
        assert time.monotonic() < deadline, "the replacement never showed up"
        time.sleep(0.01)
    view = buffer.update_ep_member(timeout_s=update_s)
    events = list(RANK_STATE["events"]) if "events" in RANK_STATE else []
    return {"view": list(view.ranks), "epoch": view.epoch, "events": [(type(e).__name__, e) for e in events]}


def test_subscriber_sees_a_rank_left_out_then_its_replacement_pending_and_admitted():
    with harness.fresh_cluster(2) as cluster:
        harness.check_outcomes(cluster.run(rank_subscribe))
        cluster.run(rank_exit, ranks=[1], timeout_s=30)
        cluster.respawn(1)  # the process only: it does nothing until told
        # Rank 1 exited between calls, unknown to rank 0: its update waits half of update_s for it, then seals alone.
        left = outcome_value(cluster.run(rank_member_update, False, 6.0, ranks=[0], timeout_s=60)[0])
        assert left["view"] == [0], left
        assert [name for name, _ in left["events"]] == ["RankLeftOut"], left
        assert tuple(left["events"][0][1]) == ((1,), left["epoch"]), left
        both = [outcome_value(o) for o in cluster.run(rank_member_update, True, timeout_s=90)]
        assert [b["view"] for b in both] == [[0, 1]] * 2, both
        events = both[0]["events"]
        assert [name for name, _ in events] == ["JoinerPending", "JoinerAdmitted"], events
        assert events[0][1].ranks == (1,) and tuple(events[1][1]) == ((1,), both[0]["epoch"]), events
        harness.check_outcomes(cluster.run(rank_teardown))
