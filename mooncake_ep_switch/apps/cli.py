"""Command line: `mooncake-ep [demo|bench|simulate]` (also `python -m mooncake_ep_switch`).

Subcommands (each has its own `--help`):
  demo      serve a small MoE model on local CPU ranks (the default when no subcommand is given)
  bench     benchmarks with in-run baselines; `bench --help` lists its own subcommands
            (soak, hosts, elastic, memory, recovery, resize, --device cuda)
  simulate  replay serving and RL-rollout traces through the TP<->EP switch policy
"""
import argparse
import importlib
import sys

from mooncake_ep_switch.version import version_line


def _demo(args) -> int:
    if args.device == "cuda":
        from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason

        if args.model is not None or args.transport not in ("auto", "cuda"):
            raise SystemExit("demo --device cuda: runs the built-in MoE stack over the 'cuda' transport "
                             "(no --model, --transport auto or cuda)")
        reason = cuda_unavailable_reason()
        if reason:
            print(f"demo --device cuda: {reason}", file=sys.stderr)
            return 2
        args.transport = "cuda"  # the whole demo (switches, online EPLB, a rank replaced) on device memory
    if args.transport == "cuda" and args.device != "cuda":
        raise SystemExit("demo: --transport cuda needs --device cuda")
    transport = _host_transport(args.transport)
    if args.resize:
        return _resize(args, transport)
    if args.model is not None:
        if args.store != "tcp":
            raise SystemExit("demo --model: runs on the launcher's TCPStore (no --store etcd)")
        if not _importable("transformers"):
            print(f"demo --model {args.model}: needs Hugging Face transformers (the `models` extra): "
                  "pip install -e '.[models]' or pip install 'transformers>=5,<6'", file=sys.stderr)
            return 2
        from mooncake_ep_switch.models.demo import run_model_demo

        return 0 if run_model_demo(args.model, args.ranks, transport) else 1
    from mooncake_ep_switch.apps.demo import DemoConfig, run_demo

    defaults = DemoConfig()
    steps = defaults.steps if args.steps is None else args.steps
    first, end = (int(round(f * steps)) for f in defaults.burst)
    kill_step = args.kill_step
    if kill_step is None:  # a step a little past the middle of the burst
        kill_step = first + (end - first) * 4 // 5
    covered_kill_step = args.covered_kill_step
    if covered_kill_step is None:  # two steps into the burst, when the main kill comes late enough after it
        covered_kill_step = first + 2 if kill_step >= 0 and first + 2 < kill_step - 1 else -1
    # Every expert with two copies at the start (each rank's redundant slots hold the next rank's experts): the
    # covered kill finds a rank whose experts all live elsewhere; EPLB then leaves some with one copy.
    redundant = args.redundant
    if redundant is None:
        redundant = defaults.experts // args.ranks if covered_kill_step >= 0 else defaults.redundant_per_rank
    # Ranks sharing one GPU are time-sliced: a live peer can be late by several slices.
    timeout_us = 3_000_000 if transport == "cuda" else defaults.timeout_us
    config = DemoConfig(num_ranks=args.ranks, steps=steps, transport=transport, out_dir=args.out,
                        kill_step=kill_step, kill_rank=min(2, args.ranks - 1), timeout_us=timeout_us,
                        replacement=args.replacement, replace_after=args.replace_after,
                        kill_covered=args.kill_covered, store=args.store, covered_kill_step=covered_kill_step,
                        redundant_per_rank=redundant)
    metrics = run_demo(config)
    return 0 if metrics["correct"] else 1


