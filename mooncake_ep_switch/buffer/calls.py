"""Typed records that the Buffer hands to a transport for one dispatch or combine call."""
from typing import Any, NamedTuple, Optional

import torch


class DispatchCall(NamedTuple):
    """A validated dispatch request.

    Fields:
        x: `[N, hidden]` torch.bfloat16 tokens.
        topk_idx: `[N, K]` torch.int64 global expert ids, -1 = none.
        active_ranks: `[R]` torch.int32, the caller's mask (timeouts are written into it).
        num_max_dispatch_tokens_per_rank: `T`.
        num_experts: `E`.
        timeout_us: per-source deadline in microseconds, -1 = none.
        use_fp8: send FP8 rows with per-128-channel scales.
        call: call number (signal tag), advances by one per dispatch on every rank.
        epoch: membership epoch.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    active_ranks: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    timeout_us: int
    use_fp8: bool
    call: int
    epoch: int


class DispatchOutputs(NamedTuple):
    """Output tensors of a dispatch, allocated by the Buffer and filled by the transport.

    Fields:
        recv_x: `[L, R*T, hidden]` torch.bfloat16, or torch.float8_e4m3fn with FP8.
        recv_scales: `[L, hidden/128, R*T]` torch.float32 (physical, token axis contiguous), or None.
        src_info: `[L, R*T]` torch.int32.
        layout_range: `[L, R]` torch.int64.
        recv_count: `[L]` torch.int32.
    """

    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    src_info: torch.Tensor
    layout_range: torch.Tensor
    recv_count: torch.Tensor


class CombineCall(NamedTuple):
    """A validated combine request.

    Fields:
        x: `[L, R*T, hidden]` torch.bfloat16 expert outputs in the dispatch's packed layout.
        topk_idx: `[N, K]` torch.int64, as given to the matching dispatch.
        topk_weights: `[N, K]` torch.float32.
        active_ranks: `[R]` torch.int32 caller's mask.
        timeout_us: deadline in microseconds, -1 = none.
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts: the handle.
        call: call number of the matching dispatch.
        transport_plan: the transport's private record of the dispatch, or None.
        out: `[N, hidden]` torch.bfloat16 output.
        bias: `(bias0, bias1)`, each None or `[N, h]` torch.bfloat16 (`h <= hidden`, row-contiguous, both
            with the same row stride) that each token's float32 sum starts from (`Buffer.combine`'s `bias`);
            `()` without one.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    active_ranks: torch.Tensor
    timeout_us: int
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    call: int
    transport_plan: Any
    out: torch.Tensor
    bias: tuple = ()


def bias_args(bias: tuple) -> dict:
    """`CombineCall.bias` as the native reductions' keywords (`_native.combine_recv`, `combine_round`,
    `combine_reduce`): `bias0_ptr`, `bias1_ptr` (0 = none), `bias_stride` (bytes) and `bias_hidden`;
    `{}` without a bias."""
    if not bias:
        return {}
    part = bias[0] if bias[0] is not None else bias[1]
    return {"bias0_ptr": 0 if bias[0] is None else bias[0].data_ptr(),
            "bias1_ptr": 0 if bias[1] is None else bias[1].data_ptr(),
            "bias_stride": 2 * part.size(1), "bias_hidden": part.size(1)}
