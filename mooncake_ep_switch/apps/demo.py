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
from typing import NamedTuple

import numpy as np
import torch

from mooncake_ep_switch.expert_memory import ExpertMemory
from mooncake_ep_switch.expert_memory import initial_placement as _initial_placement
from mooncake_ep_switch.apps.recovery_phases import phase_lines, recovery_phases
from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes
from mooncake_ep_switch.reference.compare import calc_diff


class DemoConfig(NamedTuple):
    """Demo settings (a scaled-down Qwen3-MoE-like layer stack).

    Fields:
        num_ranks: local CPU ranks.
        steps: decode steps.
        layers: MoE layers.
        experts: logical experts per layer.
        top_k: experts per token.
        hidden: hidden size.
        intermediate: expert intermediate size.
        low_requests: in-flight requests outside the burst (a multiple of `num_ranks`).
        burst_requests: in-flight requests during the burst (a multiple of `num_ranks`).
        burst: (first step, end step) of the burst, as fractions of `steps`.
        switch_threshold: requests at which the policy enters EP (`SwitchPolicy.threshold_high`).
        redundant_per_rank: redundant experts per rank (EPLB replicas of hot experts).
        rebalance_after: EP steps of recorded load before each rebalance.
        transport: Buffer transport.
        out_dir: where metrics.json and timeline.png are written.
        kill_step: decode step at which `kill_rank` is SIGKILLed and then replaced (-1: no failure).
        kill_rank: the rank that dies.
        timeout_us: per-call deadline of dispatch/combine/all-reduce (how fast a dead rank is noticed).
        replacement: how the killed rank's replacement starts: "forked" (default: a process started after the
            death, forked from a server that imported torch and the package when the cluster started),
            "spawn" (a fresh interpreter started after the death: its imports count) or "standby" (a warm
            standby started before the death, `standby.WarmStandby`: imports, weights, store done).
        replace_after: steps the survivors serve without the killed rank before its replacement starts
            (fault-aware routing from live copies; from 2 on, a coverage epoch begun in the first of them
            gives every expert that lost its only copy a copy on a survivor, committed in the second).
        kill_covered: kill a rank all of whose experts have a copy on another rank at the kill step
            (the lowest such rank; `kill_rank` when there is none), instead of `kill_rank`.
    """

    num_ranks: int = 4
    steps: int = 40
    layers: int = 2
    experts: int = 16
    top_k: int = 4
    hidden: int = 512
    intermediate: int = 256
    low_requests: int = 16
    burst_requests: int = 128
    burst: tuple = (0.2, 0.75)
    switch_threshold: int = 64
    redundant_per_rank: int = 1
    rebalance_after: int = 5
    transport: str = "host"
    out_dir: str = "mep_demo_out"
    kill_step: int = 25
    kill_rank: int = 2
    timeout_us: int = 2_000_000
    replacement: str = "forked"
    replace_after: int = 0
    kill_covered: bool = False


_RANK_STATE = {}
CHECK_LIMIT = 1e-4  # calc_diff against the single-process reference (bf16 activations)
PROGRESS_EVERY = 5  # steps between progress lines when the output is not a terminal
LAYOUT_TP, LAYOUT_EP = "tp", "ep"
REPLACEMENTS = ("forked", "spawn", "standby")


def request_trace(config: DemoConfig):
    """In-flight requests per step: low, a burst, low again (multiples of the rank count).

    Arguments:
        config: the `DemoConfig`.

    Returns:
        requests: list of `config.steps` ints, `burst_requests` inside the burst, else `low_requests`.
    """
    first, end = (int(round(f * config.steps)) for f in config.burst)
    return [config.burst_requests if first <= step < end else config.low_requests for step in range(config.steps)]


def initial_placement(config: DemoConfig) -> np.ndarray:
    """[L, R * slots] phy2log of the demo's shape (see `expert_memory.initial_placement`).

    Arguments:
        config: the `DemoConfig` (`experts` a multiple of `num_ranks`).

    Returns:
        phy2log: `[L, R * (E/R + redundant_per_rank)]` np.int64: rank r's primaries, then redundant
            experts `(r+1) * E/R + j` (mod `E`), the same in every layer.
    """
    return _initial_placement(config.layers, config.experts, config.num_ranks, config.redundant_per_rank)


