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
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason
from mooncake_ep_switch.launcher.launch import check_outcomes
from tests import harness
from tests.test_cuda import _use_device, on_device
from tests.test_switch_kv import H_KV, LAYERS as KV_LAYERS, D, PAGE, _all_specs, _dense, _populate
from tests.test_switch_weights import E, H, I, _expected_shard

gpu = pytest.mark.skipif(bool(cuda_unavailable_reason()), reason="no CUDA device")
MOE_LAYERS, UNITS = 2, 96
TIMEOUT_US = 20_000_000
FAULT_TIMEOUT_US = 3_000_000  # ranks time-sliced on one GPU are late by several slices
KILL_RANKS, KILLED = 4, 2


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
def _expected_kv_bytes(ctx, kv, target: str) -> tuple:
    """(remote, local) KV bytes this rank's switch to `target` moves, from the plan of every rank's published state:
    a move is its filled tokens' rows of `H_kv/P` heads in every layer, K and V (independent of the copy blocks)."""
    blobs = [None] * ctx.num_ranks
    dist.all_gather_object(blobs, kv.encode_meta(), group=ctx.group)
    moves = kv.plan([kv.decode_meta(blob) for blob in blobs], target).moves
    config = kv.config
    per_token = (config.num_kv_heads // ctx.num_ranks) * config.head_dim * 2 * config.num_layers * 2
    mine = moves[moves[:, 0] == ctx.rank]
    local = int(mine[mine[:, 2] == ctx.rank, 4].sum()) * per_token
    return int(mine[:, 4].sum()) * per_token - local, local


def rank_round_trip(ctx, kernel_min_blocks: int = 0) -> dict:
    """`kernel_min_blocks` > 0: from that many blocks on a device move is the block-copy kernel (1: every move)."""
    from mooncake_ep_switch.buffer import device_region
    from mooncake_ep_switch.switch.switcher import switch_layout

    _use_device()
    if kernel_min_blocks > 0:
        device_region.KERNEL_MIN_BLOCKS = kernel_min_blocks  # this fresh rank process only
    states = {}
    for transport in ("shm", "cuda"):
        buffer, full, unified, kv = _build(ctx, transport, "tp")
        steps = [dict(_state(unified, kv), exact=_weights_exact(unified, full, ctx.rank, ctx.num_ranks) and _kv_exact(kv))]
        try:
            for target in ("ep", "tp"):
                expected_kv = _expected_kv_bytes(ctx, kv, target)
                report = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=TIMEOUT_US)
                assert report.outcome == "completed" and report.layout == target, report
                assert (report.kv_bytes, report.kv_local_bytes) == expected_kv, (transport, target, report)
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


def _round_trip(num_ranks: int, emulated: bool, kernel_min_blocks: int = 0) -> None:
    with harness.fresh_cluster(num_ranks) as cluster:
        results = check_outcomes(cluster.run(*on_device(rank_round_trip, emulated), kernel_min_blocks,
                                             timeout_s=180))
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


def test_emulated_every_move_by_the_block_copy_kernel_matches_the_host_path():
    """The weight chunks too (a few large strided blocks a layer, runtime copies by default) moved by the block-copy
    kernel (`KERNEL_MIN_BLOCKS = 1`, what `bench --device cuda` times beside the default): the same bytes."""
    _round_trip(2, emulated=True, kernel_min_blocks=1)


@gpu
def test_gpu_every_move_by_the_block_copy_kernel_matches_the_host_path():
    _round_trip(2, emulated=False, kernel_min_blocks=1)


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
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier(group=ctx.group)  # no rank stages from a peer's frame before that peer loaded it
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
            # 2. the same placement change with every rank active: committed at step 6 on every rank. Ranks begin
            # after a serving step (a collective), as an engine does: a rank still waiting for the aborted epoch's
            # votes must not see a peer's next plan (docs/eplb.md: ranks in lockstep between begin() and the votes).
            dist.barrier(group=ctx.group)
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


# ---------------------------------------------------------------------------------------------
# Re-admission: a replacement's slots copied from the members' device copies, then a switch and a commit
# ---------------------------------------------------------------------------------------------
_STATE = {}


def _memory(buffer, loader):
    from mooncake_ep_switch.expert_memory import ExpertMemory
    from mooncake_ep_switch.switch import WeightShape
    from tests import test_readmit_regions as readmit

    return ExpertMemory(buffer, WeightShape(readmit.EXPERTS, readmit.HIDDEN, readmit.INTER), loader, layout="ep",
                        max_tp_tokens=readmit.R * readmit.TOKENS, phy2log=readmit.COVERED,
                        redundant_per_rank=readmit.REDUNDANT, timeout_us=readmit.TIMEOUT_US)


