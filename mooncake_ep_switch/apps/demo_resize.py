"""`mooncake-ep demo --resize`: serve while the EP group shrinks for good and grows with new processes.

The controller (this process, an engine's scheduler) drives rank processes (`apps/resize_ranks.py`):

- `num_ranks` ranks serve two MoE layers on physical experts, every step checked against the
  single-process reference (`rank_serve`);
- **shrink**: rank `kill_rank` is SIGKILLed and no replacement comes. The survivors see it end (peer
  watcher), mask it and serve the next step fault-aware (its experts from live copies; the reference
  leaves out exactly the experts with no live copy), then remove it for good (`eplb.shrink_experts`:
  one vote, the view without it, the placement over the remaining ranks, weights of an expert with no
  live copy from the loader); the placement commits at the next step, served in full again;
- **grow**: `grow_by` new processes start (`LocalCluster.add_rank`) and call `elastic.join_grow`; the
  members call `elastic.grow` and poll it at every step boundary while their current Buffer serves; at
  the agreed step every rank (the newcomers too) serves on the grown Buffer and placement
  (`eplb.grow_slots`: the newcomers' copies from the members' memory).

`shrink_first` orders them (4 -> 3 -> 5 needs a grow from a view with holes); metrics.json has every
step (group size, members, diff, lost contributions) and every resize (per-rank timings and bytes);
timeline.png shows the group size over the steps. `run_resize` is also the bench's driver
(`apps/resize_bench.py`: after each resize a memcpy of the bytes each rank moved is timed on that rank).
"""
import json
import os
import sys
import time

from mooncake_ep_switch.apps.demo_ranks import CHECK_LIMIT
from mooncake_ep_switch.apps.resize_ranks import (ResizeConfig, rank_death_seen, rank_grow_begin, rank_grow_poll,
                                                  rank_join_begin, rank_join_end, rank_memcpy, rank_placement,
                                                  rank_serve, rank_setup, rank_shrink, rank_teardown)
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes

RANK_MODULES = ("mooncake_ep_switch.apps.resize_ranks",)


