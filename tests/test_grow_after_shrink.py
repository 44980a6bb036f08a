"""Growing after a shrink, 5 -> 4 -> 6 in one job (issue 37), and a grow and a shrink of one Buffer at once.

Seven processes: ranks 0-4 serve two MoE layers on physical experts over a 5-rank group (test_grow's
sizes; layer 1 holds expert SOLE only on VICTIM), ranks 5 and 6 are new processes. After step 1 VICTIM is
SIGKILLed and no replacement comes: the four survivors `shrink_experts(buffer, rebalancer, [VICTIM], 2)`
(the view without it, a coverage epoch that moves SOLE onto a survivor at step 2, from the loader). Then
they grow to 6 (`GrowOperation`), serving on the old Buffer while the grown one is built: the members are
renumbered densely (old 0, 1, 3, 4 are ranks 0-3 of the grown group), the newcomers take ranks 4 and 5
(`join_grow(..., old_num_ranks=4, group_ranks=range(5))`), the placement is the members' columns of the
shrunk one (`renumber_placement`) grown by `grow_placement`, the newcomers' copies from the members'
memory. Checked on every rank: every step's outputs equal the single-process reference (5 ranks, 4
after the shrink, 6 after the grow), no dispatch-map entry names a slot outside the view (VICTIM's after
the shrink, one past 6 * SPR after the grow), every expert is served, one switch-over step and one
placement everywhere. Cells: shm; shm with `_use_fallback` set on the members (the calls on the collective
fallback): then every rank of the grown group, the newcomers too, runs on the fallback; a Buffer of the
"collective" transport (its slots on a second, shm Buffer of each group, as test_shrink's and test_grow's,
the grown group's built in `build`); the "cuda" transport on the emulated device (the slots in device
memory). On the Transfer Engine across namespace hosts: tests/test_hosts_resize.py (the same rank function
and checks).

Unit tests (no processes): a grow and a shrink started together on one Buffer refuse each other by name,
nothing changed; the request of a view with holes names it, a member asking with another view is
refused by name, so is a newcomer that names the group's size instead of the members' count;
`renumber_placement` keeps the members' columns and checks its arguments.
"""
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

from tests import harness
from tests.harness import outcome_value
from tests.test_grow import EXPERTS, HIDDEN, INTER, LAYERS, LIMIT, SPR, TOKENS, _forward

R0, R1, VICTIM = 5, 6, 2
SURVIVORS = [r for r in range(R0) if r != VICTIM]
SOLE = 7
PLACEMENT = [[0, 1, 2, 3, 4, 5, 6, 0, 1, 7, 2, 3, 4, 5, 6],   # every expert of VICTIM has another copy
             [0, 1, 2, 3, 4, 5, 7, 0, 1, 6, 2, 3, 4, 5, 6]]   # SOLE only on VICTIM
PLACEMENT_KEY = "test/grow_after_shrink/placement"
TIMEOUT_US = harness.FAULT_TIMEOUT_US


def _maps(phy2log, num_ranks, active):
    from mooncake_ep_switch.eplb.maps import build_dispatch_map

    return build_dispatch_map(phy2log, num_ranks, num_ranks, active_ranks=active)


MODES = {"shm": ("shm", False), "fallback": ("shm", True), "collective": ("collective", False),
         "cuda": ("cuda", False), "mooncake": ("mooncake", False)}  # mode: (the members' transport, _use_fallback)
# A live peer must never miss a deadline: the Transfer Engine across hosts and the emulated CUDA device wait longer.
TIMEOUTS = {"mooncake": harness.FAULT_TIMEOUT_US_TE, "cuda": 3_000_000}


