"""Draining a live rank out of the group (issue 37 item 1, 4 -> 3): `eplb.drain` and `Buffer.shrink(drain=True)`.

R=4 ranks serve two MoE layers on test_eplb_fault_routing's placement (layer 1 holds expert SOLE_EXPERT on
rank LEAVING only). Every rank, LEAVING too, calls `begin_drain(buffer, rebalancer, [LEAVING], 3)`, serves
steps 2 and 3 (the move commits at 3: the sole expert is copied from LEAVING's own frame, the loader is
never read), then `finish_drain`: one decision of all four, the view [0, 1, 2] sealed; LEAVING's Buffer
refuses dispatch, update_ep_member and shrink by name and is destroyed; the survivors serve steps 4 and 5
over three ranks. Every served step is checked against the single-process reference. On shm, the
collective fallback and the emulated CUDA device (the Transfer Engine across namespace hosts:
tests/test_hosts_resize.py).

A leaving rank killed while the survivors copy its experts (after `begin_drain`, before its vote): the
move aborts on every survivor, they remove it as a dead rank (`shrink_experts`, its lost copy from the
loader) and all end on one view, one placement, serving exactly.

Bad input (no process): ranks out of range, repeated, not members, seen dead, all of them (zero left),
an expert left without a slot, a drain while a rebalance is in progress, a finish before the move
committed, a shrink while another shrink of the Buffer runs, `drain` not a bool: refused by name,
nothing changed.
"""
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests import harness
from tests.harness import RANK_STATE, outcome_value
from tests.test_eplb_fault_routing import EXPERTS, LIMIT, PLACEMENT, R, SLOTS_PER_RANK
from tests.test_shrink import _forward, _setup

LEAVING = 3


def _rows(slots, rank, active=None):
    from mooncake_ep_switch.eplb.maps import build_dispatch_map

    return build_dispatch_map(slots.phy2log, R, R, active_ranks=active)[rank]


