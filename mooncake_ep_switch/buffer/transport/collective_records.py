"""The collective transport's records: checked wrappers that hand torch tensors to the native record
packers and the weighted combine reduction as raw pointers.

The native code (csrc/) never sees torch: it gets addresses, sizes and byte strides. These
wrappers check the few layout facts the kernels rely on and keep the pointer plumbing in one place.
"""
import torch

from mooncake_ep_switch import _native


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


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


# ------------------------------------------------------------------ collective fallback records
# The collective transport's record packers (csrc/dataplane/kernels.cpp, bound by pybind11 like every native call).

def _checked(what: str, call, *args, **flags) -> int:
    """Run a native record packer; its ValueError / RuntimeError comes back as RuntimeError naming `what`."""
    try:
        return call(*args, **flags)
    except (ValueError, RuntimeError) as error:
        raise RuntimeError(f"{what}: {error}") from None


def record_layout(hidden: int, num_local_experts: int, use_fp8: bool):
    """(payload bytes, byte offset of the int32 token index, record bytes) of a collective record.

    Arguments:
        hidden: `H`, a multiple of 128.
        num_local_experts: `L`, local experts per rank (one flag byte each).
        use_fp8: payload is the e4m3fn row plus `H/128` float32 scales (else the bf16 row).

    Returns:
        payload: int bytes, `H + 4 * H/128` with FP8 else `2 * H`.
        meta: int byte offset of the token index (equal to `payload`).
        size: int record bytes, `payload + 4 + L` rounded up to a multiple of 16.
    """
    payload = hidden + 4 * (hidden // 128) if use_fp8 else 2 * hidden
    return payload, payload, (payload + 4 + num_local_experts + 15) // 16 * 16


def coll_dispatch_pack(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                       max_tokens: int, active: torch.Tensor, use_fp8: bool, fixed: bool, record: tuple,
                       send: torch.Tensor, tokens_to: torch.Tensor, pairs_to: torch.Tensor,
                       row_index: torch.Tensor) -> int:
    """Write this rank's dispatch records into `send`; returns the number of records.

    Arguments:
        x: `[N, hidden]` torch.bfloat16 CPU tokens.
        topk_idx: `[N, K]` torch.int64 global expert ids, -1 = none.
        num_experts: `E`, a multiple of `R`.
        num_ranks: `R`.
        max_tokens: `T`, num_max_dispatch_tokens_per_rank.
        active: `[R]` torch.int32, the destinations this rank sends to (1 = active).
        use_fp8: quantise the payload to FP8 with per-128-channel scales.
        fixed: fixed slots of `T + 1` records per destination (slot 0 a header).
        record: `record_layout(...)`.
        send: torch.uint8 buffer (fixed: `R * (T + 1)` records; exact: enough for every record).
        tokens_to: `[R]` torch.int64 output, records per destination rank.
        pairs_to: `[R]` torch.int64 output, (token, expert) pairs per destination rank.
        row_index: `[N, K]` torch.int64 output, combine receive row of every pair (-1 = not sent).

    Returns:
        records: int, data records written over all destinations (fixed-mode headers not counted).

    Raises:
        RuntimeError: the native packer refused (the message says why).
    """
    _, meta, size = record
    return _checked("collective dispatch", _native.coll_dispatch_pack,
                    x.data_ptr(), x.size(0), x.size(1), topk_idx.data_ptr(), topk_idx.size(1), num_experts, num_ranks,
                    max_tokens, active.data_ptr(), use_fp8=bool(use_fp8), fixed=bool(fixed), rec_size=size,
                    meta=meta, send=send.data_ptr(), send_bytes=send.numel(), tokens_to=tokens_to.data_ptr(),
                    pairs_to=pairs_to.data_ptr(), row_index=row_index.data_ptr())


def coll_dispatch_unpack(recv: torch.Tensor, num_ranks: int, max_tokens: int, hidden: int, num_local: int,
                         record: tuple, fixed: bool, recv_tokens: torch.Tensor, accepted_by: torch.Tensor,
                         accept: torch.Tensor, use_fp8: bool, outputs, rows_to_rank: torch.Tensor) -> int:
    """Validate received records and pack them into the dispatch outputs; returns the rows packed.

    Arguments:
        recv: torch.uint8 records as received.
        num_ranks: `R`.
        max_tokens: `T`, num_max_dispatch_tokens_per_rank.
        hidden: `H`.
        num_local: `L`, local experts per rank.
        record: `record_layout(...)`.
        fixed: the records came in fixed slots of `T + 1` per source.
        recv_tokens: `[R]` torch.int64 records per source (input in exact mode, output in fixed
            mode, read from the headers).
        accepted_by: `[R]` torch.int64 output (fixed mode): whether each source accepts this rank.
        accept: `[R]` torch.int32, the sources this rank accepts.
        use_fp8: the payload is FP8 with scales.
        outputs: the `DispatchOutputs`, filled here.
        rows_to_rank: `[R]` torch.int64 output, rows each source will get back in combine.

    Returns:
        rows: int, rows packed into `outputs` over all local experts.

    Raises:
        RuntimeError: malformed records (the message says why).
    """
    _, meta, size = record
    scales = outputs.recv_scales.data_ptr() if outputs.recv_scales is not None else 0
    return _checked("collective dispatch", _native.coll_dispatch_unpack,
                    recv.data_ptr(), recv.numel(), num_ranks, max_tokens, hidden, num_local, size, meta,
                    fixed=bool(fixed), recv_tokens=recv_tokens.data_ptr(), accepted_by=accepted_by.data_ptr(),
                    accept=accept.data_ptr(), use_fp8=bool(use_fp8), recv_x=outputs.recv_x.data_ptr(),
                    recv_scales=scales, src_info=outputs.src_info.data_ptr(),
                    layout_range=outputs.layout_range.data_ptr(), recv_count=outputs.recv_count.data_ptr(),
                    rows_to_rank=rows_to_rank.data_ptr())


def coll_combine_pack(x: torch.Tensor, layout_range: torch.Tensor, max_tokens: int, send: torch.Tensor) -> int:
    """Copy the expert outputs each source gets back into `send` `[P, hidden]`: by source, local expert, token.

    Arguments:
        x: `[L, R*T, hidden]` torch.bfloat16 expert outputs in the dispatch's packed layout.
        layout_range: `[L, R]` torch.int64, the layout this rank produced as an owner.
        max_tokens: `T`, num_max_dispatch_tokens_per_rank.
        send: `[P, hidden]` torch.bfloat16, `P` the rows returned to all sources.

    Returns:
        rows: int, rows written into `send`.

    Raises:
        RuntimeError: the layout does not fit `send` (the message says why).
    """
    num_local, num_ranks = layout_range.shape
    return _checked("collective combine", _native.coll_combine_pack, x.data_ptr(), x.size(2), num_local, num_ranks,
                    max_tokens, layout_range.data_ptr(), send.data_ptr(), send.size(0))
