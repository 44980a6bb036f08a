"""A replacement rank joins mid-serve; then a TP<->EP switch and an online EPLB commit work, exactly.

R=3 ranks serve two MoE layers on physical experts (`ExpertMemory`: unified weights, TP
all-reduce, expert slots with one redundant copy per rank, online rebalancer) over shared memory.
Before the failure they rebalance once and switch EP -> TP -> EP, so the switch sequence, the
rebalance epochs and the placement a replacement must take over are not the initial ones. Rank 0
is SIGKILLed during an EP step; the survivors serve that step
without it. Its replacement is admitted with public calls only: `elastic.join()`, `Buffer`,
`update_ep_member()` on every rank, then one `ExpertMemory(...)` on the replacement, whose weights
are copied from the members' copies where they exist (`ExpertMemory` on a replacement), the
caller's checkpoint loader read only for slots no member holds: with placement "covered" the
members hold a copy of every slot of rank 0 and the loader is never called, with "partial" it is
called once and provides exactly the one slot per layer nobody else has. No region is touched by hand. Then every rank switches EP -> TP
(checked: the TP views equal the TP shards of the checkpoint bit for bit, the TP forward equals the
single-process reference), back to EP, and rebalances online to a new placement (committed on
every rank at the agreed step, frames equal to the checkpoint bit for bit, every step's output
equal to the reference).
"""
import os
import signal

import numpy as np
import pytest
import torch

from tests import harness

R = 3
LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, TOKENS, REDUNDANT = 2, 6, 128, 96, 2, 8, 1
LOCAL = EXPERTS // R
PER_RANK = LOCAL + REDUNDANT
TIMEOUT_US = harness.FAULT_TIMEOUT_US
DEAD = 0


def _load():
    """The checkpoint loader: the full weights of every layer (seeded, the same on every call)."""
    from mooncake_ep_switch.reference.moe_block import random_weights

    return [random_weights(EXPERTS, HIDDEN, INTER, seed=300 + layer) for layer in range(LAYERS)]


def _placement(shift):
    """[L, R * PER_RANK] phy2log: primaries, then a copy of rank (r + shift)'s first expert."""
    rows = []
    for rank in range(R):
        rows += [rank * LOCAL + j for j in range(LOCAL)] + [((rank + shift) % R) * LOCAL]
    return np.asarray([rows] * LAYERS, dtype=np.int64)


# Rank 0's slots [0, 1 | 2]: rank 1 holds copies of 2 (primary) and 0, rank 2 of 1: all from peers.
COVERED = np.asarray([[0, 1, 2, 2, 3, 0, 4, 5, 1]] * LAYERS, dtype=np.int64)
BEFORE_FAILURE = {"covered": COVERED, "partial": _placement(2)}
# What the replacement of rank 0 copies from peers and loads, (from_peers, from_loader), per case:
# partial: rank 0 holds [0, 1 | 4]; 0 is a frame on rank 1, 4 rank 2's primary, 1 only on rank 0.
RESTORED = {"covered": (LAYERS * PER_RANK, 0, False), "partial": (LAYERS * 2, LAYERS * 1, True)}


def _close(out, ref):
    """calc_diff as DeepEP's tests (float32 summation order inside the GEMMs differs)."""
    x, y = out.double() + 1, ref.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum()) < 1e-6


def slots_exact(slots, weights) -> bool:
    """Whether every physical expert (slot) of `slots` holds its logical expert of `weights`, bit for bit
    (device slots are compared on the host; tests/test_switch_device.py uses it too)."""
    return all(torch.equal(slots.expert(layer, slot)[0].cpu(), weights[layer].gate_up[expert])
               and torch.equal(slots.expert(layer, slot)[1].cpu(), weights[layer].down[expert])
               for layer in range(slots.shape.num_layers) for slot, expert in enumerate(slots.local_experts(layer)))


def _counted_load():
    """The loader a replacement gets: counts its calls."""
    harness.RANK_STATE["loads"] = harness.RANK_STATE.get("loads", 0) + 1
    return _load()