def rank_readmit_setup(ctx) -> dict:
    """Members: a "cuda" Buffer and ExpertMemory (placement COVERED: every slot of rank DEAD has a copy on a
    member), one switch EP -> TP -> EP; rank DEAD is then SIGKILLed. A replacement: its Buffer only."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join
    from tests import test_readmit_regions as readmit

    _use_device()
    size = Buffer.get_ep_buffer_size_hint(readmit.TOKENS, readmit.HIDDEN, readmit.R, readmit.R * readmit.PER_RANK)
    if ctx.group is None:  # the replacement: builds its memory once admitted
        _STATE["buffer"] = Buffer(join(ctx.store, ctx.rank, ctx.num_ranks), size, transport="cuda")
        return {}
    buffer = _STATE["buffer"] = Buffer(ctx.group, size, transport="cuda")
    memory = _STATE["memory"] = _memory(buffer, readmit._load)
    switched = [buffer.switch_layout(target, weights=memory.unified, timeout_us=TIMEOUT_US).outcome
                for target in ("tp", "ep")]
    if ctx.rank == readmit.DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"switched": switched, "regions": [type(r).__name__ for r in memory.slots.shared_regions()]}


def rank_readmit(ctx) -> dict:
    """update_ep_member() everywhere; the replacement then builds its ExpertMemory (weights from peers)."""
    from tests import test_readmit_regions as readmit

    buffer = _STATE["buffer"]
    deadline = time.monotonic() + 60
    while ctx.rank != readmit.DEAD and readmit.DEAD not in buffer.pending_joiners():
        assert time.monotonic() < deadline, "the replacement never asked to join"
        time.sleep(0.01)
    view = buffer.update_ep_member(timeout_s=60)
    result = {"view": list(view.ranks)}
    if ctx.rank == readmit.DEAD:
        loads = []
        memory = _STATE["memory"] = _memory(buffer, lambda: loads.append(1) or readmit._load())
        result.update(restored=tuple(memory.restored), loads=len(loads),
                      slots_exact=readmit.slots_exact(memory.slots, readmit._load()), seq=memory.unified.seq,
                      device=str(memory.slots.region.local.device))
    return result


def rank_after_readmit(ctx) -> dict:
    """Every rank: switch EP -> TP (views exact) -> EP, then an online rebalance committed (frames exact)."""
    from mooncake_ep_switch.reference.moe_block import shard_tp
    from tests import test_readmit_regions as readmit

    buffer, memory = _STATE["buffer"], _STATE["memory"]
    weights = readmit._load()
    to_tp = buffer.switch_layout("tp", weights=memory.unified, timeout_us=TIMEOUT_US).outcome
    views = all(torch.equal(memory.unified.view(layer, "tp")[0].cpu(), shard_tp(w.gate_up, w.down, ctx.rank, readmit.R)[0])
                and torch.equal(memory.unified.view(layer, "tp")[1].cpu(), shard_tp(w.gate_up, w.down, ctx.rank, readmit.R)[1])
                for layer, w in enumerate(weights))
    to_ep = buffer.switch_layout("ep", weights=memory.unified, timeout_us=TIMEOUT_US).outcome
    target = readmit._placement(1)
    memory.rebalancer.begin(target, commit_step=3)
    reports = []
    for step in range(1, 5):
        reports += memory.rebalancer.step(step, None)
    result = {"switches": [to_tp, to_ep], "tp_views": views,
              "reports": [(r.outcome, r.commit_step) for r in reports],
              "placement": bool(np.array_equal(memory.slots.phy2log, target)),
              "frames": readmit.slots_exact(memory.slots, weights)}
    memory.destroy()
    buffer.destroy()
    return result


def _readmitted(emulated: bool) -> None:
    from tests import test_readmit_regions as readmit

    with harness.fresh_cluster(readmit.R) as cluster:
        outcomes = cluster.run(*on_device(rank_readmit_setup, emulated), timeout_s=120, failure_grace_s=30)
        assert not outcomes[readmit.DEAD].ok and outcomes[readmit.DEAD].exitcode == -signal.SIGKILL
        for outcome in outcomes:
            if outcome.rank != readmit.DEAD:
                value = harness.outcome_value(outcome)
                assert value["switched"] == ["completed", "completed"], value
                assert value["regions"] == ["DeviceRegion"], value
        cluster.respawn(readmit.DEAD)
        check_outcomes(cluster.run(*on_device(rank_readmit_setup, emulated), ranks=[readmit.DEAD], timeout_s=120))
        admitted = check_outcomes(cluster.run(*on_device(rank_readmit, emulated), timeout_s=120))
        assert [value["view"] for value in admitted] == [list(range(readmit.R))] * readmit.R
        replacement = admitted[readmit.DEAD]
        # every slot of the replacement copied from the members' device copies; the loader never called
        assert replacement["restored"] == (readmit.LAYERS * readmit.PER_RANK, 0, False), replacement
        assert replacement["loads"] == 0 and replacement["slots_exact"], replacement
        assert replacement["seq"] == 2, replacement  # the members' switch sequence was taken over
        if not emulated:
            assert replacement["device"].startswith("cuda"), replacement
        after = check_outcomes(cluster.run(*on_device(rank_after_readmit, emulated), timeout_s=120))
    for rank, result in enumerate(after):
        assert result["switches"] == ["completed", "completed"] and result["tp_views"], (rank, result)
        assert result["reports"] and all(outcome == "committed" for outcome, _ in result["reports"]), (rank, result)
        assert result["reports"][0][1] == 3 and result["placement"] and result["frames"], (rank, result)


def test_emulated_replacement_restores_from_device_copies_then_switch_and_commit():
    _readmitted(emulated=True)


@gpu
def test_gpu_replacement_restores_from_device_copies_then_switch_and_commit():
    _readmitted(emulated=False)


def test_emulated_switch_bench_rounds_run():
    """The device switch benchmark's rank body (`bench.switch_cuda_bench`) on the emulated device, tiny shape."""
    from mooncake_ep_switch.bench.switch_bench import SwitchBenchShape
    from mooncake_ep_switch.bench.switch_cuda_bench import rank_switch_rounds

    shape = SwitchBenchShape(2, 2, 4, 128, 32, 2, 2, 16, 4, 2, 16)
    with harness.fresh_cluster(2) as cluster:
        results = check_outcomes(cluster.run(run_emulated_bench, shape, timeout_s=120))
        results += check_outcomes(cluster.run(run_emulated_bench, shape, 1, timeout_s=120))  # every move a kernel
    for result in results:
        for way in ("ep->tp", "tp->ep"):
            assert len(result[way]) == 1 and result[way][0]["weight_bytes"] > 0, result
            assert result[way][0]["kv_bytes"] + result[way][0]["kv_local_bytes"] > 0, result
    del rank_switch_rounds


def test_switch_bench_subcommand_runs_the_switch_rows_alone(monkeypatch, tmp_path):
    """`bench --device cuda switch [--quick]` reaches `switch_cuda_bench.run` (its rows alone, the device asked there)
    and prints and writes their table; without `--quick` the full shape."""
    import torch

    from mooncake_ep_switch.bench import __main__ as bench_main
    from mooncake_ep_switch.bench import switch_cuda_bench

    calls = []
    row = {"benchmark": "cuda weight reshard EP->TP (probe row)", "shape": "R=2", "ours_ms": 2.0, "baseline": "copy",
           "baseline_ms": 1.0, "speedup": 0.5, "note": "n"}

    def rows(quick, where=None):
        calls.append((quick, where))
        return [row]

    monkeypatch.setattr(switch_cuda_bench, "run", rows)
    threads = torch.get_num_threads()
    out = tmp_path / "switch.md"
    try:
        assert bench_main.main(["--device", "cuda", "switch", "--quick", "--out", str(out)]) == 0
        assert bench_main.main(["--device=cuda", "switch"]) == 0
    finally:
        torch.set_num_threads(threads)  # the table command takes one thread
    assert calls == [(True, None), (False, None)]
    assert "cuda weight reshard EP->TP (probe row)" in out.read_text()


