"""Typed handles and completion events returned by dispatch() and combine()."""
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch


class _DispatchHandleFields(NamedTuple):
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


@dataclass(frozen=True, slots=True, eq=False)
class DispatchPlan:
    """Transport-private record of one dispatch call, kept on its handle.

    Fields:
        call: the call number (signal tag); the region half is `call % 2`.
        num_tokens: `N`, rows of the dispatched `x`.
        top_k: `K`, columns of the dispatched `topk_idx`.
        use_fp8: whether the dispatch carried FP8 rows.
        epoch: membership epoch the call ran in.
        transport_plan: transport-specific state (the collective fallback's exchange plan), or None.
        spec: the Buffer's validated record of the call shape (lets combine() skip re-checking the
            handle's fields), or None.
        receipt: `ReceiveReceipt` of a dispatch whose receive phase runs later (hook or async
            mode), or None when it ran inside the call.
        topk_idx: `[N, K]` torch.int64 copy of the dispatch's top-k (combine must be given the same
            values: rows exist only for the pairs that were dispatched), or None.
        src_ptr: address of the handle's src_info (how a plain 5-tuple handle is matched to its
            dispatch), or 0.
        combined: True once a combine of this dispatch has started (every later combine of it is
            a call of its own, see `Buffer.combine`); set only by `mark_combined()`, the plan's one
            change after it is made.
    """

    call: int
    num_tokens: int
    top_k: int
    use_fp8: bool
    epoch: int
    transport_plan: Any
    spec: Optional[Any] = None  # a call_spec.CallSpec
    receipt: Optional["ReceiveReceipt"] = None
    topk_idx: Optional[torch.Tensor] = None
    src_ptr: int = 0
    combined: bool = False

    def mark_combined(self) -> None:
        """A combine of this dispatch has started."""
        object.__setattr__(self, "combined", True)


def check_combinable(plan: "DispatchPlan") -> None:
    """Device transports combine a handle once: ValueError naming `handle` if this dispatch was combined
    already (the host transports combine it again, `check_combinable_again`)."""
    if plan.combined:
        raise ValueError(f"handle: expected a dispatch not combined yet, got the handle of call {plan.call}, "
                         "which was combined already (the cuda transport combines a handle once; the host "
                         "transports combine it again until the next dispatch)")


def check_half_free(plan: "DispatchPlan", latest_call: int) -> None:
    """A dispatch's first combine takes the dispatch's call number and region half, so it must come before
    any call two numbers later reuses that half: a dispatch after next, or a handle combined again (which
    takes a call number of its own). ValueError naming `handle` otherwise, before anything moves (peers
    may still be reading the later call's rows from that half)."""
    if latest_call - plan.call >= 2:
        raise ValueError(f"handle: expected the handle of one of the last two calls ({latest_call - 1} or "
                         f"{latest_call}), got the handle of call {plan.call}, whose region half call "
                         f"{plan.call + 2} reused (combine a dispatch before the call after next: a dispatch, or "
                         "a combine of a handle combined already)")


def check_combinable_again(plan: "DispatchPlan", latest: Optional["DispatchPlan"]) -> None:
    """A handle combined already is combined again only while it is the latest dispatch: a later dispatch
    reused or is about to reuse the region half its next combine needs. ValueError naming `handle`."""
    if plan is not latest:
        later = "a later dispatch" if latest is None else f"dispatch call {latest.call}"
        raise ValueError(f"handle: expected the latest dispatch's handle to combine again, got the handle of call "
                         f"{plan.call}, combined already and followed by {later} (a handle is combined again only "
                         "before the next dispatch: the next combine needs the region half that dispatch uses)")


def check_same_routing(plan: "DispatchPlan", topk_idx: torch.Tensor) -> None:
    """Combine takes its dispatch's `topk_idx` (rows exist only for the dispatched pairs): ValueError
    naming `topk_idx` otherwise. Reads the values (on a CUDA tensor, a host synchronisation)."""
    if plan.topk_idx is not None and not torch.equal(topk_idx, plan.topk_idx):
        differ = int((topk_idx != plan.topk_idx).sum())
        raise ValueError(f"topk_idx: expected the topk_idx given to the matching dispatch (call {plan.call}), "
                         f"got one that differs in {differ} entries (rows exist only for dispatched pairs)")


