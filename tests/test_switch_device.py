"""Switching, KV redistribution, online EPLB and re-admission on device memory (the "cuda" transport).

Every structure peers write into (unified weights, KV pages, expert frames) is a `DeviceRegion` on the
"cuda" transport: device memory opened by CUDA IPC, moved by queued device copies, control words in
host memory. Each test body runs the same calls through a host ("shm") Buffer and a "cuda" Buffer in
the same rank processes and requires the weights, the KV cache (region bytes and page tables) and the
expert frames to be identical bit for bit after every step, besides equal to independent references
(shards sliced from the checkpoint with plain indexing, K/V regenerated from their seeds).

`test_emulated_*` run everywhere on the emulated device of tests/emulated_device.py (device memory as
shared regions, copies complete at once); `test_gpu_*` run the same bodies on a GPU (rank processes
on the one GPU) and are skipped without one ("no CUDA device"); scripts/gpu_check.sh runs them.
"""
import hashlib
import os
import signal
import time

import numpy as np
import pytest
import torch

from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason
from mooncake_ep_switch.launcher.launch import check_outcomes
from tests import harness
from tests.test_cuda import on_device
from tests.test_switch_kv import H_KV, LAYERS as KV_LAYERS, D, PAGE, _all_specs, _dense, _populate
from tests.test_switch_weights import E, H, I, _expected_shard

gpu = pytest.mark.skipif(bool(cuda_unavailable_reason()), reason="no CUDA device")
MOE_LAYERS, UNITS = 2, 96
TIMEOUT_US = 20_000_000
FAULT_TIMEOUT_US = 3_000_000  # ranks time-sliced on one GPU are late by several slices
KILL_RANKS, KILLED = 4, 2


def _use_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _build(ctx, transport: str, layout: str):
    """A Buffer, its unified weights (loaded from the checkpoint) and its KV cache (populated) in `layout`."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E), transport=transport)
    full = [random_weights(E, H, I, seed=20 + layer) for layer in range(MOE_LAYERS)]
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), MOE_LAYERS, layout=layout)
    unified.load_full(full)
    kv = PagedKVCache(buffer, KVCacheConfig(KV_LAYERS, H_KV, D, PAGE, UNITS), layout=layout)
    _populate(kv, ctx.rank, ctx.num_ranks, layout)
    return buffer, full, unified, kv


def _weights_exact(unified, full, rank: int, num_ranks: int) -> bool:
    for layer, weights in enumerate(full):
        want = _expected_shard(weights, unified.layout, rank, num_ranks)
        got = unified.view(layer)
        if not (torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])):
            return False
    return True


def _kv_exact(kv) -> bool:
    """Every request's K/V of every head group held here equals the K/V regenerated from its seeds."""
    specs = {spec[0]: spec for spec in _all_specs(kv.num_ranks)}
    per_group = H_KV // kv.num_ranks
    for rid, request in kv.requests.items():
        for layer in range(KV_LAYERS):
            k_ref, v_ref = _dense(specs[rid], layer, request.num_tokens)
            for group in kv.head_groups():
                heads = slice(group * per_group, (group + 1) * per_group)
                k, v = kv.gather(rid, layer, group)
                if not (torch.equal(k.cpu(), k_ref[:, heads].permute(1, 0, 2))
                        and torch.equal(v.cpu(), v_ref[:, heads].permute(1, 0, 2))):
                    return False
    return True


def _state(unified, kv) -> dict:
    return {"weights": _digest(unified.local), "kv": _digest(kv.local), "tables": _digest(torch.from_numpy(kv.encode_meta())),
            "layout": unified.layout}


# ---------------------------------------------------------------------------------------------
# TP -> EP -> TP, weights and KV, against the host path
# ---------------------------------------------------------------------------------------------
def rank_round_trip(ctx) -> dict:
    from mooncake_ep_switch.switch.switcher import switch_layout

    _use_device()
    states = {}
    for transport in ("shm", "cuda"):
        buffer, full, unified, kv = _build(ctx, transport, "tp")
        steps = [dict(_state(unified, kv), exact=_weights_exact(unified, full, ctx.rank, ctx.num_ranks) and _kv_exact(kv))]
        try:
            for target in ("ep", "tp"):
                report = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=TIMEOUT_US)
                assert report.outcome == "completed" and report.layout == target, report
                exact = _weights_exact(unified, full, ctx.rank, ctx.num_ranks) and _kv_exact(kv)
                steps.append(dict(_state(unified, kv), exact=exact, weight_bytes=report.weight_bytes,
                                  kv_bytes=report.kv_bytes, device=str(unified.local.device),
                                  regions=[type(r).__name__ for r in unified.shared_regions() + kv.shared_regions()]))
        finally:
            kv.destroy()
            unified.destroy()
            buffer.destroy()
        states[transport] = steps
    return states


