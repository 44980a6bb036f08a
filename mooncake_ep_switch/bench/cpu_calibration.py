"""The cost model measured on this CPU: one MoE layer timed in the TP and the EP layout (`simulate --calibrate`).

A single process emulates P ranks, one thread each: the TP layout's per-rank expert GEMMs on its
intermediate slice plus the all-reduce's summation, the EP layout's per-rank experts on the tokens
routed to them; the decode latency per batch size is fed to `policy.calibrate()` for the crossover.
"""
import math
import time
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

from mooncake_ep_switch.switch.planning.cost_model import CostModel
from mooncake_ep_switch.switch.planning.policy import Calibration, calibrate
from mooncake_ep_switch.layouts import EP, TP

#: The MoE layer timed by `--calibrate`: Qwen3-235B-A22B's ratio I/H = 1536/4096 = 0.375, scaled
#: down to fit a CPU run of a few seconds; P ranks emulated in one process, one thread each.
CPU_LAYER = {"num_experts": 16, "hidden": 2048, "intermediate": 768, "top_k": 2, "num_ranks": 4}
CPU_BATCH_SIZES = (1, 8, 32, 128, 512, 1024, 2048)
QUICK_CPU_BATCH_SIZES = (1, 32, 256, 1024)


class CpuCalibration(NamedTuple):
    """What `cpu_calibration()` measured.

    Arguments:
        calibration: the `Calibration` (TP and EP step latency per batch size, ``T_h``).
        switch_seconds: ``(min, max)`` switch time: min = one rank's weight reshard copy of the
            layer, measured; max = min scaled by the paper's 434/215 (the KV part is not measured).
        tp_prefill_seconds_per_token, ep_prefill_seconds_per_token: per-token cost at the largest
            measured batch, used for prefill (no fixed prefill cost: the step's decode latency
            already holds the fixed part).
        layer: the timed layer's shape (``CPU_LAYER``).
        trials: timings per point (minimum kept).
        wall_seconds: how long the calibration took.
    """

    calibration: Calibration
    switch_seconds: Tuple[float, float]
    tp_prefill_seconds_per_token: float
    ep_prefill_seconds_per_token: float
    layer: Dict[str, int]
    trials: int
    wall_seconds: float

    def cost_model(self) -> CostModel:
        """The `CostModel` of this calibration (one engine step = one MoE layer here).

        Returns:
            model: a `CostModel` with the measured decode tables, switch and prefill costs.
        """
        cal = self.calibration
        return CostModel.from_calibration(
            cal, self.switch_seconds,
            tp_prefill_seconds_per_token=self.tp_prefill_seconds_per_token,
            ep_prefill_seconds_per_token=self.ep_prefill_seconds_per_token, prefill_overhead_seconds=0.0)