def _refused(call):
    """The call's refusal as (type name, message), or None when it returned."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type is asserted by the caller
        return type(error).__name__, str(error)
    return None


def rank_drain(ctx, transport):
    import torch.distributed as dist

    from mooncake_ep_switch.buffer.membership.removed import removed_ranks
    from mooncake_ep_switch.eplb.drain import begin_drain, finish_drain

    buffer, holder, weights, slots, rebalancer, loader, loads = _setup(ctx, transport)
    RANK_STATE.update(buffer=buffer, holder=holder, slots=slots)
    active = buffer.active_mask()
    rows = _rows(slots, ctx.rank)
    dist.barrier(group=ctx.group)
    full = {1: _forward(ctx, buffer, slots, weights, rows, active, 1, transport)}
    chunks = begin_drain(buffer, rebalancer, [LEAVING], 3, loader)
    reports = []
    for step in (2, 3):  # LEAVING serves on; the sole expert's copy is staged from its frame
        done = rebalancer.step(step, active)
        reports += done
        if any(r.outcome == "committed" for r in done):
            rows = _rows(slots, ctx.rank, active)
        full[step] = _forward(ctx, buffer, slots, weights, rows, active, step, transport)
    started = time.monotonic()
    if holder is not buffer:
        holder.shrink([LEAVING], timeout_s=60, drain=True)  # the slots' Buffer lets it go too
    view = finish_drain(buffer, rebalancer, [LEAVING], timeout_s=60)
    drain_s = time.monotonic() - started
    result = {"view": list(view.ranks), "epoch": view.epoch, "chunks": len(chunks), "loads": loads,
              "reports": [(r.outcome, r.moved_bytes, r.remote_bytes, r.loaded_bytes) for r in reports],
              "frame_bytes": slots.frame_bytes, "drain_s": drain_s, "phy2log": slots.phy2log.tolist(),
              "removed": removed_ranks(buffer.membership)}
    if ctx.rank == LEAVING:
        result["refusals"] = [
            _refused(lambda: _forward(ctx, buffer, slots, weights, rows, active, 4, transport)),
            _refused(lambda: buffer.update_ep_member(timeout_s=5)),
            _refused(lambda: buffer.shrink([0], timeout_s=5)),
            _refused(lambda: holder.update_ep_member(timeout_s=5))]
        for name in ("slots", "holder", "buffer"):  # destroyed cleanly (the teardown's check of the regions)
            thing = RANK_STATE.pop(name)
            if name == "buffer" or thing is not buffer:
                thing.destroy()
        return result
    active = buffer.active_mask()
    rows = _rows(slots, ctx.rank, active)
    for step in (4, 5):
        full[step] = _forward(ctx, buffer, slots, weights, rows, active, step, transport)
    maps = _rows(slots, ctx.rank, active)
    result.update(full=full, mask=active.tolist(), map_on_leaving=int(((maps // SLOTS_PER_RANK) == LEAVING).sum()),
                  map_unserved=int((maps < 0).sum()))
    return result


def rank_close(ctx):
    for name in ("slots", "holder"):
        thing = RANK_STATE.pop(name, None)
        if thing is not None and thing is not RANK_STATE.get("buffer"):
            thing.destroy()
    return harness.rank_teardown(ctx)


@pytest.mark.parametrize("transport", ["shm", "collective", "emulated cuda"])
def test_a_live_rank_drained_out_hands_its_experts_over_and_the_three_serve_the_reference(transport):
    if transport == "emulated cuda":  # the "cuda" transport on the emulated device (tests/emulated_device.py): the
        from tests.test_cuda import on_device  # slots in device memory; fresh processes (the swap stays)

        with harness.fresh_cluster(R) as cluster:
            try:
                results = [outcome_value(o) for o in cluster.run(*on_device(rank_drain, True), "cuda", timeout_s=180)]
            finally:
                harness.check_outcomes(cluster.run(rank_close, timeout_s=60))
        return check_drain(results, "cuda")
    cluster = harness.cluster(R)
    try:
        results = [outcome_value(o) for o in cluster.run(rank_drain, transport, timeout_s=180)]
    finally:
        harness.check_outcomes(cluster.run(rank_close, timeout_s=60))
    check_drain(results, transport)


def check_drain(results, transport):
    """The checks of a 4 -> 3 drain of LEAVING on every rank's `rank_drain` value (the test above,
    tests/test_hosts_resize.py); prints `finish_drain`'s times after `transport` (its name)."""
    assert len({str(r["phy2log"]) for r in results}) == 1, "ranks ended on different placements"
    final = np.asarray(results[0]["phy2log"])
    placed = np.asarray(PLACEMENT)
    assert (final != placed).sum() == 1, "only the sole expert's copy moves (onto a remaining rank)"
    assert not (final != placed)[:, LEAVING * SLOTS_PER_RANK:].any(), "the drained rank's slots were staged"
    frame = results[0]["frame_bytes"]
    staged = [r["reports"] for r in results]
    assert all([o for o, *_ in rep] == ["committed"] for rep in staged), staged
    assert sorted(rep[0][2] for rep in staged) == [0, 0, 0, frame], "one frame read from a peer (the leaving rank)"
    assert all(rep[0][3] == 0 for rep in staged) and all(r["loads"] == [] for r in results), "the loader was read"
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        assert r["view"] == [0, 1, 2] and r["chunks"] == 1, where
        assert r["removed"] in ({LEAVING: r["epoch"]}, {LEAVING: r["epoch"] - 1}), where
        if rank == LEAVING:
            kinds = [k for k, _ in r["refusals"]]
            assert kinds == ["MembershipError"] * 4, where
            assert all(f"rank {LEAVING} was drained out of the EP group" in m for _, m in r["refusals"]), where
            continue
        assert r["mask"] == [1, 1, 1, 0] and r["map_on_leaving"] == 0 and r["map_unserved"] == 0, where
        assert sorted(r["full"]) == [1, 2, 3, 4, 5], where
        for step, diffs in r["full"].items():
            assert all(d < LIMIT for d in diffs), (where, step, diffs)
    print(f"\n{transport}: finish_drain 4 -> 3: " + ", ".join(f"{r['drain_s'] * 1e3:.0f} ms" for r in results))