def _round_trip(num_ranks: int, emulated: bool) -> None:
    with harness.fresh_cluster(num_ranks) as cluster:
        results = check_outcomes(cluster.run(*on_device(rank_round_trip, emulated), timeout_s=180))
    for rank, states in enumerate(results):
        host, device = states["shm"], states["cuda"]
        assert [s["layout"] for s in device] == ["tp", "ep", "tp"], device
        assert all(s["exact"] for s in host + device), (rank, host, device)
        for index, (a, b) in enumerate(zip(host, device)):
            for key in ("weights", "kv", "tables"):
                assert a[key] == b[key], f"rank {rank}: {key} after switch {index} differs from the host path"
        assert sum(s["kv_bytes"] for s in device[1:]) > 0 and all(s["weight_bytes"] > 0 for s in device[1:])
        # weights and KV pages in device regions, the switch's control words in host memory
        assert all(s["regions"] == ["DeviceRegion", "SharedRegion", "DeviceRegion"] for s in device[1:]), device
        assert all(s["regions"] == ["SharedRegion"] * 3 for s in host[1:]), host
        if not emulated:
            assert all(s["device"].startswith("cuda") for s in device[1:]), device


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_emulated_tp_ep_tp_weights_and_kv_match_the_host_path(num_ranks):
    _round_trip(num_ranks, emulated=True)


@gpu
def test_gpu_tp_ep_tp_weights_and_kv_match_the_host_path():
    _round_trip(2, emulated=False)


# ---------------------------------------------------------------------------------------------
# A rank killed at each phase of a switch
# ---------------------------------------------------------------------------------------------
def rank_killed_in_switch(ctx, target: str, phase: str, index: int) -> dict:
    from mooncake_ep_switch.switch.switcher import switch_layout

    _use_device()
    buffer, full, unified, kv = _build(ctx, "cuda", "ep")
    if target == "ep":  # to TP first (no fault), then fail on the way back
        assert switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=TIMEOUT_US).outcome == "completed"

    def hook(where, at):
        if ctx.rank == KILLED and where == phase and at == index:
            os.kill(os.getpid(), signal.SIGKILL)

    started = time.monotonic()
    report = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=FAULT_TIMEOUT_US, on_step=hook)
    seconds = time.monotonic() - started
    result = {"report": report._asdict(), "rids": sorted(kv.requests), "heads": kv.head_groups(), "seconds": seconds,
              "weights": unified.layout == report.layout and _weights_exact(unified, full, ctx.rank, ctx.num_ranks),
              "kv": kv.layout == report.layout and _kv_exact(kv)}
    kv.destroy()
    unified.destroy()
    buffer.destroy()
    return result


# (target, phase, index): every phase the switch has a hook at
KILL_POINTS = [("tp", "enter", 0), ("tp", "decide", 0), ("tp", "weights", 1), ("ep", "weights_partial", 0),
               ("tp", "kv", 0), ("ep", "commit", 0)]


def _killed(target: str, phase: str, index: int, emulated: bool) -> None:
    with harness.fresh_cluster(KILL_RANKS) as cluster:
        outcomes = cluster.run(*on_device(rank_killed_in_switch, emulated), target, phase, index, timeout_s=150,
                               failure_grace_s=60)
        processes = list(cluster.processes)
    assert not outcomes[KILLED].ok and outcomes[KILLED].exitcode == -signal.SIGKILL, outcomes[KILLED]
    survivors = [o for o in outcomes if o.rank != KILLED]
    for outcome in survivors:
        assert outcome.ok, outcome.error
    reports = [o.value["report"] for o in survivors]
    assert len({(r["layout"], r["outcome"], r["dead_ranks"]) for r in reports}) == 1, reports
    outcome, layout = reports[0]["outcome"], reports[0]["layout"]
    if phase in ("enter", "decide"):  # nothing moved: refused everywhere, the source layout kept
        assert outcome == "refused" and layout != target, reports
    else:  # the survivors complete the switch from the dead rank's memory
        assert outcome == "completed" and layout == target and tuple(reports[0]["dead_ranks"]) == (KILLED,), reports
    for o in survivors:
        assert o.value["weights"] and o.value["kv"], (o.rank, o.value)
    all_rids = {spec[0] for spec in _all_specs(KILL_RANKS)}
    if outcome == "completed" and target == "tp":
        assert all(set(o.value["rids"]) == all_rids and o.value["heads"] == [o.rank] for o in survivors)
    elif outcome == "completed":
        held = [rid for o in survivors for rid in o.value["rids"]]
        lost = set(reports[0]["lost_requests"])
        assert len(held) == len(set(held)) and set(held) | lost == all_rids and not set(held) & lost
    assert not any(process.is_alive() for process in processes), "leftover rank processes"


@pytest.mark.parametrize("target, phase, index", KILL_POINTS)
def test_emulated_rank_killed_at_each_switch_phase(target, phase, index):
    _killed(target, phase, index, emulated=True)


