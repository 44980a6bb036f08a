"""Where the host's time goes in a TP <-> EP switch on device memory (weights and KV moves).

`bench --device cuda` times the weight and KV phases of `switch_layout()` on a "cuda" Buffer against a device
copy of the same bytes. At its quick shape those copies take a few microseconds to a few hundred on an H200,
and the phases take 0.4-0.9 ms (docs/benchmarks.md): the rest is the host's part, the protocol (a progress word
per layer, a wait for every peer's) and the Python that builds and queues the block tables. This measures it:
R rank processes run `--iters` EP -> TP -> EP round trips (`bench.switch_cuda_bench.rank_switch_rounds`), and
print each phase's median per rank; `--profile` adds rank 0's profile of the weight and KV phases.

  --emulated   no GPU needed: the emulated device of tests/emulated_device.py, its queued block copies
               replaced by a count of their bytes (neither checked nor made; on a GPU the check is native), so
               what is left is the host alone: the protocol and the Python layer (CI's machines, a dry run).
  on a GPU     the real copies: compare the phases with the emulated run's on the same host.

Prints `SWITCH <way> rank <r>: prepare <ms> weights <ms> kv <ms> commit <ms> total <ms>` per way and rank.

Usage: python3 scripts/switch_host_profile.py [--emulated] [--iters N] [--ranks R] [--full] [--requests N]
                                             [--tokens T] [--profile] [--functions F1,F2] [--top K]
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("prepare_ms", "weight_ms", "kv_ms", "commit_ms", "total_ms")


def _count_only(desc_ptr, n, *args, **kwargs) -> int:
    """The emulated device's `copy_blocks_async` without the copy: the bytes of the `[n, 6]` table at `desc_ptr`."""
    import numpy as np

    from mooncake_ep_switch import _native

    if n <= 0:
        return 0
    table = np.frombuffer(_native.MappedBytes(desc_ptr, 48 * n), dtype=np.int64).reshape(n, 6)
    return int((table[:, 2] * table[:, 3]).sum())


def rank_switch_host(ctx, shape, iters: int, emulated: bool, profiled, top: int):
    """One rank: `iters` timed EP -> TP -> EP round trips after one warm-up, rank 0's `profiled` functions of
    `switch.switcher` (names; empty: none) under cProfile.

    Returns:
        result: (reports by way as `rank_switch_rounds` returns them, rank 0's profile text or "").
    """
    if emulated:
        from tests.emulated_device import install

        install().copy_blocks_async = _count_only
    from mooncake_ep_switch.bench.switch_cuda_bench import rank_switch_rounds
    from mooncake_ep_switch.switch import switcher

    profiler = cProfile.Profile() if profiled and ctx.rank == 0 else None
    if profiler is not None:
        for name in profiled:
            phase = getattr(switcher, name)

            def under_profiler(*args, _phase=phase, **kwargs):
                profiler.enable()
                try:
                    return _phase(*args, **kwargs)
                finally:
                    profiler.disable()

            setattr(switcher, name, under_profiler)
    reports = rank_switch_rounds(ctx, shape, iters)
    text = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        text = out.getvalue()
    return reports, text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--emulated", action="store_true", help="the emulated device, no copies (no GPU)")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--full", action="store_true", help="bench --device cuda's full shape (default: quick)")
    parser.add_argument("--requests", type=int, default=0, help="KV requests per rank (0: the shape's)")
    parser.add_argument("--tokens", type=int, default=0, help="tokens of a typical KV request (0: the shape's)")
    parser.add_argument("--profile", action="store_true", help="rank 0's profile of the weight and KV phases")
    parser.add_argument("--functions", default="_weights_one_sided,_kv_one_sided",
                        help="with --profile: the functions of switch.switcher profiled (switch_layout: all of it)")
    parser.add_argument("--top", type=int, default=25, help="functions listed from rank 0's profile")
    args = parser.parse_args(argv)
    profiled = [name for name in args.functions.split(",") if name] if args.profile else []
    from mooncake_ep_switch.bench.switch_bench import SwitchBenchShape
    from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes
    from tests.emulated_device import run_emulated

    # bench --device cuda's shapes (bench/switch_cuda_bench.run), with --ranks ranks
    if args.full:
        shape = SwitchBenchShape(args.ranks, 4, 32, 4096, 2048, 4, 8, 128, 16, 8, 512)
    else:
        shape = SwitchBenchShape(args.ranks, 2, 16, 2048, 1024, 2, 8, 128, 16, 4, 256)
    shape = shape._replace(requests=args.requests or shape.requests, tokens=args.tokens or shape.tokens)
    with LocalCluster(args.ranks) as cluster:
        if args.emulated:
            outcomes = cluster.run(run_emulated, "scripts.switch_host_profile", "rank_switch_host", shape, args.iters,
                                   True, profiled, args.top, timeout_s=600)
        else:
            import importlib

            rank_function = importlib.import_module("scripts.switch_host_profile").rank_switch_host
            outcomes = cluster.run(rank_function, shape, args.iters, False, profiled, args.top, timeout_s=600)
        results = check_outcomes(outcomes)
    where = "emulated device, no copies: the host alone" if args.emulated else f"{results[0][0]['device']}, real copies"
    print(f"# R={shape.num_ranks} L={shape.num_layers} E={shape.experts} H={shape.hidden} I={shape.intermediate}, "
          f"KV L={shape.kv_layers} {shape.requests} req/rank; median of {args.iters} per rank ({where})", flush=True)
    for way in ("ep->tp", "tp->ep"):
        for rank, (reports, _) in enumerate(results):
            medians = {key: statistics.median(report[key] for report in reports[way]) for key in PHASES}
            print(f"SWITCH {way} rank {rank}: prepare {medians['prepare_ms']:.3f} weights {medians['weight_ms']:.3f} "
                  f"kv {medians['kv_ms']:.3f} commit {medians['commit_ms']:.3f} total {medians['total_ms']:.3f} ms",
                  flush=True)
    if args.profile:
        print(results[0][1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
