"""The TP<->EP switch on device memory (`bench --device cuda`): weight reshard and KV moves in GB/s.

R rank processes on GPU 0 build `UnifiedWeights` and a `PagedKVCache` on a "cuda" Buffer (device
regions opened by CUDA IPC) and switch EP -> TP -> EP; each row compares a phase of `switch_layout`
(`SwitchReport.weight_ms` / `kv_ms`: the slowest rank, median over round trips; a phase ends when its
device copies completed, since every progress word is published after a fence) with a
device-to-device copy of the same bytes on the same GPU in the same run (rank 0 alone: one copy with
the GPU to itself). Bytes: every byte a rank copies (the chunks for its peers and its own chunk,
which also changes slot), per rank, never summed over ranks.

`python -m mooncake_ep_switch.bench --device cuda switch [--quick] [--out FILE]` runs these rows alone: the full
shape (R=2 L=4 E=32 H=4096 I=2048, 3 GiB of weights copied a rank; KV L=4, 8 requests a rank), or with `--quick` the
small one (192 MiB). Ranks share GPU 0 as `bench --device cuda` says (MPS when a control daemon runs).
"""
import sys
from typing import Dict, List, Optional

import torch

from mooncake_ep_switch.bench.switch_bench import SwitchBenchShape, populate_kv, slowest, switch_round_trips
from mooncake_ep_switch.buffer import device_region
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes


def rank_switch_rounds(ctx, shape: SwitchBenchShape, iters: int, kernel_min_blocks: int = 0) -> Dict[str, List[dict]]:
    """One rank: `iters` timed EP -> TP -> EP round trips (after one warm-up) on a "cuda" Buffer.

    Arguments:
        ctx: the `launch.RankContext`.
        shape: the `SwitchBenchShape` (the KV cache holds `shape.requests` requests per rank).
        iters: timed round trips.
        kernel_min_blocks: from how many blocks a device move is one block-copy kernel instead of a runtime copy
            per block (`device_region.KERNEL_MIN_BLOCKS` in this rank for these rounds; 0 = as it is).

    Returns:
        reports: dict `"ep->tp"` / `"tp->ep"` -> list of `SwitchReport._asdict()`, plus `"device"` (str).
    """
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    units = int(shape.requests * ctx.num_ranks * (shape.tokens * 1.5 + 4) / shape.page_size * 4) + 64
    units += (-units) % ctx.num_ranks
    config = KVCacheConfig(shape.kv_layers, shape.kv_heads, shape.head_dim, shape.page_size, units)
    size = Buffer.get_ep_buffer_size_hint(8, shape.hidden, ctx.num_ranks, shape.experts)
    result: Dict[str, object] = {}
    with Buffer(ctx.group, size, transport="cuda") as buffer:
        unified = UnifiedWeights(buffer, WeightShape(shape.experts, shape.hidden, shape.intermediate),
                                 shape.num_layers)
        unified.local.fill_(1)
        kv = PagedKVCache(buffer, config)
        populate_kv(kv, ctx, shape)
        result["device"] = str(unified.local.device)
        policy = device_region.KERNEL_MIN_BLOCKS
        try:
            if kernel_min_blocks > 0:
                device_region.KERNEL_MIN_BLOCKS = kernel_min_blocks
            result.update(switch_round_trips(ctx, buffer, unified, kv, iters))
        finally:
            device_region.KERNEL_MIN_BLOCKS = policy
            kv.destroy()
            unified.destroy()
    return result


