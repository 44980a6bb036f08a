"""The main job: local CPU ranks serve a small MoE model under a bursty load, switching and rebalancing.

Per decode step the controller (this process, like an engine's scheduler) reads the request count
from a bursty trace, lets the `SwitchPolicy` pick the layout, and runs the step on every rank:

- TP: every rank computes its intermediate slice of every expert for all requests' tokens (the
  unified weight memory's TP view) and a deterministic all-reduce sums the partials;
- EP: every rank serves its share of the requests; tokens go through `dispatch` -> physical
  experts -> `combine`. The physical experts are the rank's primaries (the unified memory's EP
  view) plus redundant experts placed by EPLB from the loads the ranks recorded and moved by the
  online rebalancer while serving continues.

`switch_layout` moves the unified memory between the layouts when the policy says so. In EP, ranks
are SIGKILLed (`apps.demo_kills`: by default first one whose experts all have a live copy elsewhere,
then one holding the only copy of some experts); the survivors serve on without it (the peer watcher
marks it in `active_ranks`, fault-aware routing serves its experts from live copies, a coverage
epoch gives the experts it alone held a copy on a survivor), and a replacement process is
re-admitted with `update_ep_member` and maps everyone's regions anew. Every step of every rank is
checked against a single-process reference computed from the same weights (leaving out exactly
the experts whose contribution was lost). A rank masked while alive (late past the step's
deadline, which scales with the measured step time) is a stall: reported, that step's outputs are
not judged, and the rank is unmasked for the next step. Prints a live progress line and a summary,
writes metrics.json and a PNG timeline, exits non-zero when the correctness check fails.
"""
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from mooncake_ep_switch.apps.demo_ranks import (CHECK_LIMIT, LAYOUT_EP, LAYOUT_TP, PROGRESS_EVERY,  # noqa: F401
                                                RANK_MODULES, REPLACEMENTS, DemoConfig, balancedness, coverage_commit, covered_rank,
                                                initial_placement, rank_readmit, rank_setup, rank_standby, rank_step,
                                                rank_switch, rank_teardown, request_trace)
from mooncake_ep_switch.apps.demo_kills import (covered_kill_rank, judged_diffs, only_copy_rank, plan_kills,
                                                stalled_ranks, step_timeout_us)
from mooncake_ep_switch.apps.demo_report import phases_of, plot, summary
from mooncake_ep_switch.apps.recovery_phases import recovery_phases
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes


class _Controller:
    """The scheduler side: the trace, the switch policy, the load window and rebalance plans."""

    def __init__(self, config: DemoConfig):
        from mooncake_ep_switch.switch import SwitchPolicy

        self.config = config
        self.trace = request_trace(config)
        self.policy = SwitchPolicy(config.switch_threshold, window=2, low_ratio=0.5, cooldown_steps=2)
        self.layout = LAYOUT_TP
        self.phy2log = initial_placement(config)
        self.loads = np.zeros((config.layers, config.experts), dtype=np.float64)
        self.ep_steps_recorded = 0
        self.rebalance_until = -1  # last commit step of the rebalance in flight

    def record(self, values) -> None:
        """Add one EP step's per-slot counts of every rank to the logical loads."""
        per_rank = self.phy2log.shape[1] // self.config.num_ranks
        for value in values:
            if value["counts"] is None:
                return
            for layer, counts in enumerate(value["counts"]):
                slots = self.phy2log[layer, value["rank"] * per_rank:(value["rank"] + 1) * per_rank]
                np.add.at(self.loads[layer], slots, counts)
        self.ep_steps_recorded += 1

    def plan(self, step: int):
        """A rebalance to begin at `step` (commit two steps later), or None."""
        from mooncake_ep_switch.eplb.policy.redundant import place_redundant_experts

        config = self.config
        if (self.layout != LAYOUT_EP or step <= self.rebalance_until or self.ep_steps_recorded < config.rebalance_after
                or step + 3 >= len(self.trace) or self.trace[step + 3] < config.switch_threshold):
            return None
        target = place_redundant_experts(self.loads, config.num_ranks, config.redundant_per_rank,
                                         previous=self.phy2log).numpy()
        self.loads[:] = 0
        self.ep_steps_recorded = 0
        if np.array_equal(target, self.phy2log):
            return None
        commit = step + 2
        self.rebalance_until = commit + int(np.any(target != self.phy2log, axis=1).sum()) - 1
        return {"phy2log": target.tolist(), "commit_step": commit}


