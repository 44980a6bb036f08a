"""Transport benchmarks: dispatch+combine time per transport, against in-run baselines.

Baselines measured in the same run: a single-core memcpy of the same logical bytes, and an
all-gather + all-reduce implementation of the same semantics (the design of Mooncake's fallback).
Logical bytes of a round = selections x hidden x 2 (dispatch) + the same again (combine), where
selections = valid (token, expert) pairs over all ranks.
"""
import statistics
import time
from typing import List, NamedTuple

import torch
import torch.distributed as dist

from mooncake_ep_switch.launch import LocalCluster, check_outcomes


class TransportShape(NamedTuple):
    num_ranks: int
    tokens: int
    hidden: int
    experts: int
    top_k: int


def _inputs(rank, shape: TransportShape, seed=0):
    generator = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn((shape.tokens, shape.hidden), generator=generator).to(torch.bfloat16)
    scores = torch.rand((shape.tokens, shape.experts), generator=generator)
    topk = scores.topk(shape.top_k, dim=1).indices.to(torch.int64).contiguous()
    weights = torch.rand((shape.tokens, shape.top_k), generator=generator)
    return x, topk, weights


def _timed(ctx, body, iters: int, warmup: int, batches: int = 5) -> float:
    """Seconds per iteration: the median over `batches` batches (each started by a barrier) of the
    batch's mean. On a machine shared with other work, one batch that a burst of foreign load hits
    moves a mean over all iterations; the median of batch means ignores it (and would show a
    steady slowdown all the same)."""
    for _ in range(warmup):
        body()
    per_batch = max(1, iters // batches)
    means = []
    for _ in range(batches):
        dist.barrier(group=ctx.group)
        start = time.perf_counter()
        for _ in range(per_batch):
            body()
        means.append((time.perf_counter() - start) / per_batch)
    dist.barrier(group=ctx.group)
    return statistics.median(means)


def rank_buffer_round(ctx, transport: str, shape: TransportShape, iters: int, warmup: int, use_fp8=False):
    """Seconds per dispatch + combine (bf16 unless use_fp8) on this rank (see `_timed`)."""
    from mooncake_ep_switch import Buffer

    x, topk, weights = _inputs(ctx.rank, shape)
    size = Buffer.get_ep_buffer_size_hint(shape.tokens, shape.hidden, ctx.num_ranks, shape.experts)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    # "mooncake" with disable_p2p: every peer over the Transfer Engine, as between hosts.
    with Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport) as buffer:
        local = shape.experts // ctx.num_ranks
        y = torch.randn((local, ctx.num_ranks * shape.tokens, shape.hidden)).to(torch.bfloat16)

        def body():
            _, _, handle, _, _ = buffer.dispatch(x, topk, active, shape.tokens, shape.experts, 60_000_000,
                                                 use_fp8=use_fp8)
            buffer.combine(y, topk, weights, active, 60_000_000, handle)

        seconds = _timed(ctx, body, iters, warmup)
        selections = int((topk >= 0).sum())
        return {"seconds": seconds, "selections": selections, "transport": buffer.transport}


def rank_allgather_round(ctx, shape: TransportShape, iters: int, warmup: int):
    """Seconds per all-gather + all-reduce baseline round on this rank (see `_timed`)."""
    from mooncake_ep_switch.bench.allgather_baseline import allgather_combine, allgather_dispatch

    x, topk, weights = _inputs(ctx.rank, shape)
    local = shape.experts // ctx.num_ranks
    y = torch.randn((local, ctx.num_ranks * shape.tokens, shape.hidden)).to(torch.bfloat16)

    def body():
        _, _, state = allgather_dispatch(ctx.group, ctx.rank, ctx.num_ranks, x, topk, shape.tokens, shape.experts)
        allgather_combine(ctx.group, ctx.rank, ctx.num_ranks, y, weights, x.size(0), shape.tokens, shape.experts,
                          state)

    return {"seconds": _timed(ctx, body, iters, warmup)}


def memcpy_seconds(num_bytes: int, repeats: int = 20) -> float:
    """Best single-thread copy time of `num_bytes` (the memcpy roofline)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(threads)


def measure(cluster: LocalCluster, transport: str, shape: TransportShape, iters: int, warmup: int = 3,
            use_fp8=False) -> dict:
    """Run the buffer round on a cluster; the slowest rank's time counts."""
    values = check_outcomes(cluster.run(rank_buffer_round, transport, shape, iters, warmup, use_fp8,
                                        timeout_s=600))
    return {"seconds": max(v["seconds"] for v in values), "selections": sum(v["selections"] for v in values),
            "transport": values[0]["transport"]}


def measure_allgather(cluster: LocalCluster, shape: TransportShape, iters: int, warmup: int = 2) -> float:
    values = check_outcomes(cluster.run(rank_allgather_round, shape, iters, warmup, timeout_s=600))
    return max(v["seconds"] for v in values)


def fallback_vs_allgather(iters: int = 20) -> List[dict]:
    """Issue-2 benchmark: collective fallback vs all-gather + all-reduce, R=4 T=128 H=1024 E=32 K=8."""
    shape = TransportShape(4, 128, 1024, 32, 8)
    with LocalCluster(shape.num_ranks) as cluster:
        ours = measure(cluster, "collective", shape, iters)
        base = measure_allgather(cluster, shape, iters)
    return [{
        "benchmark": "collective fallback dispatch+combine (bf16)",
        "shape": f"R={shape.num_ranks} T={shape.tokens} hidden={shape.hidden} E={shape.experts} K={shape.top_k}",
        "ours_ms": ours["seconds"] * 1e3,
        "baseline": "all-gather + all-reduce",
        "baseline_ms": base * 1e3,
        "speedup": base / ours["seconds"],
    }]
