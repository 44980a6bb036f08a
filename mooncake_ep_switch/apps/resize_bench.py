"""`mooncake-ep bench resize [--quick] [--out FILE] [--metrics FILE]`: the time of a shrink and of a grow.

Runs the resize demo's job (`apps/demo_resize.py`: 4 CPU ranks on shm, rank 2 SIGKILLed and removed for
good, then 2 new processes join: 4 -> 3 -> 5) with larger experts (hidden 1024, intermediate 512: 3 MiB per
expert copy; `--quick`: the demo's 192 KiB) and prints one table row per phase:

- shrink, agreement: `eplb.shrink_experts` on the survivors (the vote, the view without the dead rank, the
  placement over the remaining ranks begun), the slowest survivor;
- shrink, weights moved: the staging time of the new placement's chunks on the rank that copied the most
  bytes into its slots (from live copies, or the loader for an expert only the dead rank held; every survivor
  stages its own at the same time), against a memcpy of the same bytes on that rank alone right after, in
  this run;
- shrink, switch-over stall: the commit steps' own work, summed over the chunks: the vote, the wait and the
  commit, and the staging left for that step (here all of it: the chunks commit a layer a step from the
  step right after the shrink, with no step between for staging ahead);
- grow, agreement: from `elastic.grow` to the start of `build()` on a member (the request, every newcomer's
  acceptance, the gloo group and the next Buffer of the grown group), the slowest member;
- grow, weights moved: a newcomer's copies of its slots from the members' memory (the part of
  `eplb.grow_slots` after its barrier, on the newcomer that took the longest; the newcomers copy at the same
  time), against a memcpy of those bytes on that rank alone; the note gives the whole of `grow_slots`
  (slots allocated, the members' local copies, the barrier);
- grow, switch-over stall: the member's poll that agreed the switch-over (the step served on the grown
  Buffer waits for it), beside the mean of the polls before it (what each step paid during the build).

`--metrics FILE` prints the table of a finished run's metrics.json (demo --resize writes one) instead of running.
"""
import argparse
import json
import os
import sys
import tempfile

from mooncake_ep_switch.apps.demo_resize import run_resize, shrink_bytes
from mooncake_ep_switch.apps.resize_ranks import ResizeConfig


def bench_config(quick: bool, out_dir: str) -> ResizeConfig:
    """The bench's run: 3 MiB expert copies (`quick`: the demo's 192 KiB), 2 steps between the resizes."""
    if quick:
        return ResizeConfig(steps_between=2, out_dir=out_dir)
    return ResizeConfig(hidden=1024, intermediate=512, steps_between=2, out_dir=out_dir)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _ratio(ours_s, baseline_s):
    return baseline_s / ours_s if ours_s and baseline_s else None


def _memcpy_ms(resize: dict, rank: int):
    """The memcpy baseline timed on `rank` after `resize` (ms), or None (none timed: metrics.json keys are str)."""
    timed = resize.get("memcpy_s") or {}
    seconds = timed.get(rank, timed.get(str(rank)))
    return None if seconds is None else seconds * 1e3


