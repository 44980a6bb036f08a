"""Where the inner Buffer's dispatch put an `ElasticBuffer` call's rows, and the combine rows written there.

The inner dispatch lays each inner local expert's rows (slot 0: the tokens' data, 1 and 2: the bias
slots) out as one block per source rank (`layout_range[slot][source] = (begin << 32) | count`). When
the blocks follow each other and the tokens ascend (the usual case), a slot's rows are one `slice`:
read and written in place, no index gathered. The slot-0 rows of a route's inner dispatch are kept in
the route, computed once per inner dispatch.
"""
from typing import Optional, Tuple, Union

import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.elastic_buffer import layout as lay
from mooncake_ep_switch.elastic_buffer import rows as codec

Rows = Union[slice, torch.Tensor]  # rows of a slot's block: a slice when contiguous and ascending


def inner_sources(handle, slot: int, num_max_tokens_per_rank: int, as_slice: bool = False) -> Tuple[Rows, torch.Tensor]:
    """Where the inner dispatch put the rows of inner local expert `slot`, ascending by source.

    Arguments:
        handle: the inner dispatch's handle (src_info `[3, R*T]` torch.int32, layout_range `[3, R]`
            torch.int64).
        slot: inner local expert (0: data, 1 and 2: bias slots).
        num_max_tokens_per_rank: `T`.
        as_slice: return the rows as a `slice` when they are contiguous and already ascending.

    Returns:
        row_index: `[m]` torch.int64 rows of the slot's block (or a `slice` of them); src_global: `[m]`
        torch.int64 `src_rank * T + token`, ascending.
    """
    src_info, layout_range = handle[0], handle[1]
    device = src_info.device
    if device.type == "cpu":
        found = _host_sources(src_info, layout_range, slot, num_max_tokens_per_rank)
        if found is not None:
            first, stop, src_global = found
            return (slice(first, stop) if as_slice else torch.arange(first, stop)), src_global
    words = [(source, word >> 32, word & lay.COUNT_MASK) for source, word in enumerate(layout_range[slot].tolist())]
    words = [(source, begin, count) for source, begin, count in words if count]
    if not words:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return (slice(0, 0) if as_slice else empty), empty
    first, stop = words[0][1], words[0][1]
    contiguous = True
    for _, begin, count in words:
        contiguous = contiguous and begin == stop
        stop = begin + count
    if contiguous:
        offsets = torch.tensor([source * num_max_tokens_per_rank for source, _, _ in words], dtype=torch.int64,
                               device=device)
        counts = torch.tensor([count for _, _, count in words], dtype=torch.int64, device=device)
        src_global = torch.repeat_interleave(offsets, counts, output_size=stop - first) + src_info[slot][first:stop]
        if src_global.numel() < 2 or bool((src_global[1:] > src_global[:-1]).all()):
            return (slice(first, stop) if as_slice else torch.arange(first, stop, device=device)), src_global
        row_index = torch.arange(first, stop, device=device)
    else:
        row_index = torch.cat([torch.arange(begin, begin + count, device=device) for _, begin, count in words])
        ranks = torch.cat([torch.full((count,), source, dtype=torch.int64, device=device)
                           for source, _, count in words])
        src_global = ranks * num_max_tokens_per_rank + src_info[slot][row_index].to(torch.int64)
    order = torch.argsort(src_global)  # not ascending as laid out: sorted
    return row_index[order], src_global[order]


def _host_sources(src_info: torch.Tensor, layout_range: torch.Tensor, slot: int, num_max_tokens_per_rank: int):
    """`inner_sources`' usual case on host tensors in one native pass (`elastic_sources`): the slot's
    blocks follow each other in source order and the tokens ascend.

    Returns:
        (first, stop, src_global): the rows `first..stop` and their `[stop - first]` torch.int64
        `src_rank * T + token`; None otherwise (the caller's general path).
    """
    info, words = src_info[slot], layout_range[slot]
    if info.stride(0) != 1 or words.stride(0) != 1 or words.dtype != torch.int64 or info.dtype != torch.int32 \
            or info.numel() < words.numel() * num_max_tokens_per_rank:
        return None
    src_global = torch.empty(info.numel(), dtype=torch.int64)
    status, first, stop = _native.elastic_sources(info.data_ptr(), words.data_ptr(), words.numel(),
                                                  num_max_tokens_per_rank, src_global.data_ptr())
    if status:
        return None
    return first, stop, src_global[:stop - first]


