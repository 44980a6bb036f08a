"""Growing the group with new processes (issue 37 item 2): `GrowOperation` / `join_grow` and `eplb.grow_placement`.

3 -> 5 on shm, on the collective fallback (its slots on a second, shm Buffer of each group, as
test_shrink's) and on the emulated CUDA device (the Transfer Engine across namespace hosts:
tests/test_hosts_resize.py): ranks 0-2 serve two MoE layers on physical experts over a 3-rank group; ranks 3
and 4 are new processes that take no part in it (they build nothing of the 3-rank group). A first grow fails: rank 4
asks with another num_ep_buffer_bytes and is refused by name, rank 3 and every member are told at one poll
(the members' MembershipError names rank 4's refusal) and the members serve on. Then the members ask again
and keep serving while the 5-rank Buffer and the grown placement are built (the newcomers' slots
copied from the members' memory); every member polls the switch-over at each step boundary and all
five ranks serve the agreed step and the next on the new Buffer. Checked on every rank: every step's
outputs equal the single-process reference (on the old group before, on the grown one from the agreed
step), the newcomers served exactly the agreed steps, no slot and no dispatch-map entry lies outside the
5-rank view, and the newcomers' copies came from the members (no loader call).

A newcomer SIGKILLed in its build (the weight copy): the grow fails at one poll on every member (FAILED in
the ballot), no member waits for its own build blocked on the dead peer, every step is served once and
exactly on the old group, no rank masked.

Bad input (unit tests, no processes): a size past MAX_EP_RANKS or not larger, a newcomer whose
num_ep_buffer_bytes or size differs from the members' request (refused by name, the grow marked failed),
two resizes at once (refused by name, the first request kept).
"""
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.reference import calc_diff

R0, R1 = 3, 5
LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, TOKENS, SPR = 2, 8, 256, 128, 2, 16, 3
PLACEMENT = [[0, 1, 2, 3, 4, 5, 6, 7, 0], [0, 1, 2, 3, 4, 5, 6, 7, 3]]
LIMIT = 1e-6
MAX_POLLS = 200
# A live peer must never miss the deadline: the Transfer Engine across hosts (tests/test_hosts_resize.py) and the
# emulated CUDA device wait longer (test_eplb_fault_routing.TIMEOUTS).
TIMEOUTS = {"mooncake": harness.FAULT_TIMEOUT_US_TE, "cuda": 3_000_000}


def test_grow_size_is_checked_by_name():
    from mooncake_ep_switch.buffer.membership.grow import MAX_EP_RANKS, check_grow_size

    assert check_grow_size("num_ranks", 5, 3) == 5
    with pytest.raises(ValueError, match=rf"^num_ranks: expected at most MAX_EP_RANKS={MAX_EP_RANKS} ranks.*got "
                                         rf"{MAX_EP_RANKS + 1}"):
        check_grow_size("num_ranks", MAX_EP_RANKS + 1, 3)
    with pytest.raises(ValueError, match=r"^num_ranks: a grow needs more ranks than the group's 3, got 3"):
        check_grow_size("num_ranks", 3, 3)
    with pytest.raises(TypeError, match=r"^num_ranks"):
        check_grow_size("num_ranks", "5", 3)


def test_grow_placement_keeps_members_and_places_newcomers_in_the_view():
    from mooncake_ep_switch.eplb.grow_placement import grow_placement

    target = grow_placement(np.asarray(PLACEMENT), R0, R1, SPR, EXPERTS)
    assert target.shape == (LAYERS, R1 * SPR)
    assert np.array_equal(target[:, :R0 * SPR], PLACEMENT)  # the members' slots stay (a local copy each)
    for layer in range(LAYERS):  # replicas of the least-copied experts: copies differ by at most one
        counts = np.bincount(target[layer], minlength=EXPERTS)
        assert counts.min() >= 1 and counts.max() - counts.min() <= 1, counts
    with pytest.raises(ValueError, match=r"^phy2log: expected \[L, 9\]"):
        grow_placement(np.zeros((2, 8), dtype=np.int64), R0, R1, SPR, EXPERTS)


def _fake_member(store, num_ranks=R0, nbytes=1 << 20):
    membership = SimpleNamespace(prefix="mep/grp-0123456789abcdef/g1", store=SimpleNamespace(inner=store))
    return SimpleNamespace(membership=membership, members=tuple(range(num_ranks)), _use_fallback=False,
                           num_ranks=num_ranks, num_ep_buffer_bytes=nbytes, transport="shm")


