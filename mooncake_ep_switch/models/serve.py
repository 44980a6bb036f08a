"""Greedy generation of a tiny transformers MoE model on R local CPU ranks, checked against the model.

The controller (this process) drives `R` ranks of a `LocalCluster`; each rank builds the same
seeded model (`models.tiny.build_model`), keeps its own `sequences_per_rank` prompts (attention and
KV cache stay on the rank), and serves the MoE layers over the runtime (`models.runtime`). Per
generation step (step 0 is the prefill, step i > 0 decodes one token) the controller may:

- switch every rank between the EP and TP layouts (`switch_layout`, the unified weight memory);
- plan an online EPLB rebalance of the redundant experts from the loads the router really sent
  (per-slot token counts of the EP steps -> logical loads -> `place_redundant_experts`), which the
  ranks' `OnlineRebalancer` stages and commits while serving continues;
- SIGKILL one rank: the survivors' dispatch times out on it, marks it inactive and the rest of the
  generation runs without it (its experts contribute nothing).

`reference_generation` runs the single-process model over all sequences with the same schedule of
skipped experts; `serve_generation` returns every step's logits of both.
"""
import os
import time
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes

_STATE: Dict[str, object] = {}
EP_LAYOUT = "ep"


class ServeConfig(NamedTuple):
    """Settings of a served generation.

    Fields:
        model: architecture name (`models.tiny.ARCHITECTURES`).
        num_ranks: local CPU ranks `R` (dividing the experts and the expert width).
        seed: seed of the model weights and of the prompts.
        num_experts: routed experts per MoE layer.
        sequences_per_rank: prompts each rank serves.
        prompt_len: tokens per prompt.
        new_tokens: tokens generated per sequence (generation steps, the prefill included).
        redundant_per_rank: redundant experts per rank (EPLB); 0 serves the primaries only.
        switches: `((step, layout), ...)`: before `step`, switch every rank to `layout` (`"ep"`/`"tp"`).
        rebalance_step: step at which an EPLB rebalance is planned from the loads recorded so far
            (-1: none); it commits two steps later, one layer per step.
        kill_step: step at the start of which `kill_rank` SIGKILLs itself (-1: none).
        kill_rank: the rank that dies.
        transport: the Buffer transport.
        timeout_us: deadline of every dispatch, combine, all-reduce and rebalance vote.
    """

    model: str = "qwen3_moe"
    num_ranks: int = 2
    seed: int = 5
    num_experts: int = 8
    sequences_per_rank: int = 2
    prompt_len: int = 6
    new_tokens: int = 10
    redundant_per_rank: int = 1
    switches: tuple = ((2, "tp"), (4, "ep"))
    rebalance_step: int = 5
    kill_step: int = -1
    kill_rank: int = 1
    transport: str = "host"
    timeout_us: int = 10_000_000


def prompts(config: ServeConfig) -> torch.Tensor:
    """Every rank's prompts, rank-major.

    Arguments:
        config: the `ServeConfig`.

    Returns:
        ids: `[R * sequences_per_rank, prompt_len]` torch.int64 token ids drawn from `config.seed`;
            rank r serves rows `[r * sequences_per_rank, (r + 1) * sequences_per_rank)`.
    """
    from mooncake_ep_switch.models.tiny import VOCAB

    generator = torch.Generator().manual_seed(10_000 + config.seed)
    return torch.randint(0, VOCAB, (config.num_ranks * config.sequences_per_rank, config.prompt_len),
                         generator=generator)


