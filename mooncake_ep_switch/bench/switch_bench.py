"""`python -m mooncake_ep_switch.bench.switch_bench`: TP<->EP switch time, split into weights and KV.

For R in {2, 4} CPU ranks on the shm transport, every row compares a phase of `switch_layout` with
a baseline measured in the same run:

* weight reshard (EP->TP and TP->EP) vs the memcpy roofline: every rank memcpys, concurrently
  with the others, the bytes it moves to other ranks ((P-1)/P of its expert bytes). The reshard
  also moves its own 1/P chunk one slot down (every byte changes slot in the UMM), so it copies
  P/(P-1) times those bytes; the note gives the ratio against a memcpy of everything copied too.
* KV redistribution (EP->TP and TP->EP) vs the same memcpy roofline for the KV bytes moved.
* weight reshard on the direct one-sided path vs the collective fallback (gloo all_to_all with
  packing copies: the NCCL-style path the Moebius paper compares against).

Times are the slowest rank's phase time (`SwitchReport.weight_ms` / `kv_ms`, waits included),
median over iterations; memcpy is the slowest rank's time. Another process on the machine makes
every number noisy; ratios are what matter.
"""
import argparse
import statistics
import sys
import time
from typing import Dict, List, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes
from mooncake_ep_switch.bench.table import format_rows


class SwitchBenchShape(NamedTuple):
    """Benchmark shape: MoE weights and KV cache per rank group."""

    num_ranks: int
    num_layers: int
    experts: int
    hidden: int
    intermediate: int
    kv_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    requests: int
    tokens: int


_FLUSH_BYTES = 64 << 20  # > L3 of this class of machine: every timed copy starts from DRAM


def _flush(scratch: torch.Tensor) -> None:
    scratch.add_(1)


def _copy_seconds(ctx, nbytes: int, iters: int, scratch: torch.Tensor, streaming: bool = False) -> float:
    """Median time of a concurrent (all ranks at once) copy of `nbytes` on this rank, caches flushed.

    `streaming=False`: glibc memcpy (the memcpy roofline). `streaming=True`: the native
    `copy_blocks` (non-temporal stores), i.e. the best this machine's copy can do.
    """
    from mooncake_ep_switch import _native

    src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    dst = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    block = np.array([[dst.data_ptr(), src.data_ptr(), 1, nbytes, nbytes, nbytes]], dtype=np.int64)
    lo_d, lo_s = dst.data_ptr(), src.data_ptr()

    def copy():
        if streaming:
            _native.copy_blocks(block.ctypes.data, 1, lo_d, lo_d + dst.numel(), lo_s, lo_s + src.numel())
        else:
            _native.copy_bytes(lo_d, lo_s, nbytes)

    copy()
    times = []
    for _ in range(iters):
        _flush(scratch)
        dist.barrier(group=ctx.group)
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def populate_kv(kv, ctx, shape: SwitchBenchShape) -> None:
    """Requests of varied length on every rank (EP), some sharing a prefix, last pages partial."""
    generator = torch.Generator().manual_seed(ctx.rank)
    for index in range(shape.requests):
        rid = ctx.rank * 10_000 + index
        tokens = int(shape.tokens * (0.5 + (index % 5) / 4)) + 3
        if index % 4 == 3:  # shares half its parent's full pages, never more than its own length
            shared = min(kv.requests[rid - 1].num_tokens // shape.page_size // 2, (tokens - 1) // shape.page_size)
            kv.fork(rid - 1, rid, shared * shape.page_size, tokens)
        else:
            kv.add_request(rid, tokens)
        start = kv.reserve(rid, tokens - kv.requests[rid].num_tokens)
        n = tokens - start
        for layer in range(shape.kv_layers):
            k = torch.randn((n, shape.kv_heads, shape.head_dim), generator=generator).to(torch.bfloat16)
            kv.write(rid, layer, start, k, k)


def switch_round_trips(ctx, buffer, unified, kv, iters: int, before=None) -> Dict[str, List[dict]]:
    """`iters` timed EP -> TP -> EP round trips after one warm-up, every switch started by a barrier.

    Arguments:
        ctx: the `launch.RankContext` (its group).
        buffer: the Buffer; unified: its `UnifiedWeights`; kv: its `PagedKVCache`.
        iters: timed round trips.
        before: called before every switch's barrier (e.g. a cache flush), or None.

    Returns:
        reports: dict `"ep->tp"` / `"tp->ep"` -> list of `SwitchReport._asdict()` of the timed switches.
    """
    from mooncake_ep_switch.switch.switcher import switch_layout

    result: Dict[str, List] = {"ep->tp": [], "tp->ep": []}
    for iteration in range(iters + 1):  # the first round trip warms up
        for target in ("tp", "ep"):
            if before is not None:
                before()
            dist.barrier(group=ctx.group)
            report = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=60_000_000)
            assert report.outcome == "completed", report
            if iteration:
                result["ep->tp" if target == "tp" else "tp->ep"].append(report._asdict())
    return result