def _start_standby(cluster, config: DemoConfig) -> dict:
    """A warm standby started, imported and loaded now (before the death it will replace)."""
    standby = cluster.start_standby()
    standby["prepared"] = cluster.run_standby(rank_standby, config, timeout_s=120)
    return standby


def _replace(cluster, config: DemoConfig, checkpoint: str, kill, standby, clocks: dict) -> dict:
    """Start `kill.rank`'s replacement (respawned, or the standby assigned), build it and admit it: its recovery."""
    replace_started = time.perf_counter()
    if standby is not None:
        standby["assigned"] = cluster.assign_standby(kill.rank)
        spawned = standby
    else:
        spawned = cluster.respawn(kill.rank)
    check_outcomes(cluster.run(rank_setup, config, checkpoint, ranks=[kill.rank], timeout_s=120))
    readmits = check_outcomes(cluster.run(rank_readmit, kill.rank, timeout_s=120))
    joined = readmits[kill.rank]["timings"]
    clocks.update(killed_at=float(cluster.store.get("world/demo/killed_at").decode()), started=spawned,
                  replacement=joined, kind=config.replacement,
                  members=[r["timings"] for i, r in enumerate(readmits) if i != kill.rank])
    return {"rank": kill.rank, "killed_at_step": kill.step, "covered": kill.covered,
            "replace_seconds": time.perf_counter() - replace_started, "view": readmits[0]["view"],
            "restored": joined["restore"], "coverage_step": kill.coverage_step,
            "death_to_full_coverage_s": None if kill.coverage_at is None else kill.coverage_at - clocks["killed_at"],
            "_clocks": clocks}