def cpu_calibration(batch_sizes: Sequence[int] = CPU_BATCH_SIZES, trials: int = 5, seed: int = 0,
                    layer: Optional[Dict[str, int]] = None) -> CpuCalibration:
    """Time one MoE layer in the TP and the EP layout on this CPU, single process, one thread.

    One rank of ``P`` is emulated; the step latency of a layout is its slowest rank's:

    - TP: every rank routes all ``b`` tokens, runs its ``I/P`` slice of every routed expert
      (`moe_block.shard_tp` weights, `moe_block.expert_forward`), then the all-reduce: the
      ``P - 1`` peers' float32 partials are copied in and summed (what the shm all-reduce moves);
    - EP: each rank routes its ``b / P`` tokens, packs them for dispatch and combines the returned
      rows (local copies standing in for the shm transport), plus the expert compute of the most
      loaded rank: its ``E/P`` whole experts on every token routed to them.

    Each part is timed with the thread's CPU time (``time.thread_time``, robust to other
    processes on the machine), TP and EP interleaved, the minimum over ``trials`` kept; EP's
    slowest rank is the maximum over the ranks' minima. No GPU, NVLink or network is involved:
    the numbers describe this CPU, not 8xH200, and vary with its load (memory bandwidth).

    Arguments:
        batch_sizes: at least two distinct sizes (in-flight requests of the instance).
        trials: timings per point (see above).
        seed: weights and token seed.
        layer: the layer shape; default ``CPU_LAYER``.

    Returns:
        calibration: a `CpuCalibration`.
    """
    import torch

    from mooncake_ep_switch.reference.moe_block import expert_forward, random_weights, route, shard_tp

    shape = dict(CPU_LAYER if layer is None else layer)
    num_experts, hidden, inter = shape["num_experts"], shape["hidden"], shape["intermediate"]
    top_k, ranks = shape["top_k"], shape["num_ranks"]
    if num_experts % ranks or inter % ranks:
        raise ValueError(f"layer: num_ranks ({ranks}) must divide num_experts ({num_experts}) and "
                         f"intermediate ({inter})")
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weights = random_weights(num_experts, hidden, inter, seed)
        tp_gate_up, tp_down = shard_tp(weights.gate_up, weights.down, 0, ranks)
        local = num_experts // ranks
        generator = torch.Generator().manual_seed(seed + 1)

        def run_experts(x, topk_idx, topk_weights, gate_up, down, experts, out):
            flat = topk_idx.view(-1)
            present = set(flat.unique().tolist())
            for slot, expert in experts:
                if expert not in present:
                    continue
                sel = (flat == expert).nonzero().view(-1)
                rows = sel // top_k
                y = expert_forward(x[rows], gate_up[slot], down[slot]).float()
                out.index_add_(0, rows, y * topk_weights.view(-1)[sel].unsqueeze(1))

        def timed(fn) -> float:
            begin = time.thread_time()
            fn()
            return time.thread_time() - begin

        def tp_step(x: torch.Tensor) -> None:
            batch = x.size(0)
            topk_idx, topk_weights = route(x, weights.router, top_k)
            partial = torch.zeros((batch, hidden), dtype=torch.float32)
            run_experts(x, topk_idx, topk_weights, tp_gate_up, tp_down, [(e, e) for e in range(num_experts)], partial)
            received = torch.empty((ranks - 1, batch, hidden), dtype=torch.float32)
            for p in range(ranks - 1):  # the peers' partials arriving (the shm all-reduce's copies)
                received[p].copy_(partial)
            (partial + received.sum(0)).to(torch.bfloat16)

        def ep_front(x: torch.Tensor) -> None:  # this rank's tokens: route, pack for dispatch, combine
            mine = x[:max(1, -(-x.size(0) // ranks))]
            idx, w = route(mine, weights.router, top_k)
            packed = mine.index_select(0, idx.view(-1).argsort() // top_k)
            back = packed.clone()
            (back.float().view(mine.size(0), top_k, hidden) * w.unsqueeze(-1)).sum(1).to(torch.bfloat16)

        def ep_experts(x: torch.Tensor, topk_idx, topk_weights, rank: int) -> None:
            lo = rank * local
            out = torch.zeros((x.size(0), hidden), dtype=torch.float32)
            run_experts(x, topk_idx, topk_weights, weights.gate_up[lo:lo + local], weights.down[lo:lo + local],
                        [(i, lo + i) for i in range(local)], out)

        # TP and EP are timed interleaved, the minimum over trials kept (robust to other processes).
        table: Dict[Tuple[str, int], float] = {}
        for batch in sorted(set(int(b) for b in batch_sizes)):
            x = torch.randn((batch, hidden), generator=generator).to(torch.bfloat16)
            topk_idx, topk_weights = route(x, weights.router, top_k)
            tp_best, front_best, rank_best = math.inf, math.inf, [math.inf] * ranks
            for _ in range(trials):
                tp_best = min(tp_best, timed(lambda: tp_step(x)))
                front_best = min(front_best, timed(lambda: ep_front(x)))
                for r in range(ranks):
                    rank_best[r] = min(rank_best[r], timed(lambda r=r: ep_experts(x, topk_idx, topk_weights, r)))
            table[TP, batch] = tp_best
            table[EP, batch] = front_best + max(rank_best)  # the slowest rank sets the step
        result = calibrate(lambda layout, batch: table[layout, batch], batch_sizes)
        reshard = min(timed(lambda: shard_tp(weights.gate_up, weights.down, 1, ranks)) for _ in range(max(3, trials)))
    finally:
        torch.set_num_threads(threads)
    largest = result.batch_sizes[-1]
    return CpuCalibration(result, (reshard, reshard * 434.0 / 215.0), result.tp_seconds[-1] / largest,
                          result.ep_seconds[-1] / largest, shape, trials, time.perf_counter() - started)