def rank_switch_bench(ctx, shape: SwitchBenchShape, iters: int, collective_iters: int):
    """One rank: switch back and forth `iters` times; memcpy baselines; the collective fallback.

    Runs inside a `LocalCluster` rank; collective over `ctx.group` (two Buffers, "shm" then "collective").

    Arguments:
        ctx: the `launch.RankContext`.
        shape: the `SwitchBenchShape`.
        iters: timed EP -> TP -> EP round trips (after one warm-up round trip).
        collective_iters: timed round trips on the collective fallback (weights only).

    Returns:
        result: dict with `"ep->tp"` and `"tp->ep"` (lists of `SwitchReport._asdict()`, one per
            timed switch), `"memcpy_weights"`, `"memcpy_weights_all"`, `"stream_weights_all"`,
            `"memcpy_kv_ep->tp"`, `"memcpy_kv_tp->ep"` (float seconds of the copy baselines) and
            `"collective"` (list of float EP -> TP weight_ms on the fallback).
    """
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache
    from mooncake_ep_switch.switch.switcher import switch_layout
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    torch.set_num_threads(1)
    wshape = WeightShape(shape.experts, shape.hidden, shape.intermediate)
    size = Buffer.get_ep_buffer_size_hint(8, shape.hidden, ctx.num_ranks, shape.experts)
    per_token_units = 1.0 / shape.page_size
    units = int(shape.requests * ctx.num_ranks * (shape.tokens * 1.5 + 4) * per_token_units * 4) + 64
    units += (-units) % ctx.num_ranks
    config = KVCacheConfig(shape.kv_layers, shape.kv_heads, shape.head_dim, shape.page_size, units)
    result: Dict[str, List] = {"ep->tp": [], "tp->ep": []}
    scratch = torch.zeros(_FLUSH_BYTES, dtype=torch.uint8)
    with Buffer(ctx.group, size, transport="shm") as buffer:
        unified = UnifiedWeights(buffer, wshape, shape.num_layers, prefault=True)
        unified.local.fill_(1)
        kv = PagedKVCache(buffer, config, prefault=True)
        populate_kv(kv, ctx, shape)
        try:
            result.update(switch_round_trips(ctx, buffer, unified, kv, iters, before=lambda: _flush(scratch)))
        finally:
            kv.destroy()
            unified.destroy()
    weight_remote = result["ep->tp"][0]["weight_bytes"]
    weight_all = weight_remote + result["ep->tp"][0]["weight_local_bytes"]
    reps = max(3, iters)
    result["memcpy_weights"] = _copy_seconds(ctx, weight_remote, reps, scratch)
    result["memcpy_weights_all"] = _copy_seconds(ctx, weight_all, reps, scratch)
    result["stream_weights_all"] = _copy_seconds(ctx, weight_all, reps, scratch, streaming=True)
    for way in ("ep->tp", "tp->ep"):
        result[f"memcpy_kv_{way}"] = _copy_seconds(ctx, max(r["kv_bytes"] for r in result[way]), reps, scratch)
    # The collective fallback on the same shapes (private memory, gloo all_to_all), weights only.
    with Buffer(ctx.group, 0, transport="collective") as buffer:
        unified = UnifiedWeights(buffer, wshape, shape.num_layers)
        unified.local.fill_(1)
        result["collective"] = []
        for iteration in range(collective_iters + 1):
            for target in ("tp", "ep"):
                _flush(scratch)
                dist.barrier(group=ctx.group)
                report = switch_layout(buffer, target, weights=unified)
                if iteration and target == "tp":
                    result["collective"].append(report.weight_ms)
        unified.destroy()
    return result


def slowest(results, way: str, key: str) -> float:
    """Median over iterations of the slowest rank's value."""
    per_iter = zip(*[[r[key] for r in res[way]] for res in results])
    return statistics.median(max(values) for values in per_iter)