def _weights(config: DemoConfig, checkpoint: str = ""):
    """Every layer's `MoEWeights`: read from `checkpoint` (a file `_save_checkpoint` wrote) when it exists, else
    made (the same seeds on every rank)."""
    from mooncake_ep_switch.reference.moe_block import MoEWeights, random_weights

    if checkpoint and os.path.exists(checkpoint):  # what a replacement reads: the rank-0 copy of the loader's output
        return [MoEWeights(*layer) for layer in torch.load(checkpoint, mmap=True, weights_only=True)]
    layers = []
    for layer in range(config.layers):
        weights = random_weights(config.experts, config.hidden, config.intermediate, seed=layer)
        # A skewed router (a few hot experts, as real routers are): what EPLB is for.
        skew = torch.zeros(config.experts)
        skew[torch.randperm(config.experts, generator=torch.Generator().manual_seed(99 + layer))[:3]] = 0.08
        bias = torch.randn(config.hidden, generator=torch.Generator().manual_seed(7))
        layers.append(MoEWeights(weights.router + skew[:, None] * bias[None, :], weights.gate_up, weights.down))
    return layers


def _save_checkpoint(weights, checkpoint: str) -> None:
    """Write the loader's weights where a replacement reads them (`_weights`), as a checkpoint (atomically)."""
    partial = f"{checkpoint}.{os.getpid()}"
    torch.save([tuple(layer) for layer in weights], partial)
    os.replace(partial, checkpoint)


def _build_structures(buffer, config: DemoConfig, weights=None):
    """Unified weights, TP all-reduce, expert slots and rebalancer (an `ExpertMemory`) on `buffer`.

    A replacement rank makes the same call once admitted: it takes the members' layout, counters
    and placement over through the Buffer and loads its weights from the loader (`_weights`).
    """
    from mooncake_ep_switch.switch import WeightShape

    loading = time.time()
    checkpoint = _RANK_STATE.get("checkpoint", "")
    weights = _weights(config, checkpoint) if weights is None else weights  # the loader (a checkpoint file)
    _RANK_STATE["loader_s"] = time.time() - loading
    if checkpoint and buffer.rank == 0 and not os.path.exists(checkpoint):
        _save_checkpoint(weights, checkpoint)
    memory = ExpertMemory(buffer, WeightShape(config.experts, config.hidden, config.intermediate),
                          weights, layout=LAYOUT_TP, max_tp_tokens=config.burst_requests,
                          phy2log=initial_placement(config), redundant_per_rank=config.redundant_per_rank,
                          timeout_us=config.timeout_us)
    device = _RANK_STATE["device"]
    _RANK_STATE.update(weights=weights, memory=memory, unified=memory.unified, all_reduce=memory.all_reduce,
                       slots=memory.slots, rebalancer=memory.rebalancer,
                       routers=[w.router.to(device) for w in weights])  # routing runs where the tokens are


