"""A reference MoE block (router + SwiGLU experts) with an EP forward over a Buffer.

Used by the demo and tests. Expert weights follow the layout of docs/switching.md: gate/up
`[E, 2I, H]` (gate rows first, then up rows) and down `[E, H, I]`. The single-process
`reference_forward` computes the same thing without communication, as the correctness check.
"""
from typing import NamedTuple

import torch


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
    """Random-weight layer, identical on every rank for the same seed."""
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

    Computed in float32 row by row-block; with I' a slice of I (TP), the result is a partial sum.
    """
    intermediate = gate_up.size(0) // 2
    hidden_states = x.float() @ gate_up.float().t()
    gate, up = hidden_states[:, :intermediate], hidden_states[:, intermediate:]
    activated = torch.nn.functional.silu(gate) * up
    return (activated @ down.float().t()).to(torch.bfloat16)


def reference_forward(x: torch.Tensor, weights: MoEWeights, top_k: int) -> torch.Tensor:
    """Single-process MoE forward (no communication), the correctness reference.

    Arguments:
        x: `[N, H]` torch.bfloat16.
        weights: the layer's `MoEWeights`.
        top_k: experts per token.

    Returns:
        out: `[N, H]` torch.bfloat16, `sum_k w_k * expert_k(x)` in float32, then bf16.
    """
    topk_idx, topk_weights = route(x, weights.router, top_k)
    out = torch.zeros((x.size(0), x.size(1)), dtype=torch.float32)
    for k in range(top_k):
        for expert in topk_idx[:, k].unique().tolist():
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