@gpu
@pytest.mark.parametrize("target, phase, index", [("ep", "weights_partial", 0), ("tp", "kv", 0)])
def test_gpu_rank_killed_in_a_switch(target, phase, index):
    _killed(target, phase, index, emulated=False)


# ---------------------------------------------------------------------------------------------
# Online EPLB on device frames: an abort, then a commit, against the host path
# ---------------------------------------------------------------------------------------------
EPLB_EXPERTS, EPLB_SLOTS = 4, 3  # per rank: 2 primaries' experts + 1 redundant, all in frames


def _eplb_placement(num_ranks: int, shift: int) -> np.ndarray:
    rows = []
    for rank in range(num_ranks):
        rows += [2 * rank, 2 * rank + 1, (2 * rank + shift) % EPLB_EXPERTS]
    return np.asarray([rows] * MOE_LAYERS, dtype=np.int64)


def _frames_exact(slots, weights) -> bool:
    for layer in range(MOE_LAYERS):
        for local_slot, expert in enumerate(slots.local_experts(layer)):
            gate_up, down = slots.expert(layer, local_slot)
            if not (torch.equal(gate_up.cpu(), weights[layer].gate_up[expert])
                    and torch.equal(down.cpu(), weights[layer].down[expert])):
                return False
    return True


def rank_eplb(ctx) -> dict:
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
    from mooncake_ep_switch.reference.moe_block import random_weights

    _use_device()
    weights = [random_weights(EPLB_EXPERTS, H, I, seed=100 + layer) for layer in range(MOE_LAYERS)]
    old, target = _eplb_placement(ctx.num_ranks, 2), _eplb_placement(ctx.num_ranks, 3)
    results = {}
    for transport in ("shm", "cuda"):
        size = Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, ctx.num_ranks * EPLB_SLOTS)
        buffer = Buffer(ctx.group, size, transport=transport)
        slots = ExpertSlots(buffer, SlotShape(MOE_LAYERS, EPLB_EXPERTS, EPLB_SLOTS, H, I), old, spare_frames=EPLB_SLOTS)
        slots.load(weights)
        rebalancer = OnlineRebalancer(slots, timeout_us=TIMEOUT_US, frames_per_step=1)
        device = buffer.runtime.device or torch.device("cpu")
        try:
            # 1. rank 1 sees rank 0 inactive at the commit: it votes ABORT, every rank keeps the old placement
            mask = torch.ones(ctx.num_ranks, dtype=torch.int32, device=device)
            if ctx.rank == 1:
                mask[0] = 0
            rebalancer.begin(target, commit_step=3)
            reports = []
            for step in range(1, 4):
                reports += rebalancer.step(step, mask)
            aborted = {"reports": [(r.epoch, r.outcome) for r in reports],
                       "placement_old": bool(np.array_equal(slots.phy2log, old)), "frames": _frames_exact(slots, weights),
                       "digest": _digest(slots.region.local)}
            # 2. the same placement change with every rank active: committed at step 6 on every rank
            rebalancer.begin(target, commit_step=6)
            reports = []
            for step in range(4, 8):
                reports += rebalancer.step(step, None)
            committed = {"reports": [(r.epoch, r.outcome, r.commit_step, r.moved_bytes) for r in reports],
                         "placement_target": bool(np.array_equal(slots.phy2log, target)),
                         "frames": _frames_exact(slots, weights), "digest": _digest(slots.region.local),
                         "device": str(slots.region.local.device)}
        finally:
            slots.destroy()
            buffer.destroy()
        results[transport] = {"aborted": aborted, "committed": committed}
    return results


def _eplb(emulated: bool) -> None:
    with harness.fresh_cluster(2) as cluster:
        results = check_outcomes(cluster.run(*on_device(rank_eplb, emulated), timeout_s=180))
    for rank, result in enumerate(results):
        host, device = result["shm"], result["cuda"]
        for run in (host, device):
            assert [o for _, o in run["aborted"]["reports"]] == ["aborted"], (rank, run)
            assert run["aborted"]["placement_old"] and run["aborted"]["frames"], (rank, run)
            assert [(o, step) for _, o, step, _ in run["committed"]["reports"]] == [("committed", 6)], (rank, run)
            assert run["committed"]["placement_target"] and run["committed"]["frames"], (rank, run)
            assert run["committed"]["reports"][0][3] > 0, run
        for phase in ("aborted", "committed"):
            assert host[phase]["digest"] == device[phase]["digest"], f"rank {rank}: frames after the {phase} epoch differ"
        if not emulated:
            assert device["committed"]["device"].startswith("cuda"), device


def test_emulated_online_eplb_abort_then_commit_match_the_host_path():
    _eplb(emulated=True)


@gpu
def test_gpu_online_eplb_abort_then_commit_match_the_host_path():
    _eplb(emulated=False)
