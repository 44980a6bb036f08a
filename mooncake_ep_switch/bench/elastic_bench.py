"""ElasticBuffer benchmark: DeepEP V2's dispatch + combine against the legacy Buffer on the same inputs.

`python -m mooncake_ep_switch.bench elastic [--quick]`. For each transport and shape, one rank's
ElasticBuffer round (dispatch not expanded, the expert side's partials, combine with the weights
gathered back; `max_num_bias=0`: no bias, as the Buffer has none) and the Buffer's low-latency round on
the same tokens and routing, in the same rank processes, in alternating batches of a few rounds (both
under the same load: the 2-core box these rows come from is shared with other work, whose load moves
the round time by 2-4x within seconds). The times are the medians of the batch means (the slowest rank's
per batch); the ratio is the median over batches of the two buffers' ratio in that batch (both ran back
to back), which a load burst lasting a few batches moves far less than the ratio of the two medians.
Bandwidth is per rank (DeepEP's convention): the bytes ONE rank's tokens move, once per destination
rank each way for the ElasticBuffer (V2's layout) and once per (token, expert) pair each way for the
Buffer, against one core's memcpy of those bytes; never summed over ranks.
"""
import statistics
import sys
from typing import List

import torch

from mooncake_ep_switch.bench import transport as tb
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes

TIMEOUT_US = 60_000_000