def rank_leaving_killed_in_the_copy(ctx):
    import torch.distributed as dist

    from mooncake_ep_switch.eplb.drain import begin_drain
    from mooncake_ep_switch.eplb.shrink_placement import shrink_experts
    from tests.test_shrink import _wait_seen_dead

    buffer, holder, weights, slots, rebalancer, loader, loads = _setup(ctx, "shm")
    RANK_STATE.update(buffer=buffer, holder=holder, slots=slots)
    active = buffer.active_mask()
    rows = _rows(slots, ctx.rank)
    dist.barrier(group=ctx.group)
    full = {1: _forward(ctx, buffer, slots, weights, rows, active, 1, "shm")}
    begin_drain(buffer, rebalancer, [LEAVING], 3, loader)
    if ctx.rank == LEAVING:  # dies while the survivors stage its expert from its frame
        os.kill(os.getpid(), signal.SIGKILL)
    reports = [(r.outcome, r.reason) for r in rebalancer.step(2, active)]  # staging (copies from LEAVING's memory)
    reports += [(r.outcome, r.reason) for r in rebalancer.step(3, active)]  # LEAVING never votes: ABORT
    _wait_seen_dead(buffer)
    view, chunks = shrink_experts(buffer, rebalancer, [LEAVING], 4, loader, timeout_s=60)
    active = buffer.active_mask()
    for step in (4, 5):
        done = rebalancer.step(step, active)
        reports += [(r.outcome, r.reason) for r in done]
        if any(r.outcome == "committed" for r in done):
            rows = _rows(slots, ctx.rank, active)
        full[step] = _forward(ctx, buffer, slots, weights, rows, active, step, "shm")
    return {"reports": reports, "view": list(view.ranks), "mask": active.tolist(), "loads": loads, "full": full,
            "phy2log": slots.phy2log.tolist(), "unserved": int((_rows(slots, ctx.rank, active) < 0).sum())}


def test_a_leaving_rank_killed_during_the_weight_copy_leaves_the_survivors_on_one_size_and_placement():
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(rank_leaving_killed_in_the_copy, timeout_s=180, failure_grace_s=60)
        assert not outcomes[LEAVING].ok and outcomes[LEAVING].exitcode == -signal.SIGKILL, outcomes[LEAVING]
        survivors = [outcome_value(o) for o in outcomes if o.rank != LEAVING]
        cluster.accept_dead(LEAVING)
        harness.check_outcomes(cluster.run(rank_close, ranks=[0, 1, 2], timeout_s=60))
    assert len({str(s["phy2log"]) for s in survivors}) == 1, "survivors ended on different placements"
    for rank, s in enumerate(survivors):
        where = f"rank {rank}: {s}"
        assert [o for o, _ in s["reports"]] == ["aborted", "committed"], where
        assert f"[{LEAVING}]" in s["reports"][0][1], where  # named: it never voted
        assert s["view"] == [0, 1, 2] and s["mask"] == [1, 1, 1, 0] and s["unserved"] == 0, where
        for step, diffs in s["full"].items():
            assert all(d < LIMIT for d in diffs), (where, step, diffs)
    assert sum(len(s["loads"]) for s in survivors) == 1, "the lost sole copy comes from the loader, once"


# ---------------------------------------------------------------------------------------- bad input, no process
class _Rebalancer:
    """What `begin_drain` / `finish_drain` use of an `OnlineRebalancer`, recording `begin` calls."""

    def __init__(self, placement, spare_frames=1, busy=False):
        shape = SimpleNamespace(slots_per_rank=SLOTS_PER_RANK, num_logical_experts=EXPERTS)
        self.slots = SimpleNamespace(phy2log=np.asarray(placement, dtype=np.int64), shape=shape,
                                     spare_frames=spare_frames, num_primary=0)
        self.in_progress, self.begun = busy, []

    def pending_chunks(self):
        return ("chunk",) if self.in_progress else ()

    def begin(self, target, commit_step, **kwargs):
        self.begun.append((target, commit_step, kwargs))
        return ("chunk",)


class _Buffer:
    """What the drain uses of a `Buffer`: its view, watcher and `shrink`, recording shrinks."""

    def __init__(self, members=tuple(range(R)), dead=()):
        import torch

        self.num_ranks, self.epoch, self.members, self.dead, self.shrinks = R, 0, tuple(members), list(dead), []
        self._mask = torch.zeros(R, dtype=torch.int32)
        self._mask[list(members)] = 1

    def active_mask(self):
        return self._mask.clone()

    def dead_peers(self):
        return self.dead

    def shrink(self, ranks, timeout_s=None, drain=False):
        self.shrinks.append((ranks, drain))
        return "view"


