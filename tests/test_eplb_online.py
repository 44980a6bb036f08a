"""Online rebalance over shared memory: outputs, traffic, commits at an agreed step, aborts on failure.

R=4 ranks serve two MoE layers on physical experts (3 slots per rank for 8 logical experts: 4
redundant copies) while `OnlineRebalancer` moves them to a placement computed from the loads the
ranks recorded. Every step's output is checked against the single-process reference; the moved
frames are compared bit for bit with the checkpoint weights.
"""
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.test_etcd_ballots import TIMEOUT_US as BALLOT_TIMEOUT_US

R = 4
LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 2, 8, 256, 128, 2, 16
SLOTS_PER_RANK = 3
TIMEOUT_US = harness.FAULT_TIMEOUT_US
DEAD = 3


def _initial_phy2log():
    rows = []
    for rank in range(R):
        rows += [2 * rank, 2 * rank + 1, (2 * rank + 2) % EXPERTS]  # primaries, then one redundant copy
    return np.asarray([rows] * LAYERS, dtype=np.int64)


def _setup(ctx, spare_frames=SLOTS_PER_RANK, transport="shm", timeout_us=TIMEOUT_US, load=True):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, ctx.num_ranks, R * SLOTS_PER_RANK)
    buffer = Buffer(ctx.group, size, transport=transport)
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=100 + layer) for layer in range(LAYERS)]
    slots = ExpertSlots(buffer, SlotShape(LAYERS, EXPERTS, SLOTS_PER_RANK, HIDDEN, INTER), _initial_phy2log(),
                        spare_frames=spare_frames)
    if load:
        slots.load(weights)
    rebalancer = OnlineRebalancer(slots, timeout_us=timeout_us, frames_per_step=1)
    return buffer, weights, slots, rebalancer


