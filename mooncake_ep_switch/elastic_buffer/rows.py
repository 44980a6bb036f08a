"""The rows an `ElasticBuffer` moves through its inner `Buffer`: byte codecs and the inner routing.

DeepEP V2's dispatch sends each token once per destination rank with its top-k ids and weights;
its combine returns one partial per rank that the owner sums, after the bias, in a fixed order. Both
ride on the inner Buffer's dispatch and combine (every transport, every fault rule of the Buffer):

* a dispatch row is raw bytes viewed as bfloat16, `[x | FP8 scales | top-k ids (int32) | top-k
  weights (float32) | zeros]`, `inner_hidden` elements wide. The inner dispatch copies rows and
  never computes with them, so every byte arrives as it left.
* the inner routing of a token: columns `[bias slot 0, bias slot 1, rank groups...]`, inner expert
  `3 * rank + j` (`j` 0: the token's data, 1 and 2: the owner's own bias slots, which the ElasticBuffer
  no longer routes (`num_bias=0`): the inner combine starts from the bias itself, on every transport).
  Rank groups are ordered by the position of each rank's *last* top-k entry: the order in which V2's reference
  accumulates the per-rank partials (`deep_ep/utils/refs.py`, grouped reduce then ordered sum).
* a combine row is `[partial (bf16) | this rank's top-k weight bytes as small integers | zeros]`.
  The inner combine sums rows with weight 1.0 in fp32 in the routing's column order, then rounds to
  bfloat16: bias 0, bias 1 (its `bias` rows), then the partials, as V2 does. A weight byte `b` becomes the
  bfloat16 number `b` (exact up to 256); every other rank adds 0 at that column, so the sum is `b`
  again, and the owner rebuilds each float32 weight bit for bit.
"""
from typing import Optional, Tuple

import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.elastic_buffer import layout as lay

INNER_SLOTS = 3  # inner experts per rank: data, bias 0, bias 1
MAX_TOPK = 31  # top-k ids and weights (8 bytes each) fit the 256-byte metadata block
_BLOCK = 128  # the inner Buffer's hidden is a multiple of 128 bfloat16 elements (256 bytes)