def test_two_resizes_at_once_are_refused_by_name():
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation

    store = dist.HashStore()
    first = SimpleNamespace()
    GrowOperation._claim(first, _fake_member(store), 5)
    same = SimpleNamespace()
    GrowOperation._claim(same, _fake_member(store), 5)  # another member of the same grow: the same attempt
    assert same.attempt == first.attempt == 1
    with pytest.raises(RuntimeError, match=r"^grow: another resize of this group is in progress \(3 -> 5 ranks, "
                                           r"num_ep_buffer_bytes=1048576.*asked for 3 -> 6 ranks.*two resizes at once"):
        GrowOperation._claim(SimpleNamespace(), _fake_member(store), 6)
    assert store.get("mep/grp-0123456789abcdef/grow/request").decode() == "1|3|5|1048576|shm"  # kept


def test_a_newcomer_with_another_buffer_size_is_refused_and_fails_the_grow():
    from mooncake_ep_switch.buffer.membership.group_keys import group_prefix
    from mooncake_ep_switch.buffer.membership.grow import join_grow

    store = dist.HashStore()
    base = group_prefix(range(R0))
    store.set(f"{base}/grow/request", "4|3|5|1048576|shm")
    built = []
    with pytest.raises(ValueError, match=r"^num_ep_buffer_bytes: expected the members' 1048576 bytes, got 4096 "
                                         r"\(newcomer rank 3\)"):
        join_grow(store, 3, R1, 4096, lambda *a, **k: built.append(a), old_num_ranks=R0, timeout_s=5)
    assert not built  # no group, no Buffer
    assert store.get(f"{base}/grow/4/failed").decode().startswith("newcomer rank 3 refused: num_ep_buffer_bytes")
    store = dist.HashStore()  # a new request (the failed attempt's is not joined again)
    store.set(f"{base}/grow/request", "5|3|5|1048576|shm")
    with pytest.raises(ValueError, match=r"^num_ranks: the members grow the group 3 -> 5 ranks; this newcomer asked "
                                         r"3 -> 6"):
        join_grow(store, 5, 6, 1048576, lambda *a, **k: built.append(a),
                  old_num_ranks=R0, timeout_s=5)
    with pytest.raises(ValueError, match=r"^rank: a newcomer takes a new rank id in \[3, 5\), got 1"):
        join_grow(store, 1, R1, 1048576, lambda *a, **k: built.append(a), old_num_ranks=R0, timeout_s=5)
    assert not built


def test_a_newcomer_rank_taken_in_an_attempt_is_refused_by_name():
    """One rank of an attempt is one process: a second join_grow of that rank (another process, or this one again
    after it gave up) is refused by name instead of entering a rendezvous nobody else comes to."""
    import os

    from mooncake_ep_switch.buffer.membership.group_keys import group_prefix
    from mooncake_ep_switch.buffer.membership.grow import join_grow
    from mooncake_ep_switch.errors import MembershipError

    store = dist.HashStore()
    base = group_prefix(range(R0))
    store.set(f"{base}/grow/request", "2|3|5|1048576|shm")
    built = []
    for held, who in [("ready pid 1 0123456789ab", "by another process"),
                      (f"ready pid {os.getpid()} 0123456789ab", "this process joined that attempt before")]:
        store.set(f"{base}/grow/2/newcomer/3", held)
        with pytest.raises(MembershipError, match=rf"^grow: newcomer rank 3 of attempt 2 is taken \('{held}'\): {who}"):
            join_grow(store, 3, R1, 1048576, lambda *a, **k: built.append(a), old_num_ranks=R0, timeout_s=5)
        assert store.get(f"{base}/grow/2/newcomer/3").decode() == held and not store.check([f"{base}/grow/2/failed"])
    assert not built


NEWCOMER_S = 15.0  # their first deadline: the build (~1 s, more on a loaded box) fits, the switch-over never comes