def run_emulated_bench(ctx, shape, kernel_min_blocks: int = 0):
    from tests.emulated_device import run_emulated

    return run_emulated(ctx, "mooncake_ep_switch.bench.switch_cuda_bench", "rank_switch_rounds", shape, 1,
                        kernel_min_blocks)


def test_emulated_demo_steps_switch_and_rebalance_on_the_cuda_transport():
    """`demo --device cuda`'s rank functions on the emulated device: TP steps, a switch to EP, EP steps with an
    online rebalance committed, every step against the single-process reference."""
    from mooncake_ep_switch.apps.demo import DemoConfig, initial_placement
    from tests.emulated_device import run_emulated

    config = DemoConfig(num_ranks=2, steps=8, transport="cuda", kill_step=-1, low_requests=8, burst_requests=16)
    module = "mooncake_ep_switch.apps.demo"
    target = initial_placement(config)
    per_rank = config.experts // 2 + config.redundant_per_rank
    for rank in range(2):  # each rank's redundant slot takes the next expert
        target[:, (rank + 1) * per_rank - 1] = (target[:, (rank + 1) * per_rank - 1] + 1) % config.experts
    with harness.fresh_cluster(2) as cluster:
        assert check_outcomes(cluster.run(run_emulated, module, "rank_setup", config, timeout_s=120)) == ["cuda"] * 2
        steps = [check_outcomes(cluster.run(run_emulated, module, "rank_step", 0, {"requests": 16}, timeout_s=120))]
        switched = check_outcomes(cluster.run(run_emulated, module, "rank_switch", "ep", timeout_s=120))
        command = {"requests": 16, "rebalance": {"phy2log": target.tolist(), "commit_step": 3}}
        steps.append(check_outcomes(cluster.run(run_emulated, module, "rank_step", 1, command, timeout_s=120)))
        for step in (2, 3, 4):
            steps.append(check_outcomes(cluster.run(run_emulated, module, "rank_step", step, {"requests": 16},
                                                    timeout_s=120)))
        check_outcomes(cluster.run(run_emulated, module, "rank_teardown", timeout_s=60))
    assert [r["outcome"] for r in switched] == ["completed"] * 2, switched
    assert [s[0]["layout"] for s in steps] == ["tp"] + ["ep"] * 4
    assert all(r["diff"] < 1e-4 and not r["dead"] for step in steps for r in step), steps
    outcomes = [(report["outcome"], report["commit_step"]) for step in steps for report in step[0]["reports"]]
    assert outcomes and all(o == "committed" for o, _ in outcomes) and outcomes[0][1] == 3, outcomes  # a chunk per layer
    assert steps[-1][0]["phy2log"] == target.tolist()


# ---------------------------------------------------------------------------------------------
# The device block copies themselves (one runtime copy per block, or one kernel for many blocks)
# ---------------------------------------------------------------------------------------------
def _random_blocks(generator: np.random.Generator, count: int, dst_base: int, src_base: int, nbytes: int,
                   aligned: bool, max_rows: int = 5, max_width: int = 300) -> np.ndarray:
    """`count` blocks with disjoint destinations inside `[dst_base, dst_base + nbytes)`, sources anywhere."""
    rows = []
    at = 0
    for _ in range(count):
        height = int(generator.integers(1, max_rows + 1))
        width = int(generator.integers(1, max_width + 1)) * (16 if aligned else 1)
        dst_stride = width + int(generator.integers(0, 4)) * (16 if aligned else 1)
        src_stride = width + int(generator.integers(0, 64)) * (16 if aligned else 1)
        src_span = (height - 1) * src_stride + width
        src_at = int(generator.integers(0, nbytes - src_span)) // (16 if aligned else 1) * (16 if aligned else 1)
        at += int(generator.integers(0, 3)) * (16 if aligned else 1) + (0 if aligned else int(generator.integers(0, 3)))
        rows.append((dst_base + at, src_base + src_at, height, width, dst_stride, src_stride))
        at += (height - 1) * dst_stride + width
        assert at < nbytes
    return np.asarray(rows, dtype=np.int64)


# (count, aligned, max_rows, max_width): few and many blocks, 16-byte aligned or not, tall blocks, and blocks of
# 10^5 pieces (a column of CTAs each, every thread with loads in flight and a partial last round)
COPY_CASES = [(3, True, 5, 300), (3, False, 5, 300), (40, True, 5, 300), (40, False, 5, 300), (300, True, 5, 300),
              (30, True, 60, 16), (2, True, 400, 300), (9, False, 200, 300)]


@pytest.mark.parametrize("count, aligned, max_rows, max_width", COPY_CASES)
def test_emulated_block_copy_kernel_matches_the_host_copy(count, aligned, max_rows, max_width):
    """The device moves' block-copy kernel (csrc/cuda/copy_kernels.cuh) on the emulator: every block's bytes
    equal the host `copy_blocks`', and nothing outside the blocks is written."""
    from mooncake_ep_switch import _cuda_sim, _native

    nbytes = 1 << 23
    generator = np.random.default_rng(count * 3 + aligned)
    src = torch.from_numpy(generator.integers(0, 256, nbytes, dtype=np.uint8))
    expected, got = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    blocks = _random_blocks(generator, count, expected.data_ptr(), src.data_ptr(), nbytes, aligned, max_rows,
                            max_width)
    _native.copy_blocks(blocks.ctypes.data, count, expected.data_ptr(), expected.data_ptr() + nbytes,
                        src.data_ptr(), src.data_ptr() + nbytes)
    moved = blocks.copy()
    moved[:, 0] += got.data_ptr() - expected.data_ptr()
    assert _cuda_sim.copy_blocks_kernel(moved.ctypes.data, count) == int((blocks[:, 2] * blocks[:, 3]).sum())
    assert torch.equal(got, expected)