def rank_elastic_round(ctx, transport: str, shape: tb.TransportShape, iters: int, warmup: int,
                       batches: int = 5) -> dict:
    """Seconds per ElasticBuffer dispatch + combine on this rank, and per legacy Buffer round on the same
    tokens and routing, measured in alternating batches (each started by a barrier) in the same
    processes: on a machine shared with other work both see the same load, batch by batch.

    Arguments:
        ctx: the `launch.RankContext`; transport: as `bench.transport.rank_buffer_round`;
        shape: the `TransportShape`; iters: timed rounds of each buffer, split over `batches`;
        warmup: untimed rounds of each first.

    Returns:
        result: dict with `"seconds"` and `"legacy_seconds"` (float, the median over batches of the
            batch's mean round), `"batch_seconds"` and `"legacy_batch_seconds"` (list of float, every
            batch's mean round, batch `b` of both back to back), `"rank_pairs"` (int, this rank's
            (token, destination rank) pairs) and `"transport"` (str).
    """
    from mooncake_ep_switch import Buffer, ElasticBuffer

    x, topk, weights = tb.rank_inputs(ctx.rank, shape)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=shape.tokens, hidden=shape.hidden,
                           num_topk=shape.top_k, transport=transport, disable_p2p=transport == "mooncake",
                           explicitly_destroy=True, max_num_bias=0)
    size = Buffer.get_ep_buffer_size_hint(shape.tokens, shape.hidden, ctx.num_ranks, shape.experts)
    legacy = None
    state = {}

    def elastic_body():
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=weights,
                                                       num_experts=shape.experts, active_ranks=active,
                                                       timeout_us=TIMEOUT_US)
        if "y" not in state or state["y"].shape != recv_x.shape:
            state["y"] = torch.randn(recv_x.shape).to(torch.bfloat16)  # the expert side's partials
        buffer.combine(state["y"], handle, topk_weights=recv_w, active_ranks=active, timeout_us=TIMEOUT_US)

    def legacy_body():
        _, _, handle, _, _ = legacy.dispatch(x, topk, active, shape.tokens, shape.experts, TIMEOUT_US)
        legacy.combine(state["legacy_y"], topk, weights, active, TIMEOUT_US, handle)

    try:
        legacy = Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)
        state["legacy_y"] = torch.randn((shape.experts // ctx.num_ranks, ctx.num_ranks * shape.tokens,
                                         shape.hidden)).to(torch.bfloat16)
        elastic_batches, legacy_batches = tb.timed_interleaved(ctx, [elastic_body, legacy_body], iters, warmup,
                                                               batches, per_batch_means=True)
        owner = torch.div(topk, shape.experts // ctx.num_ranks, rounding_mode="floor")
        pairs = sum(int((owner == r).any(dim=1).sum()) for r in range(ctx.num_ranks))
        return {"seconds": statistics.median(elastic_batches), "legacy_seconds": statistics.median(legacy_batches),
                "batch_seconds": elastic_batches, "legacy_batch_seconds": legacy_batches, "rank_pairs": pairs,
                "transport": buffer.runtime.transport}
    finally:
        buffer.destroy()
        if legacy is not None:
            legacy.destroy()


def measure(cluster: LocalCluster, transport: str, shape: tb.TransportShape, iters: int, warmup: int = 3,
            batches: int = 5) -> dict:
    """Both rounds on a cluster (`rank_elastic_round`, `iters` rounds of each in `batches` alternating
    batches), per batch the slowest rank's mean round of each.

    Returns:
        result: dict with `"seconds"` and `"legacy_seconds"` (float, the median over batches),
            `"ratio"` (float, the median over batches of legacy / elastic in that batch), `"rank_pairs"`
            (int, the most pairs of one rank) and `"transport"` (str).
    """
    values = check_outcomes(cluster.run(rank_elastic_round, transport, shape, iters, warmup, batches, timeout_s=900))
    elastic = [max(per_rank) for per_rank in zip(*(v["batch_seconds"] for v in values))]
    legacy = [max(per_rank) for per_rank in zip(*(v["legacy_batch_seconds"] for v in values))]
    return {"seconds": statistics.median(elastic), "legacy_seconds": statistics.median(legacy),
            "ratio": statistics.median([b / a for a, b in zip(elastic, legacy)]),
            "rank_pairs": max(v["rank_pairs"] for v in values), "transport": values[0]["transport"]}


def run(quick: bool = False) -> List[dict]:
    """Rows in the `table.format_rows` shape: per transport and shape, the ElasticBuffer against the
    Buffer (same inputs, same run) and its per-rank bandwidth against one core's memcpy."""
    iters = 5 if quick else 15
    rows = []
    for shape in (tb.TransportShape(2, 128, 7168, 32, 8), tb.TransportShape(4, 128, 1024, 32, 8)):
        label = f"R={shape.num_ranks} T={shape.tokens} hidden={shape.hidden} E={shape.experts} K={shape.top_k}"
        with LocalCluster(shape.num_ranks) as cluster:
            for transport in ("shm", "mooncake", "collective"):
                # Every transport the same timed rounds; the R=4 H=1024 shape (a round of a few ms) gets 4x as
                # many: with 5 rounds in all (1 per batch) the collective row spread 0.64-0.98x from run to
                # run. Batches of 3-4 rounds each (at least 5): the other work's load moves within seconds.
                n = iters * (4 if shape.hidden <= 1024 else 1)
                batches = max(5, n // 4)
                print(f"elastic vs Buffer: {transport}, {label}", file=sys.stderr, flush=True)
                elastic = measure(cluster, transport, shape, n, batches=batches)
                legacy = {"seconds": elastic["legacy_seconds"]}
                per_rank = elastic["rank_pairs"] * shape.hidden * 2 * 2  # one rank's tokens, both ways
                memcpy = tb.memcpy_rank_seconds(per_rank)
                name = {"mooncake": "mooncake TE (tcp, disable_p2p)"}.get(transport, transport)
                rows.append({"benchmark": f"ElasticBuffer {name} dispatch+combine (bf16, not expanded)",
                             "shape": label, "ours_ms": elastic["seconds"] * 1e3,
                             "baseline": "legacy Buffer, same tokens and routing", "baseline_ms": legacy["seconds"] * 1e3,
                             "speedup": elastic["ratio"],
                             "note": f"ratio: median of {batches} batches' ratios (of the medians: "
                                     f"{legacy['seconds'] / elastic['seconds']:.2f}x); "
                                     f"{per_rank / elastic['seconds'] / 1e9:.2f} GB/s per rank "
                                     f"({per_rank / 1e6:.1f} MB: once per destination rank each way); "
                                     f"1-core memcpy {per_rank / memcpy / 1e9:.2f} GB/s "
                                     f"({memcpy / elastic['seconds']:.2f}x of it)"})
    return rows


def main(argv=None) -> int:
    """`python -m mooncake_ep_switch.bench elastic [--quick] [--out FILE]`: the table of `run`."""
    from mooncake_ep_switch.bench.table import run_table_cli

    return run_table_cli("python -m mooncake_ep_switch.bench elastic", __doc__, run, list(argv or []))
