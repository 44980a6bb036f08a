"""`python -m mooncake_ep_switch.bench --device cuda`: the "cuda" transport on this machine's GPU.

Rows (R ranks are R processes on GPU 0; the table says whether MPS ran them concurrently or the
driver time-sliced them):
  * dispatch+combine per-rank logical bandwidth at R=2 T=128 H=7168 E=32 K=8 (bf16, and FP8
    dispatch), eager and replayed from a CUDA graph, against a device-to-device copy of one rank's
    bytes on the same GPU in the same run (DeepEP's convention: one rank's dispatch + combine bytes
    over its round time, never summed over ranks);
  * the T=1 round trip (dispatch + combine) at H=7168, eager and from a graph;
  * the CPU shm transport at the same shape in the same run, beside them;
  * the TP<->EP switch on device memory: weight reshard and KV redistribution in GB/s against a
    device-to-device copy of the same bytes (`bench.switch_cuda_bench`).
`python -m mooncake_ep_switch.bench --device cuda switch [--quick]` runs the switch rows alone
(`bench.switch_cuda_bench.main`; without `--quick` the full shape, 3 GiB of weights a rank).
Timing: per rank, CUDA events around batches started by a barrier; the median batch mean; the
slowest rank counts. Value checks (`MEP_CUDA_CHECK_VALUES`) are off in the timed ranks: they
synchronise once per call by design.
"""
import shutil
import statistics
import subprocess
import sys
from typing import List

import torch
import torch.distributed as dist

from mooncake_ep_switch.bench import transport as tb
from mooncake_ep_switch.bench.table import run_table_cli
from mooncake_ep_switch.config import settings
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes

TIMEOUT_US = 30_000_000
RANK_ENV = {"MEP_CUDA_CHECK_VALUES": "0"}


def gpu_sharing() -> str:
    """How the ranks' processes share the GPU: "MPS" when an MPS control daemon runs, else time-sliced."""
    found = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-control"], capture_output=True, text=True) \
        if shutil.which("pgrep") else None
    if found is not None and found.stdout.strip():
        return "MPS (kernels of the rank processes run concurrently)"
    return "time-sliced by the driver (no MPS: one process's kernels at a time)"


