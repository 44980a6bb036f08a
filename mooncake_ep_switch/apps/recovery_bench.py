"""`mooncake-ep bench recovery` (`python -m mooncake_ep_switch bench recovery`): a rank SIGKILLed while serving, and its replacement, phase by phase (issue 36 item 3).

Runs the demo (`apps.demo.run_demo`: EP during the burst, online EPLB, the kill) once per kind of
replacement and prints one row each, with the run's detection time beside it:

* spawn: a fresh interpreter started after the death (its imports, torch first, count);
* forked: a process started after the death, forked from a server that imported torch and the
  package when the cluster started (the demo's default);
* standby: a warm standby started before the death (`standby.WarmStandby`: imports, weights, store);
* coverage: forked, after the survivors served 3 steps without the rank (2 redundant experts per
  rank), a coverage epoch restoring the experts it held the only copy of from the loader meanwhile.

Columns: detection (death -> the survivors served the step without the rank), interruption (death
-> the first step every rank serves), replacement (its start, or the standby's assignment -> that
step), death -> full coverage (every expert with a live copy again: the coverage epoch's commit,
else the first full step), where the replacement's slots came from (peers / loader), the phases
(`apps.recovery_phases`), and the top-k contributions lost from the kill step to the first full step.
"""
import argparse
import sys
import tempfile
from typing import List, Optional

__all__ = ["run", "main"]

KINDS = ("spawn", "forked", "standby", "coverage")


def run(kinds=KINDS, quick: bool = False, stream=sys.stderr, store: str = "tcp") -> List[dict]:
    """One demo run per kind of replacement.

    Arguments:
        kinds: replacement kinds (`apps.demo.REPLACEMENTS`).
        quick: R=2 and 12 steps instead of R=4 and 24.
        stream: where the demos' own output goes.
        store: the ranks' store, "tcp" or "etcd" (`DemoConfig.store`; `--store`).

    Returns:
        rows: per kind, dict with "kind", "ranks", "recovery" (the demo's metrics["recovery"]),
            "lost" (top-k contributions lost per step, the kill step to the first full one) and "correct".
    """
    from mooncake_ep_switch.apps.demo import DemoConfig, run_demo

    rows = []
    ranks, steps = (2, 12) if quick else (4, 24)
    first, end = (int(round(f * steps)) for f in DemoConfig().burst)
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="mep_bench_recovery_") as out:
            coverage = kind == "coverage"
            config = DemoConfig(num_ranks=ranks, steps=steps, out_dir=out, kill_step=first + (end - first) * 4 // 5,
                                kill_rank=min(2, ranks - 1), replacement="forked" if coverage else kind,
                                replace_after=3 if coverage else 0, redundant_per_rank=2 if coverage else 1)
            metrics = run_demo(config._replace(store=store), stream=stream)
        recovery = metrics["recovery"]
        kill, full = recovery["killed_at_step"], recovery["first_full_step"]
        lost = [metrics["steps"][s].get("lost_contributions") for s in range(kill, full + 1)]
        rows.append({"kind": kind, "ranks": ranks, "recovery": recovery, "correct": metrics["correct"],
                     "lost": lost})
    return rows


def table(rows: List[dict]) -> str:
    """The rows as a markdown table (seconds as ms)."""
    lines = ["| replacement | R | detection | interruption (death -> first full step) | replacement start -> "
             "first full step | death -> full coverage | slots from peers / loader | phases after the death (ms) | "
             "in advance (ms) | lost top-k per step, kill -> first full |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for row in rows:
        recovery = row["recovery"]
        phases = ", ".join(f"{p['phase']} {p['seconds'] * 1e3:.0f}" for p in recovery["phases"])
        early = ", ".join(f"{p['phase']} {p['seconds'] * 1e3:.0f}" for p in recovery["in_advance"]) or "-"
        lost = ", ".join("-" if n is None else str(n) for n in row["lost"])
        coverage = recovery.get("death_to_full_coverage_s")
        coverage = recovery["interruption_s"] if coverage is None else coverage
        restored = recovery["restored"]
        lines.append(f"| {row['kind']} | {row['ranks']} | {recovery['detection_s'] * 1e3:.0f} ms | "
                     f"{recovery['interruption_s'] * 1e3:.0f} ms | {recovery['replacement_s'] * 1e3:.0f} ms | "
                     f"{coverage * 1e3:.0f} ms | {restored['from_peers']} / {restored['from_loader']} | {phases} | "
                     f"{early} | {lost} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    """`bench recovery [--quick] [--kinds spawn,forked,standby] [--store tcp|etcd] [--out FILE]`: print the table.

    Returns:
        status: 0 when every run's outputs were correct, else 1.
    """
    parser = argparse.ArgumentParser(prog="python -m mooncake_ep_switch bench recovery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="R=2, 12 steps")
    parser.add_argument("--kinds", default=",".join(KINDS), help="replacement kinds, comma-separated")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--store", default="tcp", choices=["tcp", "etcd"],
                        help="the ranks' store: the launcher's TCPStore (default) or a local 3-member etcd cluster")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--kinds: expected some of {','.join(KINDS)}, got {','.join(unknown)}")
    rows = run(kinds, quick=args.quick, store=args.store)
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0 if all(row["correct"] for row in rows) else 1