def rank_setup(ctx, config: ServeConfig) -> str:
    """Build this rank's model, Buffer and expert memory, and attach the runtime to the model.

    Arguments:
        ctx: the `launch.RankContext`.
        config: the `ServeConfig`.

    Returns:
        transport: str, the Buffer's transport.
    """
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.expert_memory import ExpertMemory, initial_placement
    from mooncake_ep_switch.models.runtime import ModelRuntime
    from mooncake_ep_switch.models.tiny import build_model, expert_layers
    from mooncake_ep_switch.switch import WeightShape

    torch.set_num_threads(1)
    model = build_model(config.model, config.seed, config.num_experts)
    layers = expert_layers(model)
    num_experts, intermediate, hidden = layers[0].down.size(0), layers[0].down.size(2), layers[0].down.size(1)
    tokens = config.sequences_per_rank * config.prompt_len
    physical = ctx.num_ranks * (num_experts // ctx.num_ranks + config.redundant_per_rank)
    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(tokens, hidden, ctx.num_ranks, physical),
                    transport=config.transport)
    phy2log = None
    if config.redundant_per_rank:
        phy2log = initial_placement(len(layers), num_experts, ctx.num_ranks, config.redundant_per_rank)
    memory = ExpertMemory(buffer, WeightShape(num_experts, hidden, intermediate), layers, layout=EP_LAYOUT,
                          max_tp_tokens=ctx.num_ranks * tokens, phy2log=phy2log,
                          redundant_per_rank=config.redundant_per_rank, timeout_us=config.timeout_us)
    runtime = ModelRuntime(buffer, memory, tokens, buffer.active_mask(), config.timeout_us)
    runtime.attach(model)
    del layers
    mine = prompts(config)[ctx.rank * config.sequences_per_rank:(ctx.rank + 1) * config.sequences_per_rank]
    _STATE.update(config=config, model=model, buffer=buffer, memory=memory, runtime=runtime, prompts=mine,
                  cache=None, last=None)
    return buffer.transport


def rank_switch(ctx, target: str) -> dict:
    """Switch this rank's unified weights to `target` (collective over the Buffer's members).

    Arguments:
        ctx: the `launch.RankContext` (unused).
        target: `"tp"` or `"ep"`.

    Returns:
        report: dict with `"outcome"`, `"reason"` (str), `"total_ms"` (float), `"weight_bytes"` (int).
    """
    from mooncake_ep_switch.switch import switch_layout

    report = switch_layout(_STATE["buffer"], target, weights=_STATE["memory"].unified,
                           timeout_us=_STATE["config"].timeout_us)
    return {"outcome": report.outcome, "reason": report.reason, "total_ms": report.total_ms,
            "weight_bytes": report.weight_bytes}


def _one_step(ctx, step: int, command: dict) -> dict:
    import signal

    from transformers import DynamicCache

    config, memory, runtime = _STATE["config"], _STATE["memory"], _STATE["runtime"]
    if step == config.kill_step and ctx.rank == config.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)  # the failure the survivors finish without
    reports = []
    rebalancer = memory.rebalancer
    if rebalancer is not None and command.get("rebalance"):
        plan = command["rebalance"]
        rebalancer.begin(np.asarray(plan["phy2log"]), plan["commit_step"])
    if rebalancer is not None and memory.layout == EP_LAYOUT:
        reports = [dict(r._asdict(), layers=list(r.layers)) for r in rebalancer.step(step, runtime.active)]
    if step == 0:
        _STATE["cache"] = DynamicCache(config=_STATE["model"].config)
        ids = _STATE["prompts"]
    else:
        ids = _STATE["last"][:, None]
    start = time.perf_counter()
    with torch.no_grad():
        out = _STATE["model"](input_ids=ids, past_key_values=_STATE["cache"], use_cache=True)
    seconds = time.perf_counter() - start
    logits = out.logits[:, -1].float()
    _STATE["last"] = logits.argmax(-1)
    return {"step": step, "logits": logits, "tokens": _STATE["last"].tolist(), "seconds": seconds,
            "layout": memory.layout, "counts": runtime.take_counts(), "reports": reports,
            "dead": [r for r in range(ctx.num_ranks) if not int(runtime.active[r])],
            "phy2log": memory.slots.phy2log.tolist() if memory.slots is not None else None}


def rank_steps(ctx, commands: Sequence) -> List[dict]:
    """Run generation steps on this rank's sequences (the kill, a rebalance's begin and chunks included).

    Arguments:
        ctx: the `launch.RankContext`.
        commands: list of `(step, command)`, `command` a dict with optionally `"rebalance"` (dict
            with `"phy2log"` `[L, R * slots_per_rank]` nested list and `"commit_step"` int).

    Returns:
        results: one dict per step with `"step"`, `"logits"` (`[b, V]` torch.float32 of the last
            position), `"tokens"` (list of b greedy ids), `"seconds"`, `"layout"`, `"counts"` (per
            layer, tokens per local physical expert, or None), `"reports"` (rebalance reports),
            `"dead"` (ranks found inactive) and `"phy2log"` (nested list, or None).
    """
    return [_one_step(ctx, step, command) for step, command in commands]


