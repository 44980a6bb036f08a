"""DeepEP V2's receive layouts, computed from what the inner Buffer's dispatch delivered.

Pure torch on whatever device the rows are on. Not expanded: one row per received token, sorted by
`src_token_global_idx = src_rank * T + token` (V2's deterministic order). Expanded: one row per
(token, local expert), grouped by local expert, tokens in the same order inside each expert, each
expert's block padded to `expert_alignment`.
"""
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

COUNT_MASK = 0xFFFFFFFF  # layout_range[l][s] = (begin << 32) | count (docs/protocol.md)


def align(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return (value + multiple - 1) // multiple * multiple


@dataclass
class Route:
    """What a dispatch's handle keeps for its combine and for cached re-dispatches (mutable: a cached
    dispatch or a combine's re-dispatch moves it to the newest inner call).

    Fields:
        inner_topk: `[N, min(K, R) + num_bias]` torch.int64, the owner's inner routing (`rows.inner_routing`).
        num_tokens, num_topk, hidden, use_fp8: the owner's call shape.
        recv_src_global: `[n]` torch.int64, the received tokens' `src_rank * T + token`, ascending.
        recv_local_topk: `[n, K]` torch.int64, their top-k ids local to this rank (-1: elsewhere).
        slots: `[n, K]` torch.int64 rows of the expanded layout (-1: not here), or None.
        num_slots: rows of the expanded layout (0 when not expanded).
        inner_handle: the inner Buffer's dispatch handle (its plan's `call` is the dispatch's call number).
        inner_call: the ElasticBuffer's count of inner dispatches when `inner_handle` was made.
        combined: whether `inner_handle` was combined already.
        inner_rows: where `inner_handle` put the data rows, kept once computed (`inner_rows.data_rows`).
        owner: the ElasticBuffer's token (a handle of another buffer is refused).
        epoch: the inner Buffer's membership epoch the handle was last checked in (its dispatch's; moved
            on when the epoch moved without admitting anyone: the collective fallback's view without a
            dead rank, agreed inside a call).
        generation: the ElasticBuffer's count of `update_ep_member()` calls at the dispatch (a handle
            from before one is refused).
    """

    inner_topk: torch.Tensor
    num_tokens: int
    num_topk: int
    hidden: int
    use_fp8: bool
    recv_src_global: torch.Tensor
    recv_local_topk: torch.Tensor
    slots: Optional[torch.Tensor]
    num_slots: int
    inner_handle: Any
    inner_call: int
    owner: object
    epoch: int
    generation: int
    combined: bool = False
    inner_rows: Optional[tuple] = None  # (inner_handle, rows, src_global) of its slot 0 (`inner_rows.data_rows`)
    _others: Optional[torch.Tensor] = None  # recv_local_topk < 0, kept once computed (`others`)

    def others(self) -> torch.Tensor:
        """`[n, K]` torch.bool, the received top-k entries of other ranks' experts (and -1), computed once."""
        if self._others is None:
            self._others = self.recv_local_topk < 0
        return self._others


def local_topk(topk_idx: torch.Tensor, rank: int, num_local_experts: int) -> torch.Tensor:
    """Global top-k ids `[n, K]` as ids local to `rank` (-1 for other ranks' experts and for -1)."""
    first = rank * num_local_experts
    inside = (topk_idx >= first) & (topk_idx < first + num_local_experts)
    return torch.where(inside, topk_idx - first, torch.full_like(topk_idx, -1))


def local_ids(topk_idx: torch.Tensor, rank: int, num_local_experts: int, num_experts: int) -> torch.Tensor:
    """`local_topk` by one lookup: global ids in `[-1, num_experts)` (IndexError outside) as ids local to
    `rank`, -1 elsewhere. The table is kept per rank, shape and device (never written)."""
    key = (rank, num_local_experts, num_experts, str(topk_idx.device))
    table = _LOCAL_TABLES.get(key)
    if table is None:
        table = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=topk_idx.device)
        first = rank * num_local_experts
        table[1 + first:1 + first + num_local_experts] = torch.arange(num_local_experts, device=topk_idx.device)
        table = _LOCAL_TABLES[key] = table
    return table[topk_idx + 1]


_LOCAL_TABLES = {}


