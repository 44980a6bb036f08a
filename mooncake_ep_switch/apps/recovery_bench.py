"""`mooncake-ep bench recovery` (`python -m mooncake_ep_switch bench recovery`): a rank SIGKILLed while serving, and its replacement, phase by phase (issue 36 item 3).

Runs the demo (`apps.demo.run_demo`: EP during the burst, online EPLB, the kill) once per kind of
replacement and prints one row each, with the run's detection time beside it:

* spawn: a fresh interpreter started after the death (its imports, torch first, count);
* forked: a process started after the death, forked from a server that imported torch and the
  package when the cluster started (the demo's default);
* standby: a warm standby started before the death (`standby.WarmStandby`: imports, weights, store);
* coverage: forked, after the survivors served 3 steps without the rank (2 redundant experts per
  rank), a coverage epoch restoring the experts it held the only copy of from the loader meanwhile;
* covered: forked, after the survivors served 2 steps without the rank, which held no expert's only
  copy (every expert has a copy on two ranks: experts / R redundant per rank, `kill_covered`): full
  coverage at once from the live copies (issue 36 case (a)), 0 contributions lost after the kill step.

Columns: detection (death -> the survivors served the step without the rank), interruption (death
-> the first step every rank serves), replacement (its start, or the standby's assignment -> that
step), death -> full coverage (every expert with a live copy again: the coverage epoch's commit,
else the first full step; "0 ms (live copies)" when every expert of the dead rank had a live copy), where
the replacement's slots came from (peers / loader), the phases (`apps.recovery_phases`), and the top-k
contributions lost from the kill step to the first full step.
"""
import argparse
import sys
import tempfile
from typing import List, Optional

__all__ = ["run", "demo_config", "table", "main"]

KINDS = ("spawn", "forked", "standby", "coverage", "covered")


def run(kinds=KINDS, quick: bool = False, stream=sys.stderr, store: str = "tcp") -> List[dict]:
    """One demo run per kind of replacement.

    Arguments:
        kinds: replacement kinds (`KINDS`).
        quick: R=2 and 12 steps instead of R=4 and 24.
        stream: where the demos' own output goes.
        store: the ranks' store, "tcp" or "etcd" (`DemoConfig.store`; `--store`).

    Returns:
        rows: per kind, dict with "kind", "ranks", "recovery" (the demo's metrics["recovery"]),
            "lost" (top-k contributions lost per step, the kill step to the first full one) and "correct".
    """
    from mooncake_ep_switch.apps.demo import run_demo

    rows = []
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="mep_bench_recovery_") as out:
            config = demo_config(kind, quick, out, store)
            metrics = run_demo(config, stream=stream)
        recovery = metrics["recovery"]
        kill, full = recovery["killed_at_step"], recovery["first_full_step"]
        lost = [metrics["steps"][s].get("lost_contributions") for s in range(kill, full + 1)]
        rows.append({"kind": kind, "ranks": config.num_ranks, "recovery": recovery, "correct": metrics["correct"],
                     "lost": lost})
    return rows


def demo_config(kind: str, quick: bool, out_dir: str, store: str = "tcp"):
    """The demo's settings for one kind of replacement (the module's docstring).

    Arguments:
        kind: one of `KINDS`.
        quick: R=2 and 12 steps instead of R=4 and 24.
        out_dir: the demo's output folder.
        store: "tcp" or "etcd".

    Returns:
        config: the `apps.demo.DemoConfig`.

    Raises:
        ValueError: an unknown `kind`.
    """
    from mooncake_ep_switch.apps.demo import DemoConfig

    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    ranks, steps = (2, 12) if quick else (4, 24)
    first, end = (int(round(f * steps)) for f in DemoConfig().burst)
    coverage, covered = kind == "coverage", kind == "covered"
    return DemoConfig(num_ranks=ranks, steps=steps, out_dir=out_dir, kill_step=first + (end - first) * 4 // 5,
                      kill_rank=min(2, ranks - 1), replacement="forked" if coverage or covered else kind,
                      replace_after=3 if coverage else 2 if covered else 0, kill_covered=covered,
                      redundant_per_rank=2 if coverage else DemoConfig().experts // ranks if covered else 1,
                      store=store)


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
        coverage = "0 ms (live copies)" if recovery.get("covered") else f"{coverage * 1e3:.0f} ms"  # case (a)
        restored = recovery["restored"]
        lines.append(f"| {row['kind']} | {row['ranks']} | {recovery['detection_s'] * 1e3:.0f} ms | "
                     f"{recovery['interruption_s'] * 1e3:.0f} ms | {recovery['replacement_s'] * 1e3:.0f} ms | "
                     f"{coverage} | {restored['from_peers']} / {restored['from_loader']} | {phases} | "
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
