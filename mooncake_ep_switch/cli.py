"""Command line: `mooncake-ep [demo|bench|simulate]` (also `python -m mooncake_ep_switch`)."""
import argparse
import sys


def _demo(args) -> int:
    from mooncake_ep_switch.demo import DemoConfig, run_demo

    config = DemoConfig(num_ranks=args.ranks, steps=args.steps, transport=args.transport, use_fp8=args.fp8,
                        out_dir=args.out, kill_step=args.kill_step, kill_rank=min(2, args.ranks - 1))
    metrics = run_demo(config)
    return 0 if metrics["correct"] else 1


def _bench(args) -> int:
    from mooncake_ep_switch.bench.__main__ import main as bench_main

    return bench_main(args.rest)


def main(argv=None) -> int:
    """Entry point of the `mooncake-ep` console script."""
    parser = argparse.ArgumentParser(prog="mooncake-ep", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="serve a small MoE model on local CPU ranks (default)")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--transport", default="auto", choices=["auto", "shm", "mooncake", "collective"])
    demo.add_argument("--fp8", action="store_true", help="FP8 dispatch")
    demo.add_argument("--out", default="mep_demo_out", help="directory for metrics.json")
    demo.add_argument("--kill-step", type=int, default=8, help="step at which a rank is killed and replaced (-1: none)")
    bench = sub.add_parser("bench", help="transport benchmarks with in-run baselines")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo"] + list(argv or sys.argv[1:]))
    if args.command == "demo":
        return _demo(args)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
