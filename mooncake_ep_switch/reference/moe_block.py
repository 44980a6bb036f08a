"""A reference MoE block (router + SwiGLU experts) with an EP forward over a Buffer.

Used by the demo and tests. Expert weights follow the layout of docs/switching.md (the UMM layout): gate/up
`[E, 2I, H]` (gate rows first, then up rows) and down `[E, H, I]`. The single-process
`reference_forward` computes the same thing without communication, as the correctness check.
"""
from typing import NamedTuple

import torch

from mooncake_ep_switch.switch.shards import shard_ep, shard_tp  # noqa: F401  (re-exported)


class MoEWeights(NamedTuple):
    """Weights of one MoE layer.

    Fields:
        router: `[E, H]` torch.float32 router weights.
        gate_up: `[E, 2I, H]` torch.bfloat16, gate rows then up rows.
        down: `[E, H, I]` torch.bfloat16.
    """

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def random_weights(num_experts: int, hidden: int, intermediate: int, seed: int) -> MoEWeights:
    """Random-weight layer, identical on every rank for the same seed.

    Arguments:
        num_experts: `E`, logical experts.
        hidden: `H`.
        intermediate: `I`.
        seed: seed of the CPU `torch.Generator` drawing the weights.

    Returns:
        weights: `MoEWeights` with router `[E, H]` torch.float32 (scaled by `H**-0.5`), gate_up
            `[E, 2I, H]` torch.bfloat16 (scaled by `H**-0.5`), down `[E, H, I]` torch.bfloat16
            (scaled by `I**-0.5`), all drawn from a standard normal.
    """
    generator = torch.Generator().manual_seed(seed)
    scale_in, scale_mid = hidden ** -0.5, intermediate ** -0.5
    router = torch.randn((num_experts, hidden), generator=generator) * scale_in
    gate_up = (torch.randn((num_experts, 2 * intermediate, hidden), generator=generator) * scale_in).to(torch.bfloat16)
    down = (torch.randn((num_experts, hidden, intermediate), generator=generator) * scale_mid).to(torch.bfloat16)
    return MoEWeights(router, gate_up, down)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int):
    """Softmax top-k routing.

    Arguments:
        x: `[N, H]` torch.bfloat16.
        router: `[E, H]` torch.float32.
        top_k: experts per token.

    Returns:
        topk_idx: `[N, top_k]` torch.int64.
        topk_weights: `[N, top_k]` torch.float32, renormalised to sum to one.
    """
    probs = torch.softmax(x.float() @ router.t(), dim=-1)
    weights, idx = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return idx.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous()


