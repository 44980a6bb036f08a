"""A grow (3 -> 5 on shm, issue 37) with a rank killed or stopped at each phase, and a replacement in the grown group.

Each case kills or freezes one rank at a named fault point (mooncake_ep_switch/faults.py) of a grow that test_grow
runs without faults, while ranks 0-2 serve two MoE layers of physical experts at every step and poll the grow:

- a member SIGKILLed as its build begins (`grow_build`: before the new gloo group) or at the agreement
  (`grow_before_vote`: its build finished, its GO not cast): the grow is FAILED at one poll on every survivor, which
  serve on over the 3-rank group with the dead rank masked (the others' builds never hold up their polls); the
  newcomers are told and leave;
- a member SIGKILLed at the switch-over (`grow_after_decision`: COMMIT read, nothing else done): every survivor
  (members and newcomers) serves the agreed step and the next on the 5-rank group with the dead rank masked;
- a newcomer SIGSTOPped in its weight copy (`grow_weight_copy`): the members' builds end at the build's deadline,
  the grow is FAILED at one poll, they serve on; resumed, the newcomer raises the grow's failure and leaves;
- a newcomer SIGSTOPped at the switch-over (`grow_before_switch`: built, the step not read): the members agree
  the switch-over (every rank was built), the grown group masks it at its first step and seals a view without it;
  resumed, the newcomer raises that it was left out and leaves, and the group serves on exactly.

Checked on every survivor: one outcome, one size and one placement everywhere, every step served once (before the
agreed step on the old group, from it on the new one, none lost), each step's outputs equal the single-process
reference without the copies on ranks its mask shows masked, and only the faulty rank is ever masked. Then a rank
of the grown group is SIGKILLed and a replacement process under its id joins the grown Buffer (`elastic.join` on
its store, `update_ep_member()`), loads its slots and serves exactly with every rank.
"""
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import RANK_STATE, outcome_value
from tests.reference import calc_diff
from tests.test_grow import EXPERTS, HIDDEN, INTER, LAYERS, LIMIT, PLACEMENT, R0, R1, SPR, TOKENS, TOP_K

VICTIM = 1  # a member of the 3-rank group (rank 1 of the grown one too)
STOPPED = R1 - 1  # a newcomer
DONE_KEY = "grow-faults/resumed"  # the resumed newcomer's error, where the members wait for it
GROW_S = 60.0  # a build's deadline where none is expected to run out
COPY_GROW_S = 5.0  # the build's deadline the newcomer frozen in its weight copy runs out (it stops there ~0.5 s after the grow starts at load 13; a build takes ~1 s)
LOOP_S = 150.0  # no case serves longer than this on the old group


