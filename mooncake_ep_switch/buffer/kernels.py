"""Thin wrappers that hand torch tensors to the native packing kernels as raw pointers.

The native code (csrc/) never sees torch: it gets addresses, sizes and byte strides. These
wrappers check the few layout facts the kernels rely on and keep the pointer plumbing in one place.
"""
import torch

from mooncake_ep_switch import _native


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def gather_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """Copy rows: `dst[i] = src[index[i]]`.

    Arguments:
        dst: `[n, ...]` contiguous rows of the same row size as `src`.
        src: `[m, ...]` contiguous rows.
        index: `[n]` torch.int64 row indices into `src`.
    """
    if index.numel() == 0:
        return
    row_bytes = src[0].numel() * src.element_size()
    _native.gather_rows(_ptr(dst), row_bytes, _ptr(src), row_bytes, row_bytes, _ptr(index), index.numel())


def quantize_fp8_rows(src: torch.Tensor, index, data: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize bf16 rows to FP8 e4m3fn with one float32 scale per 128 channels.

    Arguments:
        src: `[m, hidden]` torch.bfloat16.
        index: `[n]` torch.int64 rows of `src` to quantize, or None for all rows in order.
        data: `[n, hidden]` torch.uint8 output (e4m3fn bits).
        scales: `[n, hidden / 128]` torch.float32 output.
    """
    count = data.size(0)
    if count == 0:
        return
    _native.quantize_fp8_rows(_ptr(src), src.size(1) * 2, 0 if index is None else _ptr(index), count,
                              src.size(1), _ptr(data), _ptr(scales))


def scatter_fp8_rows(data: torch.Tensor, scales: torch.Tensor, positions: torch.Tensor,
                     recv_x: torch.Tensor, recv_scales_physical: torch.Tensor) -> None:
    """Place compact FP8 rows into the packed layout with token-contiguous scales.

    Arguments:
        data: `[n, hidden]` torch.uint8 rows.
        scales: `[n, hidden / 128]` torch.float32.
        positions: `[n]` torch.int64 flat positions `local_expert * rows_per_expert + row`.
        recv_x: `[L, rows_per_expert, hidden]` FP8 output (any 1-byte dtype).
        recv_scales_physical: `[L, hidden / 128, rows_per_expert]` torch.float32 output.
    """
    if data.size(0) == 0:
        return
    _native.scatter_fp8_rows(_ptr(data), _ptr(scales), data.size(0), data.size(1), _ptr(positions),
                             _ptr(recv_x), _ptr(recv_scales_physical), recv_x.size(1))


def combine_reduce(out: torch.Tensor, row_index: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> None:
    """`out[t] = bf16(sum_k weights[t,k] * rows[row_index[t,k]])` in fp32, top-k order, -1 skipped.

    Arguments:
        out: `[N, hidden]` torch.bfloat16 output.
        row_index: `[N, K]` torch.int64 rows of `rows`, -1 = skip.
        weights: `[N, K]` torch.float32.
        rows: `[m, hidden]` torch.bfloat16 expert outputs.
    """
    hidden = out.size(1)
    if out.size(0) == 0:
        return
    if rows.size(0) == 0:
        if bool((row_index >= 0).any()):
            raise ValueError("row_index: expected only -1 when there are no rows, got a row reference")
        out.zero_()
        return
    _native.combine_reduce(_ptr(out), out.size(0), hidden, row_index.size(1), _ptr(row_index), _ptr(weights),
                           _ptr(rows), hidden * 2)