def expert_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert on rows `x` `[n, H]` bf16 with `gate_up` `[2I', H]`, `down` `[H, I']`; returns bf16.

    Computed in float32, rounded to bf16 at the end; with I' a slice of I (TP), the result is a
    partial sum.

    Arguments:
        x: `[n, H]` torch.bfloat16 rows routed to this expert.
        gate_up: `[2I', H]` torch.bfloat16, gate rows `[0, I')` then up rows `[I', 2I')`.
        down: `[H, I']` torch.bfloat16.

    Returns:
        out: `[n, H]` torch.bfloat16, `down @ (SiLU(gate @ x) * (up @ x))` per row.
    """
    intermediate = gate_up.size(0) // 2
    hidden_states = x.float() @ gate_up.float().t()
    gate, up = hidden_states[:, :intermediate], hidden_states[:, intermediate:]
    activated = torch.nn.functional.silu(gate) * up
    return (activated @ down.float().t()).to(torch.bfloat16)


def reference_forward(x: torch.Tensor, weights: MoEWeights, top_k: int, skip_experts=()) -> torch.Tensor:
    """Single-process MoE forward (no communication), the correctness reference.

    Arguments:
        x: `[N, H]` torch.bfloat16.
        weights: the layer's `MoEWeights`.
        top_k: experts per token.
        skip_experts: experts whose contribution is left out (owned by a dead rank), no
            renormalisation, as combine does.

    Returns:
        out: `[N, H]` torch.bfloat16, `sum_k w_k * expert_k(x)` in float32, then bf16.
    """
    topk_idx, topk_weights = route(x, weights.router, top_k)
    out = torch.zeros((x.size(0), x.size(1)), dtype=torch.float32, device=x.device)
    for k in range(top_k):
        for expert in topk_idx[:, k].unique().tolist():
            if expert in skip_experts:
                continue
            rows = (topk_idx[:, k] == expert).nonzero().view(-1)
            y = expert_forward(x[rows], weights.gate_up[expert], weights.down[expert])
            out[rows] += topk_weights[rows, k:k + 1] * y.float()
    return out.to(torch.bfloat16)


def ep_forward(buffer, x: torch.Tensor, weights: MoEWeights, top_k: int, tokens_per_rank: int,
               active_ranks: torch.Tensor, timeout_us: int = 30_000_000, use_fp8: bool = False) -> torch.Tensor:
    """Expert-parallel forward: dispatch, this rank's experts on the packed rows, combine.

    Arguments:
        buffer: a `Buffer` over the EP group.
        x: `[N, H]` torch.bfloat16 local tokens.
        weights: full-layer `MoEWeights` (this rank uses its own experts' slices).
        top_k: experts per token.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask.
        timeout_us: deadline of dispatch and combine in microseconds, -1 = none.
        use_fp8: dispatch FP8 rows (dequantised to bf16 before the experts run).

    Returns:
        out: `[N, H]` torch.bfloat16.
    """
    num_experts = weights.router.size(0)
    local = num_experts // buffer.num_ranks
    topk_idx, topk_weights = route(x, weights.router, top_k)
    recv, recv_count, handle, _, _ = buffer.dispatch(x, topk_idx, active_ranks, tokens_per_rank, num_experts,
                                                     timeout_us, use_fp8=use_fp8)
    y = buffer.get_next_combine_buffer(handle)
    if use_fp8:
        data, scales = recv
        recv = (data.float().view(local, data.size(1), -1, 128) * scales.unsqueeze(-1)).view(data.shape).to(
            torch.bfloat16)
    for l_idx in range(local):
        count = int(recv_count[l_idx])
        if count:
            expert = buffer.rank * local + l_idx
            y[l_idx, :count] = expert_forward(recv[l_idx, :count], weights.gate_up[expert], weights.down[expert])
    out, _, _ = buffer.combine(y, topk_idx, topk_weights, active_ranks, timeout_us, handle, zero_copy=True)
    return out


# ---------------------------------------------------------------------------------------------
# The TP forward (shards: switch/shards.py, re-exported here)
# ---------------------------------------------------------------------------------------------

def tp_partial(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               top_k: int) -> torch.Tensor:
    """This rank's float32 partial of the MoE output in the TP layout (before the all-reduce).

    `partial[t] = sum_k w[t, k] * (SiLU(x gate_r^T) * (x up_r^T)) down_r^T` over this rank's slice `r`
    of every expert, all in float32 (no bf16 rounding until after the all-reduce).

    Arguments:
        x: `[N, H]` torch.bfloat16, the same tokens on every TP rank.
        router: `[E, H]` torch.float32.
        gate_up: `[E, 2I/P, H]` torch.bfloat16 (TP view).
        down: `[E, H, I/P]` torch.bfloat16 (TP view).
        top_k: experts per token.

    Returns:
        partial: `[N, H]` torch.float32.
    """
    topk_idx, topk_weights = route(x, router, top_k)
    part = gate_up.size(1) // 2
    out = torch.zeros((x.size(0), x.size(1)), dtype=torch.float32, device=x.device)
    xf = x.float()
    for k in range(top_k):
        for expert in topk_idx[:, k].unique().tolist():
            rows = (topk_idx[:, k] == expert).nonzero().view(-1)
            hidden_states = xf[rows] @ gate_up[expert].float().t()
            activated = torch.nn.functional.silu(hidden_states[:, :part]) * hidden_states[:, part:]
            out[rows] += topk_weights[rows, k:k + 1] * (activated @ down[expert].float().t())
    return out


def tp_forward(all_reduce, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               top_k: int, active_ranks: torch.Tensor, timeout_us: int = 30_000_000) -> torch.Tensor:
    """Tensor-parallel forward: this rank's expert slices on every token, then a deterministic all-reduce.

    Arguments:
        all_reduce: a `tp_collective.TPAllReduce` over the group.
        x: `[N, H]` torch.bfloat16, the same tokens on every rank.
        router: `[E, H]` torch.float32.
        gate_up: `[E, 2I/P, H]` torch.bfloat16, this rank's TP view (e.g. `UnifiedWeights.view(i, "tp")[0]`).
        down: `[E, H, I/P]` torch.bfloat16, this rank's TP view.
        top_k: experts per token.
        active_ranks: `[R]` torch.int32 caller-owned mask; peers that miss the deadline are set to 0.
        timeout_us: all-reduce deadline in microseconds, -1 = none.

    Returns:
        out: `[N, H]` torch.bfloat16, the float32 sum of every rank's partial in rank order, then bf16.
    """
    partial = tp_partial(x, router, gate_up, down, top_k)
    return all_reduce.all_reduce(partial, active_ranks, timeout_us)


def ep_forward_local(buffer, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     top_k: int, tokens_per_rank: int, active_ranks: torch.Tensor,
                     timeout_us: int = 30_000_000) -> torch.Tensor:
    """Expert-parallel forward with this rank's local expert weights (e.g. the UMM's EP view).

    Same as `ep_forward`, but the experts come from `[E/P, ...]` local tensors instead of a full layer.

    Arguments:
        buffer: a `Buffer` over the EP group.
        x: `[N, H]` torch.bfloat16 local tokens.
        router: `[E, H]` torch.float32.
        gate_up: `[E/P, 2I, H]` torch.bfloat16, local experts.
        down: `[E/P, H, I]` torch.bfloat16, local experts.
        top_k: experts per token.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask.
        timeout_us: deadline of dispatch and combine in microseconds, -1 = none.

    Returns:
        out: `[N, H]` torch.bfloat16.
    """
    topk_idx, topk_weights = route(x, router, top_k)
    out, _ = ep_round(buffer, x, topk_idx, topk_weights, router.size(0), gate_up.size(0),
                      lambda l_idx: (gate_up[l_idx], down[l_idx]), tokens_per_rank, active_ranks, timeout_us)
    return out


def ep_round(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             num_local: int, local_expert, tokens_per_rank: int, active_ranks: torch.Tensor,
             timeout_us: int = 30_000_000, expert_fn=None):
    """Dispatch, run every local expert on its packed rows (bf16), combine zero-copy.

    Arguments:
        buffer: a `Buffer` over the EP group.
        x: `[N, H]` torch.bfloat16 local tokens.
        topk_idx: `[N, K]` torch.int64 expert ids as dispatch sees them (logical or physical).
        topk_weights: `[N, K]` torch.float32.
        num_experts: experts dispatch addresses (`num_local` per rank).
        num_local: experts on this rank.
        local_expert: `local_expert(l) -> (gate_up [2I, H], down [H, I])` torch.bfloat16 of local expert `l`.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask.
        timeout_us: deadline of dispatch and combine.
        expert_fn: `expert_fn(rows, gate_up, down) -> [n, H]` torch.bfloat16, the expert MLP (None:
            `expert_forward`, the SwiGLU of this module; a served model passes its own).

    Returns:
        out: `[N, H]` torch.bfloat16.
        recv_count: `[num_local]` torch.int32, rows each local expert received.
    """
    expert_fn = expert_forward if expert_fn is None else expert_fn
    recv, recv_count, handle, _, _ = buffer.dispatch(x, topk_idx, active_ranks, tokens_per_rank, num_experts,
                                                     timeout_us, use_fp8=False)
    y = buffer.get_next_combine_buffer(handle)
    for l_idx in range(num_local):
        count = int(recv_count[l_idx])
        if count:
            gate_up, down = local_expert(l_idx)
            y[l_idx, :count] = expert_fn(recv[l_idx, :count], gate_up, down)
    out, _, _ = buffer.combine(y, topk_idx, topk_weights, active_ranks, timeout_us, handle, zero_copy=True)
    return out, recv_count
