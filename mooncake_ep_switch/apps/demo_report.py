"""The demo's report: tokens/s per phase, the summary it prints and the timeline PNG."""
import os

import numpy as np

from mooncake_ep_switch.apps.demo_ranks import CHECK_LIMIT, DemoConfig
from mooncake_ep_switch.apps.recovery_phases import phase_lines

__all__ = ["phases_of", "plot", "summary"]

def phases_of(steps, config: DemoConfig):
    """Tokens/s per (layout, load) phase over steps with every rank serving."""
    phases = []
    for step in steps:
        key = (step["layout"], step["requests"])
        if not phases or phases[-1]["key"] != key:
            phases.append({"key": key, "layout": step["layout"], "requests": step["requests"], "first": step["step"],
                           "steps": 0, "seconds": 0.0, "tokens": 0, "balancedness": []})
        phase = phases[-1]
        phase["last"] = step["step"]
        if step["ranks_serving"] == config.num_ranks and not step["dead_ranks"]:
            phase["steps"] += 1
            phase["seconds"] += step["seconds"]
            phase["tokens"] += step["tokens"]
            if step["balancedness"] is not None:
                phase["balancedness"].append(step["balancedness"])
    for phase in phases:
        phase.pop("key")
        phase["tokens_per_second"] = phase["tokens"] / phase["seconds"] if phase["seconds"] else float("nan")
        phase["mean_step_ms"] = 1e3 * phase["seconds"] / phase["steps"] if phase["steps"] else float("nan")
        values = phase.pop("balancedness")
        phase["mean_balancedness"] = float(np.mean(values)) if values else None
    return phases


def _balance_around_rebalance(metrics):
    """Mean EP balancedness (full steps) before the first committed rebalance and after it."""
    commits = [r["step"] for r in metrics["rebalances"] if r["outcome"] == "committed"]
    full = [s for s in metrics["steps"] if s["balancedness"] is not None and not s["dead_ranks"]]
    if not commits:
        return None, None
    before = [s["balancedness"] for s in full if s["step"] < commits[0]]
    after = [s["balancedness"] for s in full if s["step"] > commits[0]]
    return (float(np.mean(before)) if before else None), (float(np.mean(after)) if after else None)


def plot(metrics, config: DemoConfig, stream):
    """Write the timeline PNG; without matplotlib (the optional extra `plot`) one line says so and how to get it."""
    from mooncake_ep_switch.apps.timeline import plot_demo_timeline

    try:
        return plot_demo_timeline(metrics, os.path.join(config.out_dir, "timeline.png"))
    except ImportError as error:
        if (error.name or "").split(".")[0] != "matplotlib":
            raise
        print(f"  (no timeline PNG: matplotlib is not installed; pip install -e '.[plot]' or pip install "
              "matplotlib)", file=stream)
        return None


