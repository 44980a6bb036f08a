"""Shrinking the group for good (issue 37 item 1): `Buffer.shrink` and `eplb.shrink_placement`.

R=4 ranks serve two MoE layers on physical experts (test_eplb_fault_routing's placement: layer 1 holds
expert SOLE_EXPERT on rank DEAD only), on shm, the collective fallback and the emulated CUDA device (the
Transfer Engine across namespace hosts: tests/test_hosts_resize.py). DEAD is SIGKILLed and no replacement
comes; the survivors serve the step that meets the death (masked), then call `shrink_experts(buffer,
rebalancer, [DEAD], ...)`: one decision in the store, the view without DEAD, and a coverage epoch over the three
remaining ranks that commits at the next step. Checked on every survivor:

* outputs: the full single-process reference before the death and from the commit on;
* the view and mask leave DEAD out for good; no dispatch-map entry names a slot of DEAD; every expert
  has a copy on the remaining ranks; all survivors end on one placement;
* a later `update_ep_member()` returns without waiting for DEAD (its timeout is 20 s; a wait for a
  member lasts half of it); a late replacement under DEAD's id is refused by name and never listed;
* bad input (no rank, an unknown or repeated rank, this rank, every rank, a live rank, an expert left
  without a slot, a rank removed already) is refused by name with nothing changed.

A rank killed during the shrink's vote leaves every survivor on one decision: before its vote, ABORT
everywhere (then two different shrinks at once abort, nothing changed, and the same shrink of both
dead ranks commits); after its GO, COMMIT everywhere.
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
from tests.test_eplb_fault_routing import (DEAD, EXPERTS, HIDDEN, INTER, LAYERS, LIMIT, PLACEMENT, R, SLOTS_PER_RANK,
                                           TOKENS, TOP_K, _inputs)

TIMEOUT_US = harness.FAULT_TIMEOUT_US
# A live peer must never miss the deadline: the Transfer Engine across hosts (tests/test_hosts_resize.py) and the
# emulated CUDA device wait longer (test_eplb_fault_routing.TIMEOUTS).
TIMEOUTS = {"mooncake": harness.FAULT_TIMEOUT_US_TE, "cuda": 3_000_000}
VICTIM = 2


def _wait_seen_dead(buffer, seconds: float = 30.0) -> None:
    """Until this rank's peer watcher saw DEAD's process end (AssertionError after `seconds`)."""
    deadline = time.monotonic() + seconds
    while DEAD not in buffer.dead_peers():
        assert time.monotonic() < deadline, "the peer watcher never saw DEAD end"
        time.sleep(0.01)


def test_shrink_placement_covers_every_expert_on_the_remaining_ranks_or_names_ranks():
    from mooncake_ep_switch.eplb.coverage import uncovered_experts
    from mooncake_ep_switch.eplb.shrink_placement import shrink_placement

    placement = np.asarray(PLACEMENT, dtype=np.int64)
    alive = np.array([True, True, True, False])
    target = shrink_placement(placement, alive, SLOTS_PER_RANK, EXPERTS, 1)
    assert uncovered_experts(target, alive, SLOTS_PER_RANK, EXPERTS) == {}
    assert np.array_equal(target[:, DEAD * SLOTS_PER_RANK:], placement[:, DEAD * SLOTS_PER_RANK:])  # never staged
    assert (target != placement).sum() == 1  # only the sole copy of expert 6 of layer 1 moves
    with pytest.raises(ValueError, match=r"^ranks: removing \[2, 3\] leaves 6 slots .* 8 logical experts"):
        shrink_placement(placement, np.array([True, True, False, False]), SLOTS_PER_RANK, EXPERTS, 1)
    with pytest.raises(ValueError, match=r"^ranks: removing \[0, 1, 2, 3\] would leave no rank"):
        shrink_placement(placement, np.zeros(R, dtype=bool), SLOTS_PER_RANK, EXPERTS, 1)
    # Enough slots in number, but every remaining slot is a fixed primary (or no frame is spare): none moves.
    for fixed, spare in ((SLOTS_PER_RANK, 1), (0, 0)):
        with pytest.raises(ValueError, match=r"^ranks: removing \[3\] leaves an expert without a slot .* expert 6 "):
            shrink_placement(placement, alive, SLOTS_PER_RANK, EXPERTS, spare, fixed_per_rank=fixed)


def _setup(ctx, transport):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, ctx.num_ranks, R * SLOTS_PER_RANK)
    buffer = Buffer(ctx.group, size, transport=transport)
    # On the collective fallback the slots' frames sit on a second (shm) Buffer (test_eplb_fault_routing).
    holder = Buffer(ctx.group, size, transport="shm") if transport == "collective" else buffer
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=300 + layer) for layer in range(LAYERS)]
    slots = ExpertSlots(holder, SlotShape(LAYERS, EXPERTS, SLOTS_PER_RANK, HIDDEN, INTER),
                        np.asarray(PLACEMENT, dtype=np.int64), spare_frames=1)
    slots.load(weights)
    rebalancer = OnlineRebalancer(slots, timeout_us=TIMEOUTS.get(transport, TIMEOUT_US), frames_per_step=1)
    loads = []

    def loader(layer, expert):  # the checkpoint
        loads.append((layer, expert))
        return weights[layer].gate_up[expert], weights[layer].down[expert]

    return buffer, holder, weights, slots, rebalancer, loader, loads


def _refusals(ctx, buffer, slots, rebalancer):
    """Each refused call: (exception type, message); and whether the view, the store and the slots stayed."""
    from mooncake_ep_switch.buffer.membership.removed import removed_ranks
    from mooncake_ep_switch.eplb.shrink_placement import shrink_experts

    before = (buffer.epoch, buffer.members, slots.phy2log.copy(), slots.chunk_epoch)
    peer = (ctx.rank + 1) % R
    errors = []
    for call in (lambda: buffer.shrink([]), lambda: buffer.shrink([R]), lambda: buffer.shrink(["1"]),
                 lambda: buffer.shrink([peer, peer]), lambda: buffer.shrink([ctx.rank]),
                 lambda: buffer.shrink(list(range(R))), lambda: buffer.shrink([peer]),
                 lambda: shrink_experts(buffer, rebalancer, [2, 3], 5)):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as error:
            errors.append((type(error).__name__, str(error)))
    unchanged = (buffer.epoch, buffer.members, slots.chunk_epoch) == (before[0], before[1], before[3]) and \
        np.array_equal(before[2], slots.phy2log) and removed_ranks(buffer.membership) == {} and \
        not rebalancer.in_progress
    return errors, unchanged


def _forward(ctx, buffer, slots, weights, rows, active, step, transport):
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    x = _inputs(ctx.rank, step)
    diffs = []
    for layer in range(LAYERS):
        out, _ = physical_ep_forward(buffer, x, weights[layer].router, slots, layer, TOP_K, TOKENS, active,
                                     rows[layer], timeout_us=TIMEOUTS.get(transport, TIMEOUT_US), fault_aware=True)
        diffs.append(calc_diff(out, reference_forward(x, weights[layer], TOP_K)))
    return diffs


def rank_shrink(ctx, transport):
    from mooncake_ep_switch.buffer.membership.removed import removed_ranks
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.shrink_placement import shrink_experts

    marks = [("start", time.monotonic())]
    buffer, holder, weights, slots, rebalancer, loader, loads = _setup(ctx, transport)
    RANK_STATE.update(buffer=buffer, holder=holder, slots=slots)
    marks.append(("setup", time.monotonic()))
    errors, unchanged = _refusals(ctx, buffer, slots, rebalancer)
    active = buffer.active_mask()
    rows = build_dispatch_map(slots.phy2log, R, R)[ctx.rank]
    dist.barrier(group=ctx.group)
    full = {1: _forward(ctx, buffer, slots, weights, rows, active, 1, transport)}
    if ctx.rank == DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    marks.append(("refusals, step 1", time.monotonic()))
    _forward(ctx, buffer, slots, weights, rows, active, 2, transport)  # meets the death (masked; not checked)
    marks.append(("step 2 (death)", time.monotonic()))
    deadline = time.monotonic() + 30
    while DEAD not in holder.dead_peers():  # the shm Buffer's peer watcher (the collective one has none)
        assert time.monotonic() < deadline, "the peer watcher never saw DEAD end"
        time.sleep(0.01)
    started = time.monotonic()
    marks.append(("death seen", started))
    if holder is not buffer:
        holder.shrink([DEAD], timeout_s=60)  # the slots' Buffer leaves DEAD too
    view, chunks = shrink_experts(buffer, rebalancer, [DEAD], 3, loader, timeout_s=60)
    shrink_s = time.monotonic() - started
    active = buffer.active_mask()
    reports = []
    for step in (3, 4):
        done = rebalancer.step(step, active)
        reports += done
        if any(r.outcome == "committed" for r in done):
            rows = build_dispatch_map(slots.phy2log, R, R, active_ranks=active)[ctx.rank]
        full[step] = _forward(ctx, buffer, slots, weights, rows, active, step, transport)
    marks.append(("shrink, steps 3-4", time.monotonic()))
    maps = build_dispatch_map(slots.phy2log, R, R, active_ranks=active)
    started = time.monotonic()
    later = buffer.update_ep_member(timeout_s=20)
    update_s = time.monotonic() - started
    try:
        buffer.shrink([DEAD])
        again = None
    except ValueError as error:
        again = str(error)
    return {"errors": errors, "unchanged": unchanged, "full": full, "view": list(view.ranks), "epoch": view.epoch,
            "chunks": len(chunks), "reports": [(r.epoch, r.outcome, r.reason) for r in reports],
            "mask": active.tolist(), "phy2log": slots.phy2log.tolist(), "loads": loads,
            "map_slots_on_dead": int(((maps // SLOTS_PER_RANK) == DEAD).sum()), "map_unserved": int((maps < 0).sum()),
            "removed": removed_ranks(buffer.membership), "later": list(later.ranks), "update_s": update_s,
            "shrink_s": shrink_s, "again": again,
            "phases": [(name, round(t - marks[i][1], 3)) for i, (name, t) in enumerate(marks[1:])]}


def rank_late_replacement(ctx):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join
    from mooncake_ep_switch.errors import MembershipError

    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R, R * SLOTS_PER_RANK)
    buffer = Buffer(join(ctx.store, ctx.rank, R), size, transport="shm")
    try:
        buffer.update_ep_member(timeout_s=10)
        return None
    except MembershipError as error:
        return str(error)
    finally:
        buffer.destroy()


def rank_members_after(ctx):
    buffer = RANK_STATE["buffer"]
    return {"pending": buffer.pending_joiners(), "members": list(buffer.members)}


def rank_close(ctx):
    for name in ("slots", "holder"):
        thing = RANK_STATE.pop(name, None)
        if thing is not None and thing is not RANK_STATE.get("buffer"):
            thing.destroy()
    return rank_teardown(ctx)


@pytest.mark.parametrize("transport", ["shm", "collective", "emulated cuda"])
def test_shrink_after_a_death_serves_the_reference_over_three_ranks(transport):
    # "emulated cuda": the "cuda" transport on the emulated device (tests/emulated_device.py), the slots in
    # device memory; the Transfer Engine across hosts: tests/test_hosts_resize.py.
    from tests.test_cuda import on_device

    transport = transport.split()[-1]
    runner = on_device(rank_shrink, True) if transport == "cuda" else (rank_shrink,)
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(*runner, transport, timeout_s=180, failure_grace_s=60)
        assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
        survivors = [outcome_value(o) for o in outcomes if o.rank != DEAD]
        if transport == "shm":  # a late replacement under the removed id (the membership's rule: one transport)
            cluster.respawn(DEAD)
            refused = cluster.run(rank_late_replacement, ranks=[DEAD], timeout_s=60)[0]
            after = [outcome_value(o) for o in cluster.run(rank_members_after, ranks=[0, 1, 2], timeout_s=60)]
            assert outcome_value(refused) is not None and f"rank {DEAD} was removed from this EP group for good" \
                in refused.value, refused
            assert after == [{"pending": [], "members": [0, 1, 2]}] * 3, after
        else:
            cluster.accept_dead(DEAD)
        harness.check_outcomes(cluster.run(rank_close, ranks=[0, 1, 2], timeout_s=60))
    check_shrink(survivors, transport)


def check_shrink(survivors, transport):
    """The checks of a 4 -> 3 shrink after DEAD's death on the survivors' `rank_shrink` values (the test above,
    tests/test_hosts_resize.py); prints the shrink's times after `transport` (its name)."""
    assert len({str(s["phy2log"]) for s in survivors}) == 1, "survivors ended on different placements"
    final = np.asarray(survivors[0]["phy2log"])
    assert np.array_equal(final[:, DEAD * SLOTS_PER_RANK:], np.asarray(PLACEMENT)[:, DEAD * SLOTS_PER_RANK:])
    for rank, s in enumerate(survivors):
        where = f"rank {rank}: {s}"
        kinds = [e and e[0] for e in s["errors"]]
        texts = [e and e[1] for e in s["errors"]]
        assert kinds == ["ValueError", "ValueError", "TypeError", "ValueError", "ValueError", "ValueError",
                         "ValueError", "ValueError"], where
        assert all(t.startswith("ranks: ") for t in texts), texts
        assert "at least one rank" in texts[0] and "in [0, 4)" in texts[1] and "distinct" in texts[3], texts
        assert "cannot remove itself" in texts[4] and "would leave no rank" in texts[5], texts
        assert "are live" in texts[6] and "drain" in texts[6] and "some expert would have no slot" in texts[7], texts
        assert s["unchanged"], f"{where}: a refused shrink changed something"
        assert s["view"] == [0, 1, 2] and s["later"] == [0, 1, 2] and s["mask"] == [1, 1, 1, 0], where
        assert s["removed"] == {DEAD: s["epoch"]} or s["removed"] == {DEAD: s["epoch"] - 1}, where
        assert s["again"] is not None and "removed already" in s["again"], where
        assert s["chunks"] == 1 and [r[1] for r in s["reports"]] == ["committed"], where
        assert s["map_slots_on_dead"] == 0 and s["map_unserved"] == 0, where  # every expert served, never on DEAD
        for step, diffs in s["full"].items():
            assert all(d < LIMIT for d in diffs), (where, step, diffs)
        assert s["update_s"] < 5.0, f"{where}: update_ep_member after the shrink waited {s['update_s']:.1f} s"
    assert sum(len(s["loads"]) for s in survivors) == 1, "one survivor loads the sole expert from the checkpoint"
    print(f"\n{transport}: shrink 4 -> 3 (vote, view, coverage begun): "
          + ", ".join(f"{s['shrink_s'] * 1e3:.0f} ms" for s in survivors)
          + "; later update_ep_member: " + ", ".join(f"{s['update_s'] * 1e3:.0f} ms" for s in survivors))