def rank_newcomer_deadline(ctx, gave_up):
    """The members poll only once both newcomers' first join_grow ended: built, they waited for a switch-over until
    their deadline. Their first poll must fail the grow (a newcomer left: nothing changed); then the members ask
    again and both newcomers join that next attempt (never the one they gave up). `gave_up`: this run's count of the
    newcomers' first join_grow ended."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.errors import MembershipError

    old_group = dist.new_group(list(range(R0)))
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR)
    deadline = time.monotonic() + 90
    if ctx.rank >= R0:
        try:
            join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0, timeout_s=NEWCOMER_S)
            first = "joined"
        except MembershipError as error:
            first = str(error)
        finally:
            ctx.store.add(gave_up, 1)
        result = join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0, timeout_s=60)
        attempts = None
    else:
        buffer = Buffer(old_group, size, transport="shm")
        grow = GrowOperation(buffer, R1, Buffer, timeout_s=60)
        while ctx.store.add(gave_up, 0) < R1 - R0:
            assert time.monotonic() < deadline, "the newcomers' first join_grow did not end"
            time.sleep(0.05)
        assert grow.ready(), "the members' build did not finish with the newcomers'"
        try:
            grow.poll(1)
            first = "switched"
        except MembershipError as error:
            first = str(error)
        again = GrowOperation(buffer, R1, Buffer, timeout_s=60)
        attempts, step, result = (grow.attempt, again.attempt), 2, None
        while result is None:
            assert time.monotonic() < deadline, "no switch-over agreed in the next attempt"
            result = again.poll(step)
            step += 1
        buffer.destroy()
    new = result.buffer
    out = {"first": first, "attempts": attempts, "step": result.step, "members": list(new.members),
           "num_ranks": new.num_ranks}
    new.destroy()
    return out


def _grown_everywhere(rank_fn, name):
    """Run `rank_fn(ctx, key)` on the R1 ranks (`key`: this run's own store key) and check that they all serve one
    grown group of R1 ranks from one agreed step; every rank's value."""
    import uuid

    outs = harness.run(R1, rank_fn, f"{name}/{uuid.uuid4().hex}", timeout_s=150)
    for rank, out in enumerate(outs):
        assert (out["members"], out["num_ranks"], out["step"]) == (list(range(R1)), R1, outs[0]["step"]), (rank, out)
    return outs


def test_a_newcomer_past_its_deadline_fails_the_grow_and_joins_the_next_attempt():
    outs = _grown_everywhere(rank_newcomer_deadline, "grow-deadline")
    for rank, out in enumerate(outs):
        if rank < R0:  # told at their first poll (no switch to a group whose newcomers left), then one more attempt
            assert out["first"].startswith("grow to 5 ranks failed (newcomer rank "), (rank, out["first"])
            assert "switch-over step (attempt " in out["first"] and "nothing changed" in out["first"], out["first"]
            assert out["attempts"][1] > out["attempts"][0] == outs[0]["attempts"][0], out["attempts"]
        else:  # its own deadline, or the other newcomer's failure record if that one's deadline came first
            assert out["first"].endswith(f"grow: the members' switch-over step (attempt {outs[0]['attempts'][0]}) did "
                                         "not come before the deadline"), (rank, out["first"])


LATE = 2  # the member slower to its GrowOperation


def rank_member_late(ctx, refused):
    """Every member builds its GrowOperation at step 1, LATE one second after newcomer 4 was refused (`refused`: this
    run's key of that); ranks 0 and 1 poll once the refusal is recorded (the grow's failure already there). A gloo
    barrier of the members stands for a served step between polls. Every member must raise at step 1 (LATE joined
    the attempt), then all agree a switch-over in the next attempt."""
    from datetime import timedelta

    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.errors import MembershipError

    old_group = dist.new_group(list(range(R0)), timeout=timedelta(seconds=60))
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR)
    deadline = time.monotonic() + 90
    refusals, result = [], None
    if ctx.rank >= R0:
        try:
            result = join_grow(ctx.store, ctx.rank, R1, size + 4096 * (ctx.rank == R1 - 1), Buffer, old_num_ranks=R0,
                               timeout_s=60)
        except (ValueError, MembershipError) as error:
            refusals.append(type(error).__name__)
        finally:
            if ctx.rank == R1 - 1:
                ctx.store.set(refused, "1")
        if result is None:
            result = join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0, timeout_s=60)
    else:
        buffer = Buffer(old_group, size, transport="shm")
        step = 1
        for attempt in (1, 2):
            if attempt == 1:
                if ctx.rank == LATE:
                    ctx.store.wait([refused], timedelta(seconds=60))
                    time.sleep(1.0)
                grow = GrowOperation(buffer, R1, Buffer, timeout_s=10)  # no agreement within 20 s: FAILED
                ctx.store.wait([refused], timedelta(seconds=60))
            else:
                grow = GrowOperation(buffer, R1, Buffer, timeout_s=10)
            while result is None:
                assert time.monotonic() < deadline, "no outcome"
                try:
                    result = grow.poll(step)
                except MembershipError as error:
                    refusals.append((step, str(error)))
                    break
                finally:
                    dist.barrier(group=old_group)  # the step served
                    step += 1
            if result is not None:
                break
        buffer.destroy()
    new = result.buffer
    out = {"refusals": refusals, "step": result.step, "members": list(new.members), "num_ranks": new.num_ranks}
    new.destroy()
    return out