def measure(cluster, shape: SwitchBenchShape, iters: int, where: str) -> List[dict]:
    """Rows of one shape: reshard and KV both ways against a device copy of the same bytes.

    Arguments:
        cluster: a `LocalCluster` of `shape.num_ranks` ranks.
        shape: the `SwitchBenchShape`.
        iters: timed round trips.
        where: the device and how ranks share it (for the notes).

    Returns:
        rows: list of dict in the `table.format_rows` shape.
    """
    from mooncake_ep_switch.bench.cuda_bench import rank_device_copy

    results = check_outcomes(cluster.run(rank_switch_rounds, shape, iters, timeout_s=600))
    # The weight chunks are a few large strided blocks a layer (runtime 2D copies below KERNEL_MIN_BLOCKS): the
    # same round trips with every move one block-copy kernel, beside them.
    by_kernel = check_outcomes(cluster.run(rank_switch_rounds, shape, iters, 1, timeout_s=600))
    first = results[0]["ep->tp"][0]
    weight_bytes = first["weight_bytes"] + first["weight_local_bytes"]  # every byte a rank copies
    kv_bytes = {way: max(r["kv_bytes"] + r["kv_local_bytes"] for res in results for r in res[way])
                for way in ("ep->tp", "tp->ep")}
    copy = {nbytes: check_outcomes(cluster.run(rank_device_copy, nbytes, timeout_s=120))[0]
            for nbytes in {weight_bytes, *kv_bytes.values()} if nbytes}
    label = f"R={shape.num_ranks} L={shape.num_layers} E={shape.experts} H={shape.hidden} I={shape.intermediate}"
    kv_label = (f"R={shape.num_ranks} L={shape.kv_layers} H_kv={shape.kv_heads} D={shape.head_dim} "
                f"page={shape.page_size} {shape.requests} req/rank")
    rows = []
    for way in ("ep->tp", "tp->ep"):
        ours = slowest(results, way, "weight_ms") / 1e3
        rows.append({"benchmark": f"cuda weight reshard {way.upper()} (device regions, CUDA IPC)", "shape": label,
                     "ours_ms": ours * 1e3, "baseline": "device-to-device copy of the same bytes (rank 0 alone)",
                     "baseline_ms": copy[weight_bytes] * 1e3, "speedup": copy[weight_bytes] / ours,
                     "note": f"{weight_bytes / 2**20:.1f} MiB copied per rank: {weight_bytes / ours / 1e9:.1f} GB/s "
                             f"vs copy {weight_bytes / copy[weight_bytes] / 1e9:.1f} GB/s; {where}"})
        kernel = slowest(by_kernel, way, "weight_ms") / 1e3
        rows.append({"benchmark": f"cuda weight reshard {way.upper()}: every move one block-copy kernel",
                     "shape": label, "ours_ms": kernel * 1e3,
                     "baseline": f"runtime copies below {device_region.KERNEL_MIN_BLOCKS} blocks (above)",
                     "baseline_ms": ours * 1e3, "speedup": ours / kernel,
                     "note": f"{weight_bytes / kernel / 1e9:.1f} GB/s vs copy "
                             f"{weight_bytes / copy[weight_bytes] / 1e9:.1f} GB/s: {copy[weight_bytes] / kernel:.2f}x "
                             f"of the copy; {where}"})
    for way in ("ep->tp", "tp->ep"):
        ours = slowest(results, way, "kv_ms") / 1e3
        nbytes = kv_bytes[way]
        base = copy.get(nbytes, 0.0)
        rows.append({"benchmark": f"cuda KV redistribution {way.upper()} (device regions, CUDA IPC)",
                     "shape": kv_label, "ours_ms": ours * 1e3,
                     "baseline": "device-to-device copy of the busiest rank's KV bytes (rank 0 alone)",
                     "baseline_ms": base * 1e3, "speedup": base / ours if ours else 0.0,
                     "note": f"{nbytes / 2**20:.1f} MiB on the busiest rank: {nbytes / ours / 1e9:.1f} GB/s; whole "
                             f"switch {slowest(results, way, 'total_ms'):.1f} ms (prepare "
                             f"{slowest(results, way, 'prepare_ms'):.1f}, commit "
                             f"{slowest(results, way, 'commit_ms'):.1f}); {where}"})
    return rows


def run(quick: bool, where: Optional[str] = None) -> List[dict]:
    """Every row (R=2, one shape; `quick`: a smaller shape and fewer round trips).

    Arguments:
        quick: fewer round trips and a smaller shape.
        where: the device and how ranks share it (for the notes); None: asked here (GPU 0's name as a rank
            sees it, and whether MPS runs).

    Returns:
        rows: list of dict rows.
    """
    if quick:
        shape, iters = SwitchBenchShape(2, 2, 16, 2048, 1024, 2, 8, 128, 16, 4, 256), 3
    else:
        shape, iters = SwitchBenchShape(2, 4, 32, 4096, 2048, 4, 8, 128, 16, 8, 512), 5
    with LocalCluster(shape.num_ranks) as cluster:
        if where is None:
            from mooncake_ep_switch.bench.cuda_bench import gpu_sharing, rank_device_name

            where = f"{check_outcomes(cluster.run(rank_device_name, timeout_s=120))[0]}; ranks {gpu_sharing()}"
        return measure(cluster, shape, iters, where)


def main(argv=None) -> int:
    """`python -m mooncake_ep_switch.bench --device cuda switch [--quick] [--out FILE]`: the switch rows alone.

    Arguments:
        argv: the arguments after `switch`.

    Returns:
        status: int, 0 (failures raise).
    """
    from mooncake_ep_switch.bench.table import run_table_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_table_cli("python -m mooncake_ep_switch.bench --device cuda switch", __doc__, run, argv)