@gpu
@pytest.mark.parametrize("count, aligned, max_rows, max_width", COPY_CASES + [
    (70000, True, 1, 1)])    # more blocks than its grid has in x
def test_gpu_block_copies_match_the_host_copy(count, aligned, max_rows, max_width):
    from mooncake_ep_switch import _native
    from mooncake_ep_switch.buffer.device_region import DeviceMoves

    device = torch.device("cuda", 0)
    nbytes = 1 << 22
    generator = np.random.default_rng(count * 2 + aligned)
    src_host = torch.from_numpy(generator.integers(0, 256, nbytes, dtype=np.uint8))
    dst_host = torch.zeros(nbytes, dtype=torch.uint8)
    src, dst = src_host.to(device), dst_host.to(device)
    host_blocks = _random_blocks(generator, count, dst_host.data_ptr(), src_host.data_ptr(), nbytes, aligned,
                                 max_rows, max_width)
    shift = np.asarray([dst.data_ptr() - dst_host.data_ptr(), src.data_ptr() - src_host.data_ptr(), 0, 0, 0, 0])
    device_blocks = host_blocks + shift[None, :]
    _native.copy_blocks(host_blocks.ctypes.data, count, dst_host.data_ptr(), dst_host.data_ptr() + nbytes,
                        src_host.data_ptr(), src_host.data_ptr() + nbytes)
    moves = DeviceMoves(device)
    queued = moves.copy(device_blocks, (dst.data_ptr(), dst.data_ptr() + nbytes), (src.data_ptr(), src.data_ptr() + nbytes))
    moves.fence(10.0)
    assert queued == int((host_blocks[:, 2] * host_blocks[:, 3]).sum())
    assert torch.equal(dst.cpu(), dst_host)
    outside = device_blocks.copy()
    outside[-1, 0] = dst.data_ptr() + nbytes  # the last block's destination starts at its region's end
    before = dst.clone()
    with pytest.raises(ValueError, match="outside its region"):
        moves.copy(outside, (dst.data_ptr(), dst.data_ptr() + nbytes), (src.data_ptr(), src.data_ptr() + nbytes))
    moves.fence(10.0)
    assert torch.equal(dst, before), "a refused call queued some of its blocks"


@gpu
def test_gpu_parts_of_one_table_match_the_host_copy():
    """`DeviceMoves.copy_parts` on a GPU: three parts of one table (the kernel's device table at each part's offset,
    a part of few blocks as runtime copies), each into its own destination; every byte equals the host copies'."""
    from mooncake_ep_switch import _native
    from mooncake_ep_switch.buffer.device_region import DeviceMoves

    device, nbytes = torch.device("cuda", 0), 1 << 20
    generator = np.random.default_rng(17)
    src_host = torch.from_numpy(generator.integers(0, 256, nbytes, dtype=np.uint8))
    src = src_host.to(device)
    dst_host = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(3)]
    dst = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(3)]
    tables, parts, at = [], [], 0
    for index, count in enumerate((40, 3, 25)):
        host_blocks = _random_blocks(generator, count, dst_host[index].data_ptr(), src_host.data_ptr(), nbytes, True)
        _native.copy_blocks(host_blocks.ctypes.data, count, dst_host[index].data_ptr(),
                            dst_host[index].data_ptr() + nbytes, src_host.data_ptr(), src_host.data_ptr() + nbytes)
        shift = np.asarray([dst[index].data_ptr() - dst_host[index].data_ptr(), src.data_ptr() - src_host.data_ptr(),
                            0, 0, 0, 0])
        tables.append(host_blocks + shift[None, :])
        parts.append((at, at + count, (dst[index].data_ptr(), dst[index].data_ptr() + nbytes),
                      (src.data_ptr(), src.data_ptr() + nbytes)))
        at += count
    moves = DeviceMoves(device)
    queued = moves.copy_parts(np.concatenate(tables), parts)
    moves.fence(10.0)
    assert queued == [int((table[:, 2] * table[:, 3]).sum()) for table in tables]
    for index in range(3):
        assert torch.equal(dst[index].cpu(), dst_host[index]), index


