"""ElasticBuffer benchmark: DeepEP V2's dispatch + combine against the legacy Buffer on the same inputs.

`python -m mooncake_ep_switch.bench elastic [--quick]`. For each transport and shape, one rank's
ElasticBuffer round (dispatch not expanded, the expert side's partials, combine with the weights
gathered back; `max_num_bias=0`: no bias, as the Buffer has none) and the Buffer's low-latency round on the same tokens and routing, in the same run.
Bandwidth is per rank (DeepEP's convention): the bytes ONE rank's tokens move, once per destination
rank each way for the ElasticBuffer (V2's layout) and once per (token, expert) pair each way for the
Buffer, against one core's memcpy of those bytes; never summed over ranks.
"""
import sys
from typing import List

import torch

from mooncake_ep_switch.bench import transport as tb
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes

TIMEOUT_US = 60_000_000


def rank_elastic_round(ctx, transport: str, shape: tb.TransportShape, iters: int, warmup: int) -> dict:
    """Seconds per ElasticBuffer dispatch + combine on this rank (`bench.transport.timed`).

    Arguments:
        ctx: the `launch.RankContext`; transport: as `bench.transport.rank_buffer_round`;
        shape: the `TransportShape`; iters, warmup: timed and untimed rounds.

    Returns:
        result: dict with `"seconds"` (float), `"rank_pairs"` (int, this rank's (token, destination
            rank) pairs) and `"transport"` (str).
    """
    from mooncake_ep_switch import ElasticBuffer

    x, topk, weights = tb.rank_inputs(ctx.rank, shape)
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=shape.tokens, hidden=shape.hidden,
                           num_topk=shape.top_k, transport=transport, disable_p2p=transport == "mooncake",
                           explicitly_destroy=True, max_num_bias=0)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    state = {}

    def body():
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=weights,
                                                       num_experts=shape.experts, active_ranks=active,
                                                       timeout_us=TIMEOUT_US)
        if "y" not in state or state["y"].shape != recv_x.shape:
            state["y"] = torch.randn(recv_x.shape).to(torch.bfloat16)  # the expert side's partials
        buffer.combine(state["y"], handle, topk_weights=recv_w, active_ranks=active, timeout_us=TIMEOUT_US)

    try:
        seconds = tb.timed(ctx, body, iters, warmup)
        owner = torch.div(topk, shape.experts // ctx.num_ranks, rounding_mode="floor")
        pairs = sum(int((owner == r).any(dim=1).sum()) for r in range(ctx.num_ranks))
        return {"seconds": seconds, "rank_pairs": pairs, "transport": buffer.runtime.transport}
    finally:
        buffer.destroy()


def measure(cluster: LocalCluster, transport: str, shape: tb.TransportShape, iters: int, warmup: int = 2) -> dict:
    """The ElasticBuffer round on a cluster; the slowest rank's time and the most pairs of one rank."""
    values = check_outcomes(cluster.run(rank_elastic_round, transport, shape, iters, warmup, timeout_s=900))
    return {"seconds": max(v["seconds"] for v in values), "rank_pairs": max(v["rank_pairs"] for v in values),
            "transport": values[0]["transport"]}


def run(quick: bool = False) -> List[dict]:
    """Rows in the `table.format_rows` shape: per transport and shape, the ElasticBuffer against the
    Buffer (same inputs, same run) and its per-rank bandwidth against one core's memcpy."""
    iters = 5 if quick else 15
    rows = []
    for shape in (tb.TransportShape(2, 128, 7168, 32, 8), tb.TransportShape(4, 128, 1024, 32, 8)):
        label = f"R={shape.num_ranks} T={shape.tokens} hidden={shape.hidden} E={shape.experts} K={shape.top_k}"
        with LocalCluster(shape.num_ranks) as cluster:
            for transport in ("shm", "mooncake", "collective"):
                n = iters if transport == "shm" else max(3, iters // 3)
                print(f"elastic vs Buffer: {transport}, {label}", file=sys.stderr, flush=True)
                elastic = measure(cluster, transport, shape, n)
                legacy = tb.measure(cluster, transport, shape, n)
                per_rank = elastic["rank_pairs"] * shape.hidden * 2 * 2  # one rank's tokens, both ways
                memcpy = tb.memcpy_rank_seconds(per_rank)
                name = {"mooncake": "mooncake TE (tcp, disable_p2p)"}.get(transport, transport)
                rows.append({"benchmark": f"ElasticBuffer {name} dispatch+combine (bf16, not expanded)",
                             "shape": label, "ours_ms": elastic["seconds"] * 1e3,
                             "baseline": "legacy Buffer, same tokens and routing", "baseline_ms": legacy["seconds"] * 1e3,
                             "speedup": legacy["seconds"] / elastic["seconds"],
                             "note": f"{per_rank / elastic['seconds'] / 1e9:.2f} GB/s per rank "
                                     f"({per_rank / 1e6:.1f} MB: once per destination rank each way); "
                                     f"1-core memcpy {per_rank / memcpy / 1e9:.2f} GB/s "
                                     f"({memcpy / elastic['seconds']:.2f}x of it)"})
    return rows


def main(argv=None) -> int:
    """`python -m mooncake_ep_switch.bench elastic [--quick] [--out FILE]`: the table of `run`."""
    from mooncake_ep_switch.bench.table import run_table_cli

    return run_table_cli("python -m mooncake_ep_switch.bench elastic", __doc__, run, list(argv or []))