def test_bad_drains_are_refused_by_name_with_nothing_changed():
    from mooncake_ep_switch.eplb.drain import begin_drain, finish_drain

    cases = [  # (buffer, rebalancer, ranks, exception, message)
        (_Buffer(), _Rebalancer(PLACEMENT), [R], ValueError, r"^ranks: expected ranks of the group in \[0, 4\), got \[4\]"),
        (_Buffer(), _Rebalancer(PLACEMENT), [-1], ValueError, r"^ranks: .* got \[-1\]"),
        (_Buffer(), _Rebalancer(PLACEMENT), [], ValueError, r"^ranks: expected at least one rank"),
        (_Buffer(), _Rebalancer(PLACEMENT), [3, 3], ValueError, r"^ranks: expected distinct ranks"),
        (_Buffer(), _Rebalancer(PLACEMENT), ["3"], TypeError, r"^ranks: expected int ranks"),
        (_Buffer(), _Rebalancer(PLACEMENT), 3, TypeError, r"^ranks: expected a list"),
        (_Buffer(members=(0, 1, 2)), _Rebalancer(PLACEMENT), [3], ValueError, r"^ranks: expected live members .* \[3\]"),
        (_Buffer(dead=[3]), _Rebalancer(PLACEMENT), [3], ValueError, r"^ranks: \[3\] are dead .* shrink_experts"),
        (_Buffer(), _Rebalancer(PLACEMENT), [0, 1, 2, 3], ValueError, r"^ranks: removing \[0, 1, 2, 3\] would leave no rank"),
        (_Buffer(), _Rebalancer(PLACEMENT), [2, 3], ValueError, r"^ranks: removing \[2, 3\] leaves 6 slots .* 8 logical"),
        (_Buffer(), _Rebalancer(PLACEMENT, spare_frames=0), [3], ValueError, r"^ranks: removing \[3\] leaves an expert without a slot"),
        (_Buffer(), _Rebalancer(PLACEMENT, busy=True), [3], RuntimeError, r"^begin_drain: a rebalance of these slots is in progress"),
    ]
    for buffer, rebalancer, ranks, kind, message in cases:
        before = rebalancer.slots.phy2log.copy()
        with pytest.raises(kind, match=message):
            begin_drain(buffer, rebalancer, ranks, 5)
        assert rebalancer.begun == [] and buffer.shrinks == [] and np.array_equal(before, rebalancer.slots.phy2log)
    # A finish before the move committed (or after it aborted), or while chunks are left: no shrink.
    for rebalancer, kind, message in ((_Rebalancer(PLACEMENT), ValueError, r"^ranks: draining \[3\] would leave layer 1 "
                                       r"without experts \[6\]"),
                                      (_Rebalancer(PLACEMENT, busy=True), RuntimeError, r"^finish_drain: 1 chunks")):
        buffer = _Buffer()
        with pytest.raises(kind, match=message):
            finish_drain(buffer, rebalancer, [3])
        assert buffer.shrinks == []
    # The good path: the move is begun with every member taking part (the leaving rank is a source).
    buffer, rebalancer = _Buffer(), _Rebalancer(PLACEMENT)
    assert begin_drain(buffer, rebalancer, [3], 5) == ("chunk",)
    target, step, kwargs = rebalancer.begun[0]
    assert step == 5 and kwargs["live"].tolist() == [True] * R and (target != np.asarray(PLACEMENT)).sum() == 1
    rebalancer.slots.phy2log = target
    assert finish_drain(buffer, rebalancer, [3], timeout_s=9) == "view" and buffer.shrinks == [([3], True)]


