"""The pool the Buffer allocates the host transports' outputs from: steady-state calls neither allocate nor
page-fault tens of MB, and a block is reused only when no caller holds any tensor aliasing it. The "cuda"
transport's outputs are fresh tensors from torch's allocator instead (`fresh_dispatch_outputs` says why)."""
import functools
import sys
import threading
from typing import Optional

import torch

from mooncake_ep_switch.buffer.calls import DispatchOutputs


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


_storage_use_count = torch._C._storage_Use_Count
_refcount = sys.getrefcount
_detach = torch.Tensor.detach
_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__
_inference_mode = torch.is_inference_mode_enabled
_is_shared = torch.UntypedStorage.is_shared
_storage_nbytes = torch.UntypedStorage.nbytes
_storage_ptr = torch.UntypedStorage.data_ptr


class _OutputSlot:
    """One byte block holding some output tensors of one call, with the pool's own views of it.

    The pool never hands these views out: each call gets fresh aliases (`detach()`), so whatever a
    caller does to the tensors it got (in-place reshapes, `set_`) cannot change what a later call
    receives. Every tensor that aliases the block (a returned output, any view or slice the caller
    made of one, a tensor built on its storage) holds a reference to the block's storage, and torch
    hands out one Python object per storage (`untyped_storage()`, which the pool keeps too), whose
    Python reference count grows with every holder; the slot is free when both counts are the
    pool's own. Holders the counts cannot see retire the slot for good: a storage moved to shared
    memory (sent to another process, which maps it without touching either count) or resized by a
    caller (`untyped_storage().resize_()`, which would leave the next call writing past its end).

    Arguments:
        parts: `(dtype, shape)` of every tensor, in order, or None for an absent one.
        zeroed: indices of the parts that start zeroed (a fresh `torch.zeros` would have been).
        device: where the block lives.
    """

    __slots__ = ("storage", "cdata", "baseline", "refs", "views", "nbytes", "ptr", "retired", "host")

    def __init__(self, parts, zeroed, device):
        offsets, total = [], 0
        for part in parts:
            offsets.append(total)
            if part is not None:
                dtype, shape = part
                total += _aligned(_numel(shape) * dtype.itemsize)
        block = torch.empty(max(total, 64), dtype=torch.uint8, device=device)
        views, view = [], None
        for index, (part, offset) in enumerate(zip(parts, offsets)):
            if part is None:
                views.append(None)
                continue
            dtype, shape = part
            view = block[offset:offset + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
            if index in zeroed:
                view.zero_()
            views.append(view)
        self.views = tuple(views)
        self.nbytes = block.numel()
        self.ptr = block.data_ptr()
        self.storage = block.untyped_storage()
        self.cdata = self.storage._cdata
        self.retired = False
        self.host = block.device.type == "cpu"  # torch reports every CUDA storage as shared: not a holder
        del block, view
        self.baseline = _storage_use_count(self.cdata)  # the pool's own references, counted once here
        self.refs = _refcount(self.storage)

    def is_free(self) -> bool:
        """No tensor or storage object outside the pool refers to the block, and it is intact."""
        if _storage_use_count(self.cdata) != self.baseline or _refcount(self.storage) != self.refs or self.retired:
            return False
        storage = self.storage
        if (self.host and _is_shared(storage)) or _storage_nbytes(storage) != self.nbytes \
                or _storage_ptr(storage) != self.ptr:
            self.retired = True  # see the class docstring; the pool drops it
            return False
        return True

    def hand_out(self) -> list:
        """Fresh aliases of the block for one call (the caller's to keep as long as it likes)."""
        return [None if view is None else _detach(view) for view in self.views]


def fresh_dispatch_outputs(use_fp8: bool, local: int, rows: int, hidden: int, num_ranks: int,
                           device) -> DispatchOutputs:
    """Outputs of one dispatch as fresh tensors from torch's allocator, never pooled: those of the "cuda" transport.

    Device kernels write the outputs on a stream, and a caller may go on using them on other streams (after an
    event, with `record_stream`), or drop them before an `async_finish` call's receive phase (on the communication
    stream) has written them. The pool sees none of that: reference counts alone would hand the memory to a later
    call while a kernel may still write or read it. Torch's caching allocator reuses device memory in stream order and honours
    `record_stream` (the `async_finish` path records the communication stream on every tensor), as DeepEP's own
    outputs do; device memory is not zeroed on first touch, so the pool would save only the host's allocation calls.
    Nothing is zeroed: the receive kernels write src_info, layout_range and recv_count in full (src_info past
    `recv_count` as 0); recv_x and scales rows past `recv_count` are unspecified.

    Arguments:
        as `OutputPool.dispatch_outputs`.

    Returns:
        outputs: a `DispatchOutputs` as `OutputPool.dispatch_outputs` returns.
    """
    empty = torch.empty
    rows_parts, meta_parts = _dispatch_parts(use_fp8, local, rows, hidden, num_ranks)
    return _new_tuple(DispatchOutputs, tuple(None if part is None else empty(part[1], dtype=part[0], device=device)
                                             for part in rows_parts + meta_parts))


@functools.lru_cache(maxsize=64)
def _dispatch_parts(use_fp8: bool, local: int, rows: int, hidden: int, num_ranks: int) -> tuple:
    """`(dtype, shape)` of a dispatch's outputs, in `DispatchOutputs` order: the rows block's (recv_x, the FP8 scales
    or None) and the small tensors' (src_info, layout_range, recv_count)."""
    return (((torch.float8_e4m3fn if use_fp8 else torch.bfloat16, (local, rows, hidden)),
             (torch.float32, (local, hidden // 128, rows)) if use_fp8 else None),
            ((torch.int32, (local, rows)), (torch.int64, (local, num_ranks)), (torch.int32, (local,))))


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class OutputPool:
    """Output tensors reused across calls, never while anyone else can still reach them.

    A fresh `recv_x` of hidden=7168 is tens of MB: the kernel zeroes every page of it on first
    touch, which costs about as much as the copies themselves, and at small sizes allocating five
    tensors costs more Python time than the call's data movement. The pool keeps, per output
    shape, up to `slots_per_shape` blocks. A dispatch takes two blocks: one for the rows (recv_x
    and the FP8 scales), one for the small tensors (src_info, layout_range, recv_count), so that a
    caller keeping only recv_count or a handle does not pin tens of MB of rows; a combine takes
    one block for its result.

    Reuse rule: a call gets a block only if no tensor outside the pool references its storage
    (torch's storage use count equals the pool's own count, see `_OutputSlot`). The tensors a call
    returned, any view, slice or storage object made of them, an event or hook still holding them,
    or a handle holding src_info/layout_range all keep the block busy, so a result stays valid,
    never overwritten, for as long as its holder keeps it (Mooncake/DeepEP semantics). A busy pool
    allocates a new block (kept when the shape has room, else left to be freed with its last
    reference). Keys include whether inference mode is on, so a block made under
    `torch.inference_mode()` is never handed to a call outside it (nor the reverse).

    Arguments:
        slots_per_shape: blocks kept per (kind, shape, device, inference mode); 3 covers DeepEP's
            "at most two dispatch results alive" plus the result a caller's assignment is about to
            replace.
        max_shapes: distinct keys kept; beyond it the key pooled first is dropped (its blocks stay
            valid for whoever still holds them).
    """

    def __init__(self, slots_per_shape: int = 3, max_shapes: int = 16):
        self.slots_per_shape = slots_per_shape
        self.max_shapes = max_shapes
        self._slots = {}  # key -> list of _OutputSlot, insertion order = first pooled first
        self._lock = threading.Lock()

    def _free_slot(self, key) -> Optional[_OutputSlot]:
        """A free block of `key`, dropping retired ones (call with the lock held)."""
        slots = self._slots.get(key)
        if slots is None:
            return None
        for slot in slots:
            if slot.is_free():
                return slot
        if any(slot.retired for slot in slots):
            slots[:] = [slot for slot in slots if not slot.retired]
        return None

    def acquire(self, key, parts, zeroed, device) -> tuple:
        """Aliases of a free block for `key` (whose tensors are `parts`), else of a new block.

        A new block is kept for reuse if `key` has room (the oldest key is dropped beyond `max_shapes`).

        Arguments:
            key: hashable pool key; equal keys must describe equal `parts`.
            parts: sequence of `(dtype, shape)` per tensor, or None for an absent one.
            zeroed: indices of the parts zeroed when a new block is made (a reused block keeps
                whatever the last call wrote).
            device: torch device of the block.

        Returns:
            tensors: list with one fresh alias per part (None for an absent part).
        """
        with self._lock:
            slot = self._free_slot(key)
        return self._new_block(key, parts, zeroed, device) if slot is None else slot.hand_out()

    def _new_block(self, key, parts, zeroed, device) -> list:
        """Aliases of a new block for `key` (see `acquire`), kept in the pool when `key` has room."""
        slot = _OutputSlot(parts, zeroed, device)
        outputs = slot.hand_out()
        with self._lock:
            slots = self._slots.get(key)
            if slots is None:
                while len(self._slots) >= self.max_shapes:
                    self._slots.pop(next(iter(self._slots)))
                slots = self._slots[key] = []
            if len(slots) < self.slots_per_shape:
                slots.append(slot)
        return outputs

    def dispatch_outputs(self, use_fp8: bool, local: int, rows: int, hidden: int, num_ranks: int,
                         device) -> DispatchOutputs:
        """Outputs of one dispatch of this shape.

        Rows of recv_x (and scales) beyond `recv_count` are unspecified (they may hold earlier calls'
        data, as torch.empty may hold anything); src_info beyond `recv_count` is 0; layout_range and
        recv_count are written in full by every receive.

        Arguments:
            use_fp8: rows are torch.float8_e4m3fn with scales (else torch.bfloat16, no scales).
            local: `L`, local experts per rank.
            rows: `R * T`, receive rows per local expert.
            hidden: `H`, a multiple of 128.
            num_ranks: `R`.
            device: torch device of the outputs (the host's: device outputs are never pooled, see
                `fresh_dispatch_outputs`).

        Returns:
            outputs: a `DispatchOutputs` (recv_x `[L, R*T, H]`, recv_scales `[L, H/128, R*T]`
                torch.float32 or None, src_info `[L, R*T]` torch.int32, layout_range `[L, R]`
                torch.int64, recv_count `[L]` torch.int32).
        """
        inference = _inference_mode()
        rows_key = ("dispatch rows", use_fp8, local, rows, hidden, device, inference)
        meta_key = ("dispatch meta", local, rows, num_ranks, device, inference)
        with self._lock:  # one lock for both blocks
            rows_slot, meta_slot = self._free_slot(rows_key), self._free_slot(meta_key)
        if rows_slot is not None:
            recv_x, scales = rows_slot.views
            recv_x, scales = _detach(recv_x), None if scales is None else _detach(scales)
        else:
            recv_x, scales = self._new_block(rows_key, _dispatch_parts(use_fp8, local, rows, hidden, num_ranks)[0], (),
                                             device)
        if meta_slot is not None:
            src_info, layout_range, recv_count = meta_slot.views
            src_info, layout_range, recv_count = _detach(src_info), _detach(layout_range), _detach(recv_count)
        else:
            src_info, layout_range, recv_count = self._new_block(
                meta_key, _dispatch_parts(use_fp8, local, rows, hidden, num_ranks)[1], (0, 1, 2), device)
        return _new_tuple(DispatchOutputs, (recv_x, scales, src_info, layout_range, recv_count))

    def combine_output(self, num_tokens: int, hidden: int, device) -> torch.Tensor:
        """The `[num_tokens, hidden]` bf16 result of one combine (every row is written by the call).

        Arguments:
            num_tokens: `N`, tokens of this rank.
            hidden: `H`.
            device: torch device of the output (the host's, as for `dispatch_outputs`).

        Returns:
            out: `[N, H]` torch.bfloat16, contents unspecified until the combine writes it.
        """
        key = ("combine", num_tokens, hidden, device, _inference_mode())
        with self._lock:
            slot = self._free_slot(key)
        if slot is not None:
            return _detach(slot.views[0])
        return self._new_block(key, ((torch.bfloat16, (num_tokens, hidden)),), (), device)[0]

    def pooled_bytes(self) -> int:
        """Bytes held by the pool (busy and free blocks).

        Returns:
            nbytes: int, summed over the blocks the pool keeps (not blocks only callers hold).
        """
        with self._lock:
            return sum(slot.nbytes for slots in self._slots.values() for slot in slots)

    def clear(self) -> None:
        """Drop the pool's references (outputs still held by callers stay valid)."""
        with self._lock:
            self._slots.clear()