@gpu
def test_gpu_block_tables_reused_while_moves_are_queued():
    """Moves queued behind a device sleep with no fence between them: the first `MAX_TABLES` calls fill the kept
    tables, the next get one-off tables (every kept one busy); after a fence the kept ones are reused, while more
    calls wait behind another sleep. Every destination byte equals the host copies' (a table rewritten while its
    upload or kernel was still queued would have copied other blocks)."""
    from mooncake_ep_switch import _native
    from mooncake_ep_switch.buffer import device_region

    torch.cuda.set_device(0)
    device, nbytes, kept = torch.device("cuda", 0), 1 << 22, device_region.MAX_TABLES
    generator = np.random.default_rng(11)
    src_host = torch.from_numpy(generator.integers(0, 256, nbytes, dtype=np.uint8))
    dst_host = torch.zeros(nbytes, dtype=torch.uint8)
    src, dst = src_host.to(device), dst_host.to(device)
    shift = np.asarray([dst.data_ptr() - dst_host.data_ptr(), src.data_ptr() - src_host.data_ptr(), 0, 0, 0, 0])
    moves = device_region.DeviceMoves(device)
    rounds = 3 * kept
    span = nbytes // rounds
    one_offs, tables = [], set()
    for index in range(rounds):
        if index in (0, 2 * kept):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the moves wait for the current stream, their tables stay busy
        if index == 3 * kept // 2:
            moves.fence(30.0)  # every table landed: the next calls reuse the kept ones
        count = int(generator.integers(8, 65))  # one table size (64 blocks): reuse, never a replacement
        host_blocks = _random_blocks(generator, count, dst_host.data_ptr() + index * span, src_host.data_ptr(), span,
                                     True, 2, 8)
        _native.copy_blocks(host_blocks.ctypes.data, count, dst_host.data_ptr(), dst_host.data_ptr() + nbytes,
                            src_host.data_ptr(), src_host.data_ptr() + nbytes)
        moves.copy(host_blocks + shift[None, :], (dst.data_ptr(), dst.data_ptr() + nbytes),
                   (src.data_ptr(), src.data_ptr() + nbytes))
        one_offs.append(len(moves._in_flight))
        tables |= {id(table) for table in moves._tables}
    assert max(one_offs[:3 * kept // 2]) == kept // 2, one_offs  # the calls past the kept tables: one-offs
    assert len(tables) == kept, "the kept tables were not reused after the fence"
    moves.fence(30.0)
    assert torch.equal(dst.cpu(), dst_host)


class _StandInEvent:
    """An event that completes at its `done_after`-th query (never for None), for `DeviceMoves.fence` on the CPU."""

    def __init__(self, done_after):
        self.done_after, self.queries = done_after, 0

    def record(self, stream=None):
        pass

    def query(self) -> bool:
        self.queries += 1
        return self.done_after is not None and self.queries >= self.done_after


@pytest.mark.parametrize("done_after", [1, 40, None], ids=["landed", "lands-while-spinning", "never"])
def test_fence_yields_before_it_sleeps_and_ends_at_its_deadline(monkeypatch, done_after):
    """A switch fences once per layer and its copies take tens of microseconds: the fence queries its event
    with the core yielded in between for `FENCE_SPIN_S` (a sleep would overshoot by ~60 us each) and only then
    sleeps; a device that never finishes is given up on at the deadline, naming the queued bytes."""
    import types

    from mooncake_ep_switch.buffer import device_region

    event = _StandInEvent(done_after)
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    stand_in = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=lambda: event,
                                                                current_stream=lambda device=None: stream))
    monkeypatch.setattr(device_region, "torch", stand_in)
    sleeps, yields, clock = [], [], [100.0]

    def now() -> float:  # a clock that moves 0.1 ms a reading: no preemption of this process changes the test
        clock[0] += 1e-4
        return clock[0]

    # the module's own names only (the time and os modules stay as they are for everything else)
    monkeypatch.setattr(device_region, "time", types.SimpleNamespace(monotonic=now, sleep=sleeps.append))
    monkeypatch.setattr(device_region, "os", types.SimpleNamespace(sched_yield=lambda: yields.append(1)))
    monkeypatch.setattr(device_region, "FENCE_SPIN_S", 5.0 if done_after else 0.01)
    moves = device_region.DeviceMoves.__new__(device_region.DeviceMoves)
    moves.device, moves.stream, moves.unfenced_bytes = "cuda:0", stream, 4096
    moves._in_flight = [(_StandInEvent(1), ())]
    moves._tables, moves._lock = [], threading.Lock()
    if done_after is None:
        with pytest.raises(TimeoutError, match="did not finish 4096 queued bytes of moves within 0.05 s"):
            moves.fence(0.05)
        assert yields and sleeps and sleeps[:3] == [1e-5, 2e-5, 4e-5] and max(sleeps) <= 1e-3
        assert moves.unfenced_bytes == 4096  # still owed
        return
    moves.fence(10.0)
    assert sleeps == [] and len(yields) == done_after - 1 and event.queries == done_after
    assert moves.unfenced_bytes == 0 and moves._in_flight == []


class _TableEvent:
    """A stand-in CUDA event the test completes by hand (`done`), counting its records."""

    def __init__(self):
        self.done, self.records = True, 0

    def record(self, stream=None):
        self.done, self.records = False, self.records + 1

    def query(self) -> bool:
        return self.done


class _TableMoves:
    """A `DeviceMoves` on stand-ins (no GPU): torch.empty and CUDA events recorded (`allocations`, `events`), the
    native queueing recorded (`queued`: (table, device table address)); a first block with rows -1 is refused
    (ValueError, nothing queued), rows -2 fails after queueing the table's upload (RuntimeError, a failed launch)."""

    def __init__(self, monkeypatch):
        import contextlib
        import types

        from mooncake_ep_switch.buffer import device_region

        self.allocations, self.events, self.queued = [], [], []

        def empty(size, dtype=None, pin_memory=False, device=None):
            self.allocations.append((size, "pinned" if device is None else "device"))
            return torch.zeros(size, dtype=dtype)

        def new_event():
            self.events.append(_TableEvent())
            return self.events[-1]

        def queue_copies(blocks, dst_range, src_range, stream_handle, device_table):
            if blocks[0, 2] == -1:
                raise ValueError("block 0 destination has a negative rows/row_bytes/stride")
            if blocks[0, 2] == -2:
                raise RuntimeError("k_copy_blocks launch: too many resources requested")
            self.queued.append((blocks.copy(), device_table))
            return int((blocks[:, 2] * blocks[:, 3]).sum())

        stream = types.SimpleNamespace(wait_stream=lambda other: None, cuda_stream=7)
        self.cuda = types.SimpleNamespace(Event=new_event, current_stream=lambda device=None: stream,
                                          device=lambda device: contextlib.nullcontext())
        monkeypatch.setattr(device_region, "torch", types.SimpleNamespace(
            cuda=self.cuda, empty=empty, from_numpy=torch.from_numpy, int64=torch.int64))
        monkeypatch.setattr(device_region, "device_memory", types.SimpleNamespace(queue_copies=queue_copies))
        monkeypatch.setattr(device_region, "_NEVER_RELEASED", [])
        self.moves = moves = device_region.DeviceMoves.__new__(device_region.DeviceMoves)
        moves.device, moves.stream, moves.unfenced_bytes = types.SimpleNamespace(type="cuda"), stream, 0
        moves._tables, moves._in_flight, moves._lock = [], [], threading.Lock()

    def copy(self, count: int, rows: int = 1) -> int:
        """Queue `count` blocks of `rows` rows of 16 bytes."""
        table = np.zeros((count, 6), dtype=np.int64)
        table[:, 0], table[:, 2], table[:, 3] = np.arange(count) * 64, rows, 16
        return self.moves.copy(table, (0, 1 << 30), (0, 1 << 30))