class _Run:
    """The controller's state: which cluster ranks serve, as which group ranks; the steps and events so far."""

    def __init__(self, cluster, config: ResizeConfig, stream, memcpy: bool):
        self.cluster, self.config, self.stream, self.memcpy = cluster, config, stream, memcpy
        self.serving = list(range(config.num_ranks))  # cluster rank ids serving now
        self.group_rank = {r: r for r in self.serving}  # cluster rank id -> rank in the current Buffer's group
        self.step, self.steps, self.events, self.resizes = 0, [], [], []

    def run(self, function, *args, ranks=None, timeout_s=None):
        timeout_s = 2 * self.config.timeout_s if timeout_s is None else timeout_s
        return check_outcomes(self.cluster.run(function, *args, ranks=self.serving if ranks is None else ranks,
                                               timeout_s=timeout_s, failure_grace_s=30))

    def serve(self, count: int = 1) -> None:
        for _ in range(count):
            values = self.run(rank_serve, self.step)
            placements = {str(v["phy2log"]) for v in values}
            members = {tuple(v["members"]) for v in values}
            committed = [r for v in values for r in v["reports"] if r["outcome"] == "committed"]
            entry = {"step": self.step, "seconds": max(v["seconds"] for v in values), "layout": "ep",
                     "requests": self.config.tokens * len(values), "group_size": len(values),
                     "members": sorted(members)[0] if len(members) == 1 else None,
                     "num_ranks": values[0]["num_ranks"], "max_calc_diff": max(v["diff"] for v in values),
                     "lost_contributions": sum(v["lost"] for v in values),
                     "reference_skipped": max(v["skipped"] for v in values),
                     "one_placement": len(placements) == 1, "one_view": len(members) == 1,
                     "masked": sorted({i for v in values for i, m in enumerate(v["mask"]) if not m}),
                     # the expert work spread over the serving ranks: mean / max of the top-k entries each received
                     "balancedness": _balance([v["received"] for v in values])}
            self.steps.append(entry)
            if committed:
                self.events.append({"step": self.step, "kind": "rebalance",
                                    "label": f"chunk committed ({len(values)}-rank placement)"})
                self.resizes[-1].setdefault("commits", []).append(
                    {"step": self.step, "ranks": [v["rank"] for v in values],
                     "reports": [v["reports"] for v in values]})
            print(f"  step {self.step:3d}  ranks {len(values)}  calc_diff {entry['max_calc_diff']:.1e}"
                  + (f"  lost {entry['lost_contributions']}" if entry["lost_contributions"] else ""),
                  file=self.stream, flush=True)
            self.step += 1

    def shrink(self) -> None:
        victim = self.config.kill_rank
        if victim not in self.serving or victim == self.serving[0]:
            raise ValueError(f"kill_rank: expected a serving rank other than the first of {self.serving}, got {victim}")
        process = self.cluster.processes[victim]
        killed_at = time.perf_counter()
        process.kill()
        process.join(30)
        self.cluster.accept_dead(victim)
        self.serving.remove(victim)
        group_victim = self.group_rank.pop(victim)
        self.events.append({"step": self.step, "kind": "kill", "label": f"rank {group_victim} SIGKILL, no replacement"})
        seen = self.run(rank_death_seen, group_victim)
        seen_at = time.perf_counter()
        self.resizes.append({"kind": "shrink", "rank": group_victim, "killed_step": self.step,
                             "death_seen_s": seen_at - killed_at, "seen_waits_s": seen})
        self.serve()  # masked, fault-aware: only experts with no live copy are lost (the reference leaves them out)
        values = self.run(rank_shrink, group_victim, self.step)
        resize = self.resizes[-1]
        resize.update(agree_s=[v["seconds"] for v in values], view=values[0]["view"], epoch=values[0]["epoch"],
                      chunks=values[0]["chunks"], commit_step=self.step)
        self.events.append({"step": self.step, "kind": "shrink",
                            "label": f"shrink -> {len(self.serving)} ranks {max(resize['agree_s']) * 1e3:.0f} ms"})
        self.serve(resize["chunks"] or 1)  # the placement over the remaining ranks commits (a chunk a step)
        if self.memcpy:
            resize["memcpy_s"] = self.memcpy_of(shrink_bytes(resize))

    def grow(self) -> None:
        config = self.config
        group_size = self.steps[-1]["num_ranks"]  # the current Buffer's group, removed ranks included
        members = list(self.serving)  # cluster ranks; their ids in the view, ascending:
        view = sorted(self.group_rank[r] for r in members)
        old_num_ranks, num_ranks = len(members), len(members) + config.grow_by
        newcomers = [self.cluster.add_rank() for _ in range(config.grow_by)]
        phy2log = self.run(rank_placement, ranks=members[:1])[0]  # the engine hands the newcomers the placement
        for offset, rank in enumerate(newcomers):  # the grown group's ids: members 0 .. M-1 in id order, then these
            self.run(rank_join_begin, config, old_num_ranks + offset, num_ranks, view, group_size, phy2log,
                     ranks=[rank])
        requested_step = self.step
        self.run(rank_grow_begin, num_ranks, ranks=members)
        self.events.append({"step": self.step, "kind": "grow", "label": f"grow {old_num_ranks} -> {num_ranks} asked"})
        deadline = time.monotonic() + 2 * config.timeout_s + 30
        while True:
            polls = self.run(rank_grow_poll, self.step, ranks=members)
            if any(p is not None for p in polls):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"grow to {num_ranks} ranks: no switch-over agreed by step {self.step}")
            self.serve()  # the current Buffer serves on while the grown one is built
        if any(p is None or p["step"] != self.step for p in polls):
            raise RuntimeError(f"grow: the members switched at different steps: {polls}")
        joined = self.run(rank_join_end, ranks=newcomers)
        self.serving += newcomers
        self.group_rank = {r: v["rank"] for r, v in zip(members + newcomers, polls + joined)}  # renumbered densely
        self.resizes.append({"kind": "grow", "from": old_num_ranks, "to": num_ranks, "requested_step": requested_step,
                             "switch_step": self.step, "members": polls, "newcomers": joined})
        self.events.append({"step": self.step, "kind": "switch", "label": f"on {num_ranks} ranks"})
        if self.memcpy:
            self.resizes[-1]["memcpy_s"] = self.memcpy_of({v["rank"]: v["weight_bytes"] for v in joined})
        self.serve()

    def memcpy_of(self, moved: dict) -> dict:
        """{group rank: seconds of a memcpy of the bytes it moved}, timed on that rank alone, one rank at a time."""
        cluster_rank = {group: rank for rank, group in self.group_rank.items()}
        return {group: self.run(rank_memcpy, nbytes, ranks=[cluster_rank[group]])[0]
                for group, nbytes in moved.items() if nbytes}