def summary(metrics, config: DemoConfig, stream) -> None:
    print("", file=stream)
    print(f"  transport            {metrics['transport']}", file=stream)
    print("  phase                steps  requests  layout  tokens/s  step ms  balancedness", file=stream)
    for phase in metrics["phases"]:
        bal = f"{phase['mean_balancedness']:.3f}" if phase["mean_balancedness"] is not None else "-"
        print(f"    {phase['first']:3d}-{phase['last']:<3d}            {phase['steps']:5d}  {phase['requests']:8d}  "
              f"{phase['layout'].upper():6s}  {phase['tokens_per_second']:8.0f}  {phase['mean_step_ms']:7.2f}  {bal}",
              file=stream)
    for switch in metrics["switches"]:
        print(f"  switch               step {switch['step']}: -> {switch['target'].upper()} in {switch['ms']:.0f} ms, "
              f"{switch['weight_bytes'] / 2**20:.1f} MiB of weights moved", file=stream)
    before, after = _balance_around_rebalance(metrics)
    if before is not None and after is not None:
        print(f"  EP balancedness      {before:.3f} before the first EPLB commit -> {after:.3f} after (mean rank load / "
              "max rank load, per step)", file=stream)
    for rebalance in metrics["rebalances"]:
        print(f"  EPLB rebalance       step {rebalance['step']}: epoch {rebalance['epoch']} layers {rebalance['layers']} "
              f"{rebalance['outcome']}, {rebalance['moved_bytes'] / 2**20:.2f} MiB moved, commit stall "
              f"{rebalance['stall_ms']:.1f} ms", file=stream)
    recoveries = metrics.get("recoveries") or ([metrics["recovery"]] if metrics.get("recovery") else [])
    for number, recovery in enumerate(recoveries, 1):
        _recovery_lines(metrics, recovery, f" {number}" if len(recoveries) > 1 else "", stream)
    for stall in metrics.get("stalls", []):
        print(f"  stall                step {stall['step']}: rank(s) {stall['ranks']} masked while alive (late past the "
              f"{stall['timeout_s']:.1f} s deadline: a loaded machine); unmasked for the next step, the step's "
              "outputs reported apart, not judged", file=stream)
    print("  note                 the switch threshold is a setting here: on this CPU the EP step is faster at every "
          "load; the TP/EP crossover is a GPU effect (see `mooncake-ep simulate`)", file=stream)
    stalled = "" if metrics.get("stalled_max_calc_diff") is None else \
        f"; {len(metrics['stalls'])} step(s) with a stall: max calc_diff {metrics['stalled_max_calc_diff']:.2e}, " \
        "not judged" + (" (more than half the steps: too few judged)" if 2 * len(metrics["stalls"]) >
                        len(metrics["steps"]) else "")
    print(f"  correctness          max calc_diff {metrics['max_calc_diff']:.2e} vs single-process reference "
          f"(limit {CHECK_LIMIT:.0e}){stalled}: {'PASS' if metrics['correct'] else 'FAIL'}", file=stream)
    print(f"  metrics              {os.path.join(config.out_dir, 'metrics.json')}", file=stream)
    if metrics.get("timeline"):
        print(f"  timeline             {metrics['timeline']}", file=stream)
    print(f"  wall time            {metrics['wall_seconds']:.1f} s", file=stream)


def _recovery_lines(metrics, recovery, number: str, stream) -> None:
    """One kill's lines: the failure, the recovery and its phases, lost top-k contributions, coverage."""
    what = ("every expert it held had a live copy elsewhere" if recovery.get("covered") else
            "it held the only copy of some experts")
    print(f"  failure{number:<14s}rank {recovery['rank']} SIGKILLed at step {recovery['killed_at_step']} ({what}); "
          f"survivors served it without rank(s) {recovery['survivors_saw_dead']}", file=stream)
    print(f"  recovery{number:<13s}replacement joined, view {recovery['view']}, in "
          f"{recovery['replace_seconds']:.2f} s; interruption (failure -> first full step "
          f"{recovery.get('first_full_step')}) {recovery.get('interruption_seconds', float('nan')):.2f} s",
          file=stream)
    if "phases" in recovery:
        for line in phase_lines(recovery):
            print(line, file=stream)
    lost = [(s["step"], s["lost_contributions"]) for s in metrics["steps"]
            if s["lost_contributions"] is not None and recovery["killed_at_step"] <= s["step"]
            <= recovery.get("first_full_step", recovery["killed_at_step"])]
    if lost:
        print(f"  lost top-k{number:<11s}contributions whose expert had no live copy (tokens x entries), per step: "
              + ", ".join(f"step {step} {count}" for step, count in lost)
              + (" (the kill step's rounds ran before the death was known)" if recovery.get("covered") else ""),
              file=stream)
    if recovery.get("death_to_full_coverage_s") is not None:
        print(f"  coverage restored{number:<4s}step {recovery['coverage_step']}: every expert has a live copy again, "
              f"{recovery['death_to_full_coverage_s']:.2f} s after the death (coverage epoch, weights from the "
              "loader: no live rank held them)", file=stream)
    elif recovery.get("covered"):
        print(f"  coverage{number:<13s}never lost: every expert of rank {recovery['rank']} had a live copy, served "
              "from it from the step after the death", file=stream)