def test_a_member_late_to_a_failing_grow_raises_at_the_same_poll_and_the_next_attempt_switches():
    for rank, out in enumerate(_grown_everywhere(rank_member_late, "grow-late")):
        if rank < R0:  # LATE too: the same poll, newcomer 4's refusal named
            assert [s for s, _ in out["refusals"]] == [1], (rank, out["refusals"])
            assert "newcomer rank 4 refused: num_ep_buffer_bytes" in out["refusals"][0][1], out["refusals"]


def _forward(buffer, slots, weights, rows, active, rank, step, dead=None):
    """Serve `step` on both layers; the max diff against the reference (without the copies on rank `dead`)."""
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn((TOKENS, HIDDEN), generator=generator).to(torch.bfloat16)
    diffs = []
    for layer in range(LAYERS):
        out, _ = physical_ep_forward(buffer, x, weights[layer].router, slots, layer, TOP_K, TOKENS, active,
                                     rows[layer], timeout_us=TIMEOUTS.get(buffer.transport, harness.FAULT_TIMEOUT_US))
        skip = {e for e in range(EXPERTS) if dead is not None and int(rows[layer][e]) // SPR == dead}
        diffs.append(calc_diff(out, reference_forward(x, weights[layer], TOP_K, skip_experts=skip)))
    return max(diffs)


def rank_grow(ctx, transport, then=None):
    """3 -> 5 (a failed attempt first); `then(ctx, new, slots, weights, step)`, if given, runs on the grown group."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.eplb.grow_placement import grow_placement, grow_slots
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.errors import MembershipError
    from mooncake_ep_switch.reference.moe_block import random_weights

    old_group = dist.new_group(list(range(R0)))  # torch's new_group is called by every process of the world
    shape = SlotShape(LAYERS, EXPERTS, SPR, HIDDEN, INTER)
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR)
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=500 + layer) for layer in range(LAYERS)]
    target = grow_placement(np.asarray(PLACEMENT), R0, R1, SPR, EXPERTS)
    loads = []

    def loader(layer, expert):
        loads.append((layer, expert))
        return weights[layer].gate_up[expert], weights[layer].down[expert]

    diffs, old_steps, refusals = {}, [], []
    started = time.monotonic()
    def build(new, current):  # on the collective fallback the slots' frames sit on a second (shm) Buffer
        holder = new if transport != "collective" else Buffer(new.group, size, transport="shm",
                                                       store=new.membership.store.inner)
        return holder, grow_slots(holder, shape, target, R0, current, 1, loader)

    if ctx.rank < R0:
        buffer = Buffer(old_group, size, transport=transport)
        holder = buffer if transport != "collective" else Buffer(old_group, size, transport="shm")
        slots = ExpertSlots(holder, shape, np.asarray(PLACEMENT), spare_frames=1)
        slots.load(weights)
        active = buffer.active_mask()
        rows = build_dispatch_map(slots.phy2log, R0, R0)[ctx.rank]
        step, result = 1, None
        for attempt in (1, 2):  # 1: a newcomer asks with another buffer size and the grow fails everywhere
            diffs[step] = _forward(buffer, slots, weights, rows, active, ctx.rank, step)
            old_steps.append(step)
            step += 1
            grow = GrowOperation(buffer, R1, Buffer, timeout_s=60, build=lambda new: build(new, slots))
            while result is None:
                try:
                    result = grow.poll(step)
                except MembershipError as error:
                    refusals.append((step, str(error)))
                    break
                if result is None:
                    assert time.monotonic() - started < 150, "no switch-over agreed"  # the grow's own bound: 120 s
                    diffs[step] = _forward(buffer, slots, weights, rows, active, ctx.rank, step)  # the old serves on
                    old_steps.append(step)
                    step += 1
        slots.destroy()
        for old in {id(holder): holder, id(buffer): buffer}.values():
            old.destroy()
    else:
        # A newcomer's deadline covers the whole join: rank 3's first call may span the failed attempt and the next
        # one's build (60 s ran out there once in CI beside 2 CPU hogs; the members' builds end by their 60 s).
        try:  # attempt 1: the last newcomer's buffer size differs (refused by name), the other one is told
            result = join_grow(ctx.store, ctx.rank, R1, size + 4096 * (ctx.rank == R1 - 1), Buffer, old_num_ranks=R0,
                               build=lambda new: build(new, None), timeout_s=120)
            refusals.append("joined")  # rank 3 read the request only after attempt 1 failed: it joined attempt 2
        except (ValueError, MembershipError) as error:
            refusals.append(f"{type(error).__name__}: {error}")
            result = join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0,
                               build=lambda new: build(new, None), timeout_s=120)
    grow_s = time.monotonic() - started
    assert result is not None, f"rank {ctx.rank}: no grow succeeded: {refusals}"  # each failed attempt's reason
    new, (new_holder, grown) = result.buffer, result.built
    active = new.active_mask()
    maps = build_dispatch_map(grown.slots.phy2log, R1, R1, active_ranks=active)
    new_steps = [result.step, result.step + 1]
    for step in new_steps:
        diffs[step] = _forward(new, grown.slots, weights, maps[ctx.rank], active, ctx.rank, step)
    out = {"diffs": diffs, "old_steps": old_steps, "new_steps": new_steps, "members": list(new.members),
           "num_ranks": new.num_ranks, "mask": active.tolist(), "phy2log": grown.slots.phy2log.tolist(),
           "max_slot": int(maps.max()), "unserved": int((maps < 0).sum()), "from_members": grown.from_members,
           "from_loader": grown.from_loader, "loads": loads, "grow_s": round(grow_s, 3), "refusals": refusals}
    out["transport"] = new.transport
    if then is not None:
        out["then"] = then(ctx, new, grown.slots, weights, new_steps[-1] + 1)
    grown.slots.destroy()
    for done in {id(new_holder): new_holder, id(new): new}.values():
        done.destroy()
    return out


def then_fallback(ctx, new, slots, weights, step):
    """On the grown Buffer (torch never registered its group): every rank sets `_use_fallback`, serves a round."""
    from mooncake_ep_switch.eplb.maps import build_dispatch_map

    new._use_fallback = True
    active = new.active_mask()
    rows = build_dispatch_map(slots.phy2log, R1, R1, active_ranks=active)[ctx.rank]
    return {"diff": _forward(new, slots, weights, rows, active, ctx.rank, step), "on": new._use_fallback,
            "runs_on": new._transport.name}


@pytest.mark.parametrize("transport", ["shm", "collective", "emulated cuda"])
def test_grow_3_to_5_switches_at_one_step_and_serves_exactly(transport):
    if transport == "emulated cuda":  # the "cuda" transport on the emulated device (tests/emulated_device.py): the
        from tests.test_cuda import on_device  # slots in device memory; fresh processes (the swap stays)

        with harness.fresh_cluster(R1) as cluster:
            outs = harness.check_outcomes(cluster.run(*on_device(rank_grow, True), "cuda", timeout_s=180))
        return check_grow(outs, "cuda")
    outs = harness.run(R1, rank_grow, transport, then_fallback if transport == "shm" else None, timeout_s=180)
    check_grow(outs, transport)


def check_grow(outs, transport):
    """The checks of the 3 -> 5 grow on every rank's `rank_grow` value (the test above, tests/test_hosts_resize.py);
    prints the grow's times after `transport` (its name)."""
    step = outs[0]["new_steps"][0]
    failed_at = outs[0]["refusals"][0][0]
    for rank, out in enumerate(outs):
        assert out["new_steps"] == [step, step + 1], (rank, out["new_steps"])  # one agreed step everywhere
        if rank < R0:  # every step before it served once on the old group, none lost (the failed grow's too)
            assert out["old_steps"] == list(range(1, step)), (rank, out["old_steps"])
            assert len(out["refusals"]) == 1 and out["refusals"][0][0] == failed_at, out["refusals"]  # one poll
            assert "newcomer rank 4 refused: num_ep_buffer_bytes: expected the members' " in out["refusals"][0][1]
            assert "nothing changed: the current Buffer serves on" in out["refusals"][0][1]
        elif rank == R1 - 1:
            assert out["refusals"][0].startswith("ValueError: num_ep_buffer_bytes: expected the members' "), out
        else:  # told at the failure, or it read the request only after that and joined the second attempt
            assert out["refusals"][0] == "joined" or out["refusals"][0].startswith(
                "MembershipError: grow to 5 ranks failed: newcomer rank 4 refused"), out["refusals"]
        assert max(out["diffs"].values()) < LIMIT, (rank, out["diffs"])
        assert (out["members"], out["num_ranks"], out["mask"]) == (list(range(R1)), R1, [1] * R1)
        assert out["phy2log"] == outs[0]["phy2log"]  # one placement
        assert out["max_slot"] < R1 * SPR and out["unserved"] == 0  # no copy outside the view, every expert served
        assert out["from_loader"] == 0 and out["loads"] == []  # the newcomers' copies came from the members' memory
        assert out["from_members"] == LAYERS * SPR and out["transport"] == transport
        if transport == "shm":  # then the grown Buffer moved onto the collective fallback, exact
            assert out["then"]["on"] and out["then"]["runs_on"] == "collective", out["then"]
            assert out["then"]["diff"] < LIMIT, out["then"]
    print(f"grow 3->5 on {transport} (s per rank):", [out["grow_s"] for out in outs], "switch step", step)


VICTIM = 1  # a member of the 3-rank group, rank 1 of the grown one


def then_kill_one(ctx, new, slots, weights, step):
    """On the grown Buffer: VICTIM SIGKILLs itself, the survivors serve a round, then agree a view without it."""
    import os
    import signal

    from mooncake_ep_switch.eplb.maps import build_dispatch_map

    if ctx.rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    active = new.active_mask()
    rows = build_dispatch_map(slots.phy2log, R1, R1, active_ranks=active)[ctx.rank]  # VICTIM not masked yet
    on_victim = sum(int(rows[layer][e]) // SPR == VICTIM for layer in range(LAYERS) for e in range(EXPERTS))
    diff = _forward(new, slots, weights, rows, active, ctx.rank, step, dead=VICTIM)
    started = time.monotonic()
    view = new.update_ep_member(timeout_s=30)
    return {"diff": diff, "on_victim": on_victim, "mask": active.tolist(), "epoch": view.epoch,
            "view": list(view.ranks), "members": list(new.members), "new_mask": new.active_mask().tolist(),
            "update_s": round(time.monotonic() - started, 3)}


def test_a_rank_killed_in_the_grown_group_is_masked_and_the_survivors_agree_a_view():
    import signal

    from tests.harness import outcome_value

    with harness.fresh_cluster(R1) as cluster:
        outcomes = cluster.run(rank_grow, "shm", then_kill_one, timeout_s=180, failure_grace_s=60)
    assert not outcomes[VICTIM].ok and outcomes[VICTIM].exitcode == -signal.SIGKILL, outcomes[VICTIM]
    survivors = [rank for rank in range(R1) if rank != VICTIM]
    outs = [outcome_value(outcomes[rank])["then"] for rank in survivors]
    expected_mask = [int(rank != VICTIM) for rank in range(R1)]
    for rank, out in zip(survivors, outs):
        assert out["mask"] == expected_mask, (rank, out)  # the round masked the dead rank, and only it
        assert out["diff"] < LIMIT, (rank, out)  # exact against the reference without VICTIM's copies
        assert (out["view"], out["members"], out["new_mask"]) == (survivors, survivors, expected_mask), (rank, out)
        assert out["epoch"] == outs[0]["epoch"], outs  # one view
    assert any(out["on_victim"] for out in outs), outs  # the round did route to the dead rank
    print("grown group, rank", VICTIM, "killed: update_ep_member (s):", [out["update_s"] for out in outs],
          "epoch", outs[0]["epoch"])


def test_a_grow_needs_a_member():  # a view with holes (after a shrink) grows: tests/test_grow_after_shrink.py
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation
    from mooncake_ep_switch.errors import MembershipError

    store = dist.HashStore()
    after_shrink = _fake_member(store, num_ranks=4)
    after_shrink.__dict__.update(rank=0, members=(0, 1, 3), joining=False, epoch=2)
    drained = _fake_member(store, num_ranks=4)
    drained.__dict__.update(rank=2, members=(0, 1, 3), joining=True, epoch=2)
    with pytest.raises(MembershipError, match=r"^grow: rank 2 is not a member of the group"):
        GrowOperation(drained, 6, None)
    with pytest.raises(ValueError, match=r"^timeout_s"):
        GrowOperation(after_shrink, 6, None, timeout_s=-1)
    assert not store.check(["mep/grp-0123456789abcdef/grow/request"])  # nothing claimed


def rank_newcomer_dies(ctx):
    """Newcomer R1 - 1 is SIGKILLed in its build (the weight copy); the members serve on, told at one poll."""
    import os
    import signal

    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.eplb.grow_placement import grow_placement, grow_slots
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.errors import MembershipError
    from mooncake_ep_switch.reference.moe_block import random_weights

    old_group = dist.new_group(list(range(R0)))
    shape = SlotShape(LAYERS, EXPERTS, SPR, HIDDEN, INTER)
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR)
    target = grow_placement(np.asarray(PLACEMENT), R0, R1, SPR, EXPERTS)
    if ctx.rank >= R0:
        def build(new):
            if ctx.rank == R1 - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return grow_slots(new, shape, target, R0, None, 1)

        try:
            join_grow(ctx.store, ctx.rank, R1, size, Buffer, old_num_ranks=R0, build=build, timeout_s=60)
            return "joined"
        except Exception as error:  # the gloo group or the grow's failure record, whichever it met first
            return f"{type(error).__name__}: {error}"
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=500 + layer) for layer in range(LAYERS)]
    buffer = Buffer(old_group, size, transport="shm")
    slots = ExpertSlots(buffer, shape, np.asarray(PLACEMENT), spare_frames=1)
    slots.load(weights)
    active = buffer.active_mask()
    rows = build_dispatch_map(slots.phy2log, R0, R0)[ctx.rank]
    grow = GrowOperation(buffer, R1, Buffer, timeout_s=60, build=lambda new: grow_slots(new, shape, target, R0,
                                                                                          slots, 1))
    diffs, failure, started = {}, None, time.monotonic()
    for step in range(1, MAX_POLLS):
        if failure is None:
            try:
                assert grow.poll(step) is None, "a grow with a dead newcomer switched over"
            except MembershipError as error:
                failure = (step, str(error), round(time.monotonic() - started, 3))
        diffs[step] = _forward(buffer, slots, weights, rows, active, ctx.rank, step)
        if failure is not None and step >= failure[0] + 1:
            break
    out = {"failure": failure, "diffs": diffs, "members": list(buffer.members), "mask": active.tolist()}
    slots.destroy()
    buffer.destroy()
    return out


