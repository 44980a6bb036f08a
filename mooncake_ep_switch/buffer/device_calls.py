"""`Buffer.dispatch()` and `Buffer.combine()` on CUDA tensors (the `"cuda"` transport), on the Buffer's `BufferCore`.

The same contract as the host path (core.py), with DeepEP's stream semantics and no host wait:

* synchronous call: send and receive kernels are launched on the current stream; the results are
  ready in stream order (the event is complete);
* `return_recv_hook=True`: the send kernels are launched now; `hook()` launches the receive
  kernels on the same stream, whichever is current when it runs (as DeepEP's and Mooncake EP's hooks);
* `async_finish=True`: everything runs on the transport's communication stream, which first waits
  for the current stream; `event.current_stream_wait()` makes the current stream wait for it.

Validation of shapes, dtypes and devices is on the host and never synchronises. Values (expert
ids, mask entries, combine's top-k against its dispatch's) are checked on the device with one
synchronisation per eager call when `Settings.cuda_check_values` is on (the default), and never
during CUDA graph capture. Outputs are fresh tensors from torch's caching allocator (during a capture, the
graph's private pool), never blocks of the Buffer's output pool: the allocator reuses device memory in stream
order and honours `record_stream`, which reference counts cannot see (`output_pool.fresh_dispatch_outputs`).

Rules that follow (as in DeepEP): an `async_finish` call captured in a graph forks the
communication stream, so its `event.current_stream_wait()` must run inside the capture too; a hook
runs on the stream of its dispatch; a graph must be destroyed before its Buffer (it holds the
Buffer's device addresses).
"""
from typing import Optional

import torch

from mooncake_ep_switch.buffer import validation
from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall
from mooncake_ep_switch.buffer.core import BufferCore
from mooncake_ep_switch.buffer.handle import (DispatchHandle, DispatchPlan, EventOverlap, ReceiveReceipt, StreamEvent,
                                               check_combinable, check_half_free, check_same_routing,
                                               complete_receive)
from mooncake_ep_switch.buffer.layout import LayoutHeld
from mooncake_ep_switch.buffer.lifetime import guarded, once, with_receipt
from mooncake_ep_switch.buffer.output_pool import fresh_dispatch_outputs


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _check_aligned(name: str, tensor: Optional[torch.Tensor]) -> None:
    """The kernels move rows 16 bytes at a time: a view at an odd offset is refused, never copied."""
    if tensor is not None and tensor.data_ptr() % 16:
        validation.fail(name, "a tensor whose data starts at a 16-byte aligned address (the kernels move rows "
                         "16 bytes at a time; a fresh tensor or .clone() is)", f"address {tensor.data_ptr():#x}")


def _check_values(core: BufferCore, topk_idx: torch.Tensor, num_experts: int, active_ranks: torch.Tensor, capturing: bool) -> None:
    if core.settings.cuda_check_values and not capturing:
        problem = core.transport.value_problem(topk_idx, num_experts, active_ranks)
        if problem:
            raise ValueError(problem)


def _observed(core: BufferCore, receive, timeout_us: int, what: str, call: int):
    """`receive`, then the masks the device flagged so far counted, logged and emitted (`PeerMasked`).

    The transport's `failed_sources` reads the pinned control block without a synchronisation: a
    flag the device raises later (a kernel still running on a GPU) is seen by the next call's read or
    by `update_ep_member()`; on the emulated device, whose launches complete at once, by this call's.
    """

    def run() -> None:
        receive()
        if len(core.transport.failed_sources) != core.stats.seen:  # a peer was masked: count, log, emit
            core.stats.observe(core, timeout_us, what, call)

    return run


def _run(core: BufferCore, launch, async_finish: bool, return_recv_hook: bool, keep_alive, observe=None):
    """Launch `launch()` (which returns (transport_plan, receive)) in the call's mode; returns
    (transport_plan, event, hook, receipt). `observe` (timeout_us, what, call) wraps the receive phase
    in `_observed`."""
    impl = core.transport
    if not (async_finish or return_recv_hook):  # the common case, without the wrappers below
        transport_plan, receive = launch()
        receive()
        if observe is not None and len(impl.failed_sources) != core.stats.seen:  # as `_observed`
            core.stats.observe(core, *observe)
        return transport_plan, EventOverlap(None, keep_alive), None, None
    if observe is not None:
        inner = launch

        def launch():
            transport_plan, receive = inner()
            return transport_plan, _observed(core, receive, *observe)
    if async_finish:
        current = torch.cuda.current_stream(impl.device)
        comm = impl.comm_stream()
        comm.wait_stream(current)
        with torch.cuda.stream(comm):
            transport_plan, receive = launch()
            receive()
        for tensor in keep_alive:
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(comm)  # the allocator keeps them until the communication stream is done
        done = torch.cuda.Event()
        done.record(comm)
        event = StreamEvent(done, impl.device, keep_alive)
        receipt = ReceiveReceipt()
        receipt.wait = event.current_stream_wait  # a combine's stream waits for it, whichever stream that is
        return transport_plan, event, None, receipt
    transport_plan, receive = launch()  # return_recv_hook
    hook, receipt = with_receipt(once(guarded(core.life, receive)))
    return transport_plan, EventOverlap(hook, keep_alive), hook, receipt