def as_index(rows: Rows, device) -> torch.Tensor:
    """`rows` as a `[m]` torch.int64 index."""
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows


def data_rows(route: lay.Route, num_max_tokens_per_rank: int) -> Tuple[Rows, torch.Tensor]:
    """Slot 0's rows of `route.inner_handle` (`inner_sources` with `as_slice`), computed once per inner
    dispatch and kept in the route."""
    cached = route.inner_rows
    if cached is None or cached[0] is not route.inner_handle:
        rows, src_global = inner_sources(route.inner_handle, 0, num_max_tokens_per_rank, as_slice=True)
        cached = route.inner_rows = (route.inner_handle, rows, src_global)
    return cached[1], cached[2]


def in_received_order(route: lay.Route, rows: Rows, src_global: torch.Tensor) -> bool:
    """Whether `rows` (holding `src_global`) are rows `0..n-1` holding the received tokens in order."""
    n = route.recv_src_global.numel()
    if src_global.numel() != n:
        return False
    if isinstance(rows, slice):
        if rows.start != 0 and n:
            return False
        return src_global is route.recv_src_global or torch.equal(route.recv_src_global, src_global)
    return lay.same_order(route.recv_src_global, src_global, rows)


def write_partials(inner_x: torch.Tensor, route: lay.Route, partial: torch.Tensor, weights: Optional[torch.Tensor],
                   active: torch.Tensor, num_max_tokens_per_rank: int) -> None:
    """Write this rank's partials and weight bytes into the data block of the inner combine buffer.

    Each received token's row is `[partial | the 4K bytes of its top-k weights, each as the bf16 number
    it is]`, the weights of other ranks' entries (`route.others()`) as zeros. Host tensors in the usual
    layout take one native pass (`elastic_write_partials`); the rest torch (the same numbers).

    Arguments:
        inner_x: `[3, R*T, columns]` the combine buffer's view (`hidden + 4K` columns).
        route: the handle's route (its inner dispatch is the one `inner_x` belongs to).
        partial: `[n, hidden]` torch.bfloat16, one per received token.
        weights: `[n, K]` torch.float32, the received tokens' top-k weights (only this rank's entries are
            sent), or None (zeros are sent).
        active: `active_ranks`; sources whose tokens this rank never received are cleared in it.
        num_max_tokens_per_rank: `T`.
    """
    hidden = partial.size(1)
    rows, src_global = data_rows(route, num_max_tokens_per_rank)
    if in_received_order(route, rows, src_global):
        # The usual case: the inner rows are the received tokens in order; write the partials in place.
        n = route.recv_src_global.numel()
        if _write_host(inner_x, route, partial, weights):
            return
        inner_x[0, :n, :hidden].copy_(partial)
        inner_x[0, :n, hidden:].copy_(_weight_bytes(route, weights, partial.device))
        return
    # A re-dispatch whose sources differ: match the rows by source token.
    row_index = as_index(rows, inner_x.device)
    where, known = lay.positions(route.recv_src_global, src_global)
    encoded = _weight_bytes(route, weights, partial.device)
    inner_x[0, row_index[known]] = torch.cat([partial, encoded.to(partial.dtype)], dim=1)[where[known]]
    inner_x[0, row_index[~known]] = 0
    # Tokens this rank never received (their source was out at the dispatch, in now): it has no partial
    # for them, so it sends that source nothing; the source's deadline then clears this rank there,
    # which is exact (a zero row would be summed as if it were this rank's partial).
    lay.clear_sources(active, src_global[~known], num_max_tokens_per_rank)


def _weight_bytes(route: lay.Route, weights: Optional[torch.Tensor], device) -> torch.Tensor:
    """`[n, 4K]` torch.uint8: the bytes of this rank's entries' weights, zeros for the others' (and all
    zeros without weights: an owner that asks for the weights never decodes bytes left there)."""
    others = route.others()
    masked = torch.zeros(others.shape, dtype=torch.float32, device=device) if weights is None \
        else weights.masked_fill(others, 0.0)
    return codec.weight_bytes(masked)


