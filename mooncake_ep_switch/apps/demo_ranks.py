"""The demo's rank side: its settings, and the functions every rank process runs (`apps/demo.py` drives them).

`rank_setup` builds a rank's Buffer and expert memory (a replacement's from a join ticket or a warm
standby), `rank_step` serves one decode step in the current layout and checks it against the
single-process reference, `rank_switch`, `rank_readmit` and `rank_standby` do the switch, the
re-admission and a standby's preparation.
"""
import importlib
import os
import time
from typing import NamedTuple

import numpy as np
import torch

from mooncake_ep_switch.expert_memory import ExpertMemory
from mooncake_ep_switch.expert_memory import initial_placement as _initial_placement
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
        kill_step: decode step at which a rank is SIGKILLed and then replaced (-1: no failure at all).
        kill_rank: the rank that dies at `kill_step` when it holds the only copy of some expert (else the
            lowest rank that does; `kill_covered` chooses otherwise).
        covered_kill_step: an earlier step at which a rank all of whose experts have a live copy on another
            rank is SIGKILLed (the highest such rank other than 0 and `kill_rank`), served without for one
            step and replaced before `kill_step` (-1: none). `apps.demo_kills`.
        timeout_us: the floor of the per-step deadline of dispatch/combine/all-reduce (the controller scales
            it with the measured step time, `demo_kills.step_timeout_us`; a dead rank is noticed within
            milliseconds by the peer watcher whatever the deadline, a live but late one is masked at it).
        replacement: how the killed rank's replacement starts: "forked" (default: a process started after the
            death, forked from a server that imported torch and the package when the cluster started),
            "spawn" (a fresh interpreter started after the death: its imports count) or "standby" (a warm
            standby started before the death, `standby.WarmStandby`: imports, weights, store done).
        replace_after: steps the survivors serve without the killed rank before its replacement starts
            (fault-aware routing from live copies; from 2 on, a coverage epoch begun in the first of them
            gives every expert that lost its only copy a copy on a survivor, committed in the second).
        kill_covered: kill a rank all of whose experts have a copy on another rank at the kill step
            (the lowest such rank; `kill_rank` when there is none), instead of `kill_rank`.
        store: the ranks' store: "tcp" (the launcher's TCPStore) or "etcd" (a local 3-member etcd cluster
            the demo starts: membership, switch decisions and EPLB votes there, `LocalCluster(store=)`).
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
    store: str = "tcp"
    covered_kill_step: int = -1


_RANK_STATE = {}
CHECK_LIMIT = 1e-4  # calc_diff against the single-process reference (bf16 activations)
PROGRESS_EVERY = 5  # steps between progress lines when the output is not a terminal
LAYOUT_TP, LAYOUT_EP = "tp", "ep"
REPLACEMENTS = ("forked", "spawn", "standby")
# What the rank functions import (also lazily, inside ExpertMemory): a forked replacement's server and a warm standby
# import them before any death (without bytecode caches, PYTHONDONTWRITEBYTECODE, they cost ~0.1 s of compiling).
RANK_MODULES = ("mooncake_ep_switch.apps.demo_ranks", "mooncake_ep_switch.eplb.online", "mooncake_ep_switch.eplb.slots",
                "mooncake_ep_switch.eplb.coverage", "mooncake_ep_switch.eplb.serving", "mooncake_ep_switch.switch",
                "mooncake_ep_switch.reference.moe_block", "mooncake_ep_switch.standby")


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
    for module in RANK_MODULES:  # the imports a replacement needs, done before the death
        importlib.import_module(module)
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
                                   timeout_us=state["timeout_us"])
        return out, None, None
    counts, rows = [], []
    state["masked_by_layer"] = masked = []  # the ranks masked before each layer's round (the reference's skips)
    for layer, router in enumerate(state["routers"]):
        masked.append([r for r in range(ctx.num_ranks) if not int(active[r])])
        row = state["memory"].dispatch_row(layer)
        # fault-aware: entries of an expert with a live copy go to a live copy when this rank's mask says so
        out, count = physical_ep_forward(buffer, out, router, slots, layer, config.top_k, tokens, active, row,
                                         timeout_us=state["timeout_us"], fault_aware=True)
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
    state["skipped"] = 0  # (layer, expert) pairs the reference leaves out: 0 means the full reference
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
        state["skipped"] += len(skip)
        reference = reference_forward(reference, weights, config.top_k, skip_experts=skip)
    return reference


