"""DeepEP V2's expanded combine with `allow_multiple_reduction=False`: one reduction, on the owner.

V2 then sends every (token, top-k entry) row back on its own and the owner computes, in float32,
`bias[0] + bias[1] + y[k=0] + y[k=1] + ... + y[k=K-1]` in top-k order, rounding to bfloat16 once
(`deep_ep/utils/refs.py`: `combine(..., reduce_in_local=False, reduce_in_scaleup=False)`). Here, for
each top-k column `k` in turn:

* the owner lays out entry `k` of each of its tokens (routed to the rank owning that entry's expert;
  none for a -1 entry) with an inner dispatch of empty rows, in the same inner shape as every other
  call of the buffer (a call of another shape would lay its region halves over the previous call's,
  which a slower peer may still be reading);
* each rank writes the expanded row holding entry `k` of each token it received, and that row's
  weight as byte columns (`rows.encode_weight_bytes`), into that dispatch's combine buffer;
* the inner combine (weight 1.0, one entry per token) returns entry `k`'s row exactly;

then the owner adds its own bias rows and the entries in top-k order in float32 (`ordered_sum`): the
bias never travels. The cost is K inner rounds of empty rows (V2 too sends K rows per token here).
"""
import torch

from mooncake_ep_switch.elastic_buffer import layout as lay
from mooncake_ep_switch.elastic_buffer.inner_rows import inner_sources
from mooncake_ep_switch.elastic_buffer import rows as codec


def entry_routing(topk_idx: torch.Tensor, k: int, num_experts: int, num_ranks: int) -> torch.Tensor:
    """The inner routing of top-k column `k`: `[N, 1]` torch.int64, inner expert `INNER_SLOTS * owner`
    (the owner's data slot) of each token's entry `k`, -1 for a -1 entry (its token goes nowhere)."""
    column = topk_idx[:, k:k + 1]
    owner = torch.div(column.clamp(min=0), num_experts // num_ranks, rounding_mode="floor")
    return torch.where(column >= 0, codec.INNER_SLOTS * owner, torch.full_like(owner, -1))


def fill_entries(inner_x: torch.Tensor, inner_handle, k: int, x: torch.Tensor, weights: torch.Tensor,
                 recv_src_global: torch.Tensor, slots: torch.Tensor, T: int, active: torch.Tensor) -> None:
    """Write the expanded row holding entry `k` of each token the inner dispatch brought, and its weight
    bytes, where that dispatch put the token.

    Arguments:
        inner_x: `[3, R * T, width]` torch.bfloat16, the entry dispatch's combine buffer.
        inner_handle: that dispatch's handle.
        k: the top-k column.
        x: `[num_slots, hidden]` torch.bfloat16 expanded rows; weights: `[num_slots]` torch.float32.
        recv_src_global: `[n]` ascending global indices of the tokens the expanded dispatch received.
        slots: `[n, K]` their expanded rows (-1: not here).
        T: `num_max_tokens_per_rank`.
        active: the call's mask; a source whose entry this rank never received (it was out at the
            dispatch) is cleared in it: this rank has no row for it, so it sends that source nothing.
    """
    hidden = x.size(1)
    row_index, src_global = inner_sources(inner_handle, 0, T)
    if row_index.numel() == 0:
        return
    where, known = lay.positions(recv_src_global, src_global)
    slot = slots[where.clamp(min=0), k] if slots.numel() else torch.full_like(where, -1)
    slot = torch.where(known, slot, torch.full_like(slot, -1))
    held = slot >= 0
    rows = row_index[held]
    inner_x[0, rows, :hidden] = x[slot[held]]
    encoded = codec.encode_weight_bytes(weights[slot[held]].reshape(-1, 1))
    inner_x[0, rows, hidden:hidden + encoded.size(1)] = encoded
    inner_x[0, row_index[~held]] = 0
    lay.clear_sources(active, src_global[~held], T)


def ordered_sum(entries: torch.Tensor, biases) -> torch.Tensor:
    """V2's reference accumulation: `bf16(fp32(bias0) + fp32(bias1) + sum_k entries[:, k])`, top-k order.

    Arguments:
        entries: `[N, K, hidden]` torch.bfloat16 (zero where an entry has no expert or was not returned:
            V2's reference adds those zeros too).
        biases: a pair of `[N, hidden]` torch.bfloat16 or None.

    Returns:
        combined: `[N, hidden]` torch.bfloat16.
    """
    n, num_topk, hidden = entries.shape
    b0, b1 = biases
    if b0 is not None and b1 is not None:
        acc = b0.float() + b1.float()
    elif b0 is not None or b1 is not None:
        acc = (b0 if b0 is not None else b1).float()
    else:
        acc = torch.zeros((n, hidden), dtype=torch.float32, device=entries.device)
    for k in range(num_topk):
        acc += entries[:, k].float()
    return acc.to(torch.bfloat16)


def entry_weight(out: torch.Tensor, hidden: int) -> torch.Tensor:
    """Each token's returned entry weight from its row's byte columns: `[N]` torch.float32."""
    return codec.decode_weight_bytes(out[:, hidden:hidden + 4], 1).reshape(-1)


def combine(x: torch.Tensor, handle, topk_weights, biases, active: torch.Tensor, timeout_us: int, T: int,
            num_ranks: int, inner_dispatch, inner_buffer):
    """An expanded combine with one reduction, on the owner (the module docstring's recipe).

    Arguments:
        x: `[num_slots, hidden]` torch.bfloat16 expanded rows; handle: their dispatch's `EPHandle`.
        topk_weights: `[num_slots]` torch.float32 or None; biases: a pair of `[N, hidden]` or None.
        active, timeout_us: the call's mask and deadline; T: `num_max_tokens_per_rank`; num_ranks: `R`.
        inner_dispatch: the ElasticBuffer's inner dispatch `(rows, inner_topk, active, timeout_us, T) ->
            (recv, inner_handle)`; inner_buffer: returns its inner `Buffer`.

    Returns:
        combined_x: `[N, hidden]` torch.bfloat16; combined_weights: `[N, K]` torch.float32 (each entry's
        weight as the rank holding it passed it, 0 for -1 entries and entries not returned) or None.
    """
    route, hidden, device = handle.route, x.size(1), x.device
    num_tokens, num_topk, topk_idx = route.num_tokens, route.num_topk, handle.topk_idx
    weights = topk_weights if topk_weights is not None else torch.zeros(x.size(0), device=device)
    empty = torch.zeros((num_tokens, route.inner_handle[3]), dtype=torch.bfloat16, device=device)
    ones = torch.ones((num_tokens, 1), dtype=torch.float32, device=device)
    values = torch.zeros((num_tokens, num_topk, hidden), dtype=torch.bfloat16, device=device)
    combined_weights = torch.zeros((num_tokens, num_topk), dtype=torch.float32, device=device)
    for k in range(num_topk):
        inner_topk = entry_routing(topk_idx, k, handle.num_experts, num_ranks)
        _, inner_handle = inner_dispatch(empty, inner_topk, active, timeout_us, T)
        buffer = inner_buffer()
        inner_x = buffer.get_next_combine_buffer(inner_handle)
        fill_entries(inner_x, inner_handle, k, x, weights, route.recv_src_global, route.slots, T, active)
        out, _, _ = buffer.combine(inner_x, inner_topk, ones, active, timeout_us, inner_handle)  # x: the buffer
        here = inner_topk[:, 0] >= 0
        values[here, k] = out[here, :hidden]
        combined_weights[here, k] = entry_weight(out[here], hidden)
    return ordered_sum(values, biases), combined_weights if topk_weights is not None else None