def _serve(buffer, slots, weights, num_ranks, active, rank, step):
    """Serve `step` (both layers, routed over the ranks `active` shows live): the max diff against the reference
    without the copies on ranks masked after the call, and the masked ranks."""
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    rows = build_dispatch_map(slots.phy2log, num_ranks, num_ranks, active_ranks=active)[rank]
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn((TOKENS, HIDDEN), generator=generator).to(torch.bfloat16)
    diffs = []
    for layer in range(LAYERS):
        out, _ = physical_ep_forward(buffer, x, weights[layer].router, slots, layer, TOP_K, TOKENS, active,
                                     rows[layer], timeout_us=harness.FAULT_TIMEOUT_US)
        mask = active.tolist()
        skip = {e for e in range(EXPERTS) if int(rows[layer][e]) < 0 or not mask[int(rows[layer][e]) // SPR]}
        diffs.append(calc_diff(out, reference_forward(x, weights[layer], TOP_K, skip_experts=skip)))
    return max(diffs), [r for r, live in enumerate(active.tolist()) if not live]


def _told_failed(failure) -> bool:
    """A newcomer's error says the grow failed (in its closing barrier, or waiting for the switch-over step)."""
    return failure is not None and ("the grow failed meanwhile" in failure[1] or "grow to 5 ranks failed" in failure[1])


def _wait_resumed(ctx, pids, who, timeout_s=60.0):
    """Rank 0 resumes the frozen rank `who` (once it is stopped); every caller waits for its DONE_KEY record."""
    if ctx.rank == 0:
        harness.wait_stopped(pids[who], 30.0)
        os.kill(pids[who], signal.SIGCONT)
    deadline = time.monotonic() + timeout_s
    while not ctx.store.check([DONE_KEY]):
        assert time.monotonic() < deadline, f"rank {who} never reported after SIGCONT"
        time.sleep(0.01)
    return ctx.store.get(DONE_KEY).decode()


def rank_grow_fault(ctx, how, who, grow_s):
    """3 -> 5 with rank `who` dying (`how` "kill") or freezing ("stop") at the fault point MEP_FAULT_POINT names."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.eplb.grow_placement import grow_placement, grow_slots
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.errors import MembershipError
    from mooncake_ep_switch.reference.moe_block import random_weights

    pids = [None] * R1
    dist.all_gather_object(pids, os.getpid(), group=ctx.group)
    old_group = dist.new_group(list(range(R0)))
    shape = SlotShape(LAYERS, EXPERTS, SPR, HIDDEN, INTER)
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR)
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=500 + layer) for layer in range(LAYERS)]
    target = grow_placement(np.asarray(PLACEMENT), R0, R1, SPR, EXPERTS)
    served, started = [], time.monotonic()  # (step, group size, diff, masked ranks) per served step
    out = {"failure": None, "result_step": None}
    if ctx.rank < R0:
        buffer = Buffer(old_group, size, transport="shm")
        slots = ExpertSlots(buffer, shape, np.asarray(PLACEMENT), spare_frames=1)
        slots.load(weights)
        active = buffer.active_mask()
        served.append((1, R0) + _serve(buffer, slots, weights, R0, active, ctx.rank, 1))
        grow = GrowOperation(buffer, R1, Buffer, timeout_s=grow_s,
                             build=lambda new: grow_slots(new, shape, target, R0, slots, 1))
        step, result = 2, None
        while True:
            assert time.monotonic() - started < LOOP_S, "the grow neither switched over nor failed"
            try:
                result = grow.poll(step)
            except MembershipError as error:
                out["failure"] = (step, str(error), round(time.monotonic() - started, 3))
            if result is not None or out["failure"] is not None:
                break
            served.append((step, R0) + _serve(buffer, slots, weights, R0, active, ctx.rank, step))
            step += 1
    else:
        try:
            result = join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0, timeout_s=GROW_S,
                               build=lambda new: grow_slots(new, shape, target, R0, None, 1))
        except MembershipError as error:
            out["failure"] = (None, str(error), round(time.monotonic() - started, 3))
            if ctx.rank == who:  # resumed: say so to the group, which serves on meanwhile
                ctx.store.set(DONE_KEY, str(error))
            return out
    if result is None:  # FAILED: every survivor serves on over the 3-rank group
        for later in (step, step + 1):
            served.append((later, R0) + _serve(buffer, slots, weights, R0, active, ctx.rank, later))
        if how == "stop":
            out["resumed"] = _wait_resumed(ctx, pids, who)
            served.append((step + 2, R0) + _serve(buffer, slots, weights, R0, active, ctx.rank, step + 2))
        out.update(num_ranks=buffer.num_ranks, members=list(buffer.members), phy2log=slots.phy2log.tolist())
        slots.destroy()
        buffer.destroy()
    else:
        if ctx.rank < R0:
            slots.destroy()
            buffer.destroy()
        new, grown = result.buffer, result.built
        out["result_step"] = step = result.step
        active = new.active_mask()
        for later in (step, step + 1):
            served.append((later, R1) + _serve(new, grown.slots, weights, R1, active, ctx.rank, later))
        if how == "stop":  # the engine's answer to a masked peer: a view without it; then the frozen rank resumes
            out["view"] = list(new.update_ep_member(timeout_s=60).ranks)
            active = new.active_mask()
            out["resumed"] = _wait_resumed(ctx, pids, who)
            served.append((step + 2, R1) + _serve(new, grown.slots, weights, R1, active, ctx.rank, step + 2))
        out.update(num_ranks=new.num_ranks, members=list(new.members), phy2log=grown.slots.phy2log.tolist())
        grown.slots.destroy()
        new.destroy()
    out["served"] = served
    return out


# point, how, the faulty rank, the build's deadline, whether the survivors end on the grown group
CASES = {
    "member killed as its build begins": ("grow_build", "kill", VICTIM, GROW_S, False),
    "member killed at the agreement": ("grow_before_vote", "kill", VICTIM, GROW_S, False),
    "member killed at the switch-over": ("grow_after_decision", "kill", VICTIM, GROW_S, True),
    "newcomer stopped in the weight copy": ("grow_weight_copy", "stop", STOPPED, COPY_GROW_S, False),
    "newcomer stopped at the switch-over": ("grow_before_switch", "stop", STOPPED, GROW_S, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_killed_or_stopped_in_a_grow_leaves_one_size_and_one_placement(case):
    point, how, who, grow_s, grown = CASES[case]
    started = time.monotonic()
    with harness.fresh_cluster(R1, env={"MEP_FAULT_POINT": f"{point}:{who}:*:{how}"}) as cluster:
        outcomes = cluster.run(rank_grow_fault, how, who, grow_s, timeout_s=240, failure_grace_s=120)
    seconds = time.monotonic() - started
    if how == "kill":
        assert not outcomes[who].ok and outcomes[who].exitcode == -signal.SIGKILL, outcomes[who]
    else:  # resumed, it raised its own error and left; the group went on
        mine = outcome_value(outcomes[who])
        assert mine["failure"] is not None and "served" not in mine, mine
        if grown:
            assert "was left out of the grown group" in mine["failure"][1], mine
        else:
            assert _told_failed(mine["failure"]), mine
    survivors = [r for r in range(R1) if r != who]
    on_new = [r for r in survivors if grown or r < R0]  # ranks that serve after the grow (newcomers only if grown)
    outs = {r: outcome_value(outcomes[r]) for r in survivors}
    members = [r for r in survivors if r < R0]
    if grown:
        step = outs[members[0]]["result_step"]
        size, final = R1, [r for r in range(R1) if r != who]
    else:
        step = outs[members[0]]["failure"][0]
        size, final = R0, list(range(R0))
        for r in survivors:
            if r >= R0:  # a newcomer told of the failure: it serves nothing
                assert _told_failed(outs[r]["failure"]), outs[r]
                assert "served" not in outs[r], outs[r]
    for r in on_new:
        out = outs[r]
        where = (case, r, {k: v for k, v in out.items() if k != "phy2log"})
        steps = [s for s, _, _, _ in out["served"]]
        if grown:  # one agreed step; before it the old group, from it the grown one: each step once, none lost
            assert out["result_step"] == step and out["failure"] is None, where
            before = list(range(1, step)) if r < R0 else []
            assert steps == before + list(range(step, step + len(steps) - len(before))), where
            assert all(n == (R0 if s < step else R1) for s, n, _, _ in out["served"]), where
        else:  # FAILED at one poll everywhere; every step served once, on the old group
            assert out["failure"][0] == step and out["result_step"] is None, where
            assert "grow to 5 ranks failed" in out["failure"][1] and "nothing changed" in out["failure"][1], where
            assert steps == list(range(1, len(steps) + 1)) and len(steps) >= step + 1, where
            assert all(n == R0 for _, n, _, _ in out["served"]), where
        assert all(diff < LIMIT for _, _, diff, _ in out["served"]), where
        assert all(masked in ([], [who]) for _, _, _, masked in out["served"]), where  # only the faulty rank
        if how == "kill" or grown:  # a dead member is masked by the step after its death; a stalled newcomer too
            assert out["served"][-1][3] == [who], where
        else:  # the frozen newcomer was never in the members' group
            assert all(masked == [] for _, _, _, masked in out["served"]), where
        assert out["num_ranks"] == size and out["phy2log"] == outs[on_new[0]]["phy2log"], where  # one placement
        if grown and how == "stop":
            assert out["view"] == final and out["members"] == final, where  # sealed without the frozen newcomer
    if not grown:
        assert outs[0]["phy2log"] == PLACEMENT
    if how == "kill" and not grown:
        assert f"members [{who}] ended" in outs[0]["failure"][1], outs[0]["failure"]
    if how == "stop" and not grown:
        assert "had not been built and loaded by the build's deadline" in outs[0]["failure"][1], outs[0]["failure"]
    print(f"\n{case}: {'switched at step' if grown else 'FAILED at poll'} {step}; members' grow ended after (s):",
          [outs[r]["failure"][2] if outs[r]["failure"] else None for r in members], f"whole case {seconds:.1f} s")


# ---------------------------------------------------------------- a replacement admitted into the grown group

REPLACED = R0  # a newcomer's id: a rank the group had not before the grow


def _grown_state():
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.grow_placement import grow_placement
    from mooncake_ep_switch.eplb.slots import SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    return (SlotShape(LAYERS, EXPERTS, SPR, HIDDEN, INTER), Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR),
            [random_weights(EXPERTS, HIDDEN, INTER, seed=500 + layer) for layer in range(LAYERS)],
            grow_placement(np.asarray(PLACEMENT), R0, R1, SPR, EXPERTS))


def rank_grown(ctx):
    """3 -> 5 without faults; every rank keeps the grown Buffer and slots and serves the agreed step."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.eplb.grow_placement import grow_slots
    from mooncake_ep_switch.eplb.slots import ExpertSlots

    old_group = dist.new_group(list(range(R0)))
    shape, size, weights, target = _grown_state()
    attempt, started = None, time.monotonic()
    if ctx.rank < R0:
        buffer = Buffer(old_group, size, transport="shm")
        slots = ExpertSlots(buffer, shape, np.asarray(PLACEMENT), spare_frames=1)
        slots.load(weights)
        grow = GrowOperation(buffer, R1, Buffer, timeout_s=GROW_S,
                             build=lambda new: grow_slots(new, shape, target, R0, slots, 1))
        step, result = 1, None
        while result is None:
            assert time.monotonic() - started < LOOP_S, "no switch-over agreed"
            result = grow.poll(step)
            step += result is None  # (the old group's steps are test_grow's and this file's other cases' business)
        attempt = grow.attempt
        slots.destroy()
        buffer.destroy()
    else:
        result = join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0,
                           build=lambda new: grow_slots(new, shape, target, R0, None, 1), timeout_s=GROW_S)
    RANK_STATE.update(buffer=result.buffer, slots=result.built.slots, weights=weights, step=result.step)
    diff, masked = _serve(result.buffer, result.built.slots, weights, R1, result.buffer.active_mask(), ctx.rank,
                          result.step)
    return {"attempt": attempt, "step": result.step, "diff": diff, "masked": masked}


def rank_kill_in_grown(ctx):
    """REPLACED is SIGKILLed; the others serve the next step over the grown group without it."""
    if ctx.rank == REPLACED:
        os.kill(os.getpid(), signal.SIGKILL)
    RANK_STATE["step"] += 1
    buffer = RANK_STATE["buffer"]
    return _serve(buffer, RANK_STATE["slots"], RANK_STATE["weights"], R1, buffer.active_mask(), ctx.rank,
                  RANK_STATE["step"])


def rank_replace_in_grown(ctx, attempt, step):
    """The replacement joins the grown Buffer (its store: the grow's `grow/<attempt>/buffer`), every rank calls
    update_ep_member(), the replacement loads its slots of the grown placement; then two steps with every rank."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.group_keys import group_prefix, root_store
    from mooncake_ep_switch.elastic import join
    from mooncake_ep_switch.eplb.slots import ExpertSlots

    started = time.monotonic()
    if ctx.group is None:  # the replacement process
        shape, size, weights, target = _grown_state()
        store = dist.PrefixStore(f"{group_prefix(range(R0))}/grow/{attempt}/buffer", root_store(ctx.store))
        buffer = Buffer(join(store, REPLACED, R1, keep_prefix=True), size, transport="shm")
        view = buffer.update_ep_member(timeout_s=60)
        slots = ExpertSlots(buffer, shape, target, spare_frames=1)
        slots.load(weights)  # its slots from the loader, as any replacement's
        RANK_STATE.update(buffer=buffer, slots=slots, weights=weights)
    else:
        buffer = RANK_STATE["buffer"]
        deadline = time.monotonic() + 60
        while REPLACED not in buffer.pending_joiners():
            assert time.monotonic() < deadline, "the replacement never asked to join the grown group"
            time.sleep(0.01)
        view = buffer.update_ep_member(timeout_s=60)
    admitted_s = time.monotonic() - started
    slots, weights = RANK_STATE["slots"], RANK_STATE["weights"]
    served = [(s,) + _serve(buffer, slots, weights, R1, buffer.active_mask(), ctx.rank, s) for s in (step, step + 1)]
    out = {"view": list(view.ranks), "epoch": view.epoch, "members": list(buffer.members), "served": served,
           "phy2log": slots.phy2log.tolist(), "admitted_s": round(admitted_s, 3)}
    slots.destroy()
    buffer.destroy()
    RANK_STATE.clear()
    return out


def test_a_replacement_admitted_into_the_grown_group_serves_exactly():
    with harness.fresh_cluster(R1) as cluster:
        grown = harness.check_outcomes(cluster.run(rank_grown, timeout_s=180))
        attempt, step = grown[0]["attempt"], grown[0]["step"]
        assert all(g["step"] == step and g["diff"] < LIMIT and g["masked"] == [] for g in grown), grown
        outcomes = cluster.run(rank_kill_in_grown, timeout_s=120, failure_grace_s=60)
        assert not outcomes[REPLACED].ok and outcomes[REPLACED].exitcode == -signal.SIGKILL, outcomes[REPLACED]
        for rank in (r for r in range(R1) if r != REPLACED):  # masked, exact without its copies
            diff, masked = outcome_value(outcomes[rank])
            assert diff < LIMIT and masked == [REPLACED], (rank, diff, masked)
        cluster.respawn(REPLACED)
        results = harness.check_outcomes(cluster.run(rank_replace_in_grown, attempt, step + 2, timeout_s=180))
        processes = list(cluster.processes)
    assert not any(p.is_alive() for p in processes)
    for rank, result in enumerate(results):
        where = (rank, result)
        assert result["view"] == result["members"] == list(range(R1)), where
        assert result["epoch"] == results[0]["epoch"] and result["phy2log"] == results[0]["phy2log"], where
        assert [s for s, _, _ in result["served"]] == [step + 2, step + 3], where
        assert all(diff < LIMIT and masked == [] for _, diff, masked in result["served"]), where  # full reference
    print("\nreplacement of rank", REPLACED, "in the grown group admitted after (s):",
          [r["admitted_s"] for r in results])