def run_resize(config: ResizeConfig, stream=sys.stdout, memcpy: bool = True, plot: bool = True) -> dict:
    """Run the resize demo and return its metrics (also written to `config.out_dir/metrics.json`).

    Arguments:
        config: a `ResizeConfig`.
        stream: where the progress lines and the summary go.
        memcpy: after each resize, time a memcpy of the bytes each rank moved into its slots, on that rank alone
            (the bench's baseline, `apps/resize_bench.py`): `resize["memcpy_s"]`, {group rank: seconds}.
        plot: write timeline.png (needs matplotlib; without it a line says so).

    Returns:
        metrics: dict with "steps" (per step: group size, members, max_calc_diff, lost contributions, ...),
            "events", "resizes" (per resize: the per-rank timings and bytes), "correct", "wall_seconds".

    Raises:
        ValueError: a bad setting (named).
    """
    if config.grow_by < 1 or config.num_ranks < 2:
        raise ValueError(f"grow_by/num_ranks: expected grow_by >= 1 and num_ranks >= 2, got {config.grow_by}/"
                         f"{config.num_ranks}")
    started = time.perf_counter()
    order = ("shrink", "grow") if config.shrink_first else ("grow", "shrink")
    print(f"mooncake_ep_switch demo --resize: {config.num_ranks} CPU ranks, {config.layers} MoE layers x "
          f"{config.experts} experts ({config.slots_per_rank} slots per rank), then {order[0]} and {order[1]}: "
          f"rank {config.kill_rank} dies with no replacement, {config.grow_by} new processes join", file=stream)
    # Newcomers fork from the server that imported torch and the rank module at start (new processes all the same).
    with LocalCluster(config.num_ranks, preload=True, preload_replacements=True,
                      preload_modules=RANK_MODULES) as cluster:
        run = _Run(cluster, config, stream, memcpy)
        transport = run.run(rank_setup, config)[0]["transport"]
        run.serve(config.steps_between)
        for kind in order:
            getattr(run, kind)()
            run.serve(config.steps_between - 1)
        loaded = sum(v["loaded"] for v in run.run(rank_teardown))
    steps = run.steps
    worst = max(s["max_calc_diff"] for s in steps)
    sizes = [s["group_size"] for s in steps]
    metrics = {"config": config._asdict(), "transport": transport, "steps": steps, "events": run.events,
               "resizes": run.resizes, "sizes": _runs(sizes), "loaded_experts": loaded, "max_calc_diff": worst,
               "correct": worst < CHECK_LIMIT and all(s["one_placement"] and s["one_view"] for s in steps)}
    metrics["wall_seconds"] = time.perf_counter() - started
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    metrics["timeline"] = _plot(metrics, config, stream) if plot else None
    _summary(metrics, config, stream)
    return metrics


def _balance(received):
    """Mean / max of the entries each rank's experts received in a step (1 = even), None when none came."""
    return sum(received) / len(received) / max(received) if max(received, default=0) > 0 else None


