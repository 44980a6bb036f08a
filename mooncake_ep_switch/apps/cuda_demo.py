"""`mooncake-ep demo --device cuda`: GPU ranks serve a small MoE model in EP over the "cuda" transport.

R rank processes on GPU 0 (CUDA IPC between processes on one device is the path NVLink takes
between GPUs) run decode steps of a stack of MoE layers: route, `dispatch` on CUDA tensors, the
rank's experts on its packed rows (zero-copy combine buffer), `combine`. One rank is SIGKILLed
mid-run; the survivors' device timeouts clear it in `active_ranks` and they serve that step without
its experts; a replacement process joins with `elastic.join()` and `update_ep_member()` maps its
device region. Every step of every rank is checked against the single-process forward of the same
weights on the same device (leaving out exactly the experts of ranks found dead). The TP<->EP switch
and the online EPLB of the CPU demo (`mooncake-ep demo`) run on host memory and are not part of
this one.
"""
import os
import signal
import sys
import time
from typing import NamedTuple

import torch

from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes
from mooncake_ep_switch.reference.compare import calc_diff

CHECK_LIMIT = 1e-4  # calc_diff against the single-process reference on the same device


class CudaDemoConfig(NamedTuple):
    """Settings of the GPU demo.

    Fields:
        num_ranks: rank processes (all on GPU 0).
        steps: decode steps.
        layers: MoE layers.
        experts: experts per layer (a multiple of `num_ranks`).
        top_k: experts per token.
        hidden: hidden size (a multiple of 128).
        intermediate: expert intermediate size.
        tokens: tokens per rank per step (`num_max_dispatch_tokens_per_rank`).
        kill_step: step at which `kill_rank` is SIGKILLed and then replaced (-1: none).
        kill_rank: the rank that dies.
        timeout_us: dispatch/combine deadline per source (ranks share one GPU: leave room for time-slicing).
    """

    num_ranks: int = 4
    steps: int = 20
    layers: int = 2
    experts: int = 16
    top_k: int = 4
    hidden: int = 1024
    intermediate: int = 512
    tokens: int = 32
    kill_step: int = 10
    kill_rank: int = 2
    timeout_us: int = 3_000_000


_STATE = {}


def rank_setup(ctx, config: CudaDemoConfig) -> str:
    """Build this rank's CUDA Buffer and the model's weights on the device (a replacement joins first).

    Arguments:
        ctx: the `launch.RankContext`.
        config: the `CudaDemoConfig`.

    Returns:
        device: str, the GPU's name.
    """
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join
    from mooncake_ep_switch.reference.moe_block import random_weights

    torch.cuda.set_device(0)
    size = Buffer.get_ep_buffer_size_hint(config.tokens, config.hidden, ctx.num_ranks, config.experts)
    group = join(ctx.store, ctx.rank, ctx.num_ranks) if ctx.group is None else ctx.group
    buffer = Buffer(group, size, transport="cuda")
    weights = [random_weights(config.experts, config.hidden, config.intermediate, seed=layer)
               for layer in range(config.layers)]
    weights = [type(w)(*(t.cuda() for t in w)) for w in weights]
    _STATE.update(buffer=buffer, config=config, weights=weights, active=buffer.active_mask())
    return torch.cuda.get_device_name(0)


def rank_readmit(ctx, joiner: int, timeout_s: float = 60.0) -> list:
    """Admit `joiner`'s replacement with `update_ep_member()` on every rank.

    Returns:
        ranks: list of int, the members of the agreed view.
    """
    from mooncake_ep_switch.elastic import admit

    buffer = _STATE["buffer"]
    view = admit(buffer, joiner, timeout_s)
    _STATE["active"] = buffer.active_mask()
    return list(view.ranks)


def rank_step(ctx, step: int) -> dict:
    """One decode step in EP on the GPU, checked against the single-process forward.

    Returns:
        result: dict with "seconds", "diff" (calc_diff against the reference), "dead" (ranks this
            rank found inactive).
    """
    from mooncake_ep_switch.reference.moe_block import ep_forward, reference_forward

    config, buffer, active = _STATE["config"], _STATE["buffer"], _STATE["active"]
    if step == config.kill_step and ctx.rank == config.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)  # the failure the demo survives
    generator = torch.Generator().manual_seed(step * 1009 + ctx.rank)
    x = torch.randn((config.tokens, config.hidden), generator=generator).to(torch.bfloat16).cuda()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = x
    for weights in _STATE["weights"]:
        out = ep_forward(buffer, out, weights, config.top_k, config.tokens, active, timeout_us=config.timeout_us)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    dead = [r for r in range(ctx.num_ranks) if not int(active[r])]
    local = config.experts // ctx.num_ranks
    skip = {r * local + j for r in dead for j in range(local)}
    reference = x
    for weights in _STATE["weights"]:
        reference = reference_forward(reference, weights, config.top_k, skip_experts=skip)
    return {"seconds": seconds, "diff": calc_diff(out, reference), "dead": dead}


def rank_teardown(ctx) -> bool:
    """Destroy this rank's Buffer and forget the demo's state."""
    buffer = _STATE.pop("buffer", None)
    if buffer is not None:
        buffer.destroy()
    _STATE.clear()
    return True


def run_cuda_demo(config: CudaDemoConfig, stream=sys.stdout) -> bool:
    """Run the GPU demo; returns whether every step of every rank matched its reference.

    Raises:
        RuntimeError: no CUDA device can be used here (the reason).
    """
    from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"demo --device cuda: {reason}")
    print(f"mooncake_ep_switch GPU demo: {config.num_ranks} rank processes on GPU 0, {config.layers} MoE layers x "
          f"{config.experts} experts (top-{config.top_k}, hidden {config.hidden}), {config.steps} decode steps of "
          f"{config.tokens} tokens per rank; rank {config.kill_rank} SIGKILLed at step {config.kill_step}", file=stream)
    correct = True
    with LocalCluster(config.num_ranks) as cluster:
        device = check_outcomes(cluster.run(rank_setup, config, timeout_s=180))[0]
        print(f"device: {device}", file=stream)
        for step in range(config.steps):
            outcomes = cluster.run(rank_step, step, timeout_s=120, failure_grace_s=60)
            killed = step == config.kill_step
            values = check_outcomes([o for o in outcomes if not (killed and o.rank == config.kill_rank)])
            worst = max(v["diff"] for v in values)
            dead = sorted({r for v in values for r in v["dead"]})
            ok = worst < CHECK_LIMIT and dead == ([config.kill_rank] if killed else [])
            correct &= ok
            print(f"step {step:3d}: {max(v['seconds'] for v in values) * 1e3:7.2f} ms  max calc_diff {worst:.2e}  "
                  f"dead {dead}  {'ok' if ok else 'WRONG'}", file=stream, flush=True)
            if killed:
                started = time.monotonic()
                cluster.respawn(config.kill_rank)
                check_outcomes(cluster.run(rank_setup, config, ranks=[config.kill_rank], timeout_s=180))
                views = check_outcomes(cluster.run(rank_readmit, config.kill_rank, timeout_s=120))
                print(f"rank {config.kill_rank} replaced and re-admitted in {time.monotonic() - started:.2f} s "
                      f"(view {views[0]})", file=stream)
        check_outcomes(cluster.run(rank_teardown, timeout_s=60))
    print(f"GPU demo {'PASS' if correct else 'FAIL'}", file=stream)
    return correct
