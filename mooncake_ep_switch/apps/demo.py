"""The main job: local CPU ranks serve a small MoE model under a bursty load, switching and rebalancing.

Per decode step the controller (this process, like an engine's scheduler) reads the request count
from a bursty trace, lets the `SwitchPolicy` pick the layout, and runs the step on every rank:

- TP: every rank computes its intermediate slice of every expert for all requests' tokens (the
  unified weight memory's TP view) and a deterministic all-reduce sums the partials;
- EP: every rank serves its share of the requests; tokens go through `dispatch` -> physical
  experts -> `combine`. The physical experts are the rank's primaries (the unified memory's EP
  view) plus redundant experts placed by EPLB from the loads the ranks recorded and moved by the
  online rebalancer while serving continues.

`switch_layout` moves the unified memory between the layouts when the policy says so; one rank is
SIGKILLed mid-run in EP, the survivors serve that step without it (timeouts mark it in
`active_ranks`), and a replacement process is re-admitted with `update_ep_member` and maps
everyone's regions anew. Every step of every rank is checked against a single-process reference
computed from the same weights (leaving out exactly the experts a dead rank held). Prints a live
progress line and a summary, writes metrics.json and a PNG timeline, exits non-zero when the
correctness check fails.
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


def run_demo(config: DemoConfig, stream=sys.stdout) -> dict:
    """Run the demo and return its metrics (also written to `config.out_dir/metrics.json`).

    Arguments:
        config: a `DemoConfig`.
        stream: where the progress line and the summary go.

    Returns:
        metrics: dict with "steps" (per step: requests, layout, seconds, balancedness, calc_diff),
            "events" (switches, rebalances, the kill and the rejoin), "phases", "recovery",
            "correct" and "wall_seconds".
    """
    torch.set_num_threads(1)
    started = time.perf_counter()
    if config.low_requests % config.num_ranks or config.burst_requests % config.num_ranks:
        raise ValueError(f"low_requests/burst_requests: expected multiples of num_ranks={config.num_ranks}, got "
                         f"{config.low_requests}/{config.burst_requests}")
    control = _Controller(config)
    if config.kill_step >= 0 and control.trace[config.kill_step] < config.switch_threshold:
        raise ValueError(f"kill_step: expected a step inside the burst (EP layout), got {config.kill_step}")
    where = "rank processes on GPU 0" if config.transport == "cuda" else "CPU ranks"
    print(f"mooncake_ep_switch demo: {config.num_ranks} {where}, {config.layers} MoE layers x {config.experts} "
          f"experts (top-{config.top_k}, hidden {config.hidden}), {config.steps} decode steps, "
          f"{config.low_requests} -> {config.burst_requests} -> {config.low_requests} requests", file=stream)
    steps, events, recovery, switches, rebalances = [], [], None, [], []
    terminal = stream.isatty()  # a terminal gets one line rewritten in place; a log a line every few steps
    if config.replacement not in REPLACEMENTS:
        raise ValueError(f"replacement: expected one of {REPLACEMENTS}, got {config.replacement!r}")
    scratch = tempfile.TemporaryDirectory(prefix="mep_demo_")  # the checkpoint a replacement loads
    checkpoint = os.path.join(scratch.name, "weights.pt")
    with scratch, LocalCluster(config.num_ranks, preload=True, preload_replacements=config.replacement == "forked",
                               preload_modules=RANK_MODULES, store=config.store) as cluster:
        host, port = cluster.store_addr  # the ranks' store: the launcher's TCPStore, or (etcd URL, None)
        store = host if port is None else f"tcp://{host}:{port}"
        print(f"control-plane store: {store}" + (" (3 local etcd members)" if cluster.etcd else ""), file=stream)
        transport = check_outcomes(cluster.run(rank_setup, config, checkpoint, timeout_s=120))[0]
        standby, kill_rank, coverage_step, coverage_at = None, config.kill_rank, None, None
        if config.replacement == "standby" and config.kill_step >= 0:  # started, imported and loaded before any death
            standby = cluster.start_standby()
            standby["prepared"] = cluster.run_standby(rank_standby, config, timeout_s=120)
        for step in range(config.steps):
            requests = control.trace[step]
            decision = control.policy.observe(step, requests)
            dead_now = config.kill_step >= 0 and config.kill_step < step <= config.kill_step + config.replace_after
            if decision.target is not None:
                if step <= control.rebalance_until or dead_now:  # never under a rebalance in flight or with a rank dead
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
            window = config.kill_step >= 0 and config.kill_step < step <= config.kill_step + config.replace_after
            plan = control.plan(step) if transport == "shm" and not window and step != config.kill_step else None
            command = {"requests": requests, "rebalance": plan, "kill_rank": kill_rank}
            if step == config.kill_step and config.kill_covered:
                command["kill_rank"] = kill_rank = covered_rank(control.phy2log, config)
            if window and step == config.kill_step + 1 and config.replace_after >= 2 and transport == "shm":
                command["coverage"] = coverage_step = coverage_commit(control.phy2log, config, kill_rank, step)
            serving = [r for r in range(config.num_ranks) if not window or r != kill_rank]
            outcomes = cluster.run(rank_step, step, command, timeout_s=120, failure_grace_s=60, ranks=serving)
            stepped_at = time.time()
            if step == config.kill_step:
                events.append({"step": step, "kind": "kill", "label": f"rank {kill_rank} SIGKILL"})
                values = check_outcomes([o for o in outcomes if o.rank != kill_rank])
                if config.replace_after:
                    cluster.accept_dead(kill_rank)  # the survivors serve on without it
            else:
                values = check_outcomes(outcomes)
            for outcome, value in zip([o for o in outcomes if o.ok], values):
                value["rank"] = outcome.rank
            for report in values[0]["reports"]:
                moved = sum(r["moved_bytes"] for v in values for rr in [v["reports"]] for r in rr
                            if r["epoch"] == report["epoch"])
                rebalances.append({"step": step, "epoch": report["epoch"], "layers": report["layers"],
                                   "outcome": report["outcome"], "moved_bytes": moved,
                                   "stall_ms": max(r["stall_ms"] for v in values for r in v["reports"]
                                                   if r["epoch"] == report["epoch"])})
                what = "coverage" if step == coverage_step else "EPLB"
                events.append({"step": step, "kind": "rebalance",
                               "label": f"{what} {report['outcome']} L{report['layers']} {moved / 2**20:.1f} MiB"})
                if what == "coverage" and report["outcome"] == "committed":  # death -> every expert covered again
                    coverage_at = max(r["at"] for v in values for r in v["reports"] if r["epoch"] == report["epoch"])
            if values[0]["phy2log"] is not None:
                control.phy2log = np.asarray(values[0]["phy2log"])
            layout = values[0]["layout"]
            balanced = None
            if layout == LAYOUT_EP and values[0]["counts"] is not None:
                balanced = balancedness([v["counts"] for v in values], config.layers)
                if len(values) == config.num_ranks:
                    control.record(values)
            step_seconds = max(v["seconds"] for v in values)
            worst = max(v["diff"] for v in values)
            dead = sorted({r for v in values for r in v["dead"]})
            lost = [v["lost"] for v in values if v.get("lost") is not None]
            steps.append({"step": step, "requests": requests, "layout": layout, "seconds": step_seconds,
                          "lost_contributions": sum(lost) if lost else None,
                          "tokens": requests, "balancedness": balanced, "max_calc_diff": worst,
                          "dead_ranks": dead, "ranks_serving": len(values)})
            if recovery is not None and "first_full_step" not in recovery and not dead and len(values) == config.num_ranks:
                recovery["first_full_step"] = step
                recovery["interruption_seconds"] = time.perf_counter() - recovery.pop("_failed_at")
                recovery.update(recovery_phases(first_full_at=time.time(), **recovery.pop("_clocks")))
            if step == config.kill_step:
                failed_at = time.perf_counter() - step_seconds
                detected_at = max(v["served_at"] for v in values)
            if config.kill_step >= 0 and step == config.kill_step + config.replace_after:
                replace_started = time.perf_counter()
                if standby is not None:
                    standby["assigned"] = cluster.assign_standby(kill_rank)
                    spawned = standby
                else:
                    spawned = cluster.respawn(kill_rank)
                check_outcomes(cluster.run(rank_setup, config, checkpoint, ranks=[kill_rank], timeout_s=120))
                readmits = check_outcomes(cluster.run(rank_readmit, kill_rank, timeout_s=120))
                joined = readmits[kill_rank]["timings"]
                clocks = {"killed_at": float(cluster.store.get("world/demo/killed_at").decode()),
                          "detected_at": detected_at, "stepped_at": stepped_at, "started": spawned,
                          "replacement": joined, "kind": config.replacement,
                          "members": [r["timings"] for i, r in enumerate(readmits) if i != kill_rank]}
                recovery = {"rank": kill_rank, "killed_at_step": config.kill_step,
                            "survivors_saw_dead": steps[config.kill_step]["dead_ranks"],
                            "replace_seconds": time.perf_counter() - replace_started, "view": readmits[0]["view"],
                            "replaced_after_step": step, "restored": joined["restore"], "_failed_at": failed_at,
                            "coverage_step": coverage_step,
                            "death_to_full_coverage_s": None if coverage_at is None else coverage_at - clocks["killed_at"],
                            "_clocks": clocks}
                events.append({"step": step, "kind": "rejoin",
                               "label": f"rank {kill_rank} rejoined {recovery['replace_seconds']:.1f} s"})
            line = (f"  step {step + 1}/{config.steps}  {layout.upper()}  {requests:4d} req  "
                    f"{requests / step_seconds:8.0f} tok/s  calc_diff {worst:.1e}  ranks {len(values)}")
            if terminal:
                print(f"\r{line}   ", end="", file=stream, flush=True)
            elif step % PROGRESS_EVERY == PROGRESS_EVERY - 1 or dead or step == config.kill_step or \
                    step == config.steps - 1:
                print(line, file=stream, flush=True)  # a log gets a line every few steps, and every event
        if terminal:
            print(file=stream)
        check_outcomes(cluster.run(rank_teardown, timeout_s=60))
    if recovery is not None:
        recovery.pop("_failed_at", None)
        recovery.pop("_clocks", None)
    worst = max(s["max_calc_diff"] for s in steps)
    metrics = {"config": config._asdict(), "transport": transport, "store": store, "steps": steps, "events": events,
               "switches": switches, "rebalances": rebalances, "recovery": recovery, "max_calc_diff": worst,
               "correct": worst < CHECK_LIMIT, "phases": phases_of(steps, config)}
    metrics["wall_seconds"] = time.perf_counter() - started
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    metrics["timeline"] = plot(metrics, config, stream)
    summary(metrics, config, stream)
    return metrics