def rank_setup(ctx, config: DemoConfig, checkpoint: str = ""):
    """Build this rank's Buffer and (unless it is a replacement) its weights, slots and rebalancer.

    Runs inside a `LocalCluster` rank; collective over `ctx.group`. A replacement rank
    (`ctx.group` None) joins through the store and builds the rest in `rank_readmit`.

    Arguments:
        ctx: the `launch.RankContext`.
        config: the `DemoConfig`.
        checkpoint: a file rank 0 writes the loader's weights to and a replacement reads them from
            ("" none: every rank makes them).

    Returns:
        transport: str, the transport the Buffer uses.
    """
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join

    setup_started = time.time()
    _RANK_STATE["checkpoint"] = checkpoint
    tokens = config.burst_requests // ctx.num_ranks
    physical = ctx.num_ranks * (config.experts // ctx.num_ranks + config.redundant_per_rank)
    size = Buffer.get_ep_buffer_size_hint(tokens, config.hidden, ctx.num_ranks, physical)
    replacement = ctx.group is None
    if config.transport == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(0)  # rank processes share GPU 0 (CUDA IPC between them, as NVLink between GPUs)
    standby = _RANK_STATE.pop("standby", None)
    if standby is not None:  # a warm standby told its rank: imports and weights are done
        buffer = standby.replace(ctx.rank)
        _RANK_STATE["weights"] = standby.prepared
    else:
        group = join(ctx.store, ctx.rank, ctx.num_ranks) if replacement else ctx.group
        buffer = Buffer(group, size, transport=config.transport)
    _RANK_STATE["timings"] = {"setup_started": setup_started, "buffer_built": time.time()}
    # Tokens, routers, expert weights and the KV-free layer stack live on the Buffer's device ("cuda"), else the CPU.
    device = buffer.runtime.device or torch.device("cpu")
    _RANK_STATE.update(buffer=buffer, config=config, active=buffer.active_mask(), device=device)
    if not replacement:  # a replacement builds the rest once admitted (rank_readmit)
        _build_structures(buffer, config)
    return buffer.transport


def rank_standby(ctx, config: DemoConfig):
    """Prepare this process as a warm standby (`standby.WarmStandby`): imports, the loader's weights, the store.

    Arguments:
        ctx: the `launch.RankContext` of a standby (rank `launch.STANDBY` until assigned).
        config: the `DemoConfig`.

    Returns:
        prepared: wall-clock time (`time.time()`) the standby was ready.
    """
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.standby import WarmStandby

    tokens = config.burst_requests // ctx.num_ranks
    physical = ctx.num_ranks * (config.experts // ctx.num_ranks + config.redundant_per_rank)
    size = Buffer.get_ep_buffer_size_hint(tokens, config.hidden, ctx.num_ranks, physical)
    standby = WarmStandby(ctx.store, ctx.num_ranks, size, prepare=lambda: _weights(config), transport=config.transport)
    _RANK_STATE["standby"] = standby
    return standby.timings["prepared"]


def rank_readmit(ctx, joiner: int, timeout_s: float = 60.0):
    """Admit `joiner`'s replacement: `update_ep_member()` everywhere, then the replacement builds its memory.

    The members' `update_ep_member()` hands the replacement their state and maps its regions as it
    builds them; nothing else is re-mapped by hand.

    Arguments:
        ctx: the `launch.RankContext`.
        joiner: the rank being replaced.
        timeout_s: seconds to wait for the joiner, the agreement and the replacement's rebuild.

    Returns:
        result: dict with "view" (list of int, the members of the agreed epoch) and "timings"
            (wall clocks: a member's "pending_seen" and "admitted"; the joiner's "setup_started",
            "buffer_built", "admitted" and "restored").

    Raises:
        TimeoutError: the replacement never asked to join.
    """
    from mooncake_ep_switch.elastic import admit

    buffer = _RANK_STATE["buffer"]
    timings = _RANK_STATE.pop("timings", {}) if ctx.rank == joiner else {}
    deadline = time.monotonic() + timeout_s
    while ctx.rank != joiner and joiner not in buffer.pending_joiners() and time.monotonic() < deadline:
        time.sleep(0.002)
    if ctx.rank != joiner:
        timings["pending_seen"] = time.time()
    view = admit(buffer, joiner, max(1.0, deadline - time.monotonic()))
    timings["admitted"] = time.time()
    if ctx.rank == joiner:
        _build_structures(buffer, _RANK_STATE["config"], _RANK_STATE.get("weights"))
        timings["restored"] = time.time()
        timings["restore"] = dict(_RANK_STATE["memory"].restored._asdict(), loader_s=_RANK_STATE["loader_s"])
    _RANK_STATE["active"] = buffer.active_mask()
    return {"view": list(view.ranks), "timings": timings}


def rank_switch(ctx, target: str):
    """Switch this rank's unified weights to `target` (collective over the Buffer's members).

    Arguments:
        ctx: the `launch.RankContext` (unused).
        target: `"tp"` or `"ep"`.

    Returns:
        result: dict with `"outcome"`, `"reason"` (str), `"total_ms"` (float) and `"weight_bytes"`
            (int), from the `SwitchReport`.
    """
    from mooncake_ep_switch.switch import switch_layout

    report = switch_layout(_RANK_STATE["buffer"], target, weights=_RANK_STATE["unified"],
                           timeout_us=_RANK_STATE["config"].timeout_us)
    return {"outcome": report.outcome, "total_ms": report.total_ms, "weight_bytes": report.weight_bytes,
            "reason": report.reason}


def _ep_forward(ctx, x):
    """Every layer in EP; returns (output, per-layer slot counts or None, per-layer dispatch rows or None)."""
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import ep_forward_local

    state = _RANK_STATE
    config, buffer, slots, active = state["config"], state["buffer"], state["slots"], state["active"]
    tokens = config.burst_requests // ctx.num_ranks
    out = x
    if slots is None:  # collective transport: primaries only (no one-sided slot moves)
        for layer, router in enumerate(state["routers"]):
            gate_up, down = state["unified"].view(layer, LAYOUT_EP)
            out = ep_forward_local(buffer, out, router, gate_up, down, config.top_k, tokens, active,
                                   timeout_us=config.timeout_us)
        return out, None, None
    counts, rows = [], []
    state["masked_by_layer"] = masked = []  # the ranks masked before each layer's round (the reference's skips)
    for layer, router in enumerate(state["routers"]):
        masked.append([r for r in range(ctx.num_ranks) if not int(active[r])])
        row = state["memory"].dispatch_row(layer)
        # fault-aware: entries of an expert with a live copy go to a live copy when this rank's mask says so
        out, count = physical_ep_forward(buffer, out, router, slots, layer, config.top_k, tokens, active, row,
                                         timeout_us=config.timeout_us, fault_aware=True)
        counts.append(count.tolist())
        rows.append(row)
    return out, counts, rows


def _ep_reference(ctx, x, rows, dead):
    """The single-process forward without the experts this rank's tokens lost, per layer: those sent to ranks
    found dead in the layer's round, or (fault-aware routing around the ranks masked before the round) those
    with no copy on a rank unmasked before it."""
    from mooncake_ep_switch.reference.moe_block import reference_forward

    state = _RANK_STATE
    config = state["config"]
    reference = x
    for layer, weights in enumerate(state["weights"]):
        masked = state["masked_by_layer"][layer] if rows is not None else []
        if rows is None:
            local = config.experts // ctx.num_ranks
            skip = {r * local + j for r in dead for j in range(local)}
        elif masked:  # routed around the ranks masked before the round: lost = no live copy
            per_rank = state["slots"].shape.slots_per_rank
            phy2log = state["slots"].phy2log[layer]
            live = {int(e) for slot, e in enumerate(phy2log) if slot // per_rank not in masked}
            skip = set(range(config.experts)) - live
        else:
            per_rank = state["slots"].shape.slots_per_rank
            skip = {e for e in range(config.experts) if int(rows[layer][e]) // per_rank in dead}
        reference = reference_forward(reference, weights, config.top_k, skip_experts=skip)
    return reference


def rank_step(ctx, step: int, command: dict):
    """Serve one decode step in the current layout and check it against the reference forward.

    At `config.kill_step` the `config.kill_rank` SIGKILLs itself here. In EP, a rebalance is begun
    (when `command` carries one) and advanced by one step before serving.

    Arguments:
        ctx: the `launch.RankContext`.
        step: decode step number.
        command: dict with `"requests"` (int, in flight over all ranks) and optionally
            `"rebalance"` (dict with `"phy2log"` `[L, R * slots_per_rank]` and `"commit_step"`).

    Returns:
        result: dict with `"seconds"` (float, forward time), `"diff"` (float, DeepEP-style
            difference against the reference), `"tokens"` (int, this rank's), `"dead"` (list of
            int ranks found inactive), `"layout"`, `"counts"` (per layer, tokens per local
            physical slot, or None), `"reports"` (list of `RebalanceReport` dicts) and
            `"phy2log"` (nested list, or None).
    """
    import signal

    from mooncake_ep_switch.reference.moe_block import reference_forward, tp_forward

    state = _RANK_STATE
    config, unified = state["config"], state["unified"]
    if step == config.kill_step and ctx.rank == command.get("kill_rank", config.kill_rank):
        ctx.store.set("demo/killed_at", repr(time.time()))  # the wall clock of the death, for the phases
        os.kill(os.getpid(), signal.SIGKILL)  # the failure the demo survives
    rebalancer, active = state["rebalancer"], state["active"]
    reports = []
    if rebalancer is not None and command.get("rebalance"):
        plan = command["rebalance"]
        rebalancer.begin(np.asarray(plan["phy2log"]), plan["commit_step"])
    if rebalancer is not None and command.get("coverage") is not None:  # a coverage epoch among the live ranks
        from mooncake_ep_switch.eplb.coverage import restore_coverage

        weights = state["weights"]
        restore_coverage(rebalancer, active, command["coverage"],
                         loader=lambda layer, expert: (weights[layer].gate_up[expert], weights[layer].down[expert]))
    if rebalancer is not None and unified.layout == LAYOUT_EP:
        reports = [r._asdict() for r in rebalancer.step(step, active)]
    requests = command["requests"]
    start = time.perf_counter()
    counts = lost = None
    if unified.layout == LAYOUT_EP:
        generator = torch.Generator().manual_seed(step * 1009 + ctx.rank)
        x = torch.randn((requests // ctx.num_ranks, config.hidden), generator=generator).to(torch.bfloat16)
        lost_before = int(state["slots"].lost_contributions.sum()) if state["slots"] is not None else 0
        out, counts, rows = _ep_forward(ctx, x.to(state["device"]))
        seconds = _finished(start)
        served_at = time.time()
        dead = [r for r in range(ctx.num_ranks) if not int(active[r])]  # what the timeouts found
        lost = int(state["slots"].lost_contributions.sum()) - lost_before if state["slots"] is not None else None
        reference = _ep_reference(ctx, x, rows, dead)
    else:  # TP: the same tokens on every rank
        generator = torch.Generator().manual_seed(step * 1009)
        x = torch.randn((requests, config.hidden), generator=generator).to(torch.bfloat16)
        out = x.to(state["device"])
        for layer, router in enumerate(state["routers"]):
            gate_up, down = unified.view(layer, LAYOUT_TP)
            out = tp_forward(state["all_reduce"], out, router, gate_up, down, config.top_k, active,
                             timeout_us=config.timeout_us)
        seconds = _finished(start)
        served_at = time.time()
        dead = [r for r in range(ctx.num_ranks) if not int(active[r])]
        reference = x
        for weights in state["weights"]:
            reference = reference_forward(reference, weights, config.top_k)
    for report in reports:
        report["layers"] = list(report["layers"])
    return {"seconds": seconds, "served_at": served_at, "diff": calc_diff(out.cpu(), reference), "tokens": x.size(0),
            "dead": dead, "lost": lost if unified.layout == LAYOUT_EP else None,
            "layout": unified.layout, "counts": counts, "reports": reports,
            "phy2log": state["slots"].phy2log.tolist() if state["slots"] is not None else None}


def _uncovered_without(phy2log: np.ndarray, config: DemoConfig, rank: int) -> dict:
    """{layer: experts} with no copy outside `rank` in `phy2log` (`eplb.coverage.uncovered_experts`)."""
    from mooncake_ep_switch.eplb.coverage import uncovered_experts

    alive = np.ones(config.num_ranks, dtype=bool)
    alive[rank] = False
    return uncovered_experts(np.asarray(phy2log), alive, np.asarray(phy2log).shape[1] // config.num_ranks,
                             config.experts)


def _covered_rank(phy2log: np.ndarray, config: DemoConfig) -> int:
    """The lowest rank all of whose experts have a copy on another rank; `config.kill_rank` when none has."""
    return next((r for r in range(config.num_ranks) if not _uncovered_without(phy2log, config, r)), config.kill_rank)


def _coverage_commit(phy2log: np.ndarray, config: DemoConfig, dead: int, step: int):
    """The commit step of a coverage epoch begun at `step` (the next one), or None when nothing is uncovered."""
    return step + 1 if _uncovered_without(phy2log, config, dead) else None


def _finished(start: float) -> float:
    """Seconds since `start`, once this rank's device (if any) finished what the step queued."""
    if _RANK_STATE["device"].type == "cuda":
        torch.cuda.synchronize(_RANK_STATE["device"])
    return time.perf_counter() - start


def rank_teardown(ctx):
    """Destroy this rank's rebalancer, slots, all-reduce, weights and Buffer, in that order.

    Arguments:
        ctx: the `launch.RankContext` (unused).

    Returns:
        done: True.
    """
    for name in ("memory", "buffer"):
        item = _RANK_STATE.pop(name, None)
        destroy = getattr(item, "destroy", None)
        if destroy is not None:
            destroy()
    _RANK_STATE.clear()
    return True


def _balancedness(counts_by_rank, num_layers: int) -> float:
    """Mean over layers of mean rank load / max rank load (1.0 = perfectly even)."""
    loads = np.asarray([[sum(layer) for layer in counts] for counts in counts_by_rank], dtype=np.float64)  # [R, L]
    values = [loads[:, l].mean() / loads[:, l].max() for l in range(num_layers) if loads[:, l].max() > 0]
    return float(np.mean(values)) if values else float("nan")


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
    with scratch, LocalCluster(config.num_ranks, preload_replacements=config.replacement == "forked") as cluster:
        transport = check_outcomes(cluster.run(rank_setup, config, checkpoint, timeout_s=120))[0]
        standby, kill_rank = None, config.kill_rank
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
                command["kill_rank"] = kill_rank = _covered_rank(control.phy2log, config)
            if window and step == config.kill_step + 1 and config.replace_after >= 2 and transport == "shm":
                command["coverage"] = _coverage_commit(control.phy2log, config, kill_rank, step)
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
                events.append({"step": step, "kind": "rebalance",
                               "label": f"EPLB {report['outcome']} L{report['layers']} {moved / 2**20:.1f} MiB"})
            if values[0]["phy2log"] is not None:
                control.phy2log = np.asarray(values[0]["phy2log"])
            layout = values[0]["layout"]
            balanced = None
            if layout == LAYOUT_EP and values[0]["counts"] is not None:
                balanced = _balancedness([v["counts"] for v in values], config.layers)
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
    metrics = {"config": config._asdict(), "transport": transport, "steps": steps, "events": events,
               "switches": switches, "rebalances": rebalances, "recovery": recovery, "max_calc_diff": worst,
               "correct": worst < CHECK_LIMIT, "phases": _phases(steps, config)}
    metrics["wall_seconds"] = time.perf_counter() - started
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    metrics["timeline"] = _plot(metrics, config, stream)
    _summary(metrics, config, stream)
    return metrics


def _phases(steps, config: DemoConfig):
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


def _plot(metrics, config: DemoConfig, stream):
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


def _summary(metrics, config: DemoConfig, stream) -> None:
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
    recovery = metrics["recovery"]
    if recovery is not None:
        print(f"  failure              rank {recovery['rank']} SIGKILLed at step {recovery['killed_at_step']}; "
              f"survivors served it without rank(s) {recovery['survivors_saw_dead']}", file=stream)
        print(f"  recovery             replacement joined, view {recovery['view']}, in "
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
            print("  lost top-k           contributions whose expert had no live copy (tokens x entries), per step: "
                  + ", ".join(f"step {step} {count}" for step, count in lost), file=stream)
    print("  note                 the switch threshold is a setting here: on this CPU the EP step is faster at every "
          "load; the TP/EP crossover is a GPU effect (see `mooncake-ep simulate`)", file=stream)
    print(f"  correctness          max calc_diff {metrics['max_calc_diff']:.2e} vs single-process reference "
          f"(limit {CHECK_LIMIT:.0e}): {'PASS' if metrics['correct'] else 'FAIL'}", file=stream)
    print(f"  metrics              {os.path.join(config.out_dir, 'metrics.json')}", file=stream)
    if metrics.get("timeline"):
        print(f"  timeline             {metrics['timeline']}", file=stream)
    print(f"  wall time            {metrics['wall_seconds']:.1f} s", file=stream)