def _inputs(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    # A skewed router input: a shared direction makes a few experts hot.
    bias = torch.randn((1, HIDDEN), generator=torch.Generator().manual_seed(7)) * 2.0
    return (torch.randn((TOKENS, HIDDEN), generator=generator) + bias).to(torch.bfloat16)


def _forward(ctx, buffer, weights, slots, active, x, skip_dead=(), timeout_us=TIMEOUT_US):
    """Both layers on physical experts; returns (output, reference, per-layer recv counts)."""
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    dispatch_map = build_dispatch_map(slots.phy2log, R, R)
    out, reference, counts = x, x, []
    for layer in range(LAYERS):
        row = dispatch_map[ctx.rank, layer]
        out, count = physical_ep_forward(buffer, out, weights[layer].router, slots, layer, TOP_K, TOKENS, active, row,
                                         timeout_us=timeout_us)
        counts.append(count)
        skip = {e for e in range(EXPERTS) if int(row[e]) // SLOTS_PER_RANK in skip_dead}
        reference = reference_forward(reference, weights[layer], TOP_K, skip_experts=skip)
    return out, reference, counts


def _close(out, ref):
    """Equal up to float32 summation order inside the expert GEMMs (batch shapes differ from the
    reference's): calc_diff as DeepEP's tests, far below any routing or weight error."""
    x, y = out.double() + 1, ref.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum()) < 1e-6


def _frames_match_checkpoint(slots, weights):
    for layer in range(LAYERS):
        for local_slot, expert in enumerate(slots.local_experts(layer)):
            gate_up, down = slots.expert(layer, local_slot)
            if not (torch.equal(gate_up, weights[layer].gate_up[expert]) and torch.equal(down, weights[layer].down[expert])):
                return False
    return True


def _global_counts(ctx, counts):
    """[L, R * slots_per_rank] tokens per physical slot, all-gathered (every rank alive)."""
    mine = torch.stack(counts).to(torch.int64)  # [L, slots_per_rank]
    gathered = [torch.empty_like(mine) for _ in range(ctx.num_ranks)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return torch.cat(gathered, dim=1).numpy()


def _rank_loads(slot_counts):
    return slot_counts.reshape(LAYERS, R, SLOTS_PER_RANK).sum(axis=2)


def rank_rebalance(ctx):
    from mooncake_ep_switch.eplb import place_experts
    from mooncake_ep_switch.eplb.online import COMMITTED

    buffer, weights, slots, rebalancer = _setup(ctx)
    active = buffer.active_mask()
    try:
        # Step 0: serve on the initial placement and record the logical loads.
        x0 = _inputs(ctx.rank, 0)
        before, reference, counts = _forward(ctx, buffer, weights, slots, active, x0)
        exact_before = _close(before, reference)
        slot_counts = _global_counts(ctx, counts)
        logical = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
        for layer in range(LAYERS):
            np.add.at(logical[layer], slots.phy2log[layer], slot_counts[layer])
        old = slots.phy2log.copy()
        target = place_experts(torch.from_numpy(logical).float(), R * SLOTS_PER_RANK, 1, 1, R,
                                   previous_phy2log=torch.from_numpy(old)).phy2log
        chunks = rebalancer.begin(target, commit_step=3)
        reports, step_ok = [], []
        for step in range(1, 6):  # staging runs in steps 1-2, chunks commit at steps 3 and 4
            reports += rebalancer.step(step, active)
            out, ref, _ = _forward(ctx, buffer, weights, slots, active, _inputs(ctx.rank, step))
            step_ok.append(_close(out, ref))
        after, reference_after, counts_after = _forward(ctx, buffer, weights, slots, active, x0)
        slot_counts_after = _global_counts(ctx, counts_after)
        return {
            "changed_slots": int((old != target.numpy()).sum()),
            "chunks": [(c.epoch, c.layers, c.commit_step) for c in chunks],
            "reports": [(r.epoch, r.outcome, r.moved_slots, r.moved_bytes, r.remote_bytes, r.commit_step) for r in reports],
            "placement_is_target": bool(np.array_equal(slots.phy2log, target.numpy())),
            "frames_ok": _frames_match_checkpoint(slots, weights),
            "exact_before": exact_before, "steps_exact": step_ok,
            # Not bit for bit: after the rebalance a logical expert's tokens reach other replicas, so its
            # fp32 GEMMs run on batches of other sizes, which some CPUs' kernels sum in another order.
            "same_output": _close(before, after), "exact_after": _close(after, reference_after),
            "max_before": _rank_loads(slot_counts).max(axis=1).tolist(),
            "max_after": _rank_loads(slot_counts_after).max(axis=1).tolist(),
            "slot_counts_after": slot_counts_after.tolist(), "target": target.tolist(),
            "committed": all(r.outcome == COMMITTED for r in reports), "free_frames": len(slots.free_frames),
        }
    finally:
        slots.destroy()
        buffer.destroy()


def test_online_rebalance_keeps_outputs_and_spreads_traffic():
    results = harness.run(R, rank_rebalance)
    first = results[0]
    assert first["changed_slots"] > 0, "the loads should call for a different placement"
    for rank, result in enumerate(results):
        assert result["committed"], result["reports"]
        assert result["placement_is_target"] and result["frames_ok"], f"rank {rank}"
        assert result["exact_before"] and result["exact_after"] and all(result["steps_exact"]), f"rank {rank}"
        assert result["same_output"], f"rank {rank}: output changed across the rebalance (beyond GEMM order)"
        assert result["free_frames"] == SLOTS_PER_RANK, "frames leaked"
        assert result["chunks"] == first["chunks"], "ranks planned different chunks"
    # Every changed slot was staged exactly once, by its owner, and some weights crossed ranks.
    assert sum(r[2] for res in results for r in res["reports"]) == first["changed_slots"]
    assert sum(r[4] for res in results for r in res["reports"]) > 0
    # Commits happened at the agreed steps on every rank.
    for result in results:
        assert [(r[0], r[5]) for r in result["reports"]] == [(c[0], c[2]) for c in first["chunks"]]
    # Traffic spreads: the busiest rank gets fewer tokens, and every copy of a replicated expert serves.
    assert sum(first["max_after"]) < sum(first["max_before"]), (first["max_before"], first["max_after"])
    counts = np.asarray(first["slot_counts_after"])
    target = np.asarray(first["target"])
    for layer in range(LAYERS):
        totals = np.bincount(target[layer], weights=counts[layer], minlength=EXPERTS)
        hot = int(np.argmax(totals))
        copies = np.nonzero(target[layer] == hot)[0]
        assert copies.size >= 2, f"layer {layer}: the hottest expert {hot} should be replicated"
        assert (counts[layer][copies] > 0).all(), f"layer {layer}: copies {copies} of expert {hot} idle"


def rank_kill_mid_rebalance(ctx, use_mask):
    from mooncake_ep_switch.eplb.online import ABORTED

    buffer, weights, slots, rebalancer = _setup(ctx)
    active = buffer.active_mask()
    dist.barrier(group=ctx.group)
    old = slots.phy2log.copy()
    target = old.copy()
    for layer in range(LAYERS):  # every rank's redundant copy moves to the next expert
        for rank in range(R):
            target[layer, rank * SLOTS_PER_RANK + 2] = (2 * rank + 3) % EXPERTS
    rebalancer.begin(target, commit_step=3)
    reports, exact = [], []
    for step in range(1, 5):
        if step == 2 and ctx.rank == DEAD:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-rebalance: staged, never votes
        reports += rebalancer.step(step, active if use_mask else None)
        dead = () if step < 2 else (DEAD,)
        out, ref, _ = _forward(ctx, buffer, weights, slots, active, _inputs(ctx.rank, step), skip_dead=dead)
        exact.append(_close(out, ref))
    result = {
        "reports": [(r.outcome, r.reason, r.commit_step) for r in reports],
        "stall_ms": max((r.stall_ms for r in reports), default=0.0),
        "aborted": bool(reports) and all(r.outcome == ABORTED for r in reports),
        "old_placement": bool(np.array_equal(slots.phy2log, old)),
        "frames_ok": _frames_match_checkpoint(slots, weights),
        "free_frames": len(slots.free_frames), "exact": exact, "in_progress": rebalancer.in_progress,
        "active": active.tolist(),
    }
    slots.destroy()
    buffer.destroy()
    return result


@pytest.mark.parametrize("use_mask", [True, False], ids=["mask-knows", "vote-timeout"])
def test_rank_killed_mid_rebalance_keeps_old_placement(use_mask):
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(rank_kill_mid_rebalance, use_mask, timeout_s=90, failure_grace_s=60)
    assert not outcomes[DEAD].ok
    for outcome in outcomes:
        if outcome.rank == DEAD:
            continue
        assert outcome.ok, outcome.error
        result = outcome.value
        assert result["aborted"], result["reports"]
        assert result["old_placement"] and result["frames_ok"], f"rank {outcome.rank}"
        assert result["free_frames"] == SLOTS_PER_RANK and not result["in_progress"]
        assert all(result["exact"]), f"rank {outcome.rank}: outputs differ from the reference without rank {DEAD}"
        assert result["active"][DEAD] == 0
        reason = result["reports"][0][1]
        # Without the mask the vote wait ends as soon as the peer watcher saw the process end, not
        # at the vote's deadline (this rank saw it, or a peer that did decided ABORT first).
        assert ("inactive" in reason) if use_mask else ("process is gone" in reason
                                                        or "before a peer decided it" in reason), reason
        assert result["stall_ms"] < TIMEOUT_US / 1e3 / 2, result["stall_ms"]


def rank_fault_at_commit(ctx, faulty, how, transport="shm", timeout_us=TIMEOUT_US, corrupt_table=None,
                         commit_timeout_us=None):
    """Every redundant copy moves (one chunk, epoch 1, commit step 3); rank `faulty` freezes
    (SIGSTOP, resumed by a peer once that peer has decided) or dies at the fault point set in
    MEP_FAULT_POINT (none: `how="none"`). With `corrupt_table=(rank, layer, local_slot, value)` that
    rank first publishes a bad frame id in its frame table (bad peer data). `commit_timeout_us`: the
    rebalancer's deadline per commit store step (None: `timeout_us`, as dispatch/combine). Returns the
    placement and whether every step's output matched the reference."""
    buffer, weights, slots, rebalancer = _setup(  # _setup's timeout_us is the rebalancer's
        ctx, transport=transport, timeout_us=timeout_us if commit_timeout_us is None else commit_timeout_us)
    if corrupt_table is not None and ctx.rank == corrupt_table[0]:
        _, layer, local_slot, value = corrupt_table
        at = slots.table_offset + 4 * (layer * SLOTS_PER_RANK + local_slot)
        slots.region.local[at:at + 4].view(torch.int32)[0] = value  # serving here reads frame_of, not the table
    active = buffer.active_mask()
    pids = [None] * ctx.num_ranks
    dist.all_gather_object(pids, os.getpid(), group=ctx.group)
    old = slots.phy2log.copy()
    target = old.copy()
    for layer in range(LAYERS):
        for rank in range(R):
            target[layer, rank * SLOTS_PER_RANK + 2] = (2 * rank + 3) % EXPERTS
    chunks = rebalancer.begin(target, commit_step=3)
    assert [c.epoch for c in chunks] == [1]
    reports, exact = [], []
    for step in range(1, 7):
        reports += rebalancer.step(step, None)
        if step == 3 and how == "stop":
            if ctx.rank == (faulty + 1) % R:  # decided: let the frozen rank go on (it may not have voted)
                harness.wait_stopped(pids[faulty], 60.0)
                os.kill(pids[faulty], signal.SIGCONT)
            dist.barrier(group=ctx.group)  # the frozen rank catches up before anyone serves again
        dead = (faulty,) if how == "kill" and step >= 3 else ()
        out, ref, _ = _forward(ctx, buffer, weights, slots, active, _inputs(ctx.rank, step), skip_dead=dead,
                               timeout_us=timeout_us)
        exact.append(_close(out, ref))
    result = {
        "reports": [(r.epoch, r.outcome, r.reason, r.commit_step) for r in reports],
        "stall_ms": [r.stall_ms for r in reports], "remote_bytes": sum(r.remote_bytes for r in reports),
        "te_bytes": sum(r.te_bytes for r in reports), "te_reads": slots.te_reads, "transport": buffer.transport,
        "phy2log": slots.phy2log.tolist(), "old": old.tolist(), "target": target.tolist(),
        "frames_ok": _frames_match_checkpoint(slots, weights), "free_frames": len(slots.free_frames),
        "exact": exact, "in_progress": rebalancer.in_progress,
    }
    slots.destroy()
    buffer.destroy()
    return result


@pytest.mark.parametrize("faulty, point, how, outcome, store", [
    (3, "eplb_before_vote", "stop", "aborted", "tcp"),   # frozen past the deadline before voting: everyone aborts
    (3, "eplb_after_vote", "stop", "committed", "tcp"),  # frozen after voting GO: everyone commits, it too on waking
    (0, "eplb_before_vote", "stop", "aborted", "tcp"),   # the rank holding the decision word is the slow one
    (0, "eplb_before_vote", "kill", "aborted", "tcp"),   # the decision word's holder dies before voting
    (0, "eplb_after_vote", "kill", "committed", "tcp"),  # ... or after voting GO: decided in its still-mapped memory
    (2, "eplb_after_vote", "kill", "committed", "etcd"),  # the votes and decision on the session's etcd cluster
])
def test_slow_or_dead_rank_at_commit_step_all_ranks_agree(faulty, point, how, outcome, store, request):
    env = {"MEP_FAULT_POINT": f"{point}:{faulty}:1:{how}"}
    with harness.fresh_cluster(R, env=env, store=harness.etcd_store(request, store)) as cluster:
        # On etcd each commit store step (vote, vote wait, decision) is a round trip to the cluster: it gets
        # test_etcd_ballots' deadline. 2.5 s was once missed by a decision read (load ~12 on 2 cores, 2 CPU
        # hogs, no member stopped). Nobody waits it out: every live rank has voted when rank 2 dies.
        commit_timeout_us = BALLOT_TIMEOUT_US if store == "etcd" else None
        outcomes = cluster.run(rank_fault_at_commit, faulty, how, timeout_s=120, failure_grace_s=60,
                               commit_timeout_us=commit_timeout_us)
        if store == "etcd":  # the votes went there (the ranks have no other store)
            assert type(cluster.store).__name__ == "EtcdStore" and cluster.store.num_keys() > 0
    if how == "kill":
        assert not outcomes[faulty].ok and outcomes[faulty].exitcode == -signal.SIGKILL, outcomes[faulty]
    alive = [o for o in outcomes if how == "stop" or o.rank != faulty]
    for o in alive:
        assert o.ok, o.error
    placements = {str(o.value["phy2log"]) for o in alive}
    assert len(placements) == 1, "ranks ended on different placements"
    first = alive[0].value
    expected = first["target"] if outcome == "committed" else first["old"]
    for o in alive:
        result = o.value
        assert [(r[0], r[1], r[3]) for r in result["reports"]] == [(1, outcome, 3)], (o.rank, result["reports"])
        assert result["phy2log"] == expected, f"rank {o.rank}"
        assert result["frames_ok"] and result["free_frames"] == SLOTS_PER_RANK and not result["in_progress"]
        assert all(result["exact"]), f"rank {o.rank}: outputs differ from the reference {result['exact']}"


def rank_second_rebalancer(ctx):
    """A second OnlineRebalancer of the same slots (another layer group's, or a rebuilt one, with
    the default epoch) continues the slots' chunk epochs: it never reads the first one's votes or
    decision as its own, so a rank voting ABORT aborts the chunk on every rank."""
    from mooncake_ep_switch.eplb.online import OnlineRebalancer

    buffer, weights, slots, first = _setup(ctx)
    old = slots.phy2log.copy()
    target = old.copy()
    for layer in range(LAYERS):
        for rank in range(R):
            target[layer, rank * SLOTS_PER_RANK + 2] = (2 * rank + 3) % EXPERTS
    first.begin(target, commit_step=2)
    outcomes = [r.outcome for step in range(1, 4) for r in first.step(step, None)]
    assert outcomes == ["committed"], outcomes
    moved = slots.phy2log.copy()
    dist.barrier(group=ctx.group)
    second = OnlineRebalancer(slots, timeout_us=TIMEOUT_US, frames_per_step=1)  # default epoch=0
    assert second.epoch == first.epoch == 1
    second.begin(old, commit_step=5)
    with pytest.raises(RuntimeError, match="another OnlineRebalancer"):  # one rebalance at a time per slots
        OnlineRebalancer(slots, timeout_us=TIMEOUT_US).begin(old, commit_step=5)
    reports = []
    for step in range(4, 8):
        active = torch.ones(R, dtype=torch.int32)
        if ctx.rank == 3:
            active[2] = 0  # rank 3 votes ABORT: nobody may commit
        reports += [(r.epoch, r.outcome) for r in second.step(step, active)]
    assert reports == [(2, "aborted")], reports
    assert np.array_equal(slots.phy2log, moved), "a rank left the placement every rank agreed on"
    dist.barrier(group=ctx.group)
    phy = slots.phy2log.copy()
    slots.destroy()
    buffer.destroy()
    return phy.tolist()


def test_second_rebalancer_of_the_same_slots_continues_their_epochs():
    results = harness.run(R, rank_second_rebalancer)
    assert all(result == results[0] for result in results)


def _moved_copies(old, layers):
    """`old` with every rank's redundant copy (slot 2) of `layers` moved to the next expert."""
    target = old.copy()
    for layer in layers:
        for rank in range(R):
            target[layer, rank * SLOTS_PER_RANK + 2] = (2 * rank + 3) % EXPERTS
    return target


def _run_steps(rebalancer, steps):
    return [(r.epoch, r.outcome, r.reason, r.commit_step) for step in steps for r in rebalancer.step(step, None)]


def rank_mismatched_begin(ctx, odd_rank):
    """Issue 43: rank `odd_rank` calls begin() once with another target (one chunk instead of two:
    one spare frame makes every layer its own chunk, and the first chunk's layer-0 rows are the
    same on every rank). Every rank must refuse it, naming new_phy2log, before anything commits;
    the next begin() with the same arguments everywhere then commits."""
    buffer, weights, slots, rebalancer = _setup(ctx, spare_frames=1)
    old = slots.phy2log.copy()
    target = _moved_copies(old, range(LAYERS))
    mine = _moved_copies(old, [0]) if ctx.rank == odd_rank else target
    dist.barrier(group=ctx.group)
    planned = [c.epoch for c in rebalancer.begin(mine, commit_step=3)]
    first = _run_steps(rebalancer, range(1, 6))
    first_placement_old = bool(np.array_equal(slots.phy2log, old))
    dist.barrier(group=ctx.group)  # serving steps are collective: nobody begins while a peer still votes
    again = [c.epoch for c in rebalancer.begin(target, commit_step=8)]
    second = _run_steps(rebalancer, range(6, 11))
    result = {"planned": planned, "first": first, "first_placement_old": first_placement_old, "again": again,
              "second": second, "placement_is_target": bool(np.array_equal(slots.phy2log, target)),
              "frames_ok": _frames_match_checkpoint(slots, weights), "free_frames": len(slots.free_frames),
              "in_progress": rebalancer.in_progress}
    slots.destroy()
    buffer.destroy()
    return result


def test_begin_with_different_targets_is_refused_by_name_and_the_next_rebalance_commits():
    odd = 3
    results = harness.run(R, rank_mismatched_begin, odd)
    assert results[odd]["planned"] == [1] and results[0]["planned"] == [1, 2]  # the chunk counts differ
    for rank, result in enumerate(results):
        first = result["first"]
        assert first and all(outcome == "aborted" for _, outcome, _, _ in first), (rank, first)
        reason = first[0][2]
        assert "plans differ" in reason and "new_phy2log" in reason, (rank, reason)
        assert first[0][3] == 3 and result["first_placement_old"], (rank, first)
        # Numbered alike again (from the largest epoch used, 2) and committed at the agreed steps.
        assert result["again"] == [3, 4], (rank, result["again"])
        assert [(e, o, s) for e, o, _, s in result["second"]] == [(3, "committed", 8), (4, "committed", 9)], \
            (rank, result["second"])
        assert result["placement_is_target"] and result["frames_ok"], f"rank {rank}"
        assert result["free_frames"] == 1 and not result["in_progress"], f"rank {rank}"


LOADER, LATE = 0, 1  # the rank whose move reads a copy only LATE holds; the rank that loads late or never


def rank_holder_loads_late(ctx, marker, late_load):
    """Loading is not collective: rank LOADER begins a rebalance whose move reads expert 3 (held by rank
    LATE only) while LATE has not loaded its slots (it waits for `marker`, written once LOADER's pre-commit
    step ran; then loads, or never with `late_load` False). Per rank: the reports, whether the placement is
    the target, and whether its frames hold the checkpoint's weights (None on a rank that never loaded)."""
    import time

    buffer, weights, slots, rebalancer = _setup(ctx, load=ctx.rank != LATE)
    target = slots.phy2log.copy()
    target[:, LOADER * SLOTS_PER_RANK + 2] = 3  # LOADER's redundant copy of expert 2 -> expert 3 (LATE's only)
    if ctx.rank == LATE:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "rank LOADER never ran its pre-commit step"
            time.sleep(0.005)
        if late_load:
            slots.load(weights)
    rebalancer.begin(target, commit_step=2)
    reports = rebalancer.step(1)  # LOADER: its move's holder has not loaded: nothing is read
    if ctx.rank == LOADER:
        open(marker, "w").close()
    reports += rebalancer.step(2)
    result = {"reports": [(r.epoch, r.outcome, r.reason) for r in reports],
              "placement_is_target": bool(np.array_equal(slots.phy2log, target)),
              "frames_ok": _frames_match_checkpoint(slots, weights) if ctx.rank != LATE or late_load else None,
              "free_frames": len(slots.free_frames)}
    dist.barrier(group=ctx.group)  # nobody unmaps its slots while a peer may still read them
    slots.destroy()
    buffer.destroy()
    return result


@pytest.mark.parametrize("late_load", [True, False], ids=["loads-after-the-first-step", "never-loads"])
def test_a_holder_that_has_not_loaded_its_slots_is_never_read(tmp_path, late_load):
    """A rank's staging never copies from a holder whose frames hold no weights yet: on the old code rank
    LOADER copied LATE's zeroed frame and committed it (silently wrong weights; seen in CI as
    test_etcd_ballots' frames check). Now the move waits: it stages at the commit step once LATE loaded
    and commits bit-exact, or, LATE never loading, every rank aborts at the deadline, LOADER naming LATE."""
    results = harness.run(R, rank_holder_loads_late, str(tmp_path / "staged"), late_load, timeout_s=90)
    for rank, result in enumerate(results):
        if late_load:
            assert result["reports"] == [(1, "committed", "")], (rank, result)
            assert result["placement_is_target"] and result["frames_ok"], (rank, result)
        else:
            assert [r[:2] for r in result["reports"]] == [(1, "aborted")], (rank, result)
            assert not result["placement_is_target"], (rank, result)
            assert result["frames_ok"] is (None if rank == LATE else True), (rank, result)
        assert result["free_frames"] == SLOTS_PER_RANK, (rank, result)  # the staged frame back on abort or freed
    if not late_load:
        reason = results[LOADER]["reports"][0][2]
        assert "staging failed on rank 0" in reason and "rank 1's expert slots are not loaded yet" in reason, reason


class _PrefaultAfter:
    """`slots._native` on rank LATE: its constructor's prefault of the peers' regions (after they were mapped,
    before the rest of the constructor ran) waits until `marker` exists."""

    def __init__(self, native, marker):
        self._native, self._marker = native, marker

    def prefault(self, *args):
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(self._marker):
            assert time.monotonic() < deadline, "rank LOADER never read LATE's table"
            time.sleep(0.005)
        return self._native.prefault(*args)


def rank_table_read_while_the_holder_is_built(ctx, marker):
    """Rank LATE stalls in its ExpertSlots constructor once the peers mapped its region; rank LOADER, built,
    reads LATE's frame table then (what a rebalance's staging would read). Returns what it read on LOADER."""
    from mooncake_ep_switch import SlotsNotLoaded
    from mooncake_ep_switch.eplb import slots as slots_module

    if ctx.rank == LATE:
        slots_module._native = _PrefaultAfter(slots_module._native, marker)
    try:
        buffer, weights, slots, _ = _setup(ctx)
    finally:
        slots_module._native = getattr(slots_module._native, "_native", slots_module._native)
    read = None
    if ctx.rank == LOADER:
        try:
            read = slots.peer_frame(LATE, 0, 2)
        except SlotsNotLoaded as error:
            read = f"not loaded: rank {error.rank}"
        open(marker, "w").close()
    dist.barrier(group=ctx.group)
    after = slots.peer_frame(LATE, 0, 2) if ctx.rank == LOADER else None  # LATE loaded: its frame now
    slots.destroy()
    buffer.destroy()
    return read, after


def test_a_holders_table_reads_not_loaded_from_the_moment_peers_map_it(tmp_path):
    """The table says "not loaded" before the region is shared: on the first version of the fix it was published
    at the end of the constructor, so a peer that read it in between (LATE slow in its prefault) read a zeroed
    table, frame 0, and would have staged its zeros."""
    results = harness.run(R, rank_table_read_while_the_holder_is_built, str(tmp_path / "read"), timeout_s=90)
    # Once LATE loaded: the frame of its layer-0 slot 2 (every slot in a frame, layer 0's are frames 0-2).
    assert results[LOADER] == (f"not loaded: rank {LATE}", 2), results[LOADER]


def rank_diverged_epochs(ctx, behind, ahead):
    """Chunk epochs diverged before a rebalance (a rank's count set back or forward, as a replacement
    given a wrong `epoch` would have): a rank behind numbers like its peers at once; a rank ahead
    makes one rebalance abort, naming the epochs, and the next one commits everywhere."""
    buffer, weights, slots, rebalancer = _setup(ctx)
    old = slots.phy2log.copy()
    target = _moved_copies(old, range(LAYERS))
    rebalancer.begin(target, commit_step=2)
    first = _run_steps(rebalancer, range(1, 3))
    dist.barrier(group=ctx.group)
    if ctx.rank == behind:
        slots.chunk_epoch = 0
    result = {"first": first}
    if ahead is not None:
        if ctx.rank == ahead:
            slots.chunk_epoch += 5
        result["ahead"] = [c.epoch for c in rebalancer.begin(old, commit_step=5)]
        dist.barrier(group=ctx.group)  # every rank planned before any votes (else the later ones number as it)
        result["ahead_reports"] = _run_steps(rebalancer, range(3, 7))
        result["ahead_placement"] = bool(np.array_equal(slots.phy2log, target))
        dist.barrier(group=ctx.group)
    result["last"] = [c.epoch for c in rebalancer.begin(old, commit_step=9)]
    result["last_reports"] = _run_steps(rebalancer, range(7, 11))
    result.update(placement_is_old=bool(np.array_equal(slots.phy2log, old)),
                  frames_ok=_frames_match_checkpoint(slots, weights), free_frames=len(slots.free_frames))
    slots.destroy()
    buffer.destroy()
    return result


@pytest.mark.parametrize("ahead", [None, 1], ids=["behind", "behind-and-ahead"])
def test_diverged_chunk_epochs_are_resynchronised(ahead):
    behind = 2
    results = harness.run(R, rank_diverged_epochs, behind, ahead)
    last_epoch = 2 if ahead is None else 8
    for rank, result in enumerate(results):
        assert [(e, o) for e, o, _, _ in result["first"]] == [(1, "committed")], (rank, result["first"])
        if ahead is not None:
            # The rank ahead numbered 7, its peers 2: aborted everywhere, the placement kept.
            assert result["ahead"] == ([7] if rank == ahead else [2]), (rank, result["ahead"])
            reports = result["ahead_reports"]
            assert [(o, s) for _, o, _, s in reports] == [("aborted", 5)], (rank, reports)
            assert "chunk epochs differ" in reports[0][2], (rank, reports[0][2])
            assert result["ahead_placement"], f"rank {rank}"
        assert result["last"] == [last_epoch], (rank, result["last"])
        assert [(e, o, s) for e, o, _, s in result["last_reports"]] == [(last_epoch, "committed", 9)], \
            (rank, result["last_reports"])
        assert result["placement_is_old"] and result["frames_ok"], f"rank {rank}"
        assert result["free_frames"] == SLOTS_PER_RANK, f"rank {rank}"
