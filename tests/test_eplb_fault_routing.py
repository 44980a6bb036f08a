"""Serving through a death (issue 36 item 1): fault-aware routing over live copies, lost-entry counter.

R=4 ranks serve two MoE layers on physical experts (3 slots per rank for 8 logical experts) with
`physical_ep_forward(..., fault_aware=True)`; rank DEAD is SIGKILLed before step 2. Layer 0's
placement gives every expert of rank DEAD a copy on another rank; layer 1's leaves expert
SOLE_EXPERT only on rank DEAD. Both layers run on the same input of the step, so each is compared
with its own single-process reference:

* step 1 (all live) and, from the step after the survivors' mask has the death, layer 0: the *full*
  reference (no expert skipped) and no lost entry;
* layer 1 from then on: the reference without SOLE_EXPERT only (no renormalisation), and exactly its
  top-k entries counted lost;
* the call that meets the death (step 2, layer 0): the reference without the experts this rank's
  dispatch row sent to DEAD (the death was not known when it routed), those entries counted lost.

Run on shared memory, the Transfer Engine between local ranks, the collective fallback and the
emulated CUDA device (tests/emulated_device.py); `test_gpu_*` runs the same body on a GPU.
"""
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason
from tests import harness
from tests.reference import calc_diff
from tests.test_cuda import _use_device, on_device

R, DEAD = 4, 3
LAYERS, EXPERTS, HIDDEN, INTER, TOP_K, TOKENS, SLOTS_PER_RANK = 2, 8, 256, 128, 2, 16, 3
SOLE_EXPERT = 6
PLACEMENT = [
    [0, 1, 6, 2, 3, 7, 4, 5, 6, 6, 7, 5],  # layer 0: rank 3 holds 6, 7, 5; each has a copy elsewhere (6 twice)
    [0, 1, 7, 2, 3, 0, 4, 5, 2, 6, 7, 4],  # layer 1: rank 3 holds the only copy of expert 6
]
LOST = (set(), {SOLE_EXPERT})  # per layer: experts without a live copy once DEAD is masked
STEPS = 4
LIMIT = 1e-6  # calc_diff (the demo accepts 1e-4): summation order inside the expert GEMMs only
TIMEOUTS = {"shm": harness.FAULT_TIMEOUT_US, "mooncake": harness.FAULT_TIMEOUT_US_TE,
            "collective": harness.FAULT_TIMEOUT_US, "cuda": 3_000_000}
gpu = pytest.mark.skipif(bool(cuda_unavailable_reason()), reason="no CUDA device")


