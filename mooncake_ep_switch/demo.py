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


_RANK_STATE = {}
CHECK_LIMIT = 1e-4  # calc_diff against the single-process reference (bf16 activations)


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def rank_setup(ctx, config: DemoConfig):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.moe_block import random_weights

    size = Buffer.get_ep_buffer_size_hint(config.tokens_per_rank, config.hidden, ctx.num_ranks, config.experts)
    buffer = Buffer(ctx.group, size, transport=config.transport)
    weights = [random_weights(config.experts, config.hidden, config.intermediate, seed=layer)
               for layer in range(config.layers)]
    _RANK_STATE.update(buffer=buffer, weights=weights, config=config)
    return buffer.transport


def rank_step(ctx, step: int):
    from mooncake_ep_switch.switch.moe_block import ep_forward, reference_forward

    buffer, weights, config = _RANK_STATE["buffer"], _RANK_STATE["weights"], _RANK_STATE["config"]
    generator = torch.Generator().manual_seed(step * 1009 + ctx.rank)
    x = torch.randn((config.tokens_per_rank, config.hidden), generator=generator).to(torch.bfloat16)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    start = time.perf_counter()
    hidden_states = x
    for layer in weights:
        hidden_states = ep_forward(buffer, hidden_states, layer, config.top_k, config.tokens_per_rank, active,
                                   use_fp8=config.use_fp8)
    seconds = time.perf_counter() - start
    reference = x
    for layer in weights:
        reference = reference_forward(reference, layer, config.top_k)
    return {"seconds": seconds, "diff": _calc_diff(hidden_states, reference), "tokens": x.size(0)}


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
    steps = []
    with LocalCluster(config.num_ranks) as cluster:
        transport = check_outcomes(cluster.run(rank_setup, config, timeout_s=120))[0]
        for step in range(config.steps):
            values = check_outcomes(cluster.run(rank_step, step, timeout_s=120))
            step_seconds = max(v["seconds"] for v in values)
            worst = max(v["diff"] for v in values)
            tokens = sum(v["tokens"] for v in values)
            steps.append({"step": step, "seconds": step_seconds, "max_calc_diff": worst, "tokens": tokens})
            if stream.isatty():
                print(f"\r  step {step + 1}/{config.steps}  {tokens / step_seconds:8.0f} tok/s  "
                      f"calc_diff {worst:.2e}", end="", file=stream, flush=True)
        if stream.isatty():
            print(file=stream)
        check_outcomes(cluster.run(rank_teardown, timeout_s=60))
    worst = max(s["max_calc_diff"] for s in steps)
    total_tokens = sum(s["tokens"] for s in steps)
    step_time = sum(s["seconds"] for s in steps)
    metrics = {
        "config": config._asdict(), "transport": transport, "steps": steps,
        "tokens_per_second": total_tokens / step_time, "max_calc_diff": worst,
        "correct": worst < CHECK_LIMIT, "wall_seconds": time.perf_counter() - started,
    }
    os.makedirs(config.out_dir, exist_ok=True)
    with open(os.path.join(config.out_dir, "metrics.json"), "w", encoding="utf-8") as handle:
        json.dump(metrics, handle, indent=2)
    print("", file=stream)
    print(f"  transport            {transport}", file=stream)
    print(f"  decode steps         {len(steps)} ({total_tokens} tokens, {config.layers} layers each)", file=stream)
    print(f"  EP tokens/s          {metrics['tokens_per_second']:.0f}", file=stream)
    print(f"  mean step latency    {1e3 * step_time / len(steps):.2f} ms", file=stream)
    print(f"  correctness          max calc_diff {worst:.2e} vs single-process reference "
          f"(limit {CHECK_LIMIT:.0e}): {'PASS' if metrics['correct'] else 'FAIL'}", file=stream)
    print(f"  metrics              {os.path.join(config.out_dir, 'metrics.json')}", file=stream)
    print(f"  wall time            {metrics['wall_seconds']:.1f} s", file=stream)
    return metrics