def shrink_bytes(resize: dict) -> dict:
    """{rank: weight bytes it copied into its slots over every chunk of a shrink's placement (from live copies or
    the loader: `RebalanceReport.moved_bytes` counts both)}."""
    moved = {}
    for commit in resize.get("commits", []):
        for rank, reports in zip(commit["ranks"], commit["reports"]):
            moved[rank] = moved.get(rank, 0) + sum(r["moved_bytes"] for r in reports)
    return moved


def _runs(sizes):
    """[(group size, first step, last step)] for each run of steps at one size."""
    runs = []
    for step, size in enumerate(sizes):
        if runs and runs[-1][0] == size:
            runs[-1][2] = step
        else:
            runs.append([size, step, step])
    return runs


def _plot(metrics, config: ResizeConfig, stream):
    from mooncake_ep_switch.apps.timeline import plot_demo_timeline

    try:
        return plot_demo_timeline(metrics, os.path.join(config.out_dir, "timeline.png"))
    except ImportError as error:
        if (error.name or "").split(".")[0] != "matplotlib":
            raise
        print("  (no timeline PNG: matplotlib is not installed; pip install -e '.[plot]')", file=stream)
        return None


def _summary(metrics, config: ResizeConfig, stream) -> None:
    print("", file=stream)
    print("  group size           " + ", ".join(f"{size} ranks (steps {first}-{last})"
                                                for size, first, last in metrics["sizes"]), file=stream)
    for resize in metrics["resizes"]:
        if resize["kind"] == "shrink":
            commits = resize.get("commits") or []
            reports = [r for c in commits for rank in c["reports"] for r in rank]
            if not resize["chunks"]:
                placed = "every expert kept a live copy: the placement stays"
            else:
                placed = (f"placement over the remaining ranks committed at steps {[c['step'] for c in commits]} "
                          f"({resize['chunks']} chunks; commit stall "
                          f"{max((r['stall_ms'] for r in reports), default=0):.1f} ms, "
                          f"{max((r['moved_bytes'] for r in reports), default=0) / 2**20:.2f} MiB moved per rank and "
                          "chunk at most)")
            print(f"  shrink               rank {resize['rank']} died before step {resize['killed_step']} (seen in "
                  f"{resize['death_seen_s'] * 1e3:.0f} ms), removed for good in {max(resize['agree_s']) * 1e3:.0f} ms "
                  f"(vote + view {resize['view']}), {placed}", file=stream)
        else:
            everyone = resize["members"] + resize["newcomers"]
            print(f"  grow                 {resize['from']} -> {resize['to']} ranks: asked at step "
                  f"{resize['requested_step']}, switched at step {resize['switch_step']} (request -> switch "
                  f"{max(v['switch_s'] for v in resize['members']) * 1e3:.0f} ms; grow_slots "
                  f"{max(v['weights_s'] for v in everyone) * 1e3:.0f} ms at most, "
                  f"{max(v['weight_bytes'] for v in everyone) / 2**20:.2f} MiB per rank, the newcomers' copies from "
                  f"the members' memory {max(v['copy_s'] or 0 for v in resize['newcomers']) * 1e3:.1f} ms)",
                  file=stream)
    print(f"  loader reads         {metrics['loaded_experts']} (experts no live rank held)", file=stream)
    print(f"  correctness          max calc_diff {metrics['max_calc_diff']:.2e} vs single-process reference on every "
          f"step (limit {CHECK_LIMIT:.0e}), one view and one placement per step: "
          f"{'PASS' if metrics['correct'] else 'FAIL'}", file=stream)
    print(f"  metrics              {os.path.join(config.out_dir, 'metrics.json')}", file=stream)
    if metrics.get("timeline"):
        print(f"  timeline             {metrics['timeline']}", file=stream)
    print(f"  wall time            {metrics['wall_seconds']:.1f} s", file=stream)