def rank_step(ctx, step: int, command: dict):
    """Serve one decode step in the current layout and check it against the reference forward.

    The rank `command["kill_rank"]` names SIGKILLs itself here. In EP, a rebalance is begun
    (when `command` carries one) and advanced by one step before serving.

    Arguments:
        ctx: the `launch.RankContext`.
        step: decode step number.
        command: dict with `"requests"` (int, in flight over all ranks) and optionally
            `"rebalance"` (dict with `"phy2log"` `[L, R * slots_per_rank]` and `"commit_step"`),
            `"coverage"` (the commit step of a coverage epoch to begin), `"kill_rank"` (the rank that
            dies now), `"timeout_us"` (this step's deadline) and `"unmask"` (ranks masked while alive
            in an earlier step: served again from this one).

    Returns:
        result: dict with `"seconds"` (float, forward time), `"diff"` (float, DeepEP-style
            difference against the reference), `"skipped"` (int, (layer, expert) pairs that reference
            left out: 0 for the full reference), `"tokens"` (int, this rank's), `"dead"` (list of
            int ranks found inactive), `"layout"`, `"counts"` (per layer, tokens per local
            physical slot, or None), `"reports"` (list of `RebalanceReport` dicts) and
            `"phy2log"` (nested list, or None).
    """
    import signal

    from mooncake_ep_switch.reference.moe_block import reference_forward, tp_forward

    state = _RANK_STATE
    config, unified = state["config"], state["unified"]
    if ctx.rank == command.get("kill_rank"):
        ctx.store.set("demo/killed_at", repr(time.time()))  # the wall clock of the death, for the phases
        os.kill(os.getpid(), signal.SIGKILL)  # the failure the demo survives
    rebalancer, active = state["rebalancer"], state["active"]
    for rank in command.get("unmask", ()):  # masked while alive (a stall): the controller lets it serve again
        active[rank] = 1
    state["timeout_us"] = command.get("timeout_us", config.timeout_us)
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
        reports = [dict(r._asdict(), at=time.time()) for r in rebalancer.step(step, active)]
    requests = command["requests"]
    state["skipped"] = 0
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
                             timeout_us=state["timeout_us"])
        seconds = _finished(start)
        served_at = time.time()
        dead = [r for r in range(ctx.num_ranks) if not int(active[r])]
        reference = x
        for weights in state["weights"]:
            reference = reference_forward(reference, weights, config.top_k)
    for report in reports:
        report["layers"] = list(report["layers"])
    return {"seconds": seconds, "served_at": served_at, "diff": calc_diff(out.cpu(), reference), "tokens": x.size(0),
            "dead": dead, "lost": lost if unified.layout == LAYOUT_EP else None, "skipped": state["skipped"],
            "layout": unified.layout, "counts": counts, "reports": reports,
            "phy2log": state["slots"].phy2log.tolist() if state["slots"] is not None else None}


def uncovered_without(phy2log: np.ndarray, config: DemoConfig, rank: int) -> dict:
    """{layer: experts} with no copy outside `rank` in `phy2log` (`eplb.coverage.uncovered_experts`)."""
    from mooncake_ep_switch.eplb.coverage import uncovered_experts

    alive = np.ones(config.num_ranks, dtype=bool)
    alive[rank] = False
    return uncovered_experts(np.asarray(phy2log), alive, np.asarray(phy2log).shape[1] // config.num_ranks,
                             config.experts)


def covered_rank(phy2log: np.ndarray, config: DemoConfig) -> int:
    """The lowest rank all of whose experts have a copy on another rank; `config.kill_rank` when none has."""
    return next((r for r in range(config.num_ranks) if not uncovered_without(phy2log, config, r)), config.kill_rank)


def coverage_commit(phy2log: np.ndarray, config: DemoConfig, dead: int, step: int):
    """The commit step of a coverage epoch begun at `step` (the next one), or None when nothing is uncovered."""
    return step + 1 if uncovered_without(phy2log, config, dead) else None


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


def balancedness(counts_by_rank, num_layers: int) -> float:
    """Mean over layers of mean rank load / max rank load (1.0 = perfectly even)."""
    loads = np.asarray([[sum(layer) for layer in counts] for counts in counts_by_rank], dtype=np.float64)  # [R, L]
    values = [loads[:, l].mean() / loads[:, l].max() for l in range(num_layers) if loads[:, l].max() > 0]
    return float(np.mean(values)) if values else float("nan")