@pytest.mark.parametrize("stride,kernel", [(64, False), ((1 << 31) - 1, False), (1 << 31, True), (5 << 30, True)])
def test_a_stride_past_a_runtime_copy_goes_to_the_kernel(monkeypatch, stride, kernel):
    """A move of few blocks is one runtime copy per block, whose 2D form takes pitches up to 2^31 - 1: a KV block
    (a row per layer and K/V, a whole plane apart) of a pool past that goes to the kernel, which takes any stride."""
    stand_in = _TableMoves(monkeypatch)
    table = np.array([[0, 1 << 33, 4, 16, stride, stride]], dtype=np.int64)
    assert stand_in.moves.copy(table, (0, 1 << 35), (1 << 33, 1 << 36)) == 64  # between two regions
    assert (stand_in.queued[-1][1] != 0) == kernel


@pytest.mark.parametrize("src,rows,stride,same_region,kernel", [
    (32, 4, 64, False, False),        # two regions: never overlapping areas
    (32, 4, 64, True, True),          # rows interleaved (a rank's own KV move)
    (1 << 20, 4, 64, True, False),    # one region, disjoint spans (a weight chunk between two slots)
    (16, 1, 64, True, False),         # one row each, side by side
    (208, 4, 64, True, False),        # the source starts where the destination span ends
    (192, 4, 64, True, True)])        # ... one row earlier
def test_overlapping_spans_inside_one_region_go_to_the_kernel(monkeypatch, src, rows, stride, same_region, kernel):
    """A runtime 2D copy's areas may not overlap (CUDA): a few blocks whose source and destination spans overlap,
    inside one region, go to the kernel; disjoint spans and moves between two regions stay runtime copies."""
    stand_in = _TableMoves(monkeypatch)
    table = np.array([[0, src, rows, 16, stride, stride]], dtype=np.int64)
    src_range = (0, 1 << 30) if same_region else (16, 1 << 30)
    assert stand_in.moves.copy(table, (0, 1 << 30), src_range) == rows * 16
    assert (stand_in.queued[-1][1] != 0) == kernel


def test_block_tables_are_reused_only_once_the_device_read_them(monkeypatch):
    """The block-copy kernel's tables (pinned host memory and device memory) are kept and reused, not allocated
    per call: a table is taken again only once the event after the call that read it completed; with every
    kept table busy a call gets a one-off table, held until its event completed; a refused call leaves its table
    free; at most `MAX_TABLES` are kept, each a power of two of at least `TABLE_MIN_ROWS` blocks."""
    from mooncake_ep_switch.buffer import device_region

    stand_in = _TableMoves(monkeypatch)
    moves, allocations, events, queued, cuda = (stand_in.moves, stand_in.allocations, stand_in.events,
                                                 stand_in.queued, stand_in.cuda)

    def blocks(count: int, rows: int = 1) -> np.ndarray:
        table = np.zeros((count, 6), dtype=np.int64)
        table[:, 0], table[:, 2], table[:, 3] = np.arange(count) * 64, rows, 16
        return table

    for call in range(20):  # every call's table read by the device before the next
        assert moves.copy(blocks(10 + call), (0, 1 << 20), (0, 1 << 20)) == (10 + call) * 16
        assert np.array_equal(queued[-1][0], blocks(10 + call))  # what the native call got: this call's table
        events[0].done = True
    assert allocations == [(64 * 6, "pinned"), (64 * 6, "device")] and len(events) == 1 and events[0].records == 20
    assert len({table for _, table in queued}) == 1

    events[0].done = False  # in flight: the next call needs another table, a bigger call one that fits it
    moves.copy(blocks(100), (0, 1 << 20), (0, 1 << 20))
    assert allocations[-2:] == [(128 * 6, "pinned"), (128 * 6, "device")] and len(moves._tables) == 2
    with pytest.raises(ValueError, match="negative"):
        moves.copy(blocks(9, rows=-1), (0, 1 << 20), (0, 1 << 20))
    assert len(moves._tables) == 3 and not moves._tables[-1].busy  # refused: its new table stays free
    moves.copy(blocks(30), (0, 1 << 20), (0, 1 << 20))  # and the next call takes it
    assert len(moves._tables) == 3 and len(allocations) == 6 and moves._tables[-1].busy

    for _ in range(device_region.MAX_TABLES + 3):  # every table busy: kept ones up to MAX_TABLES, then one-offs
        moves.copy(blocks(8), (0, 1 << 20), (0, 1 << 20))
    assert len(moves._tables) == device_region.MAX_TABLES and len(moves._in_flight) == 6
    tables = [table for _, table in queued]
    busy = tables[-device_region.MAX_TABLES - 5:]
    assert len(set(busy)) == len(busy), "a table was reused while the device may still read it"
    assert len(allocations) == 2 * (device_region.MAX_TABLES + 6)  # 8 kept tables, 6 one-offs
    for event in events:
        event.done = True
    moves.copy(blocks(8), (0, 1 << 20), (0, 1 << 20))
    assert moves._in_flight == [] and len(allocations) == 2 * (device_region.MAX_TABLES + 6)  # none allocated
    assert queued[-1][1] in {table.on_device.data_ptr() for table in moves._tables}
    events[0].done = False  # queued after the fence's event (another thread's copy): still held after the fence
    cuda.Event = lambda: _StandInEvent(1)  # the fence's own event: the device finished
    moves.fence(1.0)
    assert [table.busy for table in moves._tables].count(True) == 1 and moves._tables[0].busy
    before = len(allocations)
    moves.copy(blocks(8), (0, 1 << 20), (0, 1 << 20))
    assert len(allocations) == before and queued[-1][1] != moves._tables[0].on_device.data_ptr()