def complete_receive(plan: "DispatchPlan") -> None:
    """Before a combine, the dispatch's deferred receive phase must have run: an `async_finish` one is
    completed here (its event waited); a `return_recv_hook` one whose hook never ran is refused."""
    receipt = plan.receipt
    if receipt is not None and not receipt.done:
        if receipt.wait is None:
            raise ValueError("handle: expected a dispatch whose receive phase has run, got one made with "
                             "return_recv_hook=True whose hook() has not been called")
        receipt.wait()


class ReceiveReceipt:
    """Whether a dispatch's deferred receive phase has run (combine needs its layout first).

    Fields:
        done: set once the receive phase has finished (or failed: its error is the hook's to raise).
        wait: completes the receive phase for an `async_finish` dispatch (the event's wait), or None
            for a `return_recv_hook` dispatch, whose caller must run the hook itself.
    """

    __slots__ = ("done", "wait")

    def __init__(self):
        self.done = False
        self.wait = None


class DispatchHandle(_DispatchHandleFields):
    """Result handle of `Buffer.dispatch()`; unpacks as Mooncake's 5-tuple.

    Fields (tuple order):
        src_info: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank]` torch.int32,
            the source token index of every received row.
        layout_range: `[num_local_experts, num_ranks]` torch.int64, `(begin << 32) | count` of
            the rows each source rank contributed to each local expert.
        num_max_dispatch_tokens_per_rank: `T` of the call.
        hidden: hidden size of the call.
        num_experts: global number of experts of the call.

    The attribute `plan` (a `DispatchPlan`, not part of the tuple) carries the transport's record
    of the call. A plain 5-tuple built by the caller is accepted by `combine()` too when it carries
    the src_info tensor of one of the Buffer's last two dispatches (it then refers to that one).
    A handle may be combined again (DeepEP's tests do: a plain combine, then a zero-copy one) until
    the next dispatch; on the cuda transport it is combined once.
    """

    def __new__(cls, src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, plan=None):
        self = tuple.__new__(cls, (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts))
        self.__dict__["plan"] = plan
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"DispatchHandle is immutable (tried to set {name!r})")


class EventOverlap:
    """Completion of an operation, DeepEP's `EventOverlap` on a CPU runtime.

    `current_stream_wait()` completes the operation it stands for (runs or joins its receive
    phase) and is safe to call on every event, including those of synchronous calls, and more
    than once. It may also be used as a context manager: the body runs, then the wait happens.

    Arguments:
        finish: callable completing the operation, or None if it is already complete.
        extra_tensors: tensors whose lifetime must cover the operation (kept referenced).
    """

    def __init__(self, finish: Optional[Callable[[], None]] = None, extra_tensors=None):
        self._finish = finish
        self._lock = None if finish is None else threading.Lock()  # a complete event needs none
        self._error: Optional[BaseException] = None
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Block until the operation is complete, raising any error it ended with.

        Returns:
            None.
        """
        if self._lock is None:
            return
        with self._lock:
            finish, self._finish = self._finish, None
            if finish is not None:
                try:
                    finish()
                except BaseException as error:  # remembered so every waiter sees it
                    self._error = error
            if self._error is not None:
                raise self._error

    def is_complete(self) -> bool:
        """Whether the operation has been completed by a wait.

        Returns:
            complete: bool, True if the event was built already complete (no `finish`) or a
                `current_stream_wait()` has run the operation (also when it raised), else False.
        """
        return self._finish is None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.current_stream_wait()
        return False


class StreamEvent(EventOverlap):
    """`EventOverlap` of an `async_finish` call on the `"cuda"` transport (DeepEP's semantics).

    `current_stream_wait()` makes the stream current at that moment wait for the call's
    communication stream, every time it is called (on any stream); the host never waits.

    Arguments:
        event: the `torch.cuda.Event` recorded on the communication stream after the call.
        device: the CUDA device of the streams.
        extra_tensors: tensors whose lifetime must cover the operation (kept referenced).
    """

    def __init__(self, event, device, extra_tensors=None):
        super().__init__(None, extra_tensors)
        self.event, self.device = event, device

    def current_stream_wait(self) -> None:
        """Order the current stream after the call (no host wait).

        Returns:
            None.
        """
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def is_complete(self) -> bool:
        """Whether the device has finished the call.

        Returns:
            complete: bool, the event's `query()`.
        """
        return self.event.query()
