"""The main job: local CPU ranks serve a small random-weight MoE model over the Buffer.

Every decode step each rank routes its tokens, runs dispatch -> its experts -> combine for each MoE
layer, and checks the result against a single-process reference computed from the same weights.
Prints a live progress line and a summary; writes the metrics as JSON; exits non-zero when the
correctness check fails.
"""
import json
import os
import sys
import time
from typing import NamedTuple

import torch

from mooncake_ep_switch.launch import LocalCluster, check_outcomes


class DemoConfig(NamedTuple):
    """Demo settings (a scaled-down Qwen3-MoE-like layer stack).

    Fields:
        num_ranks: local CPU ranks.
        steps: decode steps.
        layers: MoE layers.
        experts: experts per layer.
        top_k: experts per token.
        hidden: hidden size.
        intermediate: expert intermediate size.
        tokens_per_rank: decode batch per rank (also `num_max_dispatch_tokens_per_rank`).
        transport: Buffer transport.
        use_fp8: FP8 dispatch.
        out_dir: where the metrics are written.
        kill_step: decode step at which `kill_rank` is killed (SIGKILL) and then replaced
            (-1: no failure).
        kill_rank: the rank that dies.
        timeout_us: per-call deadline of dispatch/combine (how fast a dead rank is noticed).
    """

    num_ranks: int = 4
    steps: int = 20
    layers: int = 2
    experts: int = 16
    top_k: int = 4
    hidden: int = 512
    intermediate: int = 256
    tokens_per_rank: int = 32
    transport: str = "auto"
    use_fp8: bool = False
    out_dir: str = "mep_demo_out"
    kill_step: int = 8
    kill_rank: int = 2
    timeout_us: int = 2_000_000


_RANK_STATE = {}
CHECK_LIMIT = 1e-4  # calc_diff against the single-process reference (bf16 activations)


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def rank_setup(ctx, config: DemoConfig):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.moe_block import random_weights

    from mooncake_ep_switch.elastic import join

    size = Buffer.get_ep_buffer_size_hint(config.tokens_per_rank, config.hidden, ctx.num_ranks, config.experts)
    group = ctx.group if ctx.group is not None else join(ctx.store, ctx.rank, ctx.num_ranks)  # a replacement
    buffer = Buffer(group, size, transport=config.transport)
    weights = [random_weights(config.experts, config.hidden, config.intermediate, seed=layer)
               for layer in range(config.layers)]
    _RANK_STATE.update(buffer=buffer, weights=weights, config=config, active=buffer.active_mask())
    return buffer.transport


def rank_readmit(ctx, joiner: int, timeout_s: float = 60.0):
    """Every rank (survivors and the replacement) agrees on the next epoch with the joiner in it."""
    buffer = _RANK_STATE["buffer"]
    deadline = time.monotonic() + timeout_s
    while ctx.group is not None and joiner not in buffer.pending_joiners():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {joiner}'s replacement never asked to join")
        time.sleep(0.01)
    view = buffer.update_ep_member(timeout_s=timeout_s)
    _RANK_STATE["active"] = buffer.active_mask()
    return list(view.ranks)


def rank_step(ctx, step: int):
    import os
    import signal

    from mooncake_ep_switch.switch.moe_block import ep_forward, reference_forward

    buffer, weights, config = _RANK_STATE["buffer"], _RANK_STATE["weights"], _RANK_STATE["config"]
    if step == config.kill_step and ctx.rank == config.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)  # the failure the demo survives
    generator = torch.Generator().manual_seed(step * 1009 + ctx.rank)
    x = torch.randn((config.tokens_per_rank, config.hidden), generator=generator).to(torch.bfloat16)
    active = _RANK_STATE["active"]  # the caller-owned mask: timeouts write into it
    start = time.perf_counter()
    hidden_states = x
    for layer in weights:
        hidden_states = ep_forward(buffer, hidden_states, layer, config.top_k, config.tokens_per_rank, active,
                                   timeout_us=config.timeout_us, use_fp8=config.use_fp8)
    seconds = time.perf_counter() - start
    # The reference leaves out exactly the experts of ranks this rank saw die (no renormalisation).
    local = config.experts // ctx.num_ranks
    dead = [r for r in range(ctx.num_ranks) if not int(active[r])]
    skip = {r * local + l for r in dead for l in range(local)}
    reference = x
    for layer in weights:
        reference = reference_forward(reference, layer, config.top_k, skip_experts=skip)
    return {"seconds": seconds, "diff": _calc_diff(hidden_states, reference), "tokens": x.size(0),
            "dead": dead}


def rank_teardown(ctx):
    buffer = _RANK_STATE.pop("buffer", None)
    if buffer is not None:
        buffer.destroy()
    return True