def rank_teardown(ctx) -> bool:
    """Destroy this rank's expert memory and Buffer and forget the model.

    Arguments:
        ctx: the `launch.RankContext` (unused).

    Returns:
        done: True.
    """
    memory, buffer = _STATE.pop("memory", None), _STATE.pop("buffer", None)
    if memory is not None:
        memory.destroy()
    if buffer is not None:
        buffer.destroy()
    _STATE.clear()
    return True


class _Loads:
    """The controller's EPLB side: logical loads from the ranks' per-slot counts, rebalance plans."""

    def __init__(self, config: ServeConfig, phy2log: Optional[np.ndarray]):
        self.config = config
        self.phy2log = phy2log
        self.loads = None if phy2log is None else np.zeros((phy2log.shape[0], config.num_experts))

    def record(self, results: List[dict]) -> None:
        """Add one step's per-slot counts of every rank to the logical loads."""
        if self.phy2log is None:
            return
        per_rank = self.phy2log.shape[1] // self.config.num_ranks
        for rank, result in enumerate(results):
            for layer, counts in enumerate(result["counts"]):
                if counts is not None:
                    slots = self.phy2log[layer, rank * per_rank:(rank + 1) * per_rank]
                    np.add.at(self.loads[layer], slots, counts)

    def plan(self, step: int) -> Optional[dict]:
        """The rebalance to begin at `step` (committing at `step + 2`), or None if nothing moves."""
        from mooncake_ep_switch.eplb.policy.redundant import place_redundant_experts

        target = place_redundant_experts(self.loads, self.config.num_ranks, self.config.redundant_per_rank,
                                         previous=self.phy2log).numpy()

        if np.array_equal(target, self.phy2log):
            return None
        return {"phy2log": target.tolist(), "commit_step": step + 2,
                "changed_layers": int(np.any(target != self.phy2log, axis=1).sum())}


def serve_generation(config: ServeConfig, cluster: Optional[LocalCluster] = None) -> dict:
    """Generate greedily on `config.num_ranks` ranks with the config's switches, rebalance and kill.

    Arguments:
        config: the `ServeConfig`.
        cluster: a `LocalCluster` of `config.num_ranks` ranks to use (left running), or None to
            start one for this call (ranks forked from a server that imported the model's modules).

    Returns:
        result: dict with `"steps"` (per step: `"logits"` `[B, V]` torch.float32 of the ranks
            that served it, rank-major, None rows dropped; `"rows"` (list of the sequence indices
            served); `"tokens"`; `"layout"`; `"seconds"` (slowest rank's forward); `"dead"`;
            `"reports"`), `"switches"` (per switch: step, target, ms), `"rebalance"` (the plan or
            None), `"transport"`, `"phy2log"` (initial and final placement, or None).

    Raises:
        ValueError: a setting the runtime cannot serve (ranks not dividing the experts, ...).
        RuntimeError: a switch did not complete.
    """
    from mooncake_ep_switch.expert_memory import initial_placement
    from mooncake_ep_switch.models.tiny import ARCHITECTURES, RANK_MODULES

    if config.model not in ARCHITECTURES:
        raise ValueError(f"model: expected one of {sorted(ARCHITECTURES)}, got {config.model!r}")
    if config.num_experts % config.num_ranks:
        raise ValueError(f"num_ranks: expected a divisor of num_experts={config.num_experts}, got {config.num_ranks}")
    if config.kill_step >= 0 and not 0 <= config.kill_rank < config.num_ranks:
        raise ValueError(f"kill_rank: expected a rank in [0, {config.num_ranks}), got {config.kill_rank}")
    owned = cluster is None
    # Ranks forked from a server that imported torch and the model's modules once (not seconds of imports per rank).
    cluster = LocalCluster(config.num_ranks, preload=True, preload_modules=RANK_MODULES) if owned else cluster
    switches = dict(config.switches)
    b = config.sequences_per_rank
    try:
        transport = check_outcomes(cluster.run(rank_setup, config, timeout_s=180))[0]
        phy2log = None
        if config.redundant_per_rank and transport == "shm":
            phy2log = initial_placement(_moe_layers(config), config.num_experts, config.num_ranks,
                                        config.redundant_per_rank)
        loads = _Loads(config, phy2log)
        initial = None if phy2log is None else phy2log.tolist()
        steps, switch_log, plan, layout = [], [], None, EP_LAYOUT
        alive = list(range(config.num_ranks))
        step = 0
        while step < config.new_tokens:
            target = switches.get(step)
            if target is not None and target != layout:
                reports = check_outcomes(cluster.run(rank_switch, target, timeout_s=120, ranks=alive))
                if reports[0]["outcome"] != "completed":
                    raise RuntimeError(f"switch to {target} before step {step}: {reports[0]}")
                layout = target
                switch_log.append({"step": step, "target": target, "ms": max(r["total_ms"] for r in reports)})
            if step == config.kill_step:  # the rest of the generation in one call: the cluster is broken after
                commands = [(s, {}) for s in range(step, config.new_tokens)]
                outcomes = cluster.run(rank_steps, commands, timeout_s=180, failure_grace_s=120)
                alive = [r for r in alive if r != config.kill_rank]
                per_rank = check_outcomes([o for o in outcomes if o.rank in alive])
            else:
                command = {}
                if step == config.rebalance_step and phy2log is not None and layout == EP_LAYOUT:
                    plan = loads.plan(step)
                    command = {"rebalance": plan} if plan else {}
                per_rank = check_outcomes(cluster.run(rank_steps, [(step, command)], timeout_s=120, ranks=alive))
            for index in range(len(per_rank[0])):
                results = [values[index] for values in per_rank]
                if len(results) == config.num_ranks:
                    loads.record(results)
                if results[0]["phy2log"] is not None:
                    loads.phy2log = np.asarray(results[0]["phy2log"])
                steps.append({"step": results[0]["step"], "logits": torch.cat([r["logits"] for r in results]),
                              "rows": [r * b + j for r in alive for j in range(b)],
                              "tokens": [t for r in results for t in r["tokens"]], "layout": results[0]["layout"],
                              "seconds": max(r["seconds"] for r in results),
                              "dead": sorted({d for r in results for d in r["dead"]}),
                              "reports": results[0]["reports"]})
            step = steps[-1]["step"] + 1
        if config.kill_step < 0:
            check_outcomes(cluster.run(rank_teardown, timeout_s=60))
    finally:
        if owned:
            cluster.close()
    return {"steps": steps, "switches": switch_log, "rebalance": plan, "transport": transport,
            "phy2log": None if phy2log is None else {"initial": initial, "final": loads.phy2log.tolist()}}