def rank_5_4_6(ctx, mode):
    """5 -> 4 -> 6 on one rank (module docstring); `mode` a key of MODES ("cuda": run it through
    tests/test_cuda.on_device; "mooncake": on namespace hosts, tests/test_hosts_resize.py)."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, join_grow
    from mooncake_ep_switch.eplb.grow_placement import grow_placement, grow_slots, renumber_placement
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.shrink_placement import shrink_experts
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    transport, fallback = MODES[mode]
    old_group = dist.new_group(list(range(R0)))  # every process of the world calls it
    shape = SlotShape(LAYERS, EXPERTS, SPR, HIDDEN, INTER)
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R1, R1 * SPR)
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=700 + layer) for layer in range(LAYERS)]
    loads = []

    def loader(layer, expert):  # the checkpoint
        loads.append((layer, expert))
        return weights[layer].gate_up[expert], weights[layer].down[expert]

    def holder_of(buffer, **store):  # on the collective transport the slots' frames sit on a second (shm) Buffer
        return buffer if transport != "collective" else Buffer(buffer.group, size, transport="shm", **store)

    def build(new, current):
        holder = holder_of(new, store=new.membership.store.inner)
        return holder, grow_slots(holder, shape, target, len(SURVIVORS), current, 1, loader)

    diffs, out = {}, {}
    if ctx.rank >= R0:  # a newcomer: rank 4 or 5 of the grown group; the placement comes from member 0
        rank = ctx.rank - 1
        started = time.monotonic()
        ctx.store.wait([PLACEMENT_KEY])
        target = np.asarray(json.loads(ctx.store.get(PLACEMENT_KEY).decode()), dtype=np.int64)
        result = join_grow(ctx.store, rank, R1, size, Buffer, old_num_ranks=len(SURVIVORS), group_ranks=range(R0),
                           build=lambda new: build(new, None), timeout_s=120)
        out.update(old_steps=[], shrink_s=None, grow_s=round(time.monotonic() - started, 3))
    else:
        buffer = Buffer(old_group, size, transport=transport)
        if fallback:
            buffer._use_fallback = True  # Mooncake's switch, on every member together
        holder = holder_of(buffer)
        slots = ExpertSlots(holder, shape, np.asarray(PLACEMENT), spare_frames=1)
        slots.load(weights)
        rebalancer = OnlineRebalancer(slots, timeout_us=TIMEOUTS.get(transport, TIMEOUT_US), frames_per_step=1)
        active = buffer.active_mask()
        diffs[1] = _forward(buffer, slots, weights, _maps(slots.phy2log, R0, active)[ctx.rank], active, ctx.rank, 1)
        if ctx.rank == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while VICTIM not in holder.dead_peers():  # no step meets the death: the shrink is what is tested
            assert time.monotonic() < deadline, "the peer watcher never saw VICTIM end"  # (the collective has none)
            time.sleep(0.01)
        started = time.monotonic()
        if holder is not buffer:
            holder.shrink([VICTIM], timeout_s=60)  # the slots' Buffer leaves VICTIM too
        view, chunks = shrink_experts(buffer, rebalancer, [VICTIM], 2, loader, timeout_s=60)
        out["shrink_s"] = round(time.monotonic() - started, 3)
        active = buffer.active_mask()
        reports, shrunk_maps = [], []
        for step in (2, 3):  # the coverage epoch commits at step 2: SOLE served from a survivor
            reports += [r.outcome for r in rebalancer.step(step, active)]
            maps = _maps(slots.phy2log, R0, active)
            shrunk_maps.append(maps)
            diffs[step] = _forward(buffer, slots, weights, maps[ctx.rank], active, ctx.rank, step)
        out.update(view=list(view.ranks), chunks=len(chunks), reports=reports, mask=active.tolist(),
                   on_victim=int(sum(((m // SPR) == VICTIM).sum() for m in shrunk_maps)),
                   shrunk_unserved=int(sum((m < 0).sum() for m in shrunk_maps)))
        dense = renumber_placement(slots.phy2log, buffer.members, SPR)
        target = grow_placement(dense, len(buffer.members), R1, SPR, EXPERTS)
        if ctx.rank == SURVIVORS[0]:  # the engine's rank 0 broadcasts the grown placement (as SGLang's scale-up)
            ctx.store.set(PLACEMENT_KEY, json.dumps(target.tolist()))
        started = time.monotonic()
        grow = GrowOperation(buffer, R1, Buffer, timeout_s=60, build=lambda new: build(new, slots))
        step, result, old_steps = 4, None, []
        while result is None:
            result = grow.poll(step)
            if result is None:  # the old Buffer serves on over the four
                assert time.monotonic() - started < 150, "no switch-over agreed"
                maps = _maps(slots.phy2log, R0, active)
                diffs[step] = _forward(buffer, slots, weights, maps[ctx.rank], active, ctx.rank, step)
                old_steps.append(step)
                step += 1
        out.update(old_steps=old_steps, grow_s=round(time.monotonic() - started, 3), old_runs_on=buffer._transport.name)
        slots.destroy()
        for old in {id(holder): holder, id(buffer): buffer}.values():
            old.destroy()
    new, (new_holder, grown) = result.buffer, result.built
    active = new.active_mask()
    maps = _maps(grown.slots.phy2log, R1, active)
    new_steps, times, subscription = [result.step, result.step + 1], [], new.subscribe()
    for step in new_steps:
        times.append(round(time.time(), 3))
        diffs[step] = _forward(new, grown.slots, weights, maps[new.rank], active, new.rank, step)
    times.append(round(time.time(), 3))
    events = list(iter(subscription.poll, None))
    masked = [(e.rank, e.reason) for e in events if type(e).__name__ == "PeerMasked"]
    subscription.close()
    out.update(new_times=times, masks=masked)  # for a failure's message: when, and whom each rank masked why
    out.update(diffs=diffs, new_steps=new_steps, rank=new.rank, num_ranks=new.num_ranks, members=list(new.members),
               grown_mask=active.tolist(), phy2log=grown.slots.phy2log.tolist(), max_slot=int(maps.max()),
               unserved=int((maps < 0).sum()), from_members=grown.from_members, from_loader=grown.from_loader,
               loads=loads, fallback=new._use_fallback, runs_on=new._transport.name, te_reads=grown.slots.te_reads)
    if transport == "mooncake":  # tests/test_hosts_resize.py: the routes of the grown Buffer
        out["routes"] = list(new.peer_routes())
    grown.slots.destroy()
    for done in {id(new_holder): new_holder, id(new): new}.values():
        done.destroy()
    return out


@pytest.mark.parametrize("mode", ["shm", "fallback", "collective", "emulated cuda"])
def test_grow_after_a_shrink_5_to_4_to_6_serves_exactly(mode):
    # "emulated cuda": the "cuda" transport on the emulated device (tests/emulated_device.py), the slots in device
    # memory, fresh processes (the swap stays); the Transfer Engine across hosts: tests/test_hosts_resize.py.
    from tests.test_cuda import on_device

    mode = mode.split()[-1]
    runner = on_device(rank_5_4_6, True) if mode == "cuda" else (rank_5_4_6,)
    with harness.fresh_cluster(R0 + 2) as cluster:
        outcomes = cluster.run(*runner, mode, timeout_s=240, failure_grace_s=60)
        cluster.accept_dead(VICTIM)
    check_5_4_6(outcomes, mode)


def check_5_4_6(outcomes, mode):
    """The checks of 5 -> 4 -> 6 on every rank's `rank_5_4_6` outcome (the test above, tests/test_hosts_resize.py);
    prints the times after `mode`. Returns the survivors' and newcomers' values (world rank order)."""
    transport, fallback = MODES[mode]
    runs_on = "collective" if fallback else transport
    fallback = runs_on == "collective"  # `_use_fallback` reads True on a Buffer built on the collective transport
    assert not outcomes[VICTIM].ok and outcomes[VICTIM].exitcode == -signal.SIGKILL, outcomes[VICTIM]
    outs = [outcome_value(o) for o in outcomes if o.rank != VICTIM]
    step = outs[0]["new_steps"][0]
    expected_rank = {old: new for new, old in enumerate(SURVIVORS + [R0, R0 + 1])}  # dense; newcomers 4, 5
    # Every rank's grown step times (wall clock), mask and mask causes: one rank's mask is explained by the others'
    timeline = [(world, out["new_times"], out["grown_mask"], out["masks"]) for world, out in
                zip(SURVIVORS + [R0, R0 + 1], outs)]
    for world, out in zip(SURVIVORS + [R0, R0 + 1], outs):
        where = f"rank {world}: {out}; every rank (world, grown step times, mask, causes): {timeline}"
        assert out["rank"] == expected_rank[world], where
        assert out["new_steps"] == [step, step + 1], where  # one switch-over step everywhere
        assert (out["num_ranks"], out["members"], out["grown_mask"]) == (R1, list(range(R1)), [1] * R1), where
        assert out["phy2log"] == outs[0]["phy2log"], where  # one placement
        assert out["max_slot"] < R1 * SPR and out["unserved"] == 0, where  # nothing outside the view, all served
        assert max(out["diffs"].values()) < LIMIT, (world, out["diffs"])
        assert (out["fallback"], out["runs_on"]) == (fallback, runs_on), where
        if world < R0:  # steps 1 (5 ranks), 2-3 (4 ranks, SOLE moved at 2) and the grow's, each once
            assert sorted(out["diffs"]) == list(range(1, step + 2)), where
            assert out["view"] == SURVIVORS and out["mask"] == [int(r != VICTIM) for r in range(R0)], where
            assert out["chunks"] == 1 and out["reports"] == ["committed"], where
            assert out["on_victim"] == 0 and out["shrunk_unserved"] == 0, where  # the shrunk maps skip VICTIM
            assert out["from_members"] == LAYERS * SPR and out["te_reads"] == 0, where  # its own slots, local copies
            assert out["old_runs_on"] == runs_on, where
        else:  # the newcomers' copies came from the members' memory
            assert sorted(out["diffs"]) == [step, step + 1] and out["from_members"] == LAYERS * SPR, where
        assert out["from_loader"] == 0, where
    grown = np.asarray(outs[0]["phy2log"])
    for layer in range(LAYERS):  # every expert on the grown group, SOLE too
        assert set(grown[layer].tolist()) == set(range(EXPERTS)), grown
    assert sum(len(out["loads"]) for out in outs) == 1, "one survivor loads SOLE (no live copy) at the shrink"
    print(f"5 -> 4 -> 6 ({mode}): shrink (s)", [out["shrink_s"] for out in outs[:4]],
          "grow (s)", [out["grow_s"] for out in outs], "switch step", step)
    return outs


def _member(core, buffer_bytes=1 << 20):
    """A member's Buffer as GrowOperation reads it, over `core` (test_drain's in-process BufferCore)."""
    return SimpleNamespace(membership=core.membership, rank=core.rank, num_ranks=core.num_ranks, members=core.members,
                           joining=False, epoch=core.epoch, settings=core.settings, num_ep_buffer_bytes=buffer_bytes,
                           transport="shm", _use_fallback=False, dead_peers=core.transport.dead_peers)


def test_a_grow_and_a_shrink_of_one_buffer_at_once_refuse_each_other_by_name():
    from mooncake_ep_switch.buffer.membership import resize_guard
    from mooncake_ep_switch.buffer.membership import shrink as group_shrink
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, _fail, grow_base
    from mooncake_ep_switch.buffer.membership.removed import removed_ranks
    from mooncake_ep_switch.errors import MembershipError
    from tests.test_drain import R, _cores

    core = _cores()[0]  # rank 0 of 4, rank 2 seen dead; nobody else votes
    member = _member(core)
    request = f"{grow_base(member)}/grow/request"
    # A grow in progress (waiting for its newcomers): a shrink of the same Buffer is refused, nothing changed.
    grow = GrowOperation(member, 6, None, timeout_s=30)
    with pytest.raises(RuntimeError, match=r"^shrink: a grow of this Buffer is in progress \(one resize at a time"):
        group_shrink.shrink(core, [2], timeout_s=5)
    assert (core.epoch, core.members, removed_ranks(core.membership)) == (0, tuple(range(R)), {})
    _fail(grow._store, grow._keys, "the test gives the grow up")
    grow._thread.join(10)
    assert not grow._thread.is_alive()
    with pytest.raises(MembershipError, match=r"grow to 6 ranks failed \(the test gives the grow up\)"):
        grow._finish("the test gives the grow up")
    store, attempts = core.membership.store.inner, f"{grow_base(member)}/grow/attempts"
    assert resize_guard.in_progress(core.membership) is None and store.get(request) == b""  # a later grow may ask
    assert store.add(attempts, 0) == 1
    # A shrink in progress (waiting for votes that never come): a grow of the same Buffer is refused, nothing claimed.
    outcome = {}

    def shrink():
        try:
            group_shrink.shrink(core, [2], timeout_s=4)
        except Exception as error:
            outcome["error"] = error

    thread = threading.Thread(target=shrink)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while resize_guard.in_progress(core.membership) != "shrink":
            assert time.monotonic() < deadline, "the shrink never started"
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match=r"^grow: a shrink of this Buffer is in progress \(one resize at a time"):
            GrowOperation(member, 6, None, timeout_s=30)
        assert store.get(request) == b"" and store.add(attempts, 0) == 1  # no request claimed
    finally:
        thread.join(30)
    error = outcome.get("error")
    assert isinstance(error, MembershipError) and "aborted on every rank" in str(error), outcome
    assert (core.epoch, core.members, removed_ranks(core.membership)) == (0, tuple(range(R)), {})
    assert resize_guard.in_progress(core.membership) is None


def test_the_request_of_a_view_with_holes_names_it_and_another_view_is_refused():
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation, _request_options

    store = dist.HashStore()
    membership = SimpleNamespace(prefix="mep/grp-0123456789abcdef/g1", store=SimpleNamespace(inner=store))

    def member(members, fallback=False):
        return SimpleNamespace(membership=membership, members=members, num_ranks=R0, num_ep_buffer_bytes=4096,
                               transport="shm", _use_fallback=fallback)

    first = SimpleNamespace()
    GrowOperation._claim(first, member((0, 1, 3, 4), fallback=True), R1)
    assert first._request == "1|4|6|4096|shm|view=0,1,3,4|fallback"
    assert _request_options(first._request) == ((0, 1, 3, 4), True)
    with pytest.raises(RuntimeError, match=r"^grow: another resize of this group is in progress \(4 -> 6 ranks, "
                                           r".*the view \[0, 1, 3, 4\], on the collective fallback\); this rank asked "
                                           r"for 4 -> 6 ranks, .*the view \[0, 1, 2, 4\].*two resizes at once"):
        GrowOperation._claim(SimpleNamespace(), member((0, 1, 2, 4), fallback=True), R1)
    assert store.get("mep/grp-0123456789abcdef/grow/request").decode() == first._request  # kept



def test_a_newcomer_naming_the_group_size_instead_of_the_members_is_refused_by_name():
    from mooncake_ep_switch.buffer.membership.group_keys import group_prefix
    from mooncake_ep_switch.buffer.membership.grow import join_grow

    store = dist.HashStore()
    base = group_prefix(range(R0))
    store.set(f"{base}/grow/request", "3|4|6|4096|shm|view=0,1,3,4")
    built = []
    with pytest.raises(ValueError, match=r"^old_num_ranks: the members grow the group from its 4 members "
                                         r"\[0, 1, 3, 4\]; this newcomer asked from 5"):
        join_grow(store, 5, R1, 4096, lambda *a, **k: built.append(a), old_num_ranks=R0, timeout_s=5)
    failed = store.get(f"{base}/grow/3/failed").decode()
    assert not built and failed.startswith("newcomer rank 5 refused: old_num_ranks"), failed


def test_renumber_placement_keeps_the_members_columns_in_order():
    from mooncake_ep_switch.eplb.grow_placement import renumber_placement

    table = np.asarray(PLACEMENT)
    dense = renumber_placement(table, SURVIVORS, SPR)
    assert dense.shape == (LAYERS, len(SURVIVORS) * SPR)
    for new, old in enumerate(SURVIVORS):
        assert np.array_equal(dense[:, new * SPR:(new + 1) * SPR], table[:, old * SPR:(old + 1) * SPR])
    with pytest.raises(ValueError, match=r"^members: expected distinct rank ids in \[0, 5\)"):
        renumber_placement(table, [0, 5], SPR)
    with pytest.raises(ValueError, match=r"^phy2log: expected \[L, R \* 3\]"):
        renumber_placement(table[:, :-1], SURVIVORS, SPR)
