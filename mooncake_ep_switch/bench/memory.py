"""Resident memory of one rank per transport: what the Buffer keeps resident, apart from the caller's tensors.

`python -m mooncake_ep_switch.bench memory [--quick]`. At DeepEP's low-latency shapes (R=2 T=128 H=7168
E=288 K=8, the region sized by `Buffer.get_ep_buffer_size_hint`: 3.19 GB per rank), every rank samples
/proc/self/status (RssAnon: heap and torch tensors; RssShmem: touched pages of the memfd regions, its own
and the peers' it maps) at four points: before the Buffer exists, after its constructor, after one
dispatch (its outputs exist) and after the combine; then it drops the round's outputs and samples again.
The caller's tensors (inputs, the expert output `y`) are made before the first sample; the round's
outputs (`recv_x`, its scales, the handle, the combined tensor) are counted by their `nbytes`, so

    ours = RSS(after the round, outputs dropped) - RSS(before the Buffer)

is what the Buffer itself keeps resident (region pages touched, staging, output pool, engine). The table
prints it for the rank that keeps the most, in MB and as a fraction of the region (both from this run).
`--quick`: a smaller shape (E=32). Logical sizes are per rank (DeepEP's convention), never summed.
"""
import gc
import sys

import torch

from mooncake_ep_switch.bench.transport import TransportShape, rank_inputs
from mooncake_ep_switch.launcher.launch import LocalCluster

FULL = TransportShape(2, 128, 7168, 288, 8)
QUICK = TransportShape(2, 128, 7168, 32, 8)
TRANSPORTS = ("shm", "mooncake", "collective")


def _status_kib() -> dict:
    found = {}
    with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "RssAnon:", "RssShmem:")):
                key, value = line.split(":", 1)
                found[key] = int(value.split()[0])
    return found


def _resident(status: dict) -> int:
    """Bytes resident that this process made: anonymous memory and shared (memfd) pages."""
    return (status.get("RssAnon", 0) + status.get("RssShmem", 0)) * 1024


def rank_memory(ctx, transport: str, shape: TransportShape) -> dict:
    """One rank: resident bytes at each point of one dispatch + combine on a fresh Buffer.

    Arguments:
        ctx: the `launch.RankContext`.
        transport: "shm", "mooncake" (disable_p2p: every peer over the Transfer Engine) or "collective".
        shape: the `TransportShape`.

    Returns:
        sample: dict of int bytes: `region` (the Buffer's region size, 0 on the collective), `before`,
            `built`, `dispatched`, `combined`, `dropped` (resident anon + shmem at each point), `outputs`
            (the nbytes of the round's outputs), and the transport the Buffer used.
    """
    from mooncake_ep_switch import Buffer

    torch.set_num_threads(1)
    x, topk, weights = rank_inputs(ctx.rank, shape)
    local = shape.experts // ctx.num_ranks
    y = torch.randn((local, ctx.num_ranks * shape.tokens, shape.hidden)).to(torch.bfloat16)  # the caller's
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    size = 0 if transport == "collective" else Buffer.get_ep_buffer_size_hint(shape.tokens, shape.hidden,
                                                                                ctx.num_ranks, shape.experts)
    gc.collect()
    torch.distributed.barrier(group=ctx.group)
    before = _resident(_status_kib())
    buffer = Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)
    built = _resident(_status_kib())
    recv, count, handle, event, hook = buffer.dispatch(x, topk, active, shape.tokens, shape.experts, 60_000_000,
                                                       use_fp8=False)
    dispatched = _resident(_status_kib())
    combined, _, _ = buffer.combine(y, topk, weights, active, 60_000_000, handle)
    after = _resident(_status_kib())
    outputs = recv.nbytes + count.nbytes + combined.nbytes + sum(t.nbytes for t in handle if torch.is_tensor(t))
    used = buffer.transport
    del recv, count, handle, event, hook, combined
    gc.collect()
    torch.distributed.barrier(group=ctx.group)
    dropped = _resident(_status_kib())
    buffer.destroy()
    return {"transport": used, "region": size, "before": before, "built": built, "dispatched": dispatched,
            "combined": after, "dropped": dropped, "outputs": outputs}


def run(quick: bool = False) -> list:
    """Measure every transport.

    Arguments:
        quick: the smaller shape.

    Returns:
        rows: list of dict per transport: `transport`, `shape` (str), and the largest rank's `rank_memory`
            sample (the rank whose Buffer kept the most resident).
    """
    from mooncake_ep_switch.launcher.launch import check_outcomes

    shape = QUICK if quick else FULL
    label = f"R={shape.num_ranks} T={shape.tokens} H={shape.hidden} E={shape.experts} K={shape.top_k}"
    rows = []
    for transport in TRANSPORTS:
        print(f"[memory] {transport} {label}", file=sys.stderr, flush=True)
        with LocalCluster(shape.num_ranks) as cluster:
            samples = check_outcomes(cluster.run(rank_memory, transport, shape, timeout_s=600))
        worst = max(samples, key=lambda s: s["dropped"] - s["before"])
        rows.append(dict(worst, requested=transport, shape=label))
    return rows


def format_table(rows: list) -> str:
    """Markdown table: per transport, what the Buffer keeps resident against its region (same run).

    Arguments:
        rows: `run()`'s rows.

    Returns:
        table: str (no trailing newline).
    """
    lines = ["| transport | shape | region (MB) | ours resident (MB) | ours / region | after constructor (MB) | "
             "after dispatch (MB) | after combine (MB) | round outputs (MB) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        base = row["before"]
        ours = row["dropped"] - base
        name = row["transport"] + (" (disable_p2p: TE to every peer)" if row["requested"] == "mooncake" else "")
        ratio = f"{ours / row['region']:.3f}x" if row["region"] else "-"
        lines.append(f"| {name} | {row['shape']} | {row['region'] / 1e6:.0f} | {ours / 1e6:.1f} | {ratio} | "
                     f"{(row['built'] - base) / 1e6:.1f} | {(row['dispatched'] - base) / 1e6:.1f} | "
                     f"{(row['combined'] - base) / 1e6:.1f} | {row['outputs'] / 1e6:.1f} |")
    return "\n".join(lines)


def main(argv) -> int:
    """`python -m mooncake_ep_switch.bench memory [--quick] [--out FILE]`: print the table.

    Arguments:
        argv: the arguments after `memory`.

    Returns:
        status: int, 0.
    """
    from mooncake_ep_switch.bench.table import run_table_cli

    return run_table_cli("python -m mooncake_ep_switch.bench memory", __doc__, run, argv, format_table)