def test_a_full_ring_replaces_only_a_finished_table_and_a_failed_launch_keeps_its_table(monkeypatch):
    """With `MAX_TABLES` kept and a call larger than every free one, the smallest *finished* table makes room,
    never a busy one; a call above `TABLE_MAX_ROWS` blocks gets a one-off table; a call that fails after its
    table's upload was queued (a failed launch) leaves that table held for good, never reused or freed."""
    from mooncake_ep_switch.buffer import device_region

    stand_in = _TableMoves(monkeypatch)
    moves, events = stand_in.moves, stand_in.events
    for _ in range(device_region.MAX_TABLES):  # 8 busy tables of 64 blocks
        stand_in.copy(8)
    kept = list(moves._tables)
    assert len(kept) == device_region.MAX_TABLES and len(events) == device_region.MAX_TABLES
    finished = kept[5]
    finished.event.done = True  # only this one's call landed
    stand_in.copy(100)  # no free table fits 100 blocks: the finished one makes room for a kept 128-block table
    assert finished not in moves._tables and all(table in moves._tables for table in kept if table is not finished)
    assert sorted(table.rows for table in moves._tables) == [64] * 7 + [128]
    assert moves._in_flight == []

    before = len(moves._tables)
    stand_in.copy(device_region.TABLE_MAX_ROWS + 1)  # a one-off, held until its event completes
    assert len(moves._tables) == before and len(moves._in_flight) == 1
    assert moves._in_flight[0][1].rows == 2 * device_region.TABLE_MAX_ROWS

    for event in events:
        event.done = True
    with pytest.raises(RuntimeError, match="launch"):
        stand_in.copy(8, rows=-2)
    held = device_region._NEVER_RELEASED
    assert len(held) == 1 and held[0][0] not in moves._tables and len(moves._tables) == before - 1
    for _ in range(20):
        stand_in.copy(8)
        assert stand_in.queued[-1][1] != held[0][0].on_device.data_ptr()
        moves._tables[0].event.done = True


def test_parts_of_one_table_share_one_upload_each_between_its_regions(monkeypatch):
    """`DeviceMoves.copy_parts` (a switch's KV phase: every peer's moves in one table): one table and one event
    record for all the parts, each part queued between its own ranges in order, as its rows of the one table (the
    kernel's device table at the part's offset); a part of few blocks between two regions stays runtime copies; a
    refused part stops the call there, the parts before it queued and the table held until the device read it."""
    stand_in = _TableMoves(monkeypatch)
    moves, queued, events = stand_in.moves, stand_in.queued, stand_in.events
    table = np.zeros((30, 6), dtype=np.int64)
    table[:, 0], table[:, 1], table[:, 2], table[:, 3] = np.arange(30) * 64, (1 << 30) + np.arange(30) * 64, 1, 16
    two = ((0, 1 << 20), (1 << 30, 1 << 31))  # (destination, source) ranges in two regions
    parts = [(0, 20, *two), (20, 20, *two), (20, 23, *two), (23, 30, *two)]
    assert moves.copy_parts(table, parts) == [20 * 16, 3 * 16, 7 * 16]  # the empty part is skipped
    assert [len(q[0]) for q in queued] == [20, 3, 7]
    for (blocks, _), (start, stop) in zip(queued, [(0, 20), (20, 23), (23, 30)]):
        assert np.array_equal(blocks, table[start:stop])
    device_table = moves._tables[0].on_device.data_ptr()
    assert [q[1] for q in queued] == [device_table, 0, 0]  # 20 blocks: the kernel; 3 and 7 between two regions: not
    assert len(moves._tables) == 1 and len(events) == 1 and events[0].records == 1 and moves.unfenced_bytes == 480

    table[:, 1] = np.arange(30) * 64 + 32  # one region, interleaved rows (a rank's own KV moves): the kernel
    table[:, 2], table[:, 4], table[:, 5] = 2, 4096, 4096
    events[0].done = True
    moves.copy_parts(table, [(0, 10, (0, 1 << 20), (0, 1 << 20)), (10, 13, (0, 1 << 20), (0, 1 << 20))])
    assert [q[1] for q in queued[-2:]] == [device_table, device_table + 48 * 10]

    events[0].done = True
    table[12, 2] = -1  # a refused block in the second part (the stand-in refuses by its part's first row)
    one = ((0, 1 << 20), (0, 1 << 20))
    bad = [(0, 12, *one), (12, 20, *one), (20, 30, *one)]
    before = len(queued)
    with pytest.raises(ValueError, match="negative"):
        moves.copy_parts(table, bad)
    assert len(queued) == before + 1 and moves._tables[0].busy and events[0].records == 3  # part 1 queued: held
    assert moves.copy_parts(table, []) == []
    before = len(queued)
    for start, stop in ((-2, 5), (5, 4), (28, 31)):  # a part's rows outside the table (its upload offset too)
        with pytest.raises(ValueError, match=r"parts: expected 0 <= start <= stop <= 30"):
            moves.copy_parts(table, [(0, 5, *one), (start, stop, *one)])
    assert len(queued) == before


def test_block_parts_on_the_host_copy_each_part_between_its_regions():
    """`copy_block_parts` on host memory: each part through the native bounds-checked copy between its own ranges
    (bytes per part, 0 for an empty one); a part outside its ranges is refused with the parts before it copied."""
    from mooncake_ep_switch.buffer.device_region import copy_block_parts

    rng = np.random.default_rng(3)
    src = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))
    dst = [torch.zeros(1024, dtype=torch.uint8) for _ in range(2)]
    table = np.array([[dst[0].data_ptr(), src.data_ptr(), 4, 16, 64, 128],
                      [dst[1].data_ptr() + 32, src.data_ptr() + 1024, 2, 32, 512, 32]], dtype=np.int64)
    whole = lambda t: (t.data_ptr(), t.data_ptr() + t.numel())  # noqa: E731
    parts = [(0, 1, whole(dst[0]), whole(src)), (1, 1, whole(dst[1]), whole(src)), (1, 2, whole(dst[1]), whole(src))]
    assert copy_block_parts(table, parts, None) == [64, 0, 64]
    for row in range(4):
        assert torch.equal(dst[0][row * 64:row * 64 + 16], src[row * 128:row * 128 + 16])
    assert torch.equal(dst[1][32:64], src[1024:1056]) and torch.equal(dst[1][544:576], src[1056:1088])
    dst[0].zero_()
    with pytest.raises(ValueError, match="outside its region"):
        copy_block_parts(table, [(0, 1, whole(dst[0]), whole(src)), (1, 2, whole(dst[0]), whole(src))], None)
    assert torch.equal(dst[0][:16], src[:16])  # the part before the refused one was copied
    dst[0].zero_()
    for start, stop in ((-1, 1), (1, 0), (0, 3)):  # rows outside the table: refused before anything is copied
        with pytest.raises(ValueError, match=r"parts: expected 0 <= start <= stop <= 2"):
            copy_block_parts(table, [(0, 1, whole(dst[0]), whole(src)), (start, stop, whole(dst[1]), whole(src))], None)
    assert not dst[0].any()