def _moe_layers(config: ServeConfig) -> int:
    from mooncake_ep_switch.models.tiny import ARCHITECTURES

    cfg = ARCHITECTURES[config.model](config.num_experts)
    first_dense = getattr(cfg, "first_k_dense_replace", 0)
    return cfg.num_hidden_layers - first_dense


class _SkippingRouter(torch.nn.Module):
    """A router whose weights of `skip` experts are zero (those experts contribute nothing)."""

    def __init__(self, router, skip: set):
        super().__init__()
        self.router = router
        self.skip = sorted(skip)

    def forward(self, hidden_states):
        logits, weights, indices = self.router(hidden_states)
        if self.skip:
            dropped = torch.isin(indices, torch.tensor(self.skip, dtype=indices.dtype))
            weights = weights.masked_fill(dropped, 0)
        return logits, weights, indices


def reference_generation(config: ServeConfig, skip_from: int = -1, skip_experts=()) -> List[dict]:
    """The single-process model's greedy generation of every rank's prompts.

    Arguments:
        config: the `ServeConfig` (model, seed, prompts, new_tokens).
        skip_from: first step from which `skip_experts` contribute nothing (-1: never).
        skip_experts: logical expert ids whose routing weights are zeroed (as a dead rank's
            experts are skipped by combine: no renormalisation).

    Returns:
        steps: one dict per step with `"logits"` `[B, V]` torch.float32 and `"tokens"` (list of B ids).
    """
    from transformers import DynamicCache

    from mooncake_ep_switch.models.tiny import build_model, moe_blocks

    model = build_model(config.model, config.seed, config.num_experts)
    routers = [block.gate for block in moe_blocks(model)]
    cache = DynamicCache(config=model.config)
    ids = prompts(config)
    steps = []
    with torch.no_grad():
        for step in range(config.new_tokens):
            if step == skip_from:
                for block, router in zip(moe_blocks(model), routers):
                    block.gate = _SkippingRouter(router, set(skip_experts))
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
            ids = logits.argmax(-1)[:, None]
            steps.append({"logits": logits, "tokens": ids[:, 0].tolist()})
    return steps
