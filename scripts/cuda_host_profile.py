"""Where the host's time goes in an eager dispatch + combine on the "cuda" transport.

A CUDA graph replays a round trip without the host; an eager call runs the Python layer (validation,
the output pool, the transport's call record) and the launches every time, and at T=1 that host path is
most of the round trip (docs/benchmarks.md: 305-410 us eager against 48-51 us from a graph on an H200).
This measures it: R rank processes each run `--rounds` eager T=1 round trips (dispatch + combine, value
checks off as in the bench) on a "cuda" Buffer; rank 0's are profiled with cProfile in a second pass.

  --emulated   no GPU needed: the emulated device of tests/emulated_device.py with the four launchers
               replaced by no-ops, so what is left is the Python layer alone (CI's machines, a dry run).
  on a GPU     the real launchers and torch.cuda: the profile splits Python from the launch calls.

Prints `HOST <n> us per eager round trip` per rank (the plain pass, no profiler) and rank 0's profile
(top functions by own time).

Usage: python3 scripts/cuda_host_profile.py [--emulated] [--rounds N] [--ranks R] [--fused] [--top K]
       [--sort tottime|cumulative]
"""
import argparse
import cProfile
import importlib
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENS, HIDDEN, EXPERTS, TOP_K = 1, 7168, 32, 8


def rank_host_profile(ctx, rounds: int, emulated: bool, top: int, sort: str = "tottime"):
    """One rank: warm-up, `rounds` timed eager round trips, then `rounds` more under cProfile (rank 0).

    Returns:
        result: (microseconds per round trip of the plain pass, rank 0's profile text or "").
    """
    if emulated:
        from tests.emulated_device import install

        fake = install()
        for name in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv"):
            setattr(fake, name, lambda *args, **kwargs: None)  # the Python layer alone
    from mooncake_ep_switch import Buffer

    device = "cpu" if emulated else "cuda"
    if not emulated:
        torch.cuda.set_device(0)
    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(TOKENS, HIDDEN, generator=generator).to(torch.bfloat16).to(device)
    topk = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(TOKENS)]).to(device)
    weights = torch.rand(TOKENS, TOP_K, generator=generator).to(device)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32, device=device)
    local = EXPERTS // ctx.num_ranks
    expert_out = torch.zeros(local, ctx.num_ranks * TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, ctx.num_ranks, EXPERTS)
    with Buffer(ctx.group, size, transport="cuda") as buffer:
        def round_trip():
            _, _, handle, _, _ = buffer.dispatch(x, topk, active, TOKENS, EXPERTS, 30_000_000, use_fp8=False)
            buffer.combine(expert_out, topk, weights, active, 30_000_000, handle)

        sync = (lambda: None) if emulated else torch.cuda.synchronize
        for _ in range(20):
            round_trip()
        sync()
        started = time.perf_counter()
        for _ in range(rounds):
            round_trip()
        sync()
        per_round = (time.perf_counter() - started) / rounds
        text = ""
        if ctx.rank == 0:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(rounds):
                round_trip()
            sync()
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(top)
            text = out.getvalue()
        else:
            for _ in range(rounds):
                round_trip()
            sync()
        if ctx.num_ranks > 1:
            torch.distributed.barrier(group=ctx.group)
    return per_round * 1e6, text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--emulated", action="store_true", help="the emulated device, no-op launchers (no GPU)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--fused", action="store_true", help="MEP_CUDA_FUSED_KERNELS=1 in the ranks")
    parser.add_argument("--top", type=int, default=30, help="functions listed from rank 0's profile")
    parser.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"),
                        help="order of the profile: own time, or time including callees")
    args = parser.parse_args(argv)
    from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes
    from tests.emulated_device import run_emulated

    env = {"MEP_CUDA_CHECK_VALUES": "0"}
    if args.fused:
        env["MEP_CUDA_FUSED_KERNELS"] = "1"
    # The ranks import the rank function by its module's name (this file runs as __main__ here).
    rank_function = importlib.import_module("scripts.cuda_host_profile").rank_host_profile
    with LocalCluster(args.ranks, env=env) as cluster:
        if args.emulated:
            outcomes = cluster.run(run_emulated, "scripts.cuda_host_profile", "rank_host_profile", args.rounds, True,
                                   args.top, args.sort, timeout_s=600)
        else:
            outcomes = cluster.run(rank_function, args.rounds, False, args.top, args.sort, timeout_s=600)
        results = check_outcomes(outcomes)
    where = "emulated device, no-op launchers: the Python layer alone" if args.emulated else \
        f"{torch.cuda.get_device_name(0)}, real launches"
    for rank, (micros, _) in enumerate(results):
        print(f"HOST rank {rank}: {micros:.1f} us per eager round trip (T={TOKENS} H={HIDDEN} E={EXPERTS} "
              f"K={TOP_K}, R={args.ranks}, {'fused' if args.fused else 'split'} launches; {where})", flush=True)
    print(results[0][1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