def run_demo(config: DemoConfig, stream=sys.stdout) -> dict:
    """Run the demo and return its metrics (also written to `config.out_dir/metrics.json`).

    Arguments:
        config: a `DemoConfig`.
        stream: where the progress line and the summary go.

    Returns:
        metrics: dict with "steps" (per step: requests, layout, seconds, balancedness, calc_diff,
            lost top-k contributions, "reference_skipped" (the most (layer, expert) pairs a rank's
            reference left out: 0 = checked against the full reference), the deadline, ranks masked
            while alive), "events" (switches,
            rebalances, the kills, stalls and rejoins), "phases", "recoveries" (one per kill, in order),
            "recovery" (the last of them, or None), "stalls", "correct" and "wall_seconds".

    Raises:
        ValueError: a bad setting (named): request counts, kill steps, the replacement kind.
    """
    torch.set_num_threads(1)
    started = time.perf_counter()
    if config.low_requests % config.num_ranks or config.burst_requests % config.num_ranks:
        raise ValueError(f"low_requests/burst_requests: expected multiples of num_ranks={config.num_ranks}, got "
                         f"{config.low_requests}/{config.burst_requests}")
    control = _Controller(config)
    kills = plan_kills(config, control.trace)
    if config.replacement not in REPLACEMENTS:
        raise ValueError(f"replacement: expected one of {REPLACEMENTS}, got {config.replacement!r}")
    where = "rank processes on GPU 0" if config.transport == "cuda" else "CPU ranks"
    print(f"mooncake_ep_switch demo: {config.num_ranks} {where}, {config.layers} MoE layers x {config.experts} "
          f"experts (top-{config.top_k}, hidden {config.hidden}), {config.steps} decode steps, "
          f"{config.low_requests} -> {config.burst_requests} -> {config.low_requests} requests", file=stream)
    steps, events, switches, rebalances, stalls = [], [], [], [], []
    terminal = stream.isatty()  # a terminal gets one line rewritten in place; a log a line every few steps
    scratch = tempfile.TemporaryDirectory(prefix="mep_demo_")  # the checkpoint a replacement loads
    checkpoint = os.path.join(scratch.name, "weights.pt")
    with scratch, LocalCluster(config.num_ranks, preload=True, preload_replacements=config.replacement == "forked",
                               preload_modules=RANK_MODULES, store=config.store) as cluster:
        host, port = cluster.store_addr  # the ranks' store: the launcher's TCPStore, or (etcd URL, None)
        store = host if port is None else f"tcp://{host}:{port}"
        print(f"control-plane store: {store}" + (" (3 local etcd members)" if cluster.etcd else ""), file=stream)
        transport = check_outcomes(cluster.run(rank_setup, config, checkpoint, timeout_s=120))[0]
        standby = _start_standby(cluster, config) if config.replacement == "standby" and kills else None
        pending, unmask, clocks = None, [], {}  # the kill whose replacement has not served a full step yet
        for step in range(config.steps):
            requests = control.trace[step]
            decision = control.policy.observe(step, requests)
            window = any(k.window(step) for k in kills)
            if decision.target is not None:
                if step <= control.rebalance_until or window:  # never under a rebalance in flight or with a rank dead
                    control.policy.set_layout(control.layout)
                else:
                    reports = check_outcomes(cluster.run(rank_switch, decision.target, timeout_s=120))
                    if reports[0]["outcome"] != "completed":
                        raise RuntimeError(f"switch to {decision.target} at step {step}: {reports[0]}")
                    control.layout = decision.target
                    ms = max(r["total_ms"] for r in reports)
                    moved = sum(r["weight_bytes"] for r in reports)
                    switches.append({"step": step, "target": decision.target, "ms": ms, "weight_bytes": moved})
                    events.append({"step": step, "kind": "switch", "label": f"-> {decision.target.upper()} {ms:.0f} ms"})
            kill = next((k for k in kills if k.step == step), None)
            plan = control.plan(step) if transport == "shm" and not window and kill is None else None
            timeout_us = step_timeout_us(config, [s["seconds"] for s in steps])
            command = {"requests": requests, "rebalance": plan, "timeout_us": timeout_us, "unmask": unmask}
            if kill is not None:
                if kill.covered and kill is not kills[-1]:  # the covered kill before the main one
                    kill.rank = covered_kill_rank(control.phy2log, config, config.kill_rank)
                else:
                    kill.rank = (covered_rank if kill.covered else only_copy_rank)(control.phy2log, config)
                if kill.rank is None:  # no rank has all its experts covered: this kill is left out
                    kill.skipped = True
                    print(f"  (step {step}: no rank has a live copy of all its experts elsewhere with "
                          f"{config.redundant_per_rank} redundant experts per rank; the covered kill is left out)",
                          file=stream)
                else:
                    command["kill_rank"] = kill.rank
            down = next((k for k in kills if k.window(step)), None)  # the kill whose rank is down this step
            if down is not None and step == down.step + 1 and down.replace_after >= 2 and transport == "shm":
                command["coverage"] = down.coverage_step = coverage_commit(control.phy2log, config, down.rank, step)
            serving = [r for r in range(config.num_ranks) if down is None or r != down.rank]
            outcomes = cluster.run(rank_step, step, command, timeout_s=120, failure_grace_s=60, ranks=serving)
            stepped_at = time.time()
            if kill is not None and not kill.skipped:
                what = "covered" if kill.covered else "only copies"
                events.append({"step": step, "kind": "kill", "label": f"rank {kill.rank} SIGKILL ({what})"})
                values = check_outcomes([o for o in outcomes if o.rank != kill.rank])
                if kill.replace_after:
                    cluster.accept_dead(kill.rank)  # the survivors serve on without it
            else:
                values = check_outcomes(outcomes)
            for outcome, value in zip([o for o in outcomes if o.ok], values):
                value["rank"] = outcome.rank
            current = next((k for k in kills if k.step == step or k.window(step)), None)
            for report in values[0]["reports"]:
                moved = sum(r["moved_bytes"] for v in values for rr in [v["reports"]] for r in rr
                            if r["epoch"] == report["epoch"])
                rebalances.append({"step": step, "epoch": report["epoch"], "layers": report["layers"],
                                   "outcome": report["outcome"], "moved_bytes": moved,
                                   "stall_ms": max(r["stall_ms"] for v in values for r in v["reports"]
                                                   if r["epoch"] == report["epoch"])})
                what = "coverage" if current is not None and step == current.coverage_step else "EPLB"
                events.append({"step": step, "kind": "rebalance",
                               "label": f"{what} {report['outcome']} L{report['layers']} {moved / 2**20:.1f} MiB"})
                if what == "coverage" and report["outcome"] == "committed":  # death -> every expert covered again
                    current.coverage_at = max(r["at"] for v in values for r in v["reports"]
                                              if r["epoch"] == report["epoch"])
            if values[0]["phy2log"] is not None:
                control.phy2log = np.asarray(values[0]["phy2log"])
            layout = values[0]["layout"]
            dead = sorted({r for v in values for r in v["dead"]})
            stalled = stalled_ranks(dead, kills, step)  # masked while alive (late past the deadline): a stall
            if stalled:
                stalls.append({"step": step, "ranks": stalled, "timeout_s": timeout_us / 1e6})
                events.append({"step": step, "kind": "stall", "label": f"rank(s) {stalled} stalled"})
            # served again from the next step (the collective fallback moves to a view without them instead)
            unmask = stalled if transport != "collective" else []
            balanced = None
            if layout == LAYOUT_EP and values[0]["counts"] is not None:
                balanced = balancedness([v["counts"] for v in values], config.layers)
                if len(values) == config.num_ranks and not dead:
                    control.record(values)
            step_seconds = max(v["seconds"] for v in values)
            lost = [v["lost"] for v in values if v.get("lost") is not None]
            steps.append({"step": step, "requests": requests, "layout": layout, "seconds": step_seconds,
                          "lost_contributions": sum(lost) if lost else None,
                          "reference_skipped": max(v["skipped"] for v in values),
                          "tokens": requests, "balancedness": balanced, "max_calc_diff": max(v["diff"] for v in values),
                          "dead_ranks": dead, "stalled_ranks": stalled, "timeout_s": timeout_us / 1e6,
                          "ranks_serving": len(values)})
            if pending is not None and not dead and len(values) == config.num_ranks:
                recovery = pending.recovery
                recovery["first_full_step"] = step
                recovery["interruption_seconds"] = time.perf_counter() - recovery.pop("_failed_at")
                recovery.update(recovery_phases(first_full_at=time.time(), **recovery.pop("_clocks")))
                pending = None
            if kill is not None and not kill.skipped:
                clocks = {"detected_at": max(v["served_at"] for v in values)}
                failed_at = time.perf_counter() - step_seconds
                seen = dead
            replacing = next((k for k in kills if not k.skipped and step == k.step + k.replace_after), None)
            if replacing is not None:
                clocks["stepped_at"] = stepped_at
                replacing.recovery = _replace(cluster, config, checkpoint, replacing, standby, clocks)
                replacing.recovery.update(survivors_saw_dead=seen, replaced_after_step=step, _failed_at=failed_at)
                pending = replacing
                events.append({"step": step, "kind": "rejoin", "label": f"rank {replacing.rank} rejoined "
                                                                        f"{replacing.recovery['replace_seconds']:.1f} s"})
                if standby is not None:
                    standby = _start_standby(cluster, config) if any(k.step > step for k in kills) else None
            worst = steps[-1]["max_calc_diff"]
            line = (f"  step {step + 1}/{config.steps}  {layout.upper()}  {requests:4d} req  "
                    f"{requests / step_seconds:8.0f} tok/s  calc_diff {worst:.1e}  ranks {len(values)}")
            if terminal:
                print(f"\r{line}   ", end="", file=stream, flush=True)
            elif step % PROGRESS_EVERY == PROGRESS_EVERY - 1 or dead or kill is not None or \
                    step == config.steps - 1:
                print(line, file=stream, flush=True)  # a log gets a line every few steps, and every event
        if terminal:
            print(file=stream)
        check_outcomes(cluster.run(rank_teardown, timeout_s=60))
    recoveries = [k.recovery for k in kills if k.recovery is not None]
    for recovery in recoveries:
        recovery.pop("_failed_at", None)
        recovery.pop("_clocks", None)
    worst, stalled_worst = judged_diffs(steps)
    metrics = {"config": config._asdict(), "transport": transport, "store": store, "steps": steps, "events": events,
               "switches": switches, "rebalances": rebalances, "recoveries": recoveries,
               "recovery": recoveries[-1] if recoveries else None, "stalls": stalls, "max_calc_diff": worst,
               "stalled_max_calc_diff": stalled_worst, "phases": phases_of(steps, config),
               # a run where most steps stalled judged too little to pass
               "correct": worst < CHECK_LIMIT and len(stalls) <= len(steps) // 2}
    metrics["wall_seconds"] = time.perf_counter() - started
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    metrics["timeline"] = plot(metrics, config, stream)
    summary(metrics, config, stream)
    return metrics