def rank_owner_gone(ctx, how: str) -> dict:
    """Rank 0 exports 64 MiB of 0xA5 by IPC; rank 1 opens it; rank 0 then frees it and allocates 64 MiB of
    0x5A (`how="free"`), or is SIGKILLed (`"kill"`); rank 1 reads what it still maps."""
    from mooncake_ep_switch.buffer.transport import device_memory

    torch.cuda.set_device(0)
    device, nbytes = torch.device("cuda", 0), 64 << 20
    mine = device_memory.DeviceAllocation(nbytes, 0) if ctx.rank == 0 else None
    if mine is not None:
        device_memory.device_view(mine, device).fill_(0xA5)
        torch.cuda.synchronize()
    handles = [None, None]
    dist.all_gather_object(handles, device_memory.ipc_handle_hex(mine) if mine is not None else None, group=ctx.group)
    peer = device_memory.PeerDeviceMapping(bytes.fromhex(handles[0]), nbytes, 0) if ctx.rank == 1 else None
    dist.barrier(group=ctx.group)
    if ctx.rank == 0:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        del mine  # cudaFree while rank 1 still maps it
        again = device_memory.DeviceAllocation(nbytes, 0)
        device_memory.device_view(again, device).fill_(0x5A)
        torch.cuda.synchronize()
        ctx.store.set("owner_gone", "freed")
        time.sleep(1.0)  # alive (and holding the new allocation) while rank 1 reads
        return {}
    if how == "free":
        ctx.store.wait(["owner_gone"])
    else:
        time.sleep(2.0)  # the owner's process is gone by then
    values = torch.unique(device_memory.device_view(peer, device).cpu()).tolist()
    return {"values": values}


@gpu
@pytest.mark.parametrize("how", ["free", "kill"])
def test_gpu_peer_memory_outlives_its_owner(how):
    """What the survivors of a switch rely on: memory a peer still maps keeps its bytes after its owner frees it or
    dies (CUDA does not promise this for legacy IPC; this checks the driver the GPU run has)."""
    with harness.fresh_cluster(2) as cluster:
        outcomes = cluster.run(rank_owner_gone, how, timeout_s=120, failure_grace_s=20)
    reader = harness.outcome_value(outcomes[1])
    assert reader["values"] == [0xA5], reader


def rank_forged_endpoints(ctx) -> list:
    """A device region refuses peer endpoints that are malformed or claim more bytes than their allocation,
    and keeps its current mapping of that peer."""
    from mooncake_ep_switch.buffer.device_region import DeviceEndpoint, DeviceRegion

    device = torch.device("cpu")  # the emulated device's tensors live on the host
    region, small, other = (DeviceRegion(None, 0, 2, n, device) for n in (4096, 1024, 4096))
    errors = []
    for fields in ([os.getpid(), "zz" * 64, 4096], [True, small.endpoint.handle, 4096], [os.getpid(), "ab", 4096],
                   [os.getpid(), small.endpoint.handle, 4096.0]):
        try:
            region.endpoint_from(fields)
        except ValueError as error:
            errors.append(str(error)[:40])
    region.map_peer(1, other.endpoint)
    mapped = region.peer_bases[1]
    try:
        region.map_peer(1, DeviceEndpoint(os.getpid(), small.endpoint.handle, 4096))  # 1024 bytes behind it
    except ValueError as error:
        errors.append(str(error))
    kept = region.peer_bases[1] == mapped and region.peer_endpoints[1] == other.endpoint
    for item in (region, small, other):
        item.destroy()
    return errors + [kept]


def test_emulated_forged_device_endpoints_are_refused():
    from tests.emulated_device import run_emulated

    with harness.fresh_cluster(1) as cluster:
        result = check_outcomes(cluster.run(run_emulated, __name__, "rank_forged_endpoints", timeout_s=60))[0]
    assert len(result) == 6 and result[-1] is True, result
    assert all(text.startswith("endpoint: expected a device region") for text in result[:4]), result
    assert "holds 1024 bytes, its owner published 4096" in result[4], result


def test_the_switch_host_profile_script_runs_on_the_emulated_device():
    """scripts/switch_host_profile.py (the host's share of a switch's weight and KV phases; gpu_check.sh's
    hostprof stage) on the emulated device, its copies only counted: every phase per way and rank, each phase
    shorter than the switch, and rank 0's profile of the weight and KV phases."""
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # --top past the number of functions the phases call: the listing holds every one (a top-8 cut by own time
    # may or may not include the phase function itself)
    run = subprocess.run([sys.executable, "scripts/switch_host_profile.py", "--emulated", "--iters", "2", "--profile",
                          "--top", "100000"], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    pattern = (r"SWITCH (ep->tp|tp->ep) rank ([01]): prepare ([\d.]+) weights ([\d.]+) kv ([\d.]+) commit ([\d.]+) "
               r"total ([\d.]+) ms")
    rows = re.findall(pattern, run.stdout)
    assert sorted((way, rank) for way, rank, *_ in rows) == [("ep->tp", "0"), ("ep->tp", "1"), ("tp->ep", "0"),
                                                             ("tp->ep", "1")], run.stdout[-3000:]
    for _, _, *phases in rows:
        prepare, weights, kv, commit, total = map(float, phases)
        assert 0 < weights < total and 0 < kv < total and prepare + weights + kv + commit <= total * 1.01, phases
    assert "the host alone" in run.stdout and "_weights_one_sided" in run.stdout, run.stdout[-3000:]