def dispatch(core: BufferCore, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts, timeout_us,
             use_fp8: Optional[bool], async_finish: bool, return_recv_hook: bool):
    """`Buffer.dispatch` on the `"cuda"` transport (see its docstring for arguments and returns)."""
    impl = core.transport
    if async_finish and return_recv_hook:
        raise ValueError("async_finish, return_recv_hook: expected at most one of them True, got both")
    # Hot path: a shape validated before and well-formed tensors on this device (CallSpecs.match_dispatch);
    # anything else takes the full validation, whose error names the argument.
    spec = core.specs.match_dispatch(x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts,
                                     timeout_us, True if use_fp8 is None else use_fp8, impl.device.index, False)
    if spec is None:
        spec, timeout_us = core.specs.validate_dispatch(x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                                                        num_experts, timeout_us, use_fp8, impl.device)
    use_fp8 = spec.use_fp8
    _check_aligned("x", x)
    capturing = _capturing()
    _check_values(core, topk_idx, spec.experts, active_ranks, capturing)
    if len(core.members) < core.num_ranks and not capturing:
        core.check_members(active_ranks)
    outputs = fresh_dispatch_outputs(use_fp8, spec.local, spec.rows, spec.hidden, core.num_ranks, impl.device)
    life = core.life
    life.enter()
    try:
        core.call += 1
        call = DispatchCall(x, topk_idx, active_ranks, spec.tokens, spec.experts, timeout_us, use_fp8, core.call,
                            core.epoch)
        keep_alive = (x, topk_idx, active_ranks, outputs.recv_x, outputs.src_info, outputs.layout_range,
                      outputs.recv_count) + ((outputs.recv_scales,) if use_fp8 else ())
        try:
            transport_plan, event, hook, receipt = _run(core, lambda: impl.dispatch(call, outputs), async_finish,
                                                 return_recv_hook, keep_alive, (timeout_us, "dispatch", call.call))
        except LayoutHeld:
            core.call -= 1  # refused before anything was launched: the call was not made
            raise
        # combine() compares its topk_idx with this copy when values are checked (one synchronisation).
        routing = topk_idx.clone() if core.settings.cuda_check_values else None
        plan = DispatchPlan(core.call, x.size(0), topk_idx.size(1), use_fp8, core.epoch, transport_plan, spec, receipt,
                            routing, outputs.src_info.data_ptr())
        core.record_plan(plan)
        handle = DispatchHandle(outputs.src_info, outputs.layout_range, spec.tokens, spec.hidden, spec.experts,
                                plan=plan)
    finally:
        life.leave()
    packed = (outputs.recv_x, outputs.recv_scales.transpose(1, 2)) if use_fp8 else outputs.recv_x
    return packed, outputs.recv_count, handle, event, hook


def combine(core: BufferCore, x, topk_idx, topk_weights, active_ranks, timeout_us, handle, async_finish: bool,
            return_recv_hook: bool, out: Optional[torch.Tensor], bias=None):
    """`Buffer.combine` on the `"cuda"` transport (see its docstring for arguments and returns; a zero-copy
    combine arrives here with `x` already the handle's combine buffer). The reduction kernel reads `bias`'s
    rows where they are (device memory)."""
    impl = core.transport
    if async_finish and return_recv_hook:
        raise ValueError("async_finish, return_recv_hook: expected at most one of them True, got both")
    # Hot path: a handle of this Buffer and well-formed tensors of its shape on this device (CallSpecs.match_combine).
    spec = core.specs.match_combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle, out, DispatchHandle,
                                    impl.device.index, False)
    if spec is not None:
        src_info, layout_range, tokens, hidden, experts = handle[0], handle[1], spec.tokens, spec.hidden, spec.experts
    else:
        fields, timeout_us = validation.check_combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle, out,
                                                      core.num_ranks, impl.device)
        src_info, layout_range, tokens, hidden, experts = fields
    bias = validation.check_combine_bias(bias, topk_idx.size(0), hidden, impl.device)
    _check_aligned("x", x)
    _check_aligned("out", out)
    plan = handle.plan if spec is not None else core.plan_of(handle)  # the hot path matched its plan and owner
    check_combinable(plan)
    check_half_free(plan, core.call)
    if spec is None and tuple(topk_idx.shape) != (plan.num_tokens, plan.top_k):  # the hot path compared them
        validation.fail("topk_idx", f"the dispatch's shape [{plan.num_tokens}, {plan.top_k}]", list(topk_idx.shape))
    capturing = _capturing()
    _check_values(core, topk_idx, experts, active_ranks, capturing)
    if core.settings.cuda_check_values and not capturing:
        check_same_routing(plan, topk_idx)
    complete_receive(plan)  # async_finish: this stream waits for the dispatch's communication stream
    if len(core.members) < core.num_ranks and not capturing:
        core.check_members(active_ranks)
    if out is None:
        out = torch.empty((topk_idx.size(0), hidden), dtype=torch.bfloat16, device=impl.device)  # as the dispatch's
    call = CombineCall(x, topk_idx, topk_weights, active_ranks, timeout_us, src_info, layout_range, tokens, hidden,
                       experts, plan.call, plan.transport_plan, out, bias)
    life = core.life
    life.enter()
    try:
        plan.mark_combined()
        keep_alive = (x, topk_idx, topk_weights, active_ranks, out, plan.transport_plan, src_info, layout_range) + bias
        _, event, hook, _ = _run(core, lambda: (None, impl.combine(call)), async_finish, return_recv_hook,
                                 keep_alive, (timeout_us, "combine", call.call))
    finally:
        life.leave()
    return out, event, hook
