"""DeepEP V1's low-latency API over our `Buffer`: `import mooncake_ep_switch.deep_ep as deep_ep`.

A thin layer: it validates DeepEP's arguments (errors name the argument, the expectation and what
came; nothing changes before one is raised), keeps DeepEP's per-Buffer state (a deadline and the
shrink-mode mask, as a Buffer-owned `active_ranks`), and lets `mooncake_ep_switch.Buffer` move the
bytes. Only the low-latency mode exists; DeepEP's normal-mode calls raise NotImplementedError.
"""
from typing import Callable, Optional, Tuple, Union

import torch

from mooncake_ep_switch.buffer.buffer import Buffer as _Buffer
from mooncake_ep_switch.buffer.handle import EventOverlap
from mooncake_ep_switch.buffer.validation import check_tensor
from mooncake_ep_switch.checks import check_flag, check_int

topk_idx_t = torch.int64  # DeepEP's `deep_ep.topk_idx_t`: the dtype of topk_idx
DEFAULT_TIMEOUT_US = 10_000_000  # DeepEP's kernels give up after ~10-100 s; ours, per call and source
__all__ = ["Buffer", "EventOverlap", "topk_idx_t", "DEFAULT_TIMEOUT_US"]

_INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # DeepEP's kFinfoAmaxInvE4M3, a float32 constant