def _memory(buffer, loader=_load):
    from mooncake_ep_switch.expert_memory import ExpertMemory
    from mooncake_ep_switch.switch import WeightShape

    return ExpertMemory(buffer, WeightShape(EXPERTS, HIDDEN, INTER), loader, layout="ep",
                        max_tp_tokens=R * TOKENS, phy2log=_placement(1), redundant_per_rank=REDUNDANT,
                        timeout_us=TIMEOUT_US)


def rank_setup(ctx):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join

    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R, R * PER_RANK)
    replacement = ctx.group is None
    buffer = Buffer(join(ctx.store, ctx.rank, R) if replacement else ctx.group, size, transport="shm")
    harness.RANK_STATE.update(buffer=buffer, weights=_load(), active=buffer.active_mask())
    if not replacement:  # a replacement builds its memory once admitted (rank_readmit)
        harness.RANK_STATE["memory"] = _memory(buffer)
    return True


def _ep_step(ctx, step, dead=()):
    """One EP step on physical experts (the rebalancer advanced first); True if equal to the reference."""
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    state = harness.RANK_STATE
    memory, active = state["memory"], state["active"]
    reports = memory.rebalancer.step(step, active)
    x = torch.randn((TOKENS, HIDDEN), generator=torch.Generator().manual_seed(97 * step + ctx.rank)).to(torch.bfloat16)
    out, reference = x, x
    for layer, weights in enumerate(state["weights"]):
        row = memory.dispatch_row(layer)
        out, _ = physical_ep_forward(state["buffer"], out, weights.router, memory.slots, layer, TOP_K, TOKENS, active,
                                     row, timeout_us=TIMEOUT_US)
        skip = {e for e in range(EXPERTS) if int(row[e]) // PER_RANK in dead}
        reference = reference_forward(reference, weights, TOP_K, skip_experts=skip)
    return _close(out, reference), [(r.epoch, r.outcome, r.commit_step) for r in reports]


def _tp_step(step):
    """One TP step (the same tokens on every rank); True if equal to the single-process reference."""
    from mooncake_ep_switch.reference.moe_block import reference_forward, tp_forward

    state = harness.RANK_STATE
    memory = state["memory"]
    x = torch.randn((R * TOKENS, HIDDEN), generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    out, reference = x, x
    for layer, weights in enumerate(state["weights"]):
        gate_up, down = memory.unified.view(layer, "tp")
        out = tp_forward(memory.all_reduce, out, weights.router, gate_up, down, TOP_K, state["active"],
                         timeout_us=TIMEOUT_US)
        reference = reference_forward(reference, weights, TOP_K)
    return _close(out, reference)


def _switch(target):
    report = harness.RANK_STATE["buffer"].switch_layout(target, weights=harness.RANK_STATE["memory"].unified,
                                                        timeout_us=TIMEOUT_US)
    return report.outcome


def _rebalance(ctx, target, first_step):
    """Rebalance online to `target` while serving EP steps; (outcomes, steps exact, frames exact)."""
    memory = harness.RANK_STATE["memory"]
    memory.rebalancer.begin(target, commit_step=first_step + 2)
    reports, exact = [], []
    for step in range(first_step, first_step + 4):
        ok, done = _ep_step(ctx, step)
        exact.append(ok)
        reports += done
    frames = slots_exact(memory.slots, harness.RANK_STATE["weights"])
    return {"reports": reports, "exact": exact, "frames": frames,
            "placement": bool(np.array_equal(memory.slots.phy2log, target))}


def rank_before_failure(ctx, case):
    """Serve, rebalance once (to BEFORE_FAILURE[case]), switch EP -> TP -> EP; then rank DEAD dies during an EP step."""
    first, _ = _ep_step(ctx, 0)
    rebalanced = _rebalance(ctx, BEFORE_FAILURE[case], 1)
    switched = [_switch("tp"), _tp_step(5), _switch("ep")]
    if ctx.rank == DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    during, _ = _ep_step(ctx, 6, dead=(DEAD,))
    return {"first": first, "rebalanced": rebalanced, "switched": switched, "during": during,
            "active": harness.RANK_STATE["active"].tolist()}


def rank_readmit(ctx):
    """Survivors: update_ep_member(). Replacement: update_ep_member(), then its memory in one call."""
    import time

    buffer = harness.RANK_STATE["buffer"]
    deadline = time.monotonic() + 60
    while ctx.rank != DEAD and DEAD not in buffer.pending_joiners():
        assert time.monotonic() < deadline, "the replacement never asked to join"
        time.sleep(0.01)
    view = buffer.update_ep_member(timeout_s=60)
    restored = None
    if ctx.rank == DEAD:
        memory = harness.RANK_STATE["memory"] = _memory(buffer, _counted_load)
        restored = tuple(memory.restored) + (harness.RANK_STATE.get("loads", 0),)
    harness.RANK_STATE["active"] = buffer.active_mask()
    return {"view": list(view.ranks), "restored": restored}


def rank_after_readmission(ctx):
    """Switch EP -> TP (views and forward exact), back to EP, then rebalance online to a new placement."""
    from mooncake_ep_switch.reference.moe_block import shard_tp

    memory = harness.RANK_STATE["memory"]
    taken_over = {"seq": memory.unified.seq, "epoch": memory.rebalancer.epoch,
                  "placement": memory.slots.phy2log.tolist()}
    to_tp = _switch("tp")
    views = all(torch.equal(memory.unified.view(layer, "tp")[0], shard_tp(w.gate_up, w.down, ctx.rank, R)[0])
                and torch.equal(memory.unified.view(layer, "tp")[1], shard_tp(w.gate_up, w.down, ctx.rank, R)[1])
                for layer, w in enumerate(harness.RANK_STATE["weights"]))
    tp_exact = _tp_step(7)
    to_ep = _switch("ep")
    rebalanced = _rebalance(ctx, _placement(1), 8)
    memory.destroy()
    return {"taken_over": taken_over, "switches": [to_tp, to_ep], "tp_views": views, "tp_exact": tp_exact,
            "rebalanced": rebalanced}


def _check_rebalance(result, first_step):
    assert result["placement"] and result["frames"] and all(result["exact"]), result
    assert result["reports"] and all(outcome == "committed" for _, outcome, _ in result["reports"]), result
    assert result["reports"][0][2] == first_step + 2


@pytest.mark.parametrize("case", ["covered", "partial"])
def test_replacement_joins_mid_serve_then_switch_and_rebalance(case):
    with harness.fresh_cluster(R) as cluster:
        harness.check_outcomes(cluster.run(rank_setup, timeout_s=60))
        outcomes = cluster.run(rank_before_failure, case, timeout_s=90, failure_grace_s=30)
        assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -9
        for outcome in outcomes:
            if outcome.rank != DEAD:
                value = harness.outcome_value(outcome)
                assert value["first"] and value["during"], value
                _check_rebalance(value["rebalanced"], 1)
                assert value["switched"] == ["completed", True, "completed"], value
                assert value["active"][DEAD] == 0, "the survivors should have seen the dead rank"
        cluster.respawn(DEAD)
        harness.check_outcomes(cluster.run(rank_setup, ranks=[DEAD], timeout_s=60))
        readmitted = harness.check_outcomes(cluster.run(rank_readmit, timeout_s=90))
        assert [value["view"] for value in readmitted] == [list(range(R))] * R
        from_peers, from_loader, loader_called = RESTORED[case]
        assert readmitted[DEAD]["restored"] == (from_peers, from_loader, loader_called, int(loader_called)), readmitted
        after = harness.check_outcomes(cluster.run(rank_after_readmission, timeout_s=90))
        for rank, result in enumerate(after):
            assert result["taken_over"] == after[1]["taken_over"], f"rank {rank} did not take the members' state over"
            assert result["switches"] == ["completed", "completed"], (rank, result)
            assert result["tp_views"] and result["tp_exact"], (rank, result)
            _check_rebalance(result["rebalanced"], 8)
        assert after[DEAD]["taken_over"]["seq"] == 2 and after[DEAD]["taken_over"]["epoch"] > 0
        assert after[DEAD]["taken_over"]["placement"] == BEFORE_FAILURE[case].tolist()
        harness.check_outcomes(cluster.run(harness.rank_teardown, timeout_s=60))


def rank_memory_misuse(ctx):
    """ExpertMemory without weights, or with weights of the wrong kind, on an ordinary rank: a clear error."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.expert_memory import ExpertMemory
    from mooncake_ep_switch.switch import WeightShape

    errors = []
    with Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, 1, EXPERTS), transport="shm") as buffer:
        for layers in (None, 7):
            try:
                ExpertMemory(buffer, WeightShape(EXPERTS, HIDDEN, INTER), layers, layout="ep", max_tp_tokens=TOKENS)
            except (TypeError, ValueError) as error:
                errors.append(f"{type(error).__name__}: {error}")
        memory = ExpertMemory(buffer, WeightShape(EXPERTS, HIDDEN, INTER), _load, layout="ep", max_tp_tokens=TOKENS)
        usable = memory.restored == (0, LAYERS * EXPERTS, True)  # an ordinary rank loads everything
        memory.destroy()
    return {"errors": errors, "usable": usable}


def test_expert_memory_without_weights_is_refused():
    value = harness.run(1, rank_memory_misuse, timeout_s=60)[0]
    assert value["usable"], value
    assert value["errors"][0].startswith("ValueError: layers: expected the full weights or a loader, got None"), value
    assert value["errors"][1].startswith("TypeError: layers: expected a sequence of layers"), value


def rank_restore_beside_an_unloaded_peer(ctx):
    """Ranks 0 and 1 load; rank 2 (a second replacement still restoring) does not. Rank 0 then restores from peers."""
    import torch.distributed as dist

    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.expert_restore import load_missing, restore_from_peers
    from mooncake_ep_switch.switch import WeightShape
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights

    weights = _load()
    with Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, R, R * PER_RANK), transport="shm") as buffer:
        unified = UnifiedWeights(buffer, WeightShape(EXPERTS, HIDDEN, INTER), LAYERS, layout="ep")
        slots = ExpertSlots(buffer, SlotShape(LAYERS, EXPERTS, PER_RANK, HIDDEN, INTER), _placement(2),
                            primaries=unified, spare_frames=1)
        if ctx.rank != 2:
            unified.load_full(weights)
            slots.load(weights)
        dist.barrier(group=ctx.group)
        result = None
        if ctx.rank == 0:
            missing = restore_from_peers(unified, slots, [0, 1, 2])
            load_missing(slots, weights, missing)
            result = {"missing": missing, "exact": slots_exact(slots, weights),
                      "loaded": [slots.is_loaded(rank) for rank in range(R)]}
        dist.barrier(group=ctx.group)
        slots.destroy()
        unified.destroy()
    return result


def test_a_replacement_never_restores_from_a_peer_that_has_not_loaded_its_slots():
    """Two replacements at once: what only the other (still restoring, zeros) holds comes from the loader.

    Rank 0 holds experts [0, 1 | 4] per layer: 0 is a frame on rank 1 (loaded), 4 rank 2's primary,
    and rank 2 has not loaded. Before `readable_peers`, rank 0 copied rank 2's zeroed primary as
    expert 4 and reported nothing missing for it.
    """
    value = harness.run(R, rank_restore_beside_an_unloaded_peer, timeout_s=60)[0]
    assert value["loaded"] == [True, True, False], value
    assert value["missing"] == [(layer, slot) for layer in range(LAYERS) for slot in (1, 2)], value
    assert value["exact"], value