def _ceil(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as bytes: `[n, m]` -> `[n, m * itemsize]` torch.uint8 (also when n is 0)."""
    shape = (tensor.size(0), tensor.size(1) * tensor.element_size())
    if tensor.numel() == 0:
        return torch.empty(shape, dtype=torch.uint8, device=tensor.device)
    return tensor.contiguous().view(torch.uint8).view(shape)


def num_scale_groups(hidden: int) -> int:
    """FP8 scale columns of a `hidden`-wide row: one float32 per 128 channels (rounded up)."""
    return (hidden + 127) // 128


def dispatch_row_bytes(hidden: int, num_topk: int, use_fp8: bool) -> int:
    """Bytes of one dispatch row before padding: the token, its scales, its top-k ids and weights."""
    token = hidden + 4 * num_scale_groups(hidden) if use_fp8 else 2 * hidden
    return token + 8 * num_topk


def inner_hidden(hidden: int, num_topk: int) -> int:
    """The inner Buffer's hidden size (bfloat16 elements) for calls of this shape.

    One size serves both directions (a dispatch handle fixes the combine's hidden): a combine row is
    `hidden` bf16 plus 4 weight bytes per top-k entry, each as one bf16 element; a dispatch row (BF16
    or FP8) is never wider than that.

    Arguments:
        hidden: `H`, the caller's hidden size.
        num_topk: `K`, at most `MAX_TOPK`.

    Returns:
        hidden: int, a multiple of 128.
    """
    combine = hidden + _ceil(4 * num_topk, _BLOCK)
    dispatch = _ceil(dispatch_row_bytes(hidden, num_topk, False), 2 * _BLOCK) // 2
    return _ceil(max(combine, dispatch), _BLOCK)


def pack_dispatch_rows(x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                       topk_weights: Optional[torch.Tensor], width: int) -> torch.Tensor:
    """Lay out each token's bytes as one inner dispatch row.

    Arguments:
        x: `[N, H]` torch.bfloat16, or torch.float8_e4m3fn with `scales`.
        scales: `[N, ceil(H / 128)]` torch.float32 FP8 scales, or None.
        topk_idx: `[N, K]` torch.int64 global expert ids, -1 = none.
        topk_weights: `[N, K]` torch.float32, or None (zeros are sent).
        width: the inner hidden (bfloat16 elements per row).

    Returns:
        rows: `[N, width]` torch.bfloat16 (raw bytes), on `x`'s device.
    """
    n = topk_idx.size(0)
    parts = [_row_bytes(part) for part in (x, scales, topk_idx.to(torch.int32), topk_weights) if part is not None]
    pad = 2 * width - sum(part.size(1) for part in parts)  # zeros (also the weights' bytes without weights)
    if pad:
        parts.append(_zero_bytes(pad, x.device).expand(n, pad))
    return torch.cat(parts, dim=1).view(torch.bfloat16)  # one copy of every byte


_ZERO_BYTES = {}


def _zero_bytes(columns: int, device) -> torch.Tensor:
    """`[1, columns]` torch.uint8 zeros, kept per width and device (never written; expanded, not copied)."""
    key = (columns, str(device))
    zeros = _ZERO_BYTES.get(key)
    if zeros is None:
        zeros = _ZERO_BYTES[key] = torch.zeros((1, columns), dtype=torch.uint8, device=device)
    return zeros


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Ids in [-1, num_experts) and no id twice in a row (V2's contract), ValueError naming topk_idx."""
    if topk_idx.numel() == 0:
        return
    low, high = (int(value) for value in torch.aminmax(topk_idx))
    if low < -1 or high >= num_experts:
        raise ValueError(f"topk_idx: expected expert ids in [-1, {num_experts}), got values in [{low}, {high}]")
    ordered = torch.sort(topk_idx, dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        row = int(torch.nonzero(repeated.any(dim=1))[0])
        raise ValueError(f"topk_idx: expected no expert twice in a row, got row {row} = {topk_idx[row].tolist()}")


def route_and_pack(x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], width: int, num_experts: int, num_ranks: int, rank: int,
                   num_bias: int, cached_routing: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """A dispatch's inner rows and routing, its ids checked (`check_expert_ids`) unless the routing is a
    cached handle's. Host tensors take one native pass (`pack_host`), others torch (the same bytes).

    Returns:
        rows: `[N, width]` torch.bfloat16; inner_topk: `cached_routing`, or `inner_routing`'s.

    Raises:
        ValueError: naming topk_idx (an id out of range or twice in a row), before anything is sent.
    """
    if on_host(x, scales, topk_idx, topk_weights):
        rows, inner_topk = pack_host(x, scales, topk_idx, topk_weights, width, num_experts, num_ranks, rank, num_bias)
        if rows is None:
            check_expert_ids(topk_idx, num_experts)  # names the fault the native pass found
            raise AssertionError("topk_idx: refused by the native check but not by check_expert_ids")
    else:
        if cached_routing is None:
            check_expert_ids(topk_idx, num_experts)
            inner_topk = inner_routing(topk_idx, num_experts, num_ranks, rank, num_bias)
        rows = pack_dispatch_rows(x, scales, topk_idx, topk_weights, width)
    return rows, (inner_topk if cached_routing is None else cached_routing)


def unpack_received(rows: torch.Tensor, hidden: int, num_topk: int, use_fp8: bool, rank: int, num_local: int,
                    num_experts: int):
    """The received rows' parts (`unpack_host` on the host, `unpack_dispatch_rows` and the layouts' ids elsewhere).

    Returns:
        x, scales (or None), local ids `[n, K]` torch.int64, topk_weights, counts per local expert (`[L]`
        torch.int64), as `unpack_host`.
    """
    if rows.device.type == "cpu":
        return unpack_host(rows, hidden, num_topk, use_fp8, rank, num_local)
    x, scales, topk, weights = unpack_dispatch_rows(rows, hidden, num_topk, use_fp8)
    ids = lay.local_ids(topk, rank, num_local, num_experts)
    return x, scales, ids, weights, lay.expert_counts(ids, num_local)


def on_host(*tensors) -> bool:
    """Whether every given tensor (None skipped) is a host tensor: the native one-pass packing applies."""
    return all(t is None or t.device.type == "cpu" for t in tensors)


def pack_host(x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
              topk_weights: Optional[torch.Tensor], width: int, num_experts: int, num_ranks: int, rank: int,
              num_bias: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """`pack_dispatch_rows` and `inner_routing` in one native pass over host tensors, the ids checked first.

    Arguments:
        x, scales, topk_idx, topk_weights, width: as `pack_dispatch_rows` (host tensors).
        num_experts, num_ranks, rank, num_bias: as `inner_routing`.

    Returns:
        rows: `[N, width]` torch.bfloat16 (raw bytes); inner_topk: `[N, num_bias + min(K, R)]` torch.int64.
        Both None when an id is out of `[-1, num_experts)` or twice in a row (nothing written; the caller
        names the fault).
    """
    n, num_topk = topk_idx.shape
    x, topk_idx = x.contiguous(), topk_idx.contiguous()
    scales = None if scales is None else scales.contiguous()
    weights = None if topk_weights is None else topk_weights.contiguous()
    rows = torch.empty((n, width), dtype=torch.bfloat16)
    inner_topk = torch.empty((n, num_bias + min(num_topk, num_ranks)), dtype=torch.int64)
    status, _ = _native.elastic_pack_rows(
        x.data_ptr(), x.size(1) * x.element_size(), 0 if scales is None else scales.data_ptr(),
        0 if scales is None else 4 * scales.size(1), topk_idx.data_ptr(), n, num_topk, num_experts, num_ranks, rank,
        num_bias, 0 if weights is None else weights.data_ptr(), rows.data_ptr(), 2 * width, inner_topk.data_ptr())
    if status:
        return None, None
    return rows, inner_topk


def unpack_host(rows: torch.Tensor, hidden: int, num_topk: int, use_fp8: bool, rank: int, num_local: int):
    """`unpack_dispatch_rows` for host rows in one native pass, with the ids made local and counted.

    Arguments:
        rows: `[n, width]` torch.bfloat16 received rows (rows contiguous, any row stride).
        hidden, num_topk, use_fp8: as `unpack_dispatch_rows`.
        rank: this rank; num_local: `L`, its experts (`rank * L` is the first).

    Returns:
        x, scales (or None), topk_weights as `unpack_dispatch_rows`; local: `[n, K]` torch.int64 ids
        local to `rank` (-1 elsewhere, `layout.local_topk`); counts: `[L]` torch.int64 entries per local
        expert (`layout.expert_counts`).
    """
    n = rows.size(0)
    groups = num_scale_groups(hidden)
    x = torch.empty((n, hidden), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    scales = torch.empty((n, groups), dtype=torch.float32) if use_fp8 else None
    local = torch.empty((n, num_topk), dtype=torch.int64)
    weights = torch.empty((n, num_topk), dtype=torch.float32)
    counts = torch.empty(num_local, dtype=torch.int64)
    if n and rows.stride(1) != 1:
        rows = rows.contiguous()
    _native.elastic_unpack_rows(rows.data_ptr() if n else 0, 2 * rows.stride(0) if n else 2 * rows.size(1), n,
                                x.size(1) * x.element_size(), 4 * groups if use_fp8 else 0, num_topk,
                                rank * num_local, num_local, x.data_ptr(), 0 if scales is None else scales.data_ptr(),
                                local.data_ptr(), weights.data_ptr(), counts.data_ptr())
    return x, scales, local, weights, counts


def unpack_dispatch_rows(rows: torch.Tensor, hidden: int, num_topk: int, use_fp8: bool):
    """The parts of received dispatch rows (`pack_dispatch_rows` in reverse).

    Arguments:
        rows: `[n, width]` torch.bfloat16 rows as received.
        hidden: `H`.
        num_topk: `K`.
        use_fp8: whether the rows carry FP8 tokens with scales.

    Returns:
        x: `[n, H]` torch.bfloat16 or torch.float8_e4m3fn; scales: `[n, ceil(H/128)]` torch.float32 or
        None; topk_idx: `[n, K]` torch.int64 global ids; topk_weights: `[n, K]` torch.float32.
        Fresh contiguous tensors.
    """
    raw = _row_bytes(rows)
    if raw.size(0) == 0:
        device, groups = rows.device, num_scale_groups(hidden)
        return (torch.empty((0, hidden), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16, device=device),
                torch.empty((0, groups), dtype=torch.float32, device=device) if use_fp8 else None,
                torch.empty((0, num_topk), dtype=torch.int64, device=device),
                torch.empty((0, num_topk), dtype=torch.float32, device=device))
    at, scales = 0, None
    if use_fp8:
        x = raw[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        at = hidden
        groups = num_scale_groups(hidden)
        scales = raw[:, at:at + 4 * groups].contiguous().view(torch.float32)
        at += 4 * groups
    else:
        x = raw[:, :2 * hidden].contiguous().view(torch.bfloat16)
        at = 2 * hidden
    topk_idx = raw[:, at:at + 4 * num_topk].contiguous().view(torch.int32).to(torch.int64)
    at += 4 * num_topk
    topk_weights = raw[:, at:at + 4 * num_topk].contiguous().view(torch.float32)
    return x, scales, topk_idx, topk_weights


def inner_routing(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, rank: int, num_bias: int = 2) -> torch.Tensor:
    """Each token's inner experts: its own `num_bias` bias slots, then one data slot per destination rank,
    ordered by the position of the rank's last entry in the token's top-k.

    Arguments:
        topk_idx: `[N, K]` torch.int64 global expert ids, -1 = none.
        num_experts: `E`, a multiple of `num_ranks`.
        num_ranks: `R`.
        rank: this rank (the tokens' owner).
        num_bias: bias slots (0 to 2): each copies the token to its owner once more at dispatch, so
            that a combine may add that many bias tensors first.

    Returns:
        inner_topk: `[N, min(K, R) + num_bias]` torch.int64 inner expert ids (`3 * rank + j`), -1 padding last.
    """
    n, num_topk = topk_idx.shape
    device = topk_idx.device
    owner = torch.div(topk_idx, num_experts // num_ranks, rounding_mode="floor")  # -1 (no expert) stays -1
    # last[:, 1 + r]: rank r's last top-k position minus (K + 1) (negative), or 0 where the token has no
    # expert on r (column 0 collects the -1 entries and is dropped). One scatter, whatever R.
    last = torch.zeros((n, num_ranks + 1), dtype=torch.int64, device=device)
    last.scatter_reduce_(1, owner + 1, _entry_keys(num_topk, device).expand(n, num_topk), "amax", include_self=False)
    key, rank_order = torch.sort(last[:, 1:], dim=1)  # present ranks by last position; absent (0) after
    width = min(num_topk, num_ranks)  # at most one column per rank (the inner top-k <= 3R)
    groups = (rank_order[:, :width] * INNER_SLOTS).masked_fill_(key[:, :width] >= 0, -1)
    if num_bias == 0:
        return groups
    bias = torch.tensor([INNER_SLOTS * rank + 1, INNER_SLOTS * rank + 2][:num_bias], dtype=torch.int64, device=device)
    return torch.cat([bias.expand(n, num_bias), groups], dim=1)


_ENTRY_KEYS = {}


def _entry_keys(num_topk: int, device) -> torch.Tensor:
    """`[K]` torch.int64 `k - (K + 1)` (kept per K and device, never written): the scatter values of
    `inner_routing`, increasing with the top-k position and all negative."""
    key = (num_topk, str(device))
    keys = _ENTRY_KEYS.get(key)
    if keys is None:
        keys = _ENTRY_KEYS[key] = torch.arange(num_topk, dtype=torch.int64, device=device) - (num_topk + 1)
    return keys


def encode_weight_bytes(weights: torch.Tensor) -> torch.Tensor:
    """Float32 weights `[n, K]` as `[n, 4K]` bfloat16 small integers (one per byte, exact)."""
    return weight_bytes(weights).to(torch.bfloat16)


def weight_bytes(weights: torch.Tensor) -> torch.Tensor:
    """Float32 weights `[n, K]` as their `[n, 4K]` torch.uint8 bytes: `encode_weight_bytes` before the
    conversion, which a `copy_` into bfloat16 columns does on the way (the same numbers)."""
    return _row_bytes(weights)


def decode_weight_bytes(encoded: torch.Tensor, num_topk: int) -> torch.Tensor:
    """`encode_weight_bytes` in reverse, after the inner combine's sum: `[n, 4K]` -> `[n, K]` float32."""
    n = encoded.size(0)
    if n == 0:
        return torch.empty((0, num_topk), dtype=torch.float32, device=encoded.device)
    return encoded[:, :4 * num_topk].to(torch.uint8).contiguous().view(torch.float32).view(n, num_topk)


def split_bias(bias) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """V2's `bias`: None, one tensor, or a pair; returns the pair (None where absent)."""
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    return bias[0], bias[1]