def measure(shape: SwitchBenchShape, iters: int, collective_iters: int) -> List[dict]:
    """Rows for one shape (spawns `shape.num_ranks` ranks).

    Arguments:
        shape: the `SwitchBenchShape`; `num_ranks` >= 2.
        iters: timed round trips per rank (see `rank_switch_bench`).
        collective_iters: timed round trips on the collective fallback.

    Returns:
        rows: list of dict rows in the `table.format_rows` shape (weights both ways, shm vs
            collective, KV both ways).

    Raises:
        RuntimeError: a rank failed (see `launch.check_outcomes`).
    """
    with LocalCluster(shape.num_ranks) as cluster:
        results = check_outcomes(cluster.run(rank_switch_bench, shape, iters, collective_iters, timeout_s=900))
    ranks = shape.num_ranks
    label = (f"R={ranks} L={shape.num_layers} E={shape.experts} H={shape.hidden} I={shape.intermediate}")
    rows = []
    memcpy_w = max(r["memcpy_weights"] for r in results)
    memcpy_all = max(r["memcpy_weights_all"] for r in results)
    stream_all = max(r["stream_weights_all"] for r in results)
    weight_bytes = results[0]["ep->tp"][0]["weight_bytes"]
    expert_bytes = weight_bytes * ranks // (ranks - 1)
    for way in ("ep->tp", "tp->ep"):
        ours = slowest(results, way, "weight_ms") / 1e3
        rows.append({
            "benchmark": f"weight reshard {way.upper()} (shm direct)", "shape": label,
            "ours_ms": ours * 1e3, "baseline": "memcpy of the moved bytes, all ranks at once",
            "baseline_ms": memcpy_w * 1e3, "speedup": memcpy_w / ours,
            "note": (f"{weight_bytes / 2**20:.1f} MiB moved per rank = (P-1)/P of {expert_bytes / 2**20:.1f} MiB; "
                     f"{weight_bytes / ours / 1e9:.2f} GB/s moved, {expert_bytes / ours / 1e9:.2f} GB/s copied; "
                     f"vs copying all {expert_bytes / 2**20:.1f} MiB: memcpy {memcpy_all / ours:.2f}x, "
                     f"streaming copy {stream_all / ours:.2f}x")})
    coll = statistics.median(max(values) for values in zip(*[r["collective"] for r in results])) / 1e3
    ours = slowest(results, "ep->tp", "weight_ms") / 1e3
    rows.append({"benchmark": "weight reshard EP->TP: shm direct vs collective", "shape": label,
                 "ours_ms": ours * 1e3, "baseline": "collective fallback (gloo all_to_all + packing)",
                 "baseline_ms": coll * 1e3, "speedup": coll / ours, "note": ""})
    kv_label = (f"R={ranks} L={shape.kv_layers} H_kv={shape.kv_heads} D={shape.head_dim} page={shape.page_size} "
                f"{shape.requests} req/rank")
    for way in ("ep->tp", "tp->ep"):
        ours = slowest(results, way, "kv_ms") / 1e3
        base = max(r[f"memcpy_kv_{way}"] for r in results)
        kv_bytes = max(r["kv_bytes"] for res in results for r in res[way])
        rows.append({"benchmark": f"KV redistribution {way.upper()} (shm direct)", "shape": kv_label,
                     "ours_ms": ours * 1e3, "baseline": "memcpy of the moved KV bytes, all ranks at once",
                     "baseline_ms": base * 1e3, "speedup": base / ours,
                     "note": f"{kv_bytes / 2**20:.1f} MiB on the busiest rank; whole switch "
                             f"{slowest(results, way, 'total_ms'):.1f} ms = prepare "
                             f"{slowest(results, way, 'prepare_ms'):.1f} + weights "
                             f"{slowest(results, way, 'weight_ms'):.1f} + KV {ours * 1e3:.1f} + commit "
                             f"{slowest(results, way, 'commit_ms'):.1f} (slowest rank each)"})
    return rows


def run(quick: bool = False) -> List[dict]:
    """Measure every row.

    Arguments:
        quick: fewer iterations and smaller shapes.

    Returns:
        rows: list of dicts with keys benchmark, shape, ours_ms, baseline, baseline_ms, speedup, note.
    """
    rows = []
    for ranks in (2, 4):
        if quick:
            shape = SwitchBenchShape(ranks, 2, 16, 512, 256, 2, 8, 64, 16, 4, 64)
            rows += measure(shape, iters=2, collective_iters=1)
        else:
            shape = SwitchBenchShape(ranks, 4, 16, 1024, 512, 4, 8, 128, 16, 8, 256)
            rows += measure(shape, iters=5, collective_iters=2)
    return rows


def main(argv=None) -> int:
    """Run the switch benchmark and print its table (`python -m mooncake_ep_switch.bench.switch_bench`).

    Arguments:
        argv: command-line arguments (`--quick`), or None for `sys.argv[1:]`.

    Returns:
        status: int, 0 (failures raise).
    """
    parser = argparse.ArgumentParser(prog="python -m mooncake_ep_switch.bench.switch_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations, smaller shapes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(format_rows(run(quick=args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