def _write_host(inner_x: torch.Tensor, route: lay.Route, partial: torch.Tensor,
                weights: Optional[torch.Tensor]) -> bool:
    """`write_partials`' usual case in one native pass on host tensors; False where it does not apply."""
    local = route.recv_local_topk
    if inner_x.device.type != "cpu" or partial.device.type != "cpu" or local.device.type != "cpu" \
            or inner_x.stride(2) != 1 or (weights is not None and weights.device.type != "cpu"):
        return False
    n, hidden = partial.shape
    if n == 0:
        return True
    if partial.stride(1) != 1:
        partial = partial.contiguous()
    local = local.contiguous()
    weights = None if weights is None else weights.contiguous()
    _native.elastic_write_partials(inner_x.data_ptr(), 2 * inner_x.stride(1), partial.data_ptr(),
                                   2 * partial.stride(0), n, 2 * hidden, 0 if weights is None else weights.data_ptr(),
                                   local.data_ptr(), local.size(1))
    return True


def read_combined(out: torch.Tensor, hidden: int, num_topk: int, with_weights: bool):
    """The inner combine's result split: the tokens, and the weights decoded from their bf16 numbers.

    Arguments:
        out: `[N, width]` torch.bfloat16, the inner combine's result (`[x | 4K weight numbers | ...]`).
        hidden: `H`; num_topk: `K`; with_weights: decode the weights too.

    Returns:
        x: `[N, H]` torch.bfloat16 (a fresh tensor); weights: `[N, K]` torch.float32, or None.
    """
    n = out.size(0)
    if out.device.type == "cpu" and out.stride(1) == 1 and n:
        x = torch.empty((n, hidden), dtype=torch.bfloat16)
        weights = torch.empty((n, num_topk), dtype=torch.float32) if with_weights else None
        _native.elastic_read_combined(out.data_ptr(), 2 * out.stride(0), n, 2 * hidden, num_topk, x.data_ptr(),
                                      0 if weights is None else weights.data_ptr())
        return x, weights
    x = out[:, :hidden].contiguous()
    return x, (codec.decode_weight_bytes(out[:, hidden:hidden + 4 * num_topk], num_topk) if with_weights else None)


def place_again(route: lay.Route, src_global: torch.Tensor, parts, active: torch.Tensor,
                num_max_tokens_per_rank: int, num_local: int):
    """A cached handle's dispatch: the received parts placed in the handle's layout again (rows from a
    source that sent nothing this time stay zero; sources the layout has no place for are cleared in
    `active`).

    Arguments:
        route: the handle's route; src_global: `[m]` the rows' `src_rank * T + token` this time.
        parts: received tensors `[m, ...]` (None skipped); active: `active_ranks`.
        num_max_tokens_per_rank: `T`; num_local: `L`.

    Returns:
        parts: `[n, ...]` each in the handle's rows; received: list of int, the (token, local expert)
        pairs that arrived in this call per local expert.
    """
    n = route.recv_src_global.numel()
    where, known = lay.positions(route.recv_src_global, src_global)
    lay.clear_sources(active, src_global[~known], num_max_tokens_per_rank)
    placed = tuple(None if part is None else lay.scatter_rows(part[known], where[known], n) for part in parts)
    local = route.recv_local_topk
    arrived = torch.zeros(n, dtype=torch.bool, device=local.device)
    arrived[where[known]] = True
    return placed, lay.expert_counts(local[arrived], num_local).tolist()


def ones(cache: dict, shape, device) -> torch.Tensor:
    """The inner combine's weights (all 1.0: the rows are summed as they are): rows of one tensor kept
    in `cache` per width and device, grown when a call has more tokens.

    Arguments:
        cache: the buffer's dict, `(width, device) -> tensor`; shape: `(rows, width)`; device: the call's.

    Returns:
        ones: `[rows, width]` torch.float32 (a view of the kept tensor, never written).
    """
    rows, width = shape
    key = (width, str(device))
    kept = cache.get(key)
    if kept is None or kept.size(0) < rows:
        kept = cache[key] = torch.ones((max(rows, 1), width), dtype=torch.float32, device=device)
    return kept[:rows]