def _inputs(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn((TOKENS, HIDDEN), generator=generator).to(torch.bfloat16)


def _bad_calls(slots, buffer, x, weights, row):
    """Refused masks: (exception type, message) of each; the counter and the Buffer must not move."""
    from mooncake_ep_switch.eplb.serving import physical_ep_forward

    errors = []
    for mask in (torch.ones(R + 1, dtype=torch.int32), torch.ones(R, dtype=torch.float32),
                 torch.ones((1, R), dtype=torch.int32), np.ones(R, dtype=np.int32),
                 torch.full((R,), 2, dtype=torch.int32)):
        try:
            physical_ep_forward(buffer, x, weights.router, slots, 0, TOP_K, TOKENS, mask, row, fault_aware=True)
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append((type(exc).__name__, str(exc)))
    return errors


def rank_serve_through_death(ctx, transport):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.maps import build_dispatch_map
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights, reference_forward, route

    _use_device()
    timeout_us = TIMEOUTS[transport]
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, ctx.num_ranks, R * SLOTS_PER_RANK)
    buffer = Buffer(ctx.group, size, transport=transport)
    # ExpertSlots needs one-sided frames: on the collective fallback they sit on a second (shm) Buffer,
    # and dispatch/combine of the physical ids go over the collective one.
    holder = Buffer(ctx.group, size, transport="shm") if transport == "collective" else buffer
    device = buffer.device or torch.device("cpu")
    weights = [random_weights(EXPERTS, HIDDEN, INTER, seed=300 + layer) for layer in range(LAYERS)]
    slots = ExpertSlots(holder, SlotShape(LAYERS, EXPERTS, SLOTS_PER_RANK, HIDDEN, INTER),
                        np.asarray(PLACEMENT, dtype=np.int64), spare_frames=1)
    try:
        slots.load(weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        routers = [w.router.to(device) for w in weights]
        rows = build_dispatch_map(slots.phy2log, R, R)[ctx.rank]  # the unmasked map, as an engine caches it
        active = buffer.active_mask()
        bad = _bad_calls(slots, buffer, _inputs(ctx.rank, 0).to(device), weights[0], rows[0].to(device))
        bad_left_no_trace = bool((slots.lost_contributions == 0).all())
        dist.barrier(group=ctx.group)  # every rank loaded its slots before anyone dispatches
        steps = []
        for step in range(1, STEPS + 1):
            if step == 2:
                if ctx.rank == DEAD:
                    os.kill(os.getpid(), signal.SIGKILL)
            x = _inputs(ctx.rank, step)
            layers = []
            for layer in range(LAYERS):
                masked_before = [r for r in range(R) if not int(active[r])]
                lost_before = int(slots.lost_contributions[layer])
                out, _ = physical_ep_forward(buffer, x.to(device), routers[layer], slots, layer, TOP_K, TOKENS,
                                             active, rows[layer].to(device), timeout_us=timeout_us, fault_aware=True)
                masked_after = [r for r in range(R) if not int(active[r])]
                topk, _ = route(x, weights[layer].router, TOP_K)
                if DEAD not in masked_after:  # all live
                    skip = set()
                elif DEAD not in masked_before:  # this call met the death: routed by the unmasked row
                    skip = {e for e in range(EXPERTS) if int(rows[layer][e]) // SLOTS_PER_RANK == DEAD}
                else:
                    skip = set(LOST[layer])
                full = reference_forward(x, weights[layer], TOP_K)
                expected = reference_forward(x, weights[layer], TOP_K, skip_experts=skip)
                on_dead = {e for e in range(EXPERTS) if int(rows[layer][e]) // SLOTS_PER_RANK == DEAD}
                out = out.cpu()
                layers.append({
                    "masked_before": masked_before, "masked_after": masked_after,
                    "diff": calc_diff(out, expected), "exact": torch.equal(out, expected),
                    "diff_full": calc_diff(out, full), "exact_full": torch.equal(out, full),
                    "uses_dead": any(bool((topk == e).any()) for e in on_dead),  # this row sends entries to DEAD
                    "full_vs_old": calc_diff(full, reference_forward(x, weights[layer], TOP_K, skip_experts=on_dead)),
                    "lost": int(slots.lost_contributions[layer]) - lost_before,
                    "expected_lost": int(sum((topk == e).sum() for e in skip)),
                })
            steps.append(layers)
        return {"bad": bad, "bad_left_no_trace": bad_left_no_trace, "steps": steps}
    finally:
        slots.destroy()
        buffer.destroy()
        if holder is not buffer:
            holder.destroy()


def _check(outcomes):
    users_of_dead = set()  # survivors whose unmasked row sent layer-0 entries to DEAD after its death
    assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    for outcome in outcomes:
        if outcome.rank == DEAD:
            continue
        assert outcome.ok, outcome.error
        result = outcome.value
        assert result["bad_left_no_trace"], "a refused call counted lost entries"
        for error in result["bad"]:
            assert error is not None and "active_ranks" in error[1], result["bad"]
        first_masked = None
        for step, layers in enumerate(result["steps"], start=1):
            for layer, value in enumerate(layers):
                where = f"rank {outcome.rank} step {step} layer {layer}: {value}"
                assert value["masked_after"] in ([], [DEAD]), where
                assert value["diff"] < LIMIT, where
                assert value["lost"] == value["expected_lost"], where
                if value["masked_before"] == [DEAD]:
                    first_masked = (step, layer) if first_masked is None else first_masked
                    if layer == 0:  # (a): every expert of the dead rank has a live copy
                        assert value["lost"] == 0 and value["diff_full"] < LIMIT, where
                        # ... and the check can tell: the old routing would have missed the mark
                        assert not value["uses_dead"] or value["full_vs_old"] > 100 * LIMIT, where
                        if value["uses_dead"]:
                            users_of_dead.add(outcome.rank)
                    else:  # (b): the sole copy's entries are lost, the rest served
                        assert value["expected_lost"] > 0, where
            assert step > 1 or all(v["masked_after"] == [] for v in layers), f"rank {outcome.rank} step 1"
        # The death is met within step 2, and from the next call on routing goes around it.
        assert first_masked is not None and first_masked <= (2, 1), (outcome.rank, first_masked)
        assert result["steps"][1][0]["masked_after"] == [DEAD], outcome.rank
    assert len(users_of_dead) >= 2, f"the placement should make survivors route to DEAD: {users_of_dead}"


def _serve_through_death(transport, emulated=False):
    runner = on_device(rank_serve_through_death, emulated) if transport == "cuda" else (rank_serve_through_death,)
    with harness.fresh_cluster(R) as cluster:
        outcomes = cluster.run(*runner, transport, timeout_s=150, failure_grace_s=60)
    _check(outcomes)


@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_serving_through_a_death_uses_live_copies(transport):
    _serve_through_death(transport)


def test_emulated_serving_through_a_death_uses_live_copies():
    _serve_through_death("cuda", emulated=True)


@gpu
def test_gpu_serving_through_a_death_uses_live_copies():
    _serve_through_death("cuda")