def test_a_newcomer_killed_in_the_weight_copy_fails_the_grow_at_one_poll_and_the_members_serve_on():
    import signal

    from tests.harness import outcome_value

    with harness.fresh_cluster(R1) as cluster:
        outcomes = cluster.run(rank_newcomer_dies, timeout_s=180, failure_grace_s=60)
    assert not outcomes[R1 - 1].ok and outcomes[R1 - 1].exitcode == -signal.SIGKILL, outcomes[R1 - 1]
    assert outcome_value(outcomes[R0]) != "joined", outcomes[R0]
    members = [outcome_value(outcomes[rank]) for rank in range(R0)]
    step = members[0]["failure"][0]
    for out in members:
        assert out["failure"][0] == step, members  # one decision: FAILED at the same poll everywhere
        assert "grow to 5 ranks failed" in out["failure"][1] and "nothing changed" in out["failure"][1], out
        assert sorted(out["diffs"]) == list(range(1, step + 2)), out["diffs"]  # every step served once, on the old
        assert max(out["diffs"].values()) < LIMIT, out["diffs"]
        assert (out["members"], out["mask"]) == (list(range(R0)), [1] * R0)
    print("newcomer killed: FAILED at poll", step, "after (s):", [out["failure"][2] for out in members],
          members[0]["failure"][1])