def _cores(ranks=(0,)):
    """`BufferCore`s of `ranks` (of R) over one in-process store, each with its own `Membership` (no transport
    but a peer watcher that sees the ranks of `transport.dead` dead)."""
    from mooncake_ep_switch.buffer.core import BufferCore
    from mooncake_ep_switch.buffer.membership.protocol import Membership
    from mooncake_ep_switch.launcher.launch import host_store

    store = host_store("127.0.0.1", 0, 1, timeout_s=30)
    transport = SimpleNamespace(dead=[2], failed_sources=[])
    transport.dead_peers = lambda: list(transport.dead)
    return [BufferCore(r, R, SimpleNamespace(connect_timeout_s=5.0), membership=Membership(store, r, R),
                       transport=transport, members=tuple(range(R))) for r in ranks]


def test_bad_shrinks_and_drains_of_a_buffer_are_refused_by_name_with_nothing_changed():
    from mooncake_ep_switch.buffer.membership import resize_guard
    from mooncake_ep_switch.buffer.membership import shrink as group_shrink
    from mooncake_ep_switch.buffer.membership.removed import removed_ranks
    from mooncake_ep_switch.errors import MembershipError

    core = _cores()[0]
    cases = [  # (ranks, drain, exception, message); rank 2 is seen dead, the others live
        ([R], True, ValueError, r"^ranks: expected ranks of the group in \[0, 4\)"),
        ([], True, ValueError, r"^ranks: expected at least one rank"),
        ([0, 1, 2, 3], True, ValueError, r"^ranks: removing \[0, 1, 2, 3\] would leave no rank"),
        ([2], True, ValueError, r"^ranks: \[2\] are dead .* shrink\(ranks\)"),
        ([3], False, ValueError, r"^ranks: \[3\] are live .* shrink\(ranks, drain=True\)"),
        ([0], False, ValueError, r"^ranks: rank 0 \(this rank\) cannot remove itself as dead"),
        ([3], 1, TypeError, r"^drain: expected a bool, got int"),
    ]
    for ranks, drain, kind, message in cases:
        with pytest.raises(kind, match=message):
            group_shrink.shrink(core, ranks, timeout_s=5, drain=drain)
    core.members = (0, 1, 2)  # rank 3 sealed out: a drain removes members only
    with pytest.raises(ValueError, match=r"^ranks: \[3\] are not members of epoch 0"):
        group_shrink.shrink(core, [3], timeout_s=5, drain=True)
    core.members = tuple(range(R))
    removed = removed_ranks(core.membership)
    assert (core.epoch, core.members, core.drained, removed) == (0, tuple(range(R)), "", {}), removed
    # A drain of rank 1 that rank 1 takes no part in (ranks 0, 2, 3 call it): it aborts on every caller at the
    # vote's deadline, naming rank 1; meanwhile a second shrink of rank 0's Buffer (two resizes at once) is
    # refused at once. Nothing changed anywhere.
    cores = _cores((0, 2, 3))
    cores[0].transport.dead = []
    first = {}
    threads = [threading.Thread(target=lambda c=c: first.update({c.rank: _refused(
        lambda: group_shrink.shrink(c, [1], timeout_s=3, drain=True))})) for c in cores]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 20
        while resize_guard.in_progress(cores[0].membership) != "shrink":
            assert time.monotonic() < deadline, "the first shrink never started"
            time.sleep(0.005)
        with pytest.raises(RuntimeError, match=r"^shrink: another shrink of this Buffer is in progress"):
            group_shrink.shrink(cores[0], [3], timeout_s=3, drain=True)
    finally:
        for thread in threads:
            thread.join(30)
    for rank, (kind, message) in first.items():
        assert kind == "MembershipError" and "aborted on every rank" in message and "nothing changed" in message, first
    assert any("ranks [1] did not vote" in message for _, message in first.values()), first
    for c in cores:
        assert (c.epoch, c.members, c.drained) == (0, tuple(range(R)), ""), c
    assert removed_ranks(cores[0].membership) == {}
    # A drained rank's Buffer refuses by name (what the leaving rank's shrink sets on its commit).
    core.drained, core.members, core.joining = "rank 0 was drained out of the EP group for good (...)", (), True
    with pytest.raises(MembershipError, match=r"^rank 0 was drained out of the EP group"):
        group_shrink.shrink(core, [1], timeout_s=5, drain=True)
    import torch
    with pytest.raises(MembershipError, match=r"^rank 0 was drained out of the EP group"):
        core.check_members(torch.ones(R, dtype=torch.int32))
