"""Transport benchmarks: dispatch+combine time per transport, against in-run baselines.

Baselines measured in the same run: a single-core memcpy of the same logical bytes, and an
all-gather + all-reduce implementation of the same semantics (the design of Mooncake's fallback).
Bandwidth is per rank, as DeepEP reports it: the bytes ONE rank dispatches and combines (its valid
(token, expert) pairs x hidden x 2, twice) over its round time, against one core's memcpy of those
bytes (never summed over ranks).
"""
import statistics
import time
from typing import List, NamedTuple

import torch
import torch.distributed as dist

from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes


class TransportShape(NamedTuple):
    """Shape of one transport benchmark round (inputs are random, seeded per rank).

    Fields:
        num_ranks: `R`.
        tokens: `T`, tokens per rank (also num_max_dispatch_tokens_per_rank).
        hidden: `H`.
        experts: `E`, a multiple of `R`.
        top_k: `K`.
    """

    num_ranks: int
    tokens: int
    hidden: int
    experts: int
    top_k: int


def rank_inputs(rank, shape: TransportShape, seed=0):
    generator = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn((shape.tokens, shape.hidden), generator=generator).to(torch.bfloat16)
    scores = torch.rand((shape.tokens, shape.experts), generator=generator)
    topk = scores.topk(shape.top_k, dim=1).indices.to(torch.int64).contiguous()
    weights = torch.rand((shape.tokens, shape.top_k), generator=generator)
    return x, topk, weights


def timed(ctx, body, iters: int, warmup: int, batches: int = 5) -> float:
    """Seconds per iteration: the median over `batches` batches (each started by a barrier) of the
    batch's mean. On a machine shared with other work, one batch that a burst of foreign load hits
    moves a mean over all iterations; the median of batch means ignores it (and would show a
    steady slowdown all the same)."""
    return timed_interleaved(ctx, [body], iters, warmup, batches)[0]


