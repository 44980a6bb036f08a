"""The EP forward of one MoE layer on physical experts (with redundant replicas) over a Buffer."""
from typing import Tuple

import torch

from mooncake_ep_switch.eplb.maps import logical_to_physical
from mooncake_ep_switch.eplb.slots import ExpertSlots
from mooncake_ep_switch.reference.moe_block import ep_round, route


def physical_ep_forward(buffer, x: torch.Tensor, router: torch.Tensor, slots: ExpertSlots, layer: int, top_k: int,
                        tokens_per_rank: int, active_ranks: torch.Tensor, dispatch_row: torch.Tensor,
                        timeout_us: int = 30_000_000) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route to logical experts, map them to physical slots, dispatch, run this rank's slots, combine.

    Arguments:
        buffer: a `Buffer` over the EP group, sized for `slots.num_slots` experts.
        x: `[N, H]` torch.bfloat16 local tokens.
        router: `[E, H]` torch.float32 router of the layer (logical experts).
        slots: this rank's `ExpertSlots` (the current placement is `slots.phy2log`).
        layer: MoE layer index.
        top_k: experts per token.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask.
        dispatch_row: `[E]` torch.int64, `build_dispatch_map(slots.phy2log, ...)[rank, layer]`.
        timeout_us: deadline of dispatch and combine.

    Returns:
        out: `[N, H]` torch.bfloat16, the combined output (no renormalisation for skipped experts).
        recv_count: `[slots_per_rank]` torch.int32, tokens each local physical slot served.
    """
    topk_idx, topk_weights = route(x, router, top_k)
    return physical_ep_round(buffer, x, topk_idx, topk_weights, slots, layer, tokens_per_rank, active_ranks,
                             dispatch_row, timeout_us)


def physical_ep_round(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      slots: ExpertSlots, layer: int, tokens_per_rank: int, active_ranks: torch.Tensor,
                      dispatch_row: torch.Tensor, timeout_us: int = 30_000_000,
                      expert_fn=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Map a router's logical top-k to physical slots, dispatch, run this rank's slots, combine.

    Arguments:
        buffer: a `Buffer` over the EP group, sized for `slots.num_slots` experts.
        x: `[N, H]` torch.bfloat16 local tokens.
        topk_idx: `[N, K]` torch.int64 logical expert ids (-1 = none), from any router.
        topk_weights: `[N, K]` torch.float32 routing weights (combine applies them, no renormalisation).
        slots: this rank's `ExpertSlots`.
        layer: MoE layer index.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask.
        dispatch_row: `[E]` torch.int64, `build_dispatch_map(slots.phy2log, ...)[rank, layer]`.
        timeout_us: deadline of dispatch and combine.
        expert_fn: the expert MLP `expert_fn(rows, gate_up, down)` (None: `moe_block.expert_forward`).

    Returns:
        out: `[N, H]` torch.bfloat16, the combined output.
        recv_count: `[slots_per_rank]` torch.int32, tokens each local physical slot served.
    """
    physical = logical_to_physical(topk_idx, dispatch_row)
    out, recv_count = ep_round(buffer, x, physical, topk_weights, slots.num_slots, slots.shape.slots_per_rank,
                               lambda local_slot: slots.expert(layer, local_slot), tokens_per_rank, active_ranks,
                               timeout_us, expert_fn=expert_fn)
    return out, recv_count.clone()