def rank_killed_in_vote(ctx, point):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.ballot import Ballot
    from mooncake_ep_switch.buffer.membership.removed import removed_ranks
    from mooncake_ep_switch.errors import MembershipError
    from mooncake_ep_switch.faults import FaultPoint

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, 128, ctx.num_ranks, 4), transport="shm")
    buffer._fault = FaultPoint(point, VICTIM, -1, "kill")  # VICTIM dies there (as MEP_FAULT_POINT would say)
    try:
        dist.barrier(group=ctx.group)
        if ctx.rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        _wait_seen_dead(buffer)
        outcomes, started = [], time.monotonic()
        try:
            view = buffer.shrink([DEAD], timeout_s=40)  # VICTIM dies in its vote
            outcomes.append(("committed", list(view.ranks)))
        except MembershipError as error:
            outcomes.append(("aborted", str(error)))
            deadline = time.monotonic() + 30
            while VICTIM not in buffer.dead_peers():
                assert time.monotonic() < deadline, "the peer watcher never saw VICTIM end"
                time.sleep(0.01)
            before = (buffer.epoch, buffer.members)
            if ctx.rank == 0:
                # Rank 0 votes once rank 1 voted on the second attempt: else rank 0 may decide that attempt ABORT
                # alone (VICTIM, one of its voters, is gone) before rank 1 reads the attempts, rank 1 then votes on
                # the third and rank 0's next shrink (the same ranks) commits it with rank 1's (a valid pairing of
                # calls, as a collective's retry; but not the "two shrinks at once" this test is about).
                ballot = Ballot(buffer.membership, "shrink", ctx.rank, ctx.num_ranks, what="shrink")
                while (ballot.records([1])[1] or [0])[0] < 2:
                    assert time.monotonic() < deadline, "rank 1 never voted on the second attempt"
                    time.sleep(0.01)
            try:  # two different shrinks at once: rank 0 removes DEAD only, rank 1 both dead ranks
                buffer.shrink([DEAD] if ctx.rank == 0 else [VICTIM, DEAD], timeout_s=40)
                outcomes.append(("committed", None))
            except MembershipError as error:
                outcomes.append(("aborted", str(error)))
            unchanged = (buffer.epoch, buffer.members) == before and removed_ranks(buffer.membership) == {}
            view = buffer.shrink([VICTIM, DEAD], timeout_s=40)  # again, the same dead ranks on both
            outcomes.append(("committed", list(view.ranks)))
            outcomes.append(("unchanged after two shrinks", unchanged))
        return {"outcomes": outcomes, "members": list(buffer.members), "mask": buffer.active_mask().tolist(),
                "seconds": time.monotonic() - started}
    finally:
        buffer.destroy()


