"""`ElasticBuffer`: DeepEP V2's elastic dispatch/combine API over this runtime's fault-tolerant Buffer."""
from typing import Optional, Tuple, Union

import torch

from mooncake_ep_switch.buffer.buffer import Buffer
from mooncake_ep_switch.buffer.handle import EventOverlap
from mooncake_ep_switch.checks import check_int, check_timeout, timeout_in_range
from mooncake_ep_switch.elastic_buffer import arguments
from mooncake_ep_switch.elastic_buffer import entry_combine as entries
from mooncake_ep_switch.elastic_buffer import inner_rows
from mooncake_ep_switch.elastic_buffer import layout as lay
from mooncake_ep_switch.elastic_buffer import rows as codec
from mooncake_ep_switch.elastic_buffer.handle import EPHandle, check_usable, new_handle

_ALIGNMENT = 2 << 20  # V2's buffer sizes are multiples of 2 MB


class ElasticBuffer:
    """DeepEP V2's `ElasticBuffer` (high-throughput dispatch/combine) that keeps serving when a rank dies.

    The calls, arguments and layouts are V2's (`deep_ep/buffers/elastic.py`): not expanded, each token
    arrives once per destination rank, rows sorted by `src_token_global_idx = src_rank * T + token`;
    expanded, one row per (token, local expert), grouped by expert and padded to `expert_alignment`.
    Beyond V2 and Mooncake's ElasticBuffer: `dispatch` and `combine` take `active_ranks` (int32
    `[num_ranks]`, caller-owned) and `timeout_us`; a rank that misses its deadline is set to 0 in the
    mask and counts as having sent nothing; inactive ranks are neither sent to nor waited for;
    `update_ep_member()` re-admits a replacement (`elastic.join`). Every call runs on an inner
    `Buffer` of the same group (shared memory, the Transfer Engine, the collective fallback, or CUDA
    IPC), so every transport and every fault rule of the Buffer applies. See docs/elastic_buffer.md.

    Attributes:
        group, rank_idx, num_ranks, num_bytes, num_max_tokens_per_rank: as in V2.
        num_scaleout_ranks, num_scaleup_ranks, scaleout_rank_idx, scaleup_rank_idx: one scale-up domain
            (`(1, num_ranks)`): combine reduces within each rank, then across ranks (V2's non-hybrid
            recipe).
        num_rdma_ranks, num_nvlink_ranks: `(1, num_ranks)`.
        runtime: the inner `Buffer`.
    """

    def __init__(self, group, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, max_num_bias: int = 2, transport: str = "auto", disable_p2p: bool = False, store=None):
        """Build the buffer (a collective call: every rank of `group` builds one).

        Arguments:
            group: the EP process group, or a replacement's ticket from `mooncake_ep_switch.elastic.join`.
            num_bytes: the inner Buffer's bytes (None: `get_buffer_size_hint` of the MoE settings).
            num_cpu_bytes: V2's Engram CPU bytes; must be 0 (Engram is not provided).
            num_max_tokens_per_rank: `T`, the default for dispatch (and the size hint's).
            hidden, num_topk, use_fp8_dispatch: the MoE settings sizing the buffer when `num_bytes` is None.
            deterministic: accepted; this runtime's layouts are always deterministic (sorted).
            allow_hybrid_mode, prefer_overlap_with_compute, sl_idx, num_allocated_qps: validated,
                no effect here (no RDMA QPs, no SMs to share).
            allow_multiple_reduction: True: an expanded combine sums each rank's entries to one bf16 partial
                first (V2's default); False: every entry goes back on its own, one reduction on the owner.
            num_cpu_timeout_secs: the default deadline of a call on host tensors (`timeout_us` overrides).
            num_gpu_timeout_secs: the default deadline of a call on CUDA tensors.
            explicitly_destroy: V2's flag; `destroy()` works either way here, and without it the
                buffer is also released when garbage-collected.
            max_num_bias: this runtime's keyword: how many bias tensors (0 to 2) a combine may add (the
                bias enters the owner's fp32 sum first, as in V2's reference). A bias is read where it is
                by the inner combine's reduction (host or device) and costs no copy of any token.
            transport: this runtime's keyword: "auto", "shm", "mooncake", "collective" or "cuda" (Buffer's).
            disable_p2p: this runtime's keyword (Mooncake's Buffer's): same-host peers over the Transfer
                Engine too, not shared memory.
            store: this runtime's keyword: the store a group without one uses (Buffer's).
        """
        for name, value in (("use_fp8_dispatch", use_fp8_dispatch), ("deterministic", deterministic),
                            ("allow_hybrid_mode", allow_hybrid_mode),
                            ("allow_multiple_reduction", allow_multiple_reduction),
                            ("prefer_overlap_with_compute", prefer_overlap_with_compute),
                            ("explicitly_destroy", explicitly_destroy)):
            arguments.check_bool(name, value)
        check_int("num_cpu_bytes", num_cpu_bytes, 0, 0)
        num_max_tokens_per_rank = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
        hidden = check_int("hidden", hidden, 0)
        num_topk = check_int("num_topk", num_topk, 0, codec.MAX_TOPK)
        check_int("sl_idx", sl_idx, 0, 15)
        num_allocated_qps = check_int("num_allocated_qps", num_allocated_qps, 0)
        self.max_num_bias = check_int("max_num_bias", max_num_bias, 0, 2)
        self.num_cpu_timeout_secs = check_int("num_cpu_timeout_secs", num_cpu_timeout_secs, 1, 10 ** 9)
        self.num_gpu_timeout_secs = check_int("num_gpu_timeout_secs", num_gpu_timeout_secs, 1, 10 ** 9)
        if num_bytes is None:
            if num_max_tokens_per_rank == 0 or hidden == 0:
                raise ValueError("num_bytes: expected a size, or num_max_tokens_per_rank and hidden to size the "
                                 f"buffer, got num_bytes=None, num_max_tokens_per_rank={num_max_tokens_per_rank}, "
                                 f"hidden={hidden}")
        else:
            num_bytes = check_int("num_bytes", num_bytes, 1)
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        if num_bytes is None:
            num_ranks = arguments.group_size(group)
            num_bytes = self._size_hint(num_ranks, num_max_tokens_per_rank, hidden, max(num_topk, 1))
        self.num_bytes = num_bytes
        self.runtime = Buffer(group, num_bytes, arguments.check_bool("disable_p2p", disable_p2p), transport=transport,
                              store=store)
        self.group = self.runtime.group
        self.rank_idx = self.runtime.rank
        self.num_ranks = self.runtime.num_ranks
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self._inner_dispatches = 0  # inner dispatches made (a handle is combined again only before the next)
        self._masks = {}  # device -> the buffer's own active_ranks when the caller passes none
        self._ones_cache = {}  # (width, device) -> the inner combine's weights of 1.0
        # (T, inner hidden) of the latest inner call (before any: the constructor's MoE settings')
        self._inner_shape = (max(num_max_tokens_per_rank, 1), codec.inner_hidden(hidden, max(num_topk, 1)))
        if Buffer.get_ep_buffer_size_hint(*self._inner_shape, self.num_ranks,
                                          codec.INNER_SLOTS * self.num_ranks) > num_bytes:
            self._inner_shape = (1, 128)  # settings larger than the buffer: the smallest shape until a call
        self._token = object()  # the owner of this buffer's handles
        self._generation = 0  # update_ep_member() calls made (a handle from before one is refused)

    # ------------------------------------------------------------------ sizes and domains
    @staticmethod
    def _size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
        inner = codec.inner_hidden(hidden, num_topk)
        size = Buffer.get_ep_buffer_size_hint(num_max_tokens_per_rank, inner, num_ranks,
                                              codec.INNER_SLOTS * num_ranks)
        return lay.align(size, _ALIGNMENT)

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes a buffer needs for calls of these settings (2 MB-aligned), without building one.

        Arguments:
            group: the EP process group (its size is read).
            num_max_tokens_per_rank: `T`; hidden: `H`; num_topk: `K` (0: sized for 1).
            use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction: accepted (the size does
                not depend on them: one inner row width serves BF16, FP8 and combine).

        Returns:
            size: int, bytes.
        """
        check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        check_int("hidden", hidden, 1)
        num_topk = check_int("num_topk", num_topk, 0, codec.MAX_TOPK)
        for name, value in (("use_fp8_dispatch", use_fp8_dispatch), ("allow_hybrid_mode", allow_hybrid_mode),
                            ("allow_multiple_reduction", allow_multiple_reduction)):
            arguments.check_bool(name, value)
        return ElasticBuffer._size_hint(arguments.group_size(group), num_max_tokens_per_rank, hidden, max(num_topk, 1))

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """`(num_scaleout_ranks, num_scaleup_ranks)`: `(1, num_ranks)`, one domain."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """`(num_rdma_ranks, num_nvlink_ranks)`: `(1, num_ranks)`."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """V2's SM estimate, kept for callers that pass it back: 1 on host ranks (the copies run on the
        calling thread), the device's SM count on CUDA ranks. The value passed back is ignored."""
        check_int("num_experts", num_experts, 1)
        check_int("num_topk", num_topk, 1, codec.MAX_TOPK)
        if self.runtime.device is not None:
            return torch.cuda.get_device_properties(self.runtime.device).multi_processor_count
        return 1

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's QP estimate (no QPs here; the value passed back is ignored)."""
        num_sms = check_int("num_sms", num_sms, 1)
        return min(num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9), self.num_allocated_qps)

    @staticmethod
    def capture() -> EventOverlap:
        """An event standing for the work issued so far (complete at once on this runtime)."""
        return EventOverlap(None)

    # ------------------------------------------------------------------ lifecycle
    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait until every active rank reached its barrier (a dispatch of no tokens: the same deadline
        and masking as any call). The three flags are V2's, validated, no effect here."""
        for name, value in (("use_comm_stream", use_comm_stream), ("with_cpu_sync", with_cpu_sync),
                            ("sequential", sequential)):
            arguments.check_bool(name, value)
        # The last call's inner shape: a region half's layout never changes under a late peer's writes.
        device, (tokens, width) = self.runtime.device, self._inner_shape
        x = torch.empty((0, width), dtype=torch.bfloat16, device=device)
        topk = torch.empty((0, 1), dtype=torch.int64, device=device)
        self._inner_dispatch(x, topk, self._mask(device), self._default_timeout(device), tokens)

    def update_ep_member(self, timeout_s: Optional[float] = None):
        """Agree on the group's members and admit a pending replacement (`Buffer.update_ep_member`).
        Handles from before it are refused after it (by dispatch and combine): dispatch again.

        Returns:
            view: the agreed view (`.ranks`, `.epoch`), as `Buffer.update_ep_member` returns it.
        """
        buffer = self._alive()
        epoch = buffer.epoch
        try:
            view = buffer.update_ep_member() if timeout_s is None else buffer.update_ep_member(timeout_s=timeout_s)
        finally:
            if buffer.epoch != epoch:  # a view was adopted (also if connecting to it failed after): handles go
                self._generation += 1
        self._masks.clear()  # the buffer's own mask starts again from the new members
        return view

    def active_mask(self) -> torch.Tensor:
        """A fresh `active_ranks` for the current members (`Buffer.active_mask`): `[num_ranks]` torch.int32."""
        return self._alive().active_mask()

    def pending_joiners(self):
        """Replacements waiting to be admitted (`Buffer.pending_joiners`): list of int ranks."""
        return self._alive().pending_joiners()

    def subscribe(self, callback=None):
        """Subscribe to the inner Buffer's typed events (`Buffer.subscribe`; buffer/events.py): the same events.

        Arguments:
            callback: called with each event, or None: events queue up for `poll()` / iteration.

        Returns:
            subscription: a `Subscription`; `close()` ends it.

        Raises:
            TypeError: `callback` is neither None nor callable. BufferDestroyed: the buffer was destroyed.
        """
        return self._alive().subscribe(callback)

    def stats(self) -> dict:
        """A snapshot of the inner Buffer's counters (`Buffer.stats()`: calls, bytes, masks by cause,
        time in waits, membership epoch), for an engine to export (docs/observability.md).

        Returns:
            stats: dict, as `Buffer.stats()` returns it.

        Raises:
            BufferDestroyed: the buffer was destroyed.
        """
        return self._alive().stats()

    @property
    def members(self) -> tuple:
        """The member ranks of the current epoch."""
        return self._alive().members

    def destroy(self) -> None:
        """Release the inner Buffer (idempotent); the buffer is unusable after."""
        runtime, self.runtime = getattr(self, "runtime", None), None
        if runtime is not None:
            runtime.destroy()

    def __del__(self):
        # Never block in a finalizer: dropping the inner Buffer runs its own __del__ (no waiting at all).
        self.runtime = None

    def _alive(self) -> Buffer:
        if self.runtime is None:
            from mooncake_ep_switch.errors import BufferDestroyed
            raise BufferDestroyed("ElasticBuffer: destroy() was called; build a new buffer")
        return self.runtime

    def _mask(self, device) -> torch.Tensor:
        device = torch.device("cpu") if device is None else torch.device(device)
        key = str(device)  # one mask per device: a host buffer's barrier and calls share the "cpu" one
        if key not in self._masks:
            self._masks[key] = self._alive().active_mask().to(device)
        return self._masks[key]

    def _default_timeout(self, device) -> int:
        seconds = self.num_gpu_timeout_secs if device is not None and torch.device(device).type == "cuda" \
            else self.num_cpu_timeout_secs
        return seconds * 1_000_000

    def _inner_dispatch(self, rows: torch.Tensor, inner_topk: torch.Tensor, active: torch.Tensor, timeout_us: int,
                        num_max_tokens_per_rank: int):
        buffer = self._alive()
        recv, _, handle, _, _ = buffer.dispatch(rows, inner_topk, active, num_max_tokens_per_rank,
                                                codec.INNER_SLOTS * self.num_ranks, timeout_us, use_fp8=False)
        self._inner_dispatches += 1
        self._inner_shape = (num_max_tokens_per_rank, rows.size(1))
        return recv, handle

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 *, active_ranks: Optional[torch.Tensor] = None, timeout_us: Optional[int] = None
                 ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], Optional[torch.Tensor],
                        Optional[torch.Tensor], EPHandle, EventOverlap]:
        """Send each token to the ranks owning its top-k experts (V2's layouts).

        Arguments:
            x: `[num_tokens, hidden]` torch.bfloat16, or FP8 `(x, sf)`: `[num_tokens, hidden]`
                torch.float8_e4m3fn and `[num_tokens, ceil(hidden / 128)]` torch.float32 scales
                (passed through, not re-quantized).
            topk_idx: `[num_tokens, num_topk]` torch.int64 expert ids in `[-1, num_experts)`, no id
                twice in a row, `num_topk <= 31`; None with `handle`.
            topk_weights: `[num_tokens, num_topk]` torch.float32, or None.
            cumulative_local_expert_recv_stats: `[num_local_experts]` torch.int32; the received
                (token, expert) pairs per local expert are added to it.
            num_experts: `E`, a multiple of `num_ranks` (from `handle` if None).
            num_max_tokens_per_rank: `T`, the same on every rank, `>= num_tokens` (default: the
                constructor's, or `handle`'s).
            expert_alignment: each local expert's received rows are padded to a multiple of it (default 1).
            num_sms, num_qps, previous_event, previous_event_before_epilogue, allocate_on_comm_stream,
                use_tma_aligned_col_major_sf: V2's, accepted (the last returns the FP8 scales as a
                column-major view).
            async_with_compute_stream: accepted; the call completes before it returns (the event is
                complete).
            handle: a cached `EPHandle`: the same layout again, no routing recomputed (`topk_idx` None);
                the same handle object is returned.
            do_handle_copy: keep a copy of `topk_idx` in the handle (else the caller's tensor).
            do_cpu_sync: accepted; counts are always exact on the host (False with `handle`).
            do_expand: the expanded layout. do_zero_padding: zero the padding rows (expanded only).
            active_ranks: this runtime's keyword: `[num_ranks]` torch.int32, 1 active; a source that
                misses the deadline is set to 0 in place and counts as having sent nothing (default:
                the buffer's own mask).
            timeout_us: this runtime's keyword: the per-source deadline in microseconds, -1 = none
                (default: the constructor's timeout).

        Returns:
            recv_x: `[num_recv_tokens, hidden]` (expanded: `[num_expanded_tokens, hidden]`), the input's
                dtype, or the FP8 tuple with `[rows, ceil(hidden / 128)]` torch.float32 scales.
            recv_topk_idx: `[num_recv_tokens, num_topk]` torch.int64 ids local to this rank, -1 for
                other ranks' experts (None when expanded).
            recv_topk_weights: `[num_recv_tokens, num_topk]` torch.float32 (expanded: `[num_expanded_tokens]`,
                one per row), or None without `topk_weights`.
            handle: `EPHandle`.
            event: `EventOverlap` (complete).
        """
        self._alive()
        R, rank = self.num_ranks, self.rank_idx
        call = arguments.dispatch_arguments(
            x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts, num_max_tokens_per_rank,
            expert_alignment, num_sms, num_qps, async_with_compute_stream, allocate_on_comm_stream, handle,
            do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf, R,
            self.num_max_tokens_per_rank)
        tokens, scales, topk_idx, use_fp8, device = call.tokens, call.scales, call.topk_idx, call.use_fp8, call.device
        num_tokens, hidden, num_topk = call.num_tokens, call.hidden, call.num_topk
        num_experts, T, alignment, L = call.num_experts, call.num_max_tokens_per_rank, call.alignment, call.num_local
        if handle is not None:
            self._check_own(handle)
        active, timeout_us = self._call_mask(active_ranks, timeout_us, device)
        width = codec.inner_hidden(hidden, num_topk)

        # The call: one inner dispatch of byte rows (no state of this buffer changed before it).
        # No bias slots (num_bias=0): the inner combine's reduction starts from the bias rows themselves.
        packed, inner_topk = codec.route_and_pack(tokens, scales, topk_idx, topk_weights, width, num_experts, R, rank,
                                                  num_bias=0,
                                                  cached_routing=None if handle is None else handle.route.inner_topk)
        recv, inner_handle = self._inner_dispatch(packed, inner_topk, active, timeout_us, T)
        rows, src_global = inner_rows.inner_sources(inner_handle, 0, T, as_slice=True)
        got_x, got_scales, local, got_weights, got_counts = codec.unpack_received(recv[0][rows], hidden, num_topk,
                                                                                  use_fp8, rank, L, num_experts)
        if handle is not None:
            route, local = handle.route, handle.route.recv_local_topk
            (got_x, got_scales, got_weights), received = inner_rows.place_again(
                route, src_global, (got_x, got_scales, got_weights), active, T, L)
            route.inner_handle, route.inner_call, route.combined = inner_handle, self._inner_dispatches, False
            route.inner_rows = (inner_handle, rows, src_global)
        else:
            route = lay.Route(inner_topk, num_tokens, num_topk, hidden, use_fp8, src_global, local, None, 0,
                              inner_handle, self._inner_dispatches, self._token, self.runtime.epoch,
                              self._generation, inner_rows=(inner_handle, rows, src_global))
        counts = (lay.expert_counts(local, L) if handle is not None else got_counts).tolist()
        if cumulative_local_expert_recv_stats is not None:
            stats = received if handle is not None else counts  # only the pairs that arrived in this call
            cumulative_local_expert_recv_stats += torch.tensor(stats, dtype=torch.int32,
                                                               device=cumulative_local_expert_recv_stats.device)
        weights_out = got_weights if topk_weights is not None else None
        if do_expand:
            if handle is None:
                route.slots, starts = lay.expanded_slots(local, counts, alignment)
                route.num_slots = sum(lay.align(c, alignment) for c in counts)
            out_x, out_scales, out_weights = lay.expand(route, got_x, got_scales, weights_out, do_zero_padding)
            recv_topk_out = None
        else:
            out_x, out_scales, out_weights, recv_topk_out = got_x, got_scales, weights_out, local.clone()
        if out_scales is not None and use_tma_aligned_col_major_sf:
            out_scales = out_scales.t().contiguous().t()
        recv_x = (out_x, out_scales) if use_fp8 else out_x
        if handle is None:
            handle = new_handle(route, do_expand, num_experts, alignment, T, num_sms, topk_idx, do_handle_copy,
                                counts, R, src_global)
        return recv_x, recv_topk_out, out_weights, handle, EventOverlap(None)

    def _check_own(self, handle: EPHandle) -> None:
        """A handle of this buffer still valid for its members (`handle.check_usable`; ValueError naming `handle`)."""
        check_usable(handle, self._token, self._generation, self.runtime)

    def _call_mask(self, active_ranks, timeout_us, device) -> Tuple[torch.Tensor, int]:
        active = self._mask(device) if active_ranks is None else arguments.check_tensor(
            "active_ranks", active_ranks, torch.int32, (self.num_ranks,))
        if timeout_us is None:
            timeout_us = self._default_timeout(device)
        elif not timeout_in_range(timeout_us):  # a plain int in range passes `check_timeout` unchanged
            timeout_us = check_timeout(timeout_us)
        return active, timeout_us

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                *, active_ranks: Optional[torch.Tensor] = None, timeout_us: Optional[int] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Return each rank's partials to the tokens' owners and sum them (V2's semantics).

        No top-k weights are applied (the expert side did). Not expanded, `x` holds one row per received
        token, summed over this rank's experts; expanded, `x` is indexed by expanded row and this rank
        first sums each token's rows in top-k order (fp32, to bf16), or with `allow_multiple_reduction`
        False sends each row on its own (`entry_combine`). The owner computes, in fp32, `bias[0] +
        bias[1] + partials` (ranks ordered by their last top-k entry; each entry in top-k order
        without multiple reduction), rounded to bf16: V2's reference bit for bit (but the sign of a
        zero sum). A rank inactive or late contributes nothing; one that sends tokens this rank did
        not receive at the dispatch is cleared in `active_ranks`.

        Arguments:
            x: `[num_recv_tokens, hidden]` (expanded: `[num_expanded_tokens, hidden]`) torch.bfloat16.
            handle: the `EPHandle` of the matching dispatch.
            topk_weights: `[num_recv_tokens, num_topk]` (expanded: `[num_expanded_tokens]`)
                torch.float32 to gather back to the owners, or None.
            bias: None, or one or two `[num_tokens, hidden]` torch.bfloat16 (the owner's tokens).
            num_sms, num_qps, previous_event, previous_event_before_epilogue, allocate_on_comm_stream:
                V2's, accepted; async_with_compute_stream: accepted, the call completes first.
            active_ranks, timeout_us: as in `dispatch`.

        Returns:
            combined_x: `[num_tokens, hidden]` torch.bfloat16.
            combined_topk_weights: `[num_tokens, num_topk]` torch.float32, the weights given by the
                rank owning each entry's expert, bit for bit (0 for -1 entries and for ranks that sent
                nothing), or None without `topk_weights`.
            event: `EventOverlap` (complete).
        """
        self._alive()
        biases = arguments.combine_arguments(x, handle, topk_weights, bias, async_with_compute_stream,
                                             allocate_on_comm_stream, self.allow_multiple_reduction,
                                             self.max_num_bias)
        route, hidden, width = handle.route, x.size(1), handle.route.inner_handle[3]
        self._check_own(handle)
        device = x.device
        active, timeout_us = self._call_mask(active_ranks, timeout_us, device)
        T = handle.num_max_tokens_per_rank
        if handle.do_expand and not self.allow_multiple_reduction:
            combined_x, combined_weights = entries.combine(x, handle, topk_weights, biases, active, timeout_us, T,
                                                           self.num_ranks, self._inner_dispatch, self._alive)
            return combined_x, combined_weights, EventOverlap(None)

        # This rank's partial per received token, and its entries' weights as exact byte columns. Only these
        # columns are read back from the sum (the rest of a row is never looked at, so never written).
        # The weight columns are always written (zeros without topk_weights): an owner that asks for the
        # weights must never decode bytes a rank that passed none left there (`inner_rows.write_partials`).
        partial = lay.reduce_expanded(x, route.slots) if handle.do_expand else x
        weights = topk_weights
        if topk_weights is not None and handle.do_expand:
            weights = topk_weights[route.slots.clamp(min=0)]  # per received token (masked when written)
        columns = hidden + 4 * route.num_topk

        if not self._combinable(route):  # the inner dispatch's region half was reused: lay the routing out again
            empty = torch.zeros((route.num_tokens, width), dtype=torch.bfloat16, device=device)
            _, inner_handle = self._inner_dispatch(empty, route.inner_topk, active, timeout_us, T)
            route.inner_handle, route.inner_call, route.combined = inner_handle, self._inner_dispatches, False
        buffer, inner_handle = self._alive(), route.inner_handle
        # The inner combine buffer, looked up once: passed back as `x` (what `zero_copy=True` would look up again).
        combine_buffer = buffer.get_next_combine_buffer(inner_handle)
        inner_x = combine_buffer[:, :, :columns]
        inner_rows.write_partials(inner_x, route, partial, weights, active, T)
        bias = None
        if biases[0] is not None or biases[1] is not None:
            # The inner reduction (host or device) starts from them (bias 0, then bias 1), read in place:
            # no bias slots in the inner routing, no copy.
            bias = tuple(None if b is None else b.to(device).contiguous() for b in biases)
        ones = inner_rows.ones(self._ones_cache, route.inner_topk.shape, device)
        out, _, _ = buffer.combine(combine_buffer, route.inner_topk, ones, active, timeout_us, inner_handle, bias=bias)
        route.combined = True
        combined_x, combined_weights = inner_rows.read_combined(out, hidden, route.num_topk, topk_weights is not None)
        return combined_x, combined_weights, EventOverlap(None)

    def _combinable(self, route: lay.Route) -> bool:
        """Whether the inner Buffer still combines `route`'s inner dispatch (its rules, `Buffer.combine`): a
        first combine before any call two numbers later reused the dispatch's region half (a dispatch, or
        a combine again, takes a number); a combine again only while no dispatch followed, and never on the
        'cuda' transport (it combines an inner dispatch once)."""
        if route.combined:
            return self.runtime.device is None and route.inner_call == self._inner_dispatches
        return self.runtime.latest_call - route.inner_handle.plan.call <= 1

    def __repr__(self) -> str:
        state = "destroyed" if self.runtime is None else f"transport={self.runtime.transport}"
        return f"ElasticBuffer(rank {self.rank_idx}/{self.num_ranks}, {state})"