def _pow2_fp8(rows: torch.Tensor, use_ue8m0: bool):
    """DeepEP's `round_scale` cast of bf16 rows `[n, H]`: per 128 channels amax = max(1e-4, |x|),
    scale_inv = 2^ceil(log2(amax * (1/448))), data = e4m3fn(x / scale_inv) (saturating). Returns
    (data `[n, H]`, scales `[n, H/128]` float32, or with `use_ue8m0` `[n, H/512]` int32 holding the
    exponent bytes `e + 127`, four per int32, channel group 4p+j in byte j, little-endian)."""
    n, hidden = rows.shape
    values = rows.float().view(n, hidden // 128, 128)
    bits = (values.abs().amax(-1).clamp_min(1e-4) * _INV_448.to(rows.device)).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # ceil(log2)
    scale = ((127 - exponent) << 23).view(torch.float32)  # 2^-e, exact
    data = (values * scale.unsqueeze(-1)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(n, hidden)
    if use_ue8m0:
        return data, (exponent + 127).to(torch.uint8).contiguous().view(torch.int32)
    return data, ((exponent + 127) << 23).view(torch.float32)


class Buffer:
    """DeepEP V1's `deep_ep.Buffer` in low-latency mode, over `mooncake_ep_switch.Buffer`.

    Arguments:
        group: the torch.distributed process group of the EP ranks.
        num_nvl_bytes: accepted and unused (low-latency mode sizes one region from `num_rdma_bytes`).
        num_rdma_bytes: bytes of the EP region per rank; pass `get_low_latency_rdma_size_hint(...)`
            (0: the `"collective"` transport only).
        low_latency_mode: must be True (normal mode is not implemented: NotImplementedError).
        num_qps_per_rank: an int > 0, accepted and unused.
        allow_nvlink_for_low_latency_mode: False reaches same-host peers through the inter-host path
            (our `disable_p2p=True`, as `NVSHMEM_DISABLE_P2P=1`).
        allow_mnnvl, use_fabric: bools, accepted and unused.
        explicitly_destroy: `destroy()` is allowed only if set (DeepEP's rule); otherwise the memory is
            released when the Buffer is garbage collected.
        enable_shrink: keep a mask of failed ranks: a rank that misses the deadline in dispatch, combine
            or `clean_low_latency_buffer` is masked (not sent to, not waited for) until unmasked with
            the `low_latency_*_mask_buffer` calls. Without it a missed deadline raises RuntimeError
            (DeepEP traps).
        comm: an mpi4py communicator: not supported (NotImplementedError), pass `group`.
        transport: ours (keyword): `"auto"`, `"host"`, `"cuda"`, `"shm"`, `"mooncake"`, `"collective"`.
        timeout_us: ours (keyword): the deadline per call and source in microseconds, an int > 0
            (never forever); settable later as `buffer.timeout_us`.
        store: ours (keyword): the group's store (see `mooncake_ep_switch.Buffer`).
    """

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None,
                 *, transport: str = "auto", timeout_us: int = DEFAULT_TIMEOUT_US, store=None) -> None:
        num_nvl_bytes = check_int("num_nvl_bytes", num_nvl_bytes, 0)
        num_rdma_bytes = check_int("num_rdma_bytes", num_rdma_bytes, 0)
        check_int("num_qps_per_rank", num_qps_per_rank, 1)
        low_latency_mode = check_flag("low_latency_mode", low_latency_mode)
        check_flag("allow_mnnvl", allow_mnnvl)
        allow_nvlink_for_low_latency_mode = check_flag("allow_nvlink_for_low_latency_mode",
                                                       allow_nvlink_for_low_latency_mode)
        check_flag("use_fabric", use_fabric)
        explicitly_destroy = check_flag("explicitly_destroy", explicitly_destroy)
        enable_shrink = check_flag("enable_shrink", enable_shrink)
        if group is None:
            raise (ValueError("group: expected a process group, got None (and no comm)") if comm is None else
                   NotImplementedError("comm: expected None (mpi4py communicators are not supported), got a "
                                       f"{type(comm).__name__}; pass group= instead"))
        if not low_latency_mode:
            raise NotImplementedError("low_latency_mode: expected True, got False (DeepEP's normal-mode intranode/"
                                      "internode dispatch is not implemented here; only the low-latency API is)")
        self._timeout_us = check_int("timeout_us", timeout_us, 1)
        self.buffer = _Buffer(group, num_rdma_bytes, disable_p2p=not allow_nvlink_for_low_latency_mode,
                              transport=transport, store=store)
        self.rank, self.group, self.group_size = self.buffer.rank, self.buffer.group, self.buffer.num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy, self.enable_shrink = True, explicitly_destroy, enable_shrink
        self.transport = self.buffer.transport
        # Shrink mode: the Buffer-owned active_ranks (1 = active) is DeepEP's mask buffer (1 = masked), inverted.
        self._mask = self.buffer.active_mask() if enable_shrink else None
        self._unwaited = None  # the event of the latest async_finish dispatch (the next call completes it)

    @property
    def timeout_us(self) -> int:
        """The deadline per call and source rank in microseconds (an int > 0)."""
        return self._timeout_us

    @timeout_us.setter
    def timeout_us(self, value) -> None:
        self._timeout_us = check_int("timeout_us", value, 1)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of EP region per rank for low-latency calls of this shape (BF16 and FP8).

        Arguments:
            num_max_dispatch_tokens_per_rank: the most tokens a rank dispatches, the same on all ranks.
            hidden: the hidden size; num_ranks: EP ranks; num_experts: experts in all.

        Returns:
            size: the `num_rdma_bytes` to pass to `Buffer`.
        """
        return _Buffer.get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def capture() -> EventOverlap:
        """An event that is complete already (calls here finish in host order).

        Returns:
            event: `EventOverlap`.
        """
        return EventOverlap()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count for normal-mode kernels: recorded in `Buffer.num_sms`, unused here.

        Arguments:
            new_num_sms: an even int >= 2.
        """
        if check_int("new_num_sms", new_num_sms, 2) % 2:
            raise ValueError(f"new_num_sms: expected an even int >= 2, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    def destroy(self) -> None:
        """Release the region, mappings and threads (only with `explicitly_destroy=True`, as DeepEP).

        Raises:
            RuntimeError: the Buffer was built with `explicitly_destroy=False`.
        """
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: expected a Buffer built with explicitly_destroy=True, got one built "
                               "without it (its memory is released when it is garbage collected)")
        self.buffer.destroy()

    # ------------------------------------------------------------------ masks and completion
    def _call_mask(self) -> torch.Tensor:
        return self._mask if self.enable_shrink else self.buffer.active_mask()

    def _completion(self, mask: torch.Tensor, what: str, then=None):
        """The step that runs after a call's receive phase: `then()`, and without shrink mode a check that
        no rank missed the deadline (DeepEP traps; we raise). Runs once."""
        done = [False]

        def finish() -> None:
            if done[0]:
                return
            done[0] = True
            if then is not None:
                then()
            if not self.enable_shrink and not (self.buffer.device is not None
                                               and torch.cuda.is_current_stream_capturing()):
                values = mask.tolist()  # one read (on a CUDA mask, one synchronisation)
                missed = [r for r in self.buffer.members if not values[r]]
                if missed:
                    raise RuntimeError(f"{what}: ranks {missed} missed the deadline of {self._timeout_us} us (DeepEP "
                                       "traps here; with enable_shrink=True they are masked instead)")
        return finish

    def _complete(self, event, hook, finish, async_finish: bool, return_recv_hook: bool, extra):
        """DeepEP's (event, hook) pair around our call's, with `finish` after the receive phase. A hook's receive
        launches on its call's stream, whichever stream is current when it runs (as DeepEP's), so `finish` (its
        reads of the counts and mask, the FP8 casts) runs on that stream too."""
        if return_recv_hook:
            device = self.buffer.device
            stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None

            def recv_hook() -> None:
                if stream is None:
                    hook()
                    finish()
                    return
                with torch.cuda.stream(stream):
                    hook()
                    finish()
            return EventOverlap(None, extra), recv_hook
        if async_finish:
            def wait() -> None:
                event.current_stream_wait()
                finish()
            return EventOverlap(wait, extra), None
        finish()
        return event, None

    def _settle(self) -> None:
        """Complete the latest `async_finish` dispatch if its event was not waited (its casts and stats
        happen then; DeepEP's stream order completes it before the next call on the stream)."""
        pending, self._unwaited = self._unwaited, None
        if pending is not None and not pending.is_complete():
            pending.current_stream_wait()

    def _check_shrink(self, what: str) -> torch.Tensor:
        if not self.enable_shrink:
            raise RuntimeError(f"{what}: expected a Buffer built with enable_shrink=True (shrink mode must be "
                               "enabled), got one without it")
        return self._mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (`mask=True`: neither sent to nor waited for) or unmask a rank in shrink mode.

        Arguments:
            rank_to_mask: the rank, an int in [0, num_ranks).
            mask: True masks, False unmasks.

        Raises:
            RuntimeError: not in shrink mode. TypeError, ValueError: a bad argument.
        """
        state = self._check_shrink("low_latency_update_mask_buffer")
        rank = check_int("rank_to_mask", rank_to_mask, 0, self.group_size - 1)
        state[rank] = 0 if check_flag("mask", mask) else 1

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into `mask_status`: `[num_ranks]` torch.int32, 1 = masked, 0 = unmasked.

        Raises:
            RuntimeError: not in shrink mode. TypeError, ValueError: a bad `mask_status`.
        """
        state = self._check_shrink("low_latency_query_mask_buffer")
        on_device = isinstance(mask_status, torch.Tensor) and mask_status.device.type != "cpu"
        check_tensor("mask_status", mask_status, torch.int32, 1, (self.group_size,),
                     mask_status.device if on_device else None)  # any device, as DeepEP's (CUDA) one
        mask_status.copy_(1 - state)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (every member of the current membership view) in shrink mode.

        Raises:
            RuntimeError: not in shrink mode.
        """
        self._check_shrink("low_latency_clean_mask_buffer").copy_(self.buffer.active_mask())

    # ------------------------------------------------------------------ low-latency calls
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's buffer cleaning, here a barrier of the unmasked ranks (nothing needs zeroing).

        Our signals are sequence-tagged, so no buffer is cleaned; the barrier (a dispatch of no tokens)
        keeps DeepEP's collective contract: every rank calls it. In shrink mode a rank that misses the
        deadline is masked; otherwise RuntimeError.

        Arguments:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: the shape of the low-latency calls.
        """
        if check_int("hidden", hidden, 1) % 128:
            raise ValueError(f"hidden: expected a positive multiple of 128, got {hidden}")
        self._settle()
        mask = self._call_mask()
        device = self.buffer.device or torch.device("cpu")
        x = torch.empty((0, hidden), dtype=torch.bfloat16, device=device)
        self.buffer.dispatch(x, torch.empty((0, 1), dtype=torch.int64, device=device), mask,
                             num_max_dispatch_tokens_per_rank, num_experts, self._timeout_us, use_fp8=False)
        self._completion(mask, "clean_low_latency_buffer")()

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor, tuple,
                                        EventOverlap, Optional[Callable[[], None]]]:
        """Send every token to the ranks owning its top-k experts (DeepEP's `low_latency_dispatch`).

        Arguments:
            x: `[num_tokens, hidden]` torch.bfloat16, `num_tokens <= num_max_dispatch_tokens_per_rank`.
            topk_idx: `[num_tokens, num_topk]` `topk_idx_t` (torch.int64), -1 = no expert.
            num_max_dispatch_tokens_per_rank: `T`, the same on all ranks; num_experts: `E`.
            cumulative_local_expert_recv_stats: optional `[E / num_ranks]` torch.int32; each dispatch
                adds the tokens every local expert received (after the receive phase).
            dispatch_wait_recv_cost_stats: optional `[num_ranks]` torch.int64, checked and not written.
            use_fp8: FP8 e4m3fn rows with per-128-channel scales.
            round_scale: FP8 scales are powers of two (the rows are cast with them, DeepEP's numerics).
            use_ue8m0: scales as UE8M0 exponent bytes packed four per int32 (needs `round_scale`).
            async_finish: complete when the event is waited; return_recv_hook: complete in `hook()`.

        Returns:
            recv_x: `[E_local, num_ranks * T, hidden]` torch.bfloat16, or with FP8 a tuple of
                `[E_local, num_ranks * T, hidden]` torch.float8_e4m3fn and scales `[E_local,
                num_ranks * T, hidden // 128]` torch.float32 (`use_ue8m0`: `[..., hidden // 512]`
                torch.int32), token axis contiguous. Rows by source rank, then source token.
            recv_count: `[E_local]` torch.int32, valid rows per local expert.
            handle: for `low_latency_combine`, a 5-tuple (src_info, layout_range, T, hidden, E).
            event: `EventOverlap`; hook: the receive phase when `return_recv_hook`, else None.
        """
        use_fp8, round_scale, use_ue8m0 = (check_flag("use_fp8", use_fp8), check_flag("round_scale", round_scale),
                                           check_flag("use_ue8m0", use_ue8m0))
        async_finish = check_flag("async_finish", async_finish)
        return_recv_hook = check_flag("return_recv_hook", return_recv_hook)
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0: expected True only with round_scale=True (UE8M0 scales are powers of "
                             "two), got use_ue8m0=True with round_scale=False")
        experts = check_int("num_experts", num_experts, 1)
        if experts % self.group_size:
            raise ValueError(f"num_experts: expected a multiple of num_ranks ({self.group_size}), got {experts}")
        where = self.buffer.device
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32, 1,
                         (experts // self.group_size,), where)
        if dispatch_wait_recv_cost_stats is not None:
            check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64, 1,
                         (self.group_size,), where)
        pow2 = use_fp8 and round_scale
        if pow2 and use_ue8m0 and isinstance(x, torch.Tensor) and x.dim() == 2 and x.size(1) % 512:
            raise ValueError(f"x: expected a hidden size that is a multiple of 512 with use_ue8m0=True, got "
                             f"{x.size(1)}")
        self._settle()
        mask = self._call_mask()
        recv, count, handle, event, hook = self.buffer.dispatch(
            x, topk_idx, mask, num_max_dispatch_tokens_per_rank, num_experts, self._timeout_us,
            use_fp8=use_fp8 and not round_scale, async_finish=async_finish, return_recv_hook=return_recv_hook)
        packed = recv
        if pow2:  # the rows travel in bf16; the receiver casts them with power-of-two scales
            local, rows, hidden = recv.shape
            groups = hidden // 512 if use_ue8m0 else hidden // 128
            data = torch.empty((local, rows, hidden), dtype=torch.float8_e4m3fn, device=recv.device)
            scales = torch.zeros((local, groups, rows), dtype=torch.int32 if use_ue8m0 else torch.float32,
                                 device=recv.device)
            packed = (data, scales.transpose(1, 2))

        def then() -> None:
            if pow2:
                for expert, valid in enumerate(count.tolist()):
                    data[expert, :valid], block = _pow2_fp8(recv[expert, :valid], use_ue8m0)
                    scales[expert, :, :valid] = block.t()
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(count)

        event, hook = self._complete(event, hook, self._completion(mask, "low_latency_dispatch", then),
                                     async_finish, return_recv_hook, (x, topk_idx, packed, count, handle))
        self._unwaited = event if async_finish else None
        return packed, count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Return expert outputs to their tokens' ranks, reduced with the weights (DeepEP's `low_latency_combine`).

        `out[t] = bf16(sum_k topk_weights[t, k] * y(topk_idx[t, k], t))` in float32, skipping -1 and
        masked owners (no renormalisation).

        Arguments:
            x: `[E_local, num_ranks * T, hidden]` torch.bfloat16 expert outputs in the dispatch layout
                (ignored with `zero_copy`: they are in `get_next_low_latency_combine_buffer(handle)`).
            topk_idx: `[num_tokens, num_topk]` torch.int64, the dispatch's; topk_weights: the same shape,
                torch.float32; handle: the dispatch's.
            use_logfmt: accepted and ignored (the rows travel in bf16, exactly); not with `zero_copy`.
            async_finish, return_recv_hook: as in `low_latency_dispatch`.
            out: optional `[num_tokens, hidden]` torch.bfloat16 output.
            combine_wait_recv_cost_stats: optional `[num_ranks]` torch.int64, checked and not written.

        Returns:
            combined_x: `[num_tokens, hidden]` torch.bfloat16; event: `EventOverlap`; hook: as in dispatch.
        """
        use_logfmt, zero_copy = check_flag("use_logfmt", use_logfmt), check_flag("zero_copy", zero_copy)
        async_finish = check_flag("async_finish", async_finish)
        return_recv_hook = check_flag("return_recv_hook", return_recv_hook)
        if use_logfmt and zero_copy:
            raise ValueError("use_logfmt, zero_copy: expected at most one of them True, got both (as in DeepEP)")
        if combine_wait_recv_cost_stats is not None:
            check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, 1,
                         (self.group_size,), self.buffer.device)
        self._settle()
        mask = self._call_mask()
        combined, event, hook = self.buffer.combine(x, topk_idx, topk_weights, mask, self._timeout_us, handle,
                                                    zero_copy=zero_copy, async_finish=async_finish,
                                                    return_recv_hook=return_recv_hook, out=out)
        event, hook = self._complete(event, hook, self._completion(mask, "low_latency_combine"), async_finish,
                                     return_recv_hook, (x, topk_idx, topk_weights, combined))
        return combined, event, hook

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The buffer to write expert outputs into for `low_latency_combine(..., zero_copy=True)`.

        Arguments:
            handle: the dispatch's handle.

        Returns:
            buffer: `[E_local, num_ranks * T, hidden]` torch.bfloat16.
        """
        return self.buffer.get_next_combine_buffer(handle)


def _normal_mode(name: str):
    def call(self, *args, **kwargs):
        raise NotImplementedError(f"{name}: DeepEP's normal-mode (intranode/internode) API is not implemented; "
                                  "use low_latency_dispatch/low_latency_combine")
    call.__name__, call.__doc__ = name, f"DeepEP's normal-mode `{name}`: not implemented (NotImplementedError)."
    return call


for _name in ("get_dispatch_layout", "dispatch", "combine", "internode_dispatch", "internode_combine"):
    setattr(Buffer, _name, _normal_mode(_name))