@pytest.mark.parametrize("point, first", [("shrink_before_vote", "aborted"), ("shrink_after_vote", "committed")])
def test_a_rank_killed_during_the_shrink_vote_leaves_every_survivor_on_one_decision(point, first):
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(rank_killed_in_vote, point, timeout_s=120, failure_grace_s=60)
    for rank in (DEAD, VICTIM):
        assert not outcomes[rank].ok and outcomes[rank].exitcode == -signal.SIGKILL, outcomes[rank]
    results = [outcome_value(outcomes[r]) for r in (0, 1)]
    for rank, result in enumerate(results):
        kinds = [kind for kind, _ in result["outcomes"]]
        if first == "committed":
            assert kinds == ["committed"] and result["outcomes"][0][1] == [0, 1], result
        else:  # aborted; two different shrinks aborted, nothing changed; the same shrink on both commits
            assert kinds == ["aborted", "aborted", "committed", "unchanged after two shrinks"], result
            one = result["outcomes"][0][1]
            # VICTIM named, or (read after the peer aborted and voted on the next attempt already) that peer
            assert "nothing changed" in one and (f"[{VICTIM}]" in one or "went on to a later attempt" in one), result
            two = result["outcomes"][1][1]
            assert "aborted on every rank" in two and "nothing changed" in two, result
            # each reads the other's vote (another digest; named before rank 0's gone VICTIM): rank 0 votes second
            assert "two shrinks at once" in two, result
            assert result["outcomes"][2][1] == [0, 1] and result["outcomes"][3][1] is True, result
        assert result["members"] == [0, 1], result
        assert result["mask"] == [1, 1, 0, 0], result
        # Nobody waits for VICTIM once it is seen dead (the view after the decision used to wait half of timeout_s).
        assert result["seconds"] < 10, result
    print(f"\n{point}: shrink calls took " + ", ".join(f"{r['seconds'] * 1e3:.0f} ms" for r in results))