def expert_counts(local: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Received (token, local expert) pairs per local expert: `[L]` torch.int64."""
    return torch.bincount(local.flatten() + 1, minlength=num_local_experts + 1)[1:]  # bin 0: the -1 entries


def expanded_slots(local: torch.Tensor, counts: List[int], alignment: int) -> Tuple[torch.Tensor, List[int]]:
    """Rows of the expanded layout: expert `j`'s block starts at the aligned sum of the blocks before it,
    its rows in received order.

    Returns:
        slots: `[n, K]` torch.int64, the row of each (token, top-k entry), -1 where not local;
        starts: list of int, each local expert's first row.
    """
    n, num_topk = local.shape
    starts, at = [], 0
    for count in counts:
        starts.append(at)
        at += align(count, alignment)
    slots = torch.full_like(local, -1)
    token, entry = torch.nonzero(local >= 0, as_tuple=True)
    if token.numel():
        expert = local[token, entry]
        order = torch.argsort(expert * n + token)  # by expert, then received order
        expert_sorted = expert[order]
        firsts = torch.tensor(starts, dtype=torch.int64, device=local.device)
        before = torch.cumsum(torch.tensor([0] + counts[:-1], dtype=torch.int64, device=local.device), 0)
        rank_in_expert = torch.arange(order.numel(), device=local.device) - before[expert_sorted]
        slots[token[order], entry[order]] = firsts[expert_sorted] + rank_in_expert
    return slots, starts


def src_metadata(src_global: torch.Tensor, local: torch.Tensor, slots: Optional[torch.Tensor],
                 num_max_tokens_per_rank: int) -> torch.Tensor:
    """V2's `recv_src_metadata` `[n, 2 + K]` torch.int32 (see `EPHandle`)."""
    n, num_topk = local.shape
    meta = torch.full((n, 2 + num_topk), -1, dtype=torch.int32, device=local.device)
    if n == 0:
        return meta
    meta[:, 0] = src_global.to(torch.int32)
    src_rank = torch.div(src_global, num_max_tokens_per_rank, rounding_mode="floor")
    first = torch.argmax((local >= 0).to(torch.int8), dim=1)
    meta[:, 1] = (src_rank * num_topk + first).to(torch.int32)
    if slots is not None:
        meta[:, 2:] = slots.to(torch.int32)
    return meta


def dst_slots(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """`[N, R]` torch.int32: each token's row among the rows this rank sends to each rank, -1: not sent."""
    n = topk_idx.size(0)
    local = num_experts // num_ranks
    valid = topk_idx >= 0
    owner = torch.div(topk_idx.clamp(min=0), local, rounding_mode="floor")
    hits = torch.zeros((n, num_ranks), dtype=torch.int32, device=topk_idx.device)
    hits.scatter_add_(1, owner, valid.to(torch.int32))
    sends = hits > 0
    order = torch.cumsum(sends.to(torch.int32), dim=0) - 1
    return torch.where(sends, order, torch.full_like(order, -1)).to(torch.int32)


def positions(keys: torch.Tensor, wanted: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where each of `wanted` sits in the ascending `keys`, and whether it is there at all."""
    if keys.numel() == 0:
        return torch.zeros_like(wanted), torch.zeros_like(wanted, dtype=torch.bool)
    where = torch.searchsorted(keys, wanted).clamp(max=keys.numel() - 1)
    return where, keys[where] == wanted


def same_order(keys: torch.Tensor, wanted: torch.Tensor, row_index: torch.Tensor) -> bool:
    """Whether rows `row_index` (holding `wanted`) are rows `0..n-1` holding exactly `keys` in order."""
    n = keys.numel()
    if wanted.numel() != n or row_index.numel() != n:
        return False
    return n == 0 or (torch.equal(row_index, torch.arange(n, device=row_index.device)) and torch.equal(keys, wanted))


def scatter_rows(part: torch.Tensor, where: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros((n,) + tuple(part.shape[1:]), dtype=part.dtype, device=part.device)
    if where.numel():
        out[where] = part
    return out


def expand(route: Route, x: torch.Tensor, scales: Optional[torch.Tensor], weights: Optional[torch.Tensor],
            zero_padding: bool):
    """The expanded layout's rows: row `slots[i, k]` holds token `i`'s data (and weight `k`)."""
    token, entry = torch.nonzero(route.slots >= 0, as_tuple=True)
    target = route.slots[token, entry]
    make = torch.zeros if zero_padding else torch.empty

    def place(part):
        if part is None:
            return None
        out = make((route.num_slots,) + tuple(part.shape[1:]), dtype=part.dtype, device=part.device)
        out[target] = part[token]
        return out

    out_weights = None
    if weights is not None:
        out_weights = make((route.num_slots,), dtype=torch.float32, device=weights.device)
        out_weights[target] = weights[token, entry]
    return place(x), place(scales), out_weights


def reduce_expanded(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each token's rows summed in top-k order in fp32 (rows not on this rank skipped), then bf16."""
    n, num_topk = slots.shape
    acc = torch.zeros((n, x.size(1)), dtype=torch.float32, device=x.device)
    for k in range(num_topk):
        column = slots[:, k]
        here = column >= 0
        if bool(here.any()):
            acc[here] += x[column[here]].float()
    return acc.to(torch.bfloat16)


def clear_sources(active: torch.Tensor, src_global: torch.Tensor, num_max_tokens_per_rank: int) -> None:
    """Set to 0 in `active` the source ranks of `src_global` (`src_rank * T + token`)."""
    if src_global.numel():
        ranks = torch.unique(torch.div(src_global, num_max_tokens_per_rank, rounding_mode="floor"))
        active[ranks.to(active.device)] = 0