def rows_of(metrics: dict) -> list:
    """The table's rows (the `bench.table.format_rows` shape) from a resize run's metrics.

    Arguments:
        metrics: `run_resize`'s metrics (or its metrics.json), with one shrink and one grow.

    Returns:
        rows: list of dict: benchmark, shape, ours_ms, baseline, baseline_ms, speedup (baseline / ours), note.

    Raises:
        ValueError: the metrics hold no shrink or no grow (named).
    """
    config = metrics["config"]
    kinds = {r["kind"]: r for r in metrics.get("resizes", [])}
    missing = [k for k in ("shrink", "grow") if k not in kinds]
    if missing:
        raise ValueError(f"metrics: expected a shrink and a grow in metrics['resizes'], missing {missing}")
    shrink, grow = kinds["shrink"], kinds["grow"]
    frame = 3 * config["hidden"] * config["intermediate"] * 2  # gate_up [2I, H] + down [H, I], bf16
    shape = (f"{config['layers']} layers x {config['experts']} experts, {config['slots_per_rank']} slots/rank, "
             f"{_mib(frame)} per expert copy")
    rows = []
    view = shrink["view"]
    rows.append({"benchmark": f"shrink {len(view) + 1} -> {len(view)} (rank {shrink['rank']} dead): agreement",
                 "shape": shape, "ours_ms": max(shrink["agree_s"]) * 1e3, "baseline": "-", "baseline_ms": None,
                 "speedup": None, "note": "shrink_experts: vote, view without it, placement begun; slowest survivor"})
    moved = shrink_bytes(shrink)
    commits = shrink.get("commits", [])
    if moved and max(moved.values()):
        rank = max(moved, key=moved.get)
        stage = sum(r["stage_ms"] for c in commits for who, reports in zip(c["ranks"], c["reports"]) if who == rank
                    for r in reports)
        memcpy_ms = _memcpy_ms(shrink, rank)
        rows.append({"benchmark": "shrink: weights moved (staging on the busiest rank)", "shape": shape,
                     "ours_ms": stage, "baseline": "memcpy of its bytes (that rank, same run)",
                     "baseline_ms": memcpy_ms,
                     "speedup": _ratio(stage, memcpy_ms), "note": f"{_mib(moved[rank])} into rank {rank}'s slots, "
                                                                 f"{len(commits)} chunks"})
    else:
        rows.append({"benchmark": "shrink: weights moved", "shape": shape, "ours_ms": 0.0, "baseline": "-",
                     "baseline_ms": None, "speedup": None, "note": "every expert kept a live copy: nothing moved"})
    stalls = [max((r["stall_ms"] for reports in c["reports"] for r in reports), default=0.0) for c in commits]
    rows.append({"benchmark": "shrink: switch-over stall (commit steps)", "shape": shape, "ours_ms": sum(stalls),
                 "baseline": "-", "baseline_ms": None, "speedup": None,
                 "note": f"{len(stalls)} commit steps: " + ", ".join(f"{s:.1f}" for s in stalls)
                 + " ms (slowest rank; the staging done in them included)"})
    everyone = grow["members"] + grow["newcomers"]
    newcomers = len(grow["newcomers"])
    rows.append({"benchmark": f"grow {grow['from']} -> {grow['to']} ({newcomers} new processes): agreement",
                 "shape": shape, "ours_ms": max(v["agree_s"] for v in grow["members"]) * 1e3, "baseline": "-",
                 "baseline_ms": None, "speedup": None,
                 "note": "request, newcomers' acceptance, gloo group and next Buffer; slowest member"})
    timed = [v for v in grow["newcomers"] if v.get("copy_s") is not None]
    if timed:  # the newcomers' copies from the members' memory (after grow_slots' barrier)
        busiest = max(timed, key=lambda v: (v["weight_bytes"], v["copy_s"]))
        memcpy_ms = _memcpy_ms(grow, busiest["rank"])
        rows.append({"benchmark": "grow: weights moved (a newcomer's copies from the members' memory)",
                     "shape": shape, "ours_ms": busiest["copy_s"] * 1e3,
                     "baseline": "memcpy of its bytes (that rank, same run)", "baseline_ms": memcpy_ms,
                     "speedup": _ratio(busiest["copy_s"] * 1e3, memcpy_ms),
                     "note": f"{_mib(busiest['weight_bytes'])} into newcomer rank {busiest['rank']}'s slots; all of "
                             f"grow_slots (slots allocated, members' local copies, barrier) "
                             f"{max(v['weights_s'] for v in everyone) * 1e3:.0f} ms on the slowest rank"})
    else:
        busiest = max(grow["newcomers"], key=lambda v: (v["weight_bytes"], v["weights_s"]))
        memcpy_ms = _memcpy_ms(grow, busiest["rank"])
        rows.append({"benchmark": "grow: weights moved (grow_slots, the busiest rank)", "shape": shape,
                     "ours_ms": busiest["weights_s"] * 1e3, "baseline": "memcpy of its bytes (that rank, same run)",
                     "baseline_ms": memcpy_ms, "speedup": _ratio(busiest["weights_s"] * 1e3, memcpy_ms),
                     "note": f"{_mib(busiest['weight_bytes'])} into rank {busiest['rank']}'s slots (allocation and "
                             "barrier included)"})
    polls = [v["polls_s"] for v in grow["members"]]
    commit_ms = max(p[-1] for p in polls) * 1e3
    waiting = [t for p in polls for t in p[:-1]]
    rows.append({"benchmark": "grow: switch-over stall (the agreeing poll)", "shape": shape, "ours_ms": commit_ms,
                 "baseline": "-", "baseline_ms": None, "speedup": None,
                 "note": (f"{len(polls[0])} polls; the earlier ones {1e3 * sum(waiting) / len(waiting):.1f} ms mean"
                          if waiting else "agreed at the first poll")
                 + f"; request -> switch {max(v['switch_s'] for v in grow['members']) * 1e3:.0f} ms"})
    return rows


def main(argv=None) -> int:
    """Run the resize bench (or read `--metrics`) and print its markdown table.

    Arguments:
        argv: `--quick`, `--out FILE` (also write the table there), `--metrics FILE`; None for `sys.argv[1:]`.

    Returns:
        status: 0, or 1 when the run's outputs were not exact (the table is printed all the same).
    """
    from mooncake_ep_switch.bench.table import format_rows

    parser = argparse.ArgumentParser(prog="mooncake-ep bench resize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo's small experts")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--metrics", default=None, help="print the table of this metrics.json instead of running")
    args = parser.parse_args(argv)
    if args.metrics is not None:
        with open(args.metrics, encoding="utf-8") as handle:
            metrics = json.load(handle)
    else:
        import torch

        torch.set_num_threads(1)
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="mep_resize_bench_") as out:
            metrics = run_resize(bench_config(args.quick, out), stream=sys.stderr, plot=False)
        print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
              f"max calc_diff {metrics['max_calc_diff']:.1e}", file=sys.stderr)
    table = format_rows(rows_of(metrics))
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(table + "\n")
    return 0 if metrics["correct"] else 1