def test_a_joiner_waiting_when_its_rank_is_removed_is_neither_listed_nor_sealed_in():
    """A replacement already waiting when a shrink removes its rank (the race the joiner's own check cannot
    see): `joining()` stops listing it and the members' next view is sealed without it (in-process ranks)."""
    import threading

    from mooncake_ep_switch.buffer.membership.protocol import Membership, MembershipError
    from mooncake_ep_switch.buffer.membership.removed import record_removed
    from mooncake_ep_switch.launcher.launch import host_store

    store = host_store("127.0.0.1", 0, 1, timeout_s=30)
    members = [Membership(store, r, 4) for r in range(4)]
    replacement = Membership(store, 2, 4)
    joined = {}

    def join():
        try:
            joined["view"] = replacement.agree_next_view(0, [], time.monotonic() + 6, joining=True)
        except MembershipError as error:
            joined["error"] = str(error)

    thread = threading.Thread(target=join)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while members[0].joining() != [2]:
            assert time.monotonic() < deadline, "the waiting joiner was never listed"
            time.sleep(0.01)
        assert record_removed(members[0], [2], 1) == {2: 1}
        assert members[0].joining() == [], "a removed rank is still listed as pending"
        views, errors = {}, {}

        def agree(member):
            try:
                views[member.rank] = member.agree_next_view(0, [0, 1, 3], time.monotonic() + 10)
            except MembershipError as error:
                errors[member.rank] = str(error)

        threads = [threading.Thread(target=agree, args=(members[r],)) for r in (0, 1, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and {v.ranks for v in views.values()} == {(0, 1, 3)}, (views, errors)
        thread.join(30)
        assert "view" not in joined or 2 not in joined["view"].ranks, joined
    finally:
        thread.join(30)
        replacement.stop_pending(withdraw=True)



def rank_stalled_in_vote(ctx):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.errors import MembershipError
    from mooncake_ep_switch.faults import FaultPoint

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, 128, ctx.num_ranks, 4), transport="shm")
    pids = [None] * ctx.num_ranks
    dist.all_gather_object(pids, os.getpid(), group=ctx.group)
    if ctx.rank == VICTIM:
        buffer._fault = FaultPoint("shrink_before_vote", VICTIM, -1, "stop")  # freezes before its vote, once
    try:
        if ctx.rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)
        _wait_seen_dead(buffer)
        started = time.monotonic()
        try:
            buffer.shrink([DEAD], timeout_s=4)  # VICTIM is stopped past the vote's deadline (2 s)
            first = "committed"
        except MembershipError as error:
            first = str(error)
        seconds = time.monotonic() - started
        if ctx.rank == VICTIM:
            buffer._fault = None
        elif ctx.rank == 0:  # decided: let the frozen rank go on; it adopts the decision
            harness.wait_stopped(pids[VICTIM], 30.0)
            os.kill(pids[VICTIM], signal.SIGCONT)
        view = buffer.shrink([DEAD], timeout_s=30)  # again, all three
        return {"first": first, "seconds": seconds, "view": list(view.ranks)}
    finally:
        buffer.destroy()


def test_a_rank_stalled_during_the_shrink_vote_aborts_it_everywhere_then_it_commits():
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(rank_stalled_in_vote, timeout_s=120, failure_grace_s=60)
    assert not outcomes[DEAD].ok
    results = [outcome_value(outcomes[r]) for r in (0, 1, VICTIM)]
    for result in results:
        assert "aborted on every rank" in result["first"] and "nothing changed" in result["first"], results
        assert result["view"] == [0, 1, 2], results
    # The survivor that decided names VICTIM; the other may already see it gone on to the retry's attempt.
    assert any(f"ranks [{VICTIM}] did not vote" in r["first"] for r in results[:2]), results
    for result in results[:2]:
        assert result["seconds"] < 10, result  # the vote's deadline (2 s), not more