def rank_cuda_round(ctx, shape: tb.TransportShape, iters: int, warmup: int, use_fp8: bool, graph: bool,
                    batches: int = 5) -> dict:
    """Seconds per dispatch + combine on this rank's CUDA Buffer (median of batch means, CUDA events).

    Arguments:
        ctx: the `launch.RankContext`.
        shape: the `TransportShape`.
        iters: timed rounds, split over `batches` batches.
        warmup: untimed rounds first.
        use_fp8: dispatch FP8 rows.
        graph: time replays of one captured dispatch + combine instead of eager calls.
        batches: barrier-separated batches.

    Returns:
        result: dict with `"seconds"` (per round) and `"selections"` (this rank's valid pairs).
    """
    from mooncake_ep_switch import Buffer

    torch.cuda.set_device(0)
    x, topk, weights = (t.cuda() for t in tb.rank_inputs(ctx.rank, shape))
    size = Buffer.get_ep_buffer_size_hint(shape.tokens, shape.hidden, ctx.num_ranks, shape.experts)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32, device="cuda")
    local = shape.experts // ctx.num_ranks
    y = torch.randn((local, ctx.num_ranks * shape.tokens, shape.hidden), device="cuda").to(torch.bfloat16)
    with Buffer(ctx.group, size, transport="cuda") as buffer:
        def round_trip():
            _, _, handle, _, _ = buffer.dispatch(x, topk, active, shape.tokens, shape.experts, TIMEOUT_US,
                                                 use_fp8=use_fp8)
            buffer.combine(y, topk, weights, active, TIMEOUT_US, handle)

        body = round_trip
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                round_trip()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                round_trip()
            body = captured.replay
        for _ in range(warmup):
            body()
        torch.cuda.synchronize()
        per_batch = max(1, iters // batches)
        means = []
        for _ in range(batches):
            dist.barrier(group=ctx.group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_batch):
                body()
            end.record()
            end.synchronize()
            means.append(start.elapsed_time(end) / 1e3 / per_batch)
        dist.barrier(group=ctx.group)
        torch.cuda.synchronize()
        if active.tolist() != [1] * ctx.num_ranks:
            raise RuntimeError(f"a healthy benchmark round masked ranks: {active.tolist()}")
    return {"seconds": statistics.median(means), "selections": int((topk >= 0).sum())}


def rank_device_copy(ctx, num_bytes: int, repeats: int = 50):
    """Seconds of one device-to-device copy of `num_bytes` on GPU 0 (median of `repeats`, CUDA events).

    Only rank 0 copies (the other ranks return None at once), so the copy has the GPU to itself: the
    baseline is one copy alone, not two ranks' copies time-sliced.
    """
    if ctx.rank != 0:
        return None
    torch.cuda.set_device(0)
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rank_device_name(ctx) -> str:
    """The name of GPU 0, as this rank sees it."""
    torch.cuda.set_device(0)
    return torch.cuda.get_device_name(0)


def _measure(cluster, shape, iters, warmup, use_fp8, graph) -> dict:
    values = check_outcomes(cluster.run(rank_cuda_round, shape, iters, warmup, use_fp8, graph, timeout_s=600))
    return {"seconds": max(v["seconds"] for v in values), "rank_selections": max(v["selections"] for v in values)}


def run(quick: bool = False) -> List[dict]:
    """Measure every row (see the module docstring).

    Arguments:
        quick: fewer rounds.

    Returns:
        rows: list of dict in the `table.format_rows` shape.
    """
    iters = 50 if quick else 500
    rows = []
    shape = tb.TransportShape(2, 128, 7168, 32, 8)
    sharing = gpu_sharing()
    with LocalCluster(shape.num_ranks, env=RANK_ENV) as cluster:
        device = check_outcomes(cluster.run(rank_device_name, timeout_s=120))[0]
        results = {(fp8, graph): _measure(cluster, shape, iters, 10, fp8, graph)
                   for fp8 in (False, True) for graph in (False, True)}
        per_rank = results[(False, False)]["rank_selections"] * shape.hidden * 2 * 2
        copy = check_outcomes(cluster.run(rank_device_copy, per_rank, timeout_s=120))[0]  # rank 0's, alone
        small = tb.TransportShape(2, 1, 7168, 32, 8)
        latency = {graph: _measure(cluster, small, iters, 20, False, graph) for graph in (False, True)}
        shm = tb.measure(cluster, "shm", shape, 20 if not quick else 5)
    label = f"R=2 T=128 hidden=7168 E=32 K=8 ({per_rank / 1e6:.1f} MB per rank)"
    launches = "fused" if settings().cuda_fused_kernels else "split"  # the ranks inherit MEP_CUDA_FUSED_KERNELS
    where = f"{device}; {launches} launches; ranks {sharing}"
    for (fp8, graph), result in results.items():
        # DeepEP's convention: the bytes that move, FP8 rows (H bytes + H/128 float32 scales) for an FP8
        # dispatch, bf16 rows for combine.
        selections = result["rank_selections"]
        moved = selections * (shape.hidden + shape.hidden // 128 * 4 if fp8 else shape.hidden * 2) + \
            selections * shape.hidden * 2
        gbps = moved / result["seconds"] / 1e9
        rows.append({"benchmark": f"cuda dispatch+combine bandwidth per rank ({'FP8 dispatch' if fp8 else 'bf16'}"
                                  f"{', CUDA graph' if graph else ', eager'})",
                     "shape": label, "ours_ms": result["seconds"] * 1e3,
                     "baseline": "device-to-device copy of one rank's bytes (rank 0 alone)", "baseline_ms": copy * 1e3,
                     "speedup": copy / result["seconds"],
                     "note": f"{gbps:.1f} GB/s logical per rank ({moved / 1e6:.1f} MB) vs copy "
                             f"{per_rank / copy / 1e9:.1f} GB/s; {where}"})
    rows.append({"benchmark": "shm dispatch+combine bandwidth per rank (bf16, CPU, same run)", "shape": label,
                 "ours_ms": shm["seconds"] * 1e3, "baseline": "cuda eager (bf16)",
                 "baseline_ms": results[(False, False)]["seconds"] * 1e3,
                 "speedup": results[(False, False)]["seconds"] / shm["seconds"],
                 "note": f"{per_rank / shm['seconds'] / 1e9:.2f} GB/s per rank on the CPU"})
    from mooncake_ep_switch.bench import switch_cuda_bench

    rows += switch_cuda_bench.run(quick, where)  # the switch's weight reshard and KV moves on device memory
    for graph, result in latency.items():
        rows.append({"benchmark": f"cuda T=1 round trip dispatch+combine ({'CUDA graph' if graph else 'eager'})",
                     "shape": "R=2 T=1 hidden=7168 E=32 K=8", "ours_ms": result["seconds"] * 1e3,
                     "baseline": "device-to-device copy of one rank's T=128 bytes", "baseline_ms": copy * 1e3,
                     "speedup": copy / result["seconds"], "note": f"{result['seconds'] * 1e6:.0f} us; {where}"})
    return rows


def main(argv=None) -> int:
    """`python -m mooncake_ep_switch.bench --device cuda [switch] [--quick] [--out FILE]`.

    Arguments:
        argv: the arguments after `--device cuda`; when the first is `switch`, the rest go to
            `bench.switch_cuda_bench.main` (the switch rows alone).

    Returns:
        status: int, 0 (failures raise).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["switch"]:
        from mooncake_ep_switch.bench import switch_cuda_bench

        return switch_cuda_bench.main(argv[1:])
    return run_table_cli("python -m mooncake_ep_switch.bench --device cuda", __doc__, run, argv)


if __name__ == "__main__":
    sys.exit(main())