def run_demo(config: DemoConfig, stream=sys.stdout) -> dict:
    """Run the demo and return its metrics (also written to `config.out_dir/metrics.json`)."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    print(f"mooncake_ep_switch demo: {config.num_ranks} CPU ranks, {config.layers} MoE layers x "
          f"{config.experts} experts (top-{config.top_k}, hidden {config.hidden}), {config.steps} decode steps",
          file=stream)
    steps, recovery = [], None
    with LocalCluster(config.num_ranks) as cluster:
        transport = check_outcomes(cluster.run(rank_setup, config, timeout_s=120))[0]
        failed_at = None
        for step in range(config.steps):
            step_started = time.perf_counter()
            outcomes = cluster.run(rank_step, step, timeout_s=120, failure_grace_s=60)
            if step == config.kill_step:
                failed_at = step_started
                values = check_outcomes([o for o in outcomes if o.rank != config.kill_rank])
            else:
                values = check_outcomes(outcomes)
            step_seconds = max(v["seconds"] for v in values)
            worst = max(v["diff"] for v in values)
            tokens = sum(v["tokens"] for v in values)
            dead = sorted({r for v in values for r in v["dead"]})
            steps.append({"step": step, "seconds": step_seconds, "max_calc_diff": worst, "tokens": tokens,
                          "dead_ranks": dead, "ranks_serving": len(values)})
            if recovery is not None and "first_full_step" not in recovery and not dead and len(values) == config.num_ranks:
                recovery["first_full_step"] = step
                recovery["interruption_seconds"] = time.perf_counter() - failed_at
            if step == config.kill_step:
                # Replace the dead rank while the survivors have served this step without it.
                replace_started = time.perf_counter()
                cluster.respawn(config.kill_rank)
                check_outcomes(cluster.run(rank_setup, config, ranks=[config.kill_rank], timeout_s=120))
                views = check_outcomes(cluster.run(rank_readmit, config.kill_rank, timeout_s=120))
                recovery = {"rank": config.kill_rank, "killed_at_step": step, "survivors_saw_dead": dead,
                            "replace_seconds": time.perf_counter() - replace_started, "view": views[0]}
            if stream.isatty():
                print(f"\r  step {step + 1}/{config.steps}  {tokens / step_seconds:8.0f} tok/s  "
                      f"calc_diff {worst:.2e}  ranks {len(values)}", end="", file=stream, flush=True)
        if stream.isatty():
            print(file=stream)
        check_outcomes(cluster.run(rank_teardown, timeout_s=60))
    worst = max(s["max_calc_diff"] for s in steps)
    total_tokens = sum(s["tokens"] for s in steps)
    healthy = [s for s in steps if not s["dead_ranks"] and s["ranks_serving"] == config.num_ranks]
    step_time = sum(s["seconds"] for s in healthy) or float("nan")
    healthy_tokens = sum(s["tokens"] for s in healthy)
    metrics = {
        "config": config._asdict(), "transport": transport, "steps": steps,
        "tokens_per_second": healthy_tokens / step_time, "max_calc_diff": worst,
        "correct": worst < CHECK_LIMIT, "wall_seconds": time.perf_counter() - started,
        "recovery": recovery,
    }
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    print("", file=stream)
    print(f"  transport            {transport}", file=stream)
    print(f"  decode steps         {len(steps)} ({total_tokens} tokens, {config.layers} layers each)", file=stream)
    print(f"  EP tokens/s          {metrics['tokens_per_second']:.0f} (steps with every rank serving)", file=stream)
    print(f"  mean step latency    {1e3 * step_time / max(1, len(healthy)):.2f} ms over {len(healthy)} full steps",
          file=stream)
    if recovery is not None:
        print(f"  failure              rank {recovery['rank']} SIGKILLed at step {recovery['killed_at_step']}; "
              f"survivors served it without rank(s) {recovery['survivors_saw_dead']}", file=stream)
        print(f"  recovery             replacement joined, view {recovery['view']}, in "
              f"{recovery['replace_seconds']:.2f} s; interruption (failure -> first full step "
              f"{recovery.get('first_full_step')}) {recovery.get('interruption_seconds', float('nan')):.2f} s",
              file=stream)
    print(f"  correctness          max calc_diff {worst:.2e} vs single-process reference "
          f"(limit {CHECK_LIMIT:.0e}): {'PASS' if metrics['correct'] else 'FAIL'}", file=stream)
    print(f"  metrics              {os.path.join(config.out_dir, 'metrics.json')}", file=stream)
    print(f"  wall time            {metrics['wall_seconds']:.1f} s", file=stream)
    return metrics