def _resize(args, transport: str) -> int:
    """`demo --resize`: serve while the group shrinks after a death and grows with new processes
    (apps/demo_resize.py)."""
    from mooncake_ep_switch.apps.demo_resize import run_resize
    from mooncake_ep_switch.apps.resize_ranks import ResizeConfig

    if args.model is not None or args.device != "cpu" or transport not in ("host", "shm"):
        raise SystemExit("demo --resize: runs the built-in MoE layers on CPU ranks over shm (no --model, --device "
                         "cuda or --transport other than auto/host/shm)")
    defaults = ResizeConfig()
    smallest = -(-defaults.experts // defaults.slots_per_rank) + 1  # after the shrink every expert still has a slot
    if not smallest <= args.ranks <= 62:
        raise SystemExit(f"demo --resize --ranks: expected {smallest} to 62 ranks ({defaults.experts} experts on "
                         f"{defaults.slots_per_rank} slots per rank after one rank is removed; 2 more after the "
                         f"grow, at most MAX_EP_RANKS = 64), got {args.ranks}")
    steps = defaults.steps_between if args.steps is None else args.steps
    if steps < 2:
        raise SystemExit(f"demo --resize --steps: expected the steps between resizes, at least 2, got {steps}")
    config = ResizeConfig(num_ranks=args.ranks, steps_between=steps, out_dir=args.out,
                          kill_rank=min(defaults.kill_rank, args.ranks - 1))
    return 0 if run_resize(config)["correct"] else 1


def _importable(module: str) -> bool:
    """Whether `module` imports (an optional extra is installed and works)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _host_transport(requested: str) -> str:
    """The CPU demos feed CPU tensors: their "auto" is "host" (the choice among the host transports,
    never the "cuda" one that "auto" picks on a machine with a GPU)."""
    return "host" if requested == "auto" else requested


def _bench(rest) -> int:
    if rest[:1] == ["recovery"]:  # runs the demo: lives with the apps (bench never imports apps)
        from mooncake_ep_switch.apps.recovery_bench import main as recovery_main

        return recovery_main(rest[1:])
    if rest[:1] == ["resize"]:  # runs the resize demo's job: with the apps too
        from mooncake_ep_switch.apps.resize_bench import main as resize_main

        return resize_main(rest[1:])
    from mooncake_ep_switch.bench.__main__ import main as bench_main

    return bench_main(rest)


def _simulate(args) -> int:
    from mooncake_ep_switch.apps.simulate_cli import run_from_args

    return run_from_args(args)


def main(argv=None) -> int:
    """Entry point of the `mooncake-ep` console script.

    Arguments:
        argv: command-line arguments without the program name, or None for `sys.argv[1:]`; with no
            subcommand, `demo` is assumed.

    Returns:
        status: int exit status (demo: 0 when its outputs were correct, else 1; bench and simulate:
            their own status).
    """
    parser = argparse.ArgumentParser(prog="mooncake-ep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="serve a small MoE model on local CPU ranks (default)",
                          description="Serve a small MoE model on local CPU ranks under a bursty load: TP<->EP "
                                      "switches, an online EPLB rebalance, a rank SIGKILLed and replaced; every step "
                                      "checked against the single-process reference. Writes metrics.json and "
                                      "timeline.png (the PNG needs the `plot` extra).")
    demo.add_argument("--ranks", type=int, default=4,
                      help="local rank processes (default 4; the experts must divide evenly among them)")
    demo.add_argument("--steps", type=int, default=None, help="decode steps (default 40)")
    demo.add_argument("--transport", default="auto", choices=["auto", "host", "cuda", "shm", "mooncake", "collective"],
                      help="the Buffers' transport: auto/host (shared memory between ranks of this host), shm, "
                           "mooncake (the Transfer Engine over TCP), collective (the PyTorch-collective fallback), "
                           "cuda (with --device cuda)")
    demo.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                      help="cpu: the main demo on CPU ranks; cuda: the same demo (TP<->EP switches, online EPLB, "
                           "a rank killed and replaced) with rank processes on GPU 0, weights and frames in device "
                           "memory, over the 'cuda' transport")
    demo.add_argument("--out", default="mep_demo_out", help="directory for metrics.json and timeline.png")
    demo.add_argument("--kill-step", type=int, default=None,
                      help="step (inside the burst) at which a rank holding the only copy of some experts is "
                           "SIGKILLed and replaced; -1: no kill at all")
    demo.add_argument("--covered-kill-step", type=int, default=None,
                      help="an earlier step at which a rank whose experts all have a live copy elsewhere is SIGKILLed "
                           "(no top-k contribution lost from the next step) and replaced after one step; default: two "
                           "steps into the burst; -1: none")
    demo.add_argument("--replace-after", type=int, default=3,
                      help="steps the survivors serve without the rank killed at --kill-step before its replacement "
                           "starts (default 3; from 2, a coverage epoch restores experts that lost their only copy)")
    demo.add_argument("--kill-covered", action="store_true",
                      help="at --kill-step too, kill a rank whose experts all have a copy on another rank")
    demo.add_argument("--redundant", type=int, default=None,
                      help="redundant experts per rank (default: experts / ranks with the covered kill, so that every "
                           "expert starts with two copies; else 1)")
    demo.add_argument("--replacement", default="forked", choices=["forked", "spawn", "standby"],
                      help="how the killed rank's replacement starts: forked after the death from a server that "
                           "imported torch at start (default), spawn (a fresh interpreter after the death), standby "
                           "(a warm standby ready before the death: mooncake_ep_switch.standby.WarmStandby)")
    demo.add_argument("--store", default="tcp", choices=["tcp", "etcd"],
                      help="the ranks' control-plane store: tcp (a TCPStore this process hosts, default) or etcd (a "
                           "local 3-member etcd cluster the demo starts: no single point of failure; needs Debian's "
                           "etcd-server and the `etcd` extra)")
    demo.add_argument("--resize", action="store_true",
                      help="instead: serve at --ranks ranks while the group is resized: a rank dies with no "
                           "replacement (shrink by one) and two new processes join (grow by two), every step checked "
                           "against the single-process reference; --steps is then the steps between resizes "
                           "(default 3); metrics.json and timeline.png show the group size over the steps")
    demo.add_argument("--model", default=None, choices=["qwen3_moe", "mixtral", "deepseek_v3"],
                      help="instead: a tiny random transformers MoE model generating greedily over EP, TP and "
                           "EPLB, checked against the single-process model (needs the `models` extra)")
    sub.add_parser("bench", add_help=False,
                   help="transport, switch and EPLB benchmarks with in-run baselines; `bench --help` lists "
                        "them (soak, hosts, elastic, memory, recovery, resize, --device cuda)")
    from mooncake_ep_switch.apps.simulate_cli import add_arguments as add_simulate_arguments

    simulate = sub.add_parser("simulate", help="replay bursty and RL-rollout traces through the TP<->EP switch "
                                               "policy under a step-latency model; checks the paper's result")
    add_simulate_arguments(simulate)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in ("demo", "bench", "simulate") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["demo"] + argv  # flags without a subcommand are the demo's
    if argv[0] == "bench":
        # Everything after `bench` is the benchmark's own, `--help` included (it lists its subcommands).
        return _bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return _simulate(args)


if __name__ == "__main__":
    sys.exit(main())