def timed_interleaved(ctx, bodies, iters: int, warmup: int, batches: int = 5, per_batch_means: bool = False) -> list:
    """Seconds per iteration of each of `bodies`, measured in alternating batches in the same processes
    (batch 1 of each body, then batch 2 of each, ...; every other batch takes the bodies in reverse
    order, so that neither always runs first): a ratio between two bodies then compares them under the
    same load. Each entry is the median of that body's batch means, as `timed` gives it, or with
    `per_batch_means` the list of its batch means (batch `b` of every body ran back to back)."""
    for _ in range(warmup):
        for body in bodies:
            body()
    per_batch = max(1, iters // batches)
    means = [[] for _ in bodies]
    for batch in range(batches):
        order = list(zip(bodies, means))
        for body, times in (order if batch % 2 == 0 else order[::-1]):
            dist.barrier(group=ctx.group)
            start = time.perf_counter()
            for _ in range(per_batch):
                body()
            times.append((time.perf_counter() - start) / per_batch)
    dist.barrier(group=ctx.group)
    return means if per_batch_means else [statistics.median(times) for times in means]


def rank_buffer_round(ctx, transport: str, shape: TransportShape, iters: int, warmup: int, use_fp8=False):
    """Seconds per dispatch + combine (bf16 unless use_fp8) on this rank (see `timed`).

    Runs inside a `LocalCluster` rank; collective over `ctx.group`.

    Arguments:
        ctx: the `launch.RankContext`.
        transport: `"shm"`, `"mooncake"` (with `disable_p2p`: every peer over the Transfer
            Engine), `"collective"` or `"auto"`.
        shape: the `TransportShape`.
        iters: timed iterations, split over 5 batches.
        warmup: untimed iterations first.
        use_fp8: dispatch FP8 rows.

    Returns:
        result: dict with `"seconds"` (float, per round), `"selections"` (int, this rank's valid
            (token, expert) pairs) and `"transport"` (str, the path the Buffer used).
    """
    from mooncake_ep_switch import Buffer

    x, topk, weights = rank_inputs(ctx.rank, shape)
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

        seconds = timed(ctx, body, iters, warmup)
        selections = int((topk >= 0).sum())
        return {"seconds": seconds, "selections": selections, "transport": buffer.transport}


def rank_allgather_round(ctx, shape: TransportShape, iters: int, warmup: int):
    """Seconds per all-gather + all-reduce baseline round on this rank (see `timed`).

    Arguments:
        ctx: the `launch.RankContext`.
        shape: the `TransportShape`.
        iters: timed iterations, split over 5 batches.
        warmup: untimed iterations first.

    Returns:
        result: dict with `"seconds"` (float, per round).
    """
    from mooncake_ep_switch.bench.allgather_baseline import allgather_combine, allgather_dispatch

    x, topk, weights = rank_inputs(ctx.rank, shape)
    local = shape.experts // ctx.num_ranks
    y = torch.randn((local, ctx.num_ranks * shape.tokens, shape.hidden)).to(torch.bfloat16)

    def body():
        _, _, state = allgather_dispatch(ctx.group, ctx.rank, ctx.num_ranks, x, topk, shape.tokens, shape.experts)
        allgather_combine(ctx.group, ctx.rank, ctx.num_ranks, y, weights, x.size(0), shape.tokens, shape.experts,
                          state)

    return {"seconds": timed(ctx, body, iters, warmup)}


def memcpy_seconds(num_bytes: int, repeats: int = 20) -> float:
    """Best single-thread copy time of `num_bytes` (the memcpy roofline).

    Arguments:
        num_bytes: bytes to copy, >= 1.
        repeats: copies timed; the fastest counts.

    Returns:
        seconds: float, the fastest `torch.Tensor.copy_` of `num_bytes` torch.uint8 on one thread.
    """
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


OUT_OF_CACHE_BYTES = 64 << 20  # memcpy baselines copy at least this much: a rate from memory, not from L3


def memcpy_rank_seconds(num_bytes: int) -> float:
    """One core's memcpy time for `num_bytes`, at the rate of a copy of at least `OUT_OF_CACHE_BYTES`
    (a smaller copy repeated back to back would run from the last-level cache, which one rank's
    round data never does).

    Arguments:
        num_bytes: bytes one rank moves per round, >= 1.

    Returns:
        seconds: float.
    """
    copied = max(int(num_bytes), OUT_OF_CACHE_BYTES)
    return memcpy_seconds(copied) * num_bytes / copied


def measure(cluster: LocalCluster, transport: str, shape: TransportShape, iters: int, warmup: int = 3,
            use_fp8=False) -> dict:
    """Run the buffer round on a cluster; the slowest rank's time counts.

    Arguments:
        cluster: a running `LocalCluster` of `shape.num_ranks` ranks.
        transport: the Buffer transport (see `rank_buffer_round`).
        shape: the `TransportShape`.
        iters: timed iterations per rank.
        warmup: untimed iterations first.
        use_fp8: dispatch FP8 rows.

    Returns:
        result: dict with `"seconds"` (float, the slowest rank's per-round time), `"selections"`
            (int, summed over ranks), `"rank_selections"` (int, the most of one rank) and `"transport"`
            (str, rank 0's path).

    Raises:
        RuntimeError: a rank failed (see `launch.check_outcomes`).
    """
    values = check_outcomes(cluster.run(rank_buffer_round, transport, shape, iters, warmup, use_fp8,
                                        timeout_s=600))
    return {"seconds": max(v["seconds"] for v in values), "selections": sum(v["selections"] for v in values),
            "rank_selections": max(v["selections"] for v in values), "transport": values[0]["transport"]}


def measure_allgather(cluster: LocalCluster, shape: TransportShape, iters: int, warmup: int = 2) -> float:
    """Run the all-gather + all-reduce baseline round on a cluster; the slowest rank's time counts.

    Arguments:
        cluster: a running `LocalCluster` of `shape.num_ranks` ranks.
        shape: the `TransportShape`.
        iters: timed iterations per rank.
        warmup: untimed iterations first.

    Returns:
        seconds: float, the slowest rank's per-round time.
    """
    values = check_outcomes(cluster.run(rank_allgather_round, shape, iters, warmup, timeout_s=600))
    return max(v["seconds"] for v in values)


def rank_exchange_floor(ctx, shape: TransportShape, iters: int, warmup: int):
    """Seconds of the collective fallback's exchanges alone: the same `all_to_all_single` calls with
    the same per-peer byte counts as one bf16 dispatch + combine round, no packing or reduction.

    Sizes follow `fallback/collective.py`: dispatch records of `record_layout` bytes, fixed
    blocks of `T + 1` records per peer when they fit `FIXED_MODE_MAX_BYTES` (else a count exchange and
    the exact records), and the combine returning one bf16 row per (token, expert) pair.

    Arguments:
        ctx: the `launch.RankContext`.
        shape: the `TransportShape`.
        iters: timed iterations, split over 5 batches.
        warmup: untimed iterations first.

    Returns:
        result: dict with `"seconds"` (float, per round), `"bytes_sent"` (int, this rank's bytes
            per round) and `"exchanges"` (int, all_to_all_single calls per round: 2 or 3).
    """
    from mooncake_ep_switch.buffer.transport.collective import FIXED_MODE_MAX_BYTES, record_layout

    R, T, H = ctx.num_ranks, shape.tokens, shape.hidden
    local = shape.experts // R
    _, topk, _ = rank_inputs(ctx.rank, shape)
    owner = torch.div(topk, local, rounding_mode="floor")
    pairs_to = torch.stack([(owner == r).sum() for r in range(R)]).to(torch.int64)
    tokens_to = torch.stack([(owner == r).any(1).sum() for r in range(R)]).to(torch.int64)
    pairs_from = torch.empty_like(pairs_to)
    dist.all_to_all_single(pairs_from, pairs_to, group=ctx.group)
    tokens_from = torch.empty_like(tokens_to)
    dist.all_to_all_single(tokens_from, tokens_to, group=ctx.group)
    record = record_layout(H, local, False)[2]
    fixed = R * (T + 1) * record <= FIXED_MODE_MAX_BYTES
    if fixed:
        d_send = d_recv = [(T + 1) * record] * R
    else:
        d_send, d_recv = (tokens_to * record).tolist(), (tokens_from * record).tolist()
    c_send, c_recv = (pairs_from * 2 * H).tolist(), (pairs_to * 2 * H).tolist()
    buffers = [torch.empty(sum(sizes), dtype=torch.uint8) for sizes in (d_send, d_recv, c_send, c_recv)]
    counts_send, counts_recv = torch.zeros((R, 2), dtype=torch.int64), torch.zeros((R, 2), dtype=torch.int64)

    def body():
        if not fixed:
            dist.all_to_all_single(counts_recv, counts_send, group=ctx.group)
        dist.all_to_all_single(buffers[1], buffers[0], d_recv, d_send, group=ctx.group)
        dist.all_to_all_single(buffers[3], buffers[2], c_recv, c_send, group=ctx.group)

    return {"seconds": timed(ctx, body, iters, warmup), "bytes_sent": sum(d_send) + sum(c_send),
            "exchanges": 2 if fixed else 3}


def fallback_vs_allgather(iters: int = 20) -> List[dict]:
    """Issue-2 benchmark: collective fallback vs all-gather + all-reduce, R=4 T=128 H=1024 E=32 K=8.

    Also measures, in the same cluster, the floor any fallback built on these exchanges has here
    (`rank_exchange_floor`), and the best ratio that floor would allow.

    Arguments:
        iters: timed iterations per measurement.

    Returns:
        rows: two dict rows in the `table.format_rows` shape (the fallback, then the floor).
    """
    shape = TransportShape(4, 128, 1024, 32, 8)
    with LocalCluster(shape.num_ranks) as cluster:
        ours = measure(cluster, "collective", shape, iters)
        base = measure_allgather(cluster, shape, iters)
        floors = check_outcomes(cluster.run(rank_exchange_floor, shape, iters, 3, timeout_s=600))
    floor = max(v["seconds"] for v in floors)
    label = f"R={shape.num_ranks} T={shape.tokens} hidden={shape.hidden} E={shape.experts} K={shape.top_k}"
    sent = max(v["bytes_sent"] for v in floors)
    return [{
        "benchmark": "collective fallback dispatch+combine (bf16)", "shape": label,
        "ours_ms": ours["seconds"] * 1e3, "baseline": "all-gather + all-reduce", "baseline_ms": base * 1e3,
        "speedup": base / ours["seconds"],
        "note": f"{100 * floor / ours['seconds']:.0f}% of it is the bare exchanges (next row)",
    }, {
        "benchmark": "floor: the fallback's exchanges alone (no packing)", "shape": label,
        "ours_ms": floor * 1e3, "baseline": "all-gather + all-reduce", "baseline_ms": base * 1e3,
        "speedup": base / floor,
        "note": (f"{floors[0]['exchanges']} all_to_all_single per round, up to {sent / 1e6:.2f} MB sent per rank; "
                 f"the ratio is the most any fallback on these exchanges could reach here"),
    }]


def copy_floor_seconds(num_bytes: int) -> float:
    """Lower bound on moving `num_bytes` once with every core of this machine copying (memcpy rate).

    Arguments:
        num_bytes: bytes to move, >= 1.

    Returns:
        seconds: float, `memcpy_seconds(num_bytes)` divided by the CPUs this process may run on.
    """
    import os

    return memcpy_seconds(num_bytes) / len(os.sched_getaffinity(0))
