"""The `"cuda"` transport: the one-sided protocol with device kernels over CUDA IPC (the NVLink path).

Every rank owns its EP region in device memory (`num_ep_buffer_bytes`, zeroed); its CUDA IPC
handle is published in the membership store, and at connect every rank opens its peers' handles
(`cudaIpcOpenMemHandle`: between processes on one GPU, or over NVLink between GPUs of one host).
A device table `peer_bases[R]` holds every region's address as mapped here; the kernels
(csrc/cuda/ep_kernels.cu) write rows straight into peers' regions and then a tagged signal, with
the region layout, signals and packing rules of docs/protocol.md, so results are bit-identical to
the shm transport's. Nothing on the call path synchronises the host: a dispatch/combine pair can
be captured in a CUDA graph (the call number advances on the device at every replay).

Failure handling is on the device: each receive waits per source up to `timeout_us` on the GPU's
global timer and then writes 0 into the caller's `active_ranks` (a CUDA int32 tensor) and flags the
source in a pinned control block the host reads (`failed_sources`); `destroy()` raises the control
block's abort word, which ends every wait at once.
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch

from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs, bias_args
from mooncake_ep_switch.buffer.layout import RegionLayout, RegionLayouts, check_half_not_reused
from mooncake_ep_switch.buffer.transport.launch_order import LaunchOrder
from mooncake_ep_switch.buffer.transport.contract import RuntimeQueries
from mooncake_ep_switch.buffer.transport.members import connect_view
from mooncake_ep_switch.buffer.transport.device_memory import DeviceAllocation, device_view, open_peer
from mooncake_ep_switch.buffer.transport.peer_watch import PeerWatch
from mooncake_ep_switch.errors import BufferDestroyed

try:
    from mooncake_ep_switch import _cuda
except ImportError:  # built only where nvcc was found
    _cuda = None

IPC_HANDLE_BYTES = 64
_NO_BIAS = (0, 0, 0, 0)


def _bias_words(bias: tuple) -> tuple:
    """`bias_args(bias)` by position: (bias0_ptr, bias1_ptr, bias_stride, bias_hidden), all 0 without a bias."""
    if not bias:
        return _NO_BIAS
    words = bias_args(bias)
    return words["bias0_ptr"], words["bias1_ptr"], words["bias_stride"], words["bias_hidden"]


def current_raw_stream(device_index: int) -> int:
    """The current stream of CUDA device `device_index` as the `cudaStream_t` int the launchers take.

    torch's C getter: `torch.cuda.current_stream(device).cuda_stream` builds a Stream object first (microseconds a
    launch on the host's path, five launches an eager round trip). The emulated device replaces this function.

    Arguments:
        device_index: the CUDA device's index.

    Returns:
        stream: int, the stream's handle (0: the legacy default stream).
    """
    return torch._C._cuda_getCurrentRawStream(device_index)


def cuda_unavailable_reason() -> str:
    """Why the `"cuda"` transport cannot run in this process ("" when it can).

    Returns:
        reason: str, e.g. "no CUDA device" or "the CUDA extension was not built (no nvcc at install)".
    """
    if _cuda is None:
        return "the CUDA extension mooncake_ep_switch._cuda was not built (no nvcc when the package was installed)"
    if _cuda.device_count() == 0 or not torch.cuda.is_available():
        status = _cuda.device_status()
        return "no CUDA device" + (f" ({status})" if status and status != "no CUDA device" else "")
    return ""


class CudaTransport(RuntimeQueries):
    """Dispatch/combine by device kernels writing into peers' IPC-mapped device regions (Mooncake's
    runtime queries: peers' memory mapped, the fast path).

    Arguments:
        rank: this rank.
        num_ranks: group size.
        num_ep_buffer_bytes: size of every rank's device region (> 0).
        settings: the runtime `Settings` (host identity, value checks, fused kernels).

    Raises:
        RuntimeError: no usable CUDA device here, or the CUDA extension was not built (the reason).
        ValueError: `num_ep_buffer_bytes` is not positive.
    """

    def __init__(self, rank: int, num_ranks: int, num_ep_buffer_bytes: int, settings):
        reason = cuda_unavailable_reason()
        if reason:
            raise RuntimeError(f"transport: 'cuda' cannot run here: {reason}")
        if num_ep_buffer_bytes <= 0:
            raise ValueError("num_ep_buffer_bytes: the cuda transport needs a region, expected > 0 "
                             f"(see Buffer.get_ep_buffer_size_hint), got {num_ep_buffer_bytes}")
        self.name = "cuda"
        self.rank, self.num_ranks, self.nbytes, self.settings = rank, num_ranks, num_ep_buffer_bytes, settings
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.abort_ptr = 0  # the Buffer's host abort word (CPU waits); device waits use the control block
        self.latest_dispatch = 0
        self._failed: List[int] = []
        self.region = DeviceAllocation(num_ep_buffer_bytes, self.device.index)
        self.base = self.region.ptr
        self.local = device_view(self.region, self.device)  # [nbytes] uint8 view of the region
        self.handle = _cuda.ipc_handle(self.base)
        # Pinned host words the device reads and writes: [0] abort, [1 + s] set when source s failed,
        # [1 + R + s] set by the peer watcher when s's process ended (the device waits stop on it).
        control_bytes = 4 * (1 + 2 * num_ranks)
        self._control_ptr = _cuda.mapped_host_alloc(control_bytes)
        from mooncake_ep_switch import _native

        self._control = torch.frombuffer(_native.MappedBytes(self._control_ptr, control_bytes), dtype=torch.int32)
        self._source_flags = self._control[1:1 + num_ranks]  # [R] the device's "source s failed" words
        self._opened: Dict[int, Tuple[bytes, int]] = {}  # peer -> (its IPC handle, address mapped here)
        self._bases = [0] * num_ranks
        self._bases[rank] = self.base
        self.peer_table = torch.zeros(num_ranks, dtype=torch.int64, device=self.device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # last call number used on the device
        self._table_ptrs = (self.peer_table.data_ptr(), self.counter.data_ptr())  # fixed for the transport's life
        self.problem = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._scratch: Dict[tuple, torch.Tensor] = {}
        self._regions: Dict[tuple, object] = {}
        self._layouts = RegionLayouts(num_ranks, num_ep_buffer_bytes)
        self._comm_stream: Optional[torch.cuda.Stream] = None
        # Every launch runs after the one before it, also on another stream (launch_order.py: the kernels' scratch is
        # shared by the calls of a shape); the functions read this module's names when called (the emulated device
        # replaces them).
        self._order = LaunchOrder(lambda: current_raw_stream(self.device.index),
                                  lambda: torch.cuda.current_stream(self.device),
                                  lambda: torch.cuda.is_current_stream_capturing())
        self._dispatch_streams = [None, None]  # per region half: (call number, stream) of its latest dispatch's send
        self.watch = PeerWatch(num_ranks, rank, None, dead=self._control[1 + num_ranks:])
        self._dead_ptr = self.watch.dead_ptr  # inside the control block: the device waits read it
        self._graphs = False  # set once a call was captured in a CUDA graph (see _call)
        self._call_word_size = _cuda.call_word_size(num_ranks)  # int64 words of a dispatch's call word
        self._fused = int(settings.cuda_fused_kernels)
        self._write_peer_table()

    # ------------------------------------------------------------------ membership
    def endpoint(self) -> dict:
        """What peers need to reach this rank (published in the store).

        Returns:
            endpoint: dict with `"cuda_ipc"` (hex of the region's 64-byte IPC handle), `"pid"` and
                `"nbytes"`. The Buffer adds `"host_id"`.
        """
        import os

        return {"cuda_ipc": self.handle.hex(), "pid": os.getpid(), "nbytes": self.nbytes}

    def peer_routes(self) -> List[Optional[str]]:
        """Every rank's device memory is mapped over CUDA IPC (see `contract.Transport`)."""
        return ["self" if peer == self.rank else "cuda" for peer in range(self.num_ranks)]

    def transfer_engine(self):
        """None: the cuda transport has no Transfer Engine."""
        return None

    def te_peer(self, peer: int):
        """None: no peer is reached over the Transfer Engine."""
        return None

    def connect_members(self, view, membership, deadline: float, construction: bool = False) -> None:
        """Open every member's region by its IPC handle (same host only); close everything else.

        Arguments:
            view: the membership `View` to connect.
            membership: the `Membership` whose store holds the endpoints.
            deadline: `time.monotonic()` deadline in seconds.
            construction: True at the Buffer's construction (every member connects at once), False after a
                membership change (`members.connect_view`).

        Raises:
            RuntimeError: `membership` is None (no store).
            ValueError: a member on another host, or whose endpoint is not a CUDA one.
            MembershipError: members that cannot be reached, or one missing from the final barrier.
        """
        from mooncake_ep_switch.buffer.membership.protocol import MembershipError

        # An IPC handle that no longer opens (its process is gone) is a member that cannot be reached.
        connect_view(self.rank, self.num_ranks, view, membership, deadline, self._open, self._drop,
                     (TimeoutError, MembershipError, RuntimeError), before_barrier=self._write_peer_table,
                     what="the cuda transport's IPC handles", construction=construction)

    def _open(self, peer: int, found: dict) -> None:
        """Map `peer`'s region from its published endpoint (validated), replacing an older mapping."""
        if found.get("host_id") != self.settings.host_id:
            raise ValueError(f"transport: 'cuda' reaches peers through CUDA IPC on one host; rank {peer} runs on "
                             f"host {found.get('host_id')!r}, this rank on {self.settings.host_id!r}")
        text, pid, nbytes = found.get("cuda_ipc"), found.get("pid"), found.get("nbytes")
        if not isinstance(text, str) or len(text) != 2 * IPC_HANDLE_BYTES or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"rank {peer} published no usable CUDA IPC endpoint (is it on the 'cuda' transport?): "
                             f"{ {k: v for k, v in found.items() if k != 'cuda_ipc'} }")
        if nbytes != self.nbytes:
            raise ValueError(f"num_ep_buffer_bytes: rank {peer} has {nbytes}, this rank {self.nbytes}; every rank "
                             "must pass the same size")
        handle = bytes.fromhex(text)
        self._layouts.settle(peer)  # mapped (anew): it writes in the current layout
        old = self._opened.get(peer)
        if old is not None and old[0] == handle:
            return
        self._drop(peer)
        self.watch.watch_process(peer, pid)
        self._opened[peer] = (handle, open_peer(handle, nbytes, self.device.index))
        self._bases[peer] = self._opened[peer][1]

    def _drop(self, peer: int) -> None:
        self.watch.forget(peer)
        old = self._opened.pop(peer, None)
        self._bases[peer] = 0
        if old is not None:
            torch.cuda.synchronize(self.device)  # no kernel of ours still writes through the mapping
            self._write_peer_table()
            try:
                _cuda.ipc_close(old[1])
            except RuntimeError:
                pass  # the exporting process is gone

    def _write_peer_table(self) -> None:
        table = torch.tensor(self._bases, dtype=torch.int64)
        _cuda.copy_to_device(self.peer_table.data_ptr(), table.data_ptr(), table.numel() * 8)

    def dead_peers(self) -> List[int]:
        """Ranks whose process the peer watcher saw end since they were last connected.

        Returns:
            ranks: list of int, ascending.
        """
        if self._control is None:
            return []  # destroyed: the words are gone
        return self.watch.dead_ranks()

    @property
    def failed_sources(self) -> List[int]:
        """Sources the device waits timed out on since the last view (read from the pinned control
        block without a synchronisation: a wait still running is seen once it has flagged)."""
        flags = self._source_flags
        if flags is not None:
            # One read of each word: the device may flag a source while we read (see PeerWatch.dead_ranks).
            words = flags.tolist()
            if any(words):
                flagged = [source for source, flag in enumerate(words) if flag]
                for source in flagged:
                    flags[source] = 0
                    self._failed.append(source)
                # a live one may still write in the layout of the calls before (layout.RegionLayouts)
                self._layouts.hold(flagged, self.dead_peers())
        return self._failed

    def latest_call(self, host_call: int) -> int:
        """The last call number used on this rank, CUDA graph replays included (one synchronisation).

        Arguments:
            host_call: the Buffer's own count of dispatches.

        Returns:
            call: int, the larger of `host_call` and the device counter.
        """
        torch.cuda.synchronize(self.device)
        return max(host_call, int(self.counter.item()))

    def destroy(self) -> None:
        """Stop every device wait (abort word), let kernels end, close peer mappings and free memory."""
        if self._control is None:
            return
        self._control[0] = 1
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError:
            pass
        stopped = self.watch.close()
        for peer in list(self._opened):
            handle, ptr = self._opened.pop(peer)
            try:
                _cuda.ipc_close(ptr)
            except RuntimeError:
                pass
        self._control = self._source_flags = None
        if stopped:  # else the watcher thread may still write its words: leave the few bytes mapped
            _cuda.mapped_host_free(self._control_ptr)
        self._control_ptr = 0
        self._scratch.clear()
        self.local = None
        self.region = None  # freed once no combine buffer view holds it
        self.base = 0

    # ------------------------------------------------------------------ helpers
    def _region(self, layout: RegionLayout):
        region = self._regions.get(layout)
        if region is None:
            region = _cuda.Region(layout.control_bytes, layout.half_bytes, layout.dispatch_data,
                                  layout.dispatch_scales, layout.dispatch_src, layout.combine_data,
                                  layout.dispatch_signals, layout.combine_signals)
            self._regions[layout] = region
        return region

    def _scratch_for(self, tokens: int, hidden: int, experts: int, top_k: int) -> torch.Tensor:
        key = (tokens, hidden, experts, top_k)
        scratch = self._scratch.get(key)
        if scratch is None:
            nbytes = _cuda.dispatch_scratch_bytes(self.num_ranks, tokens, hidden, experts, top_k)
            scratch = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._scratch[key] = scratch
        return scratch

    def _call(self, number: int, tokens: int, hidden: int, experts: int, active: torch.Tensor, call_word: torch.Tensor,
              timeout_us: int) -> tuple:
        """The kernels' record of one call, and the stream its launches go to. Its call number is the host's
        (`number`) until a call is captured in a CUDA graph; from then on the device advances it
        (max(last + 1, number)), so every replay uses a new signal tag.

        Returns:
            spec: the `_cuda.Call`.
            stream, stream_object, captured: the current stream as `LaunchOrder.current` returns it (ordered after
                the previous launch; the receive phase launches there too).
        """
        if self._control is None:
            raise BufferDestroyed("the transport was destroyed")
        stream, stream_object, captured = self._order.current()
        if captured:
            self._graphs = True
        peer_table, counter = self._table_ptrs
        return (_cuda.Call(self.num_ranks, self.rank, tokens, hidden, experts, number & 1, number, peer_table,
                           active.data_ptr(), counter, call_word.data_ptr(), self._control_ptr, self._dead_ptr,
                           timeout_us, int(self._graphs), self._fused),  # by position: keywords cost us a call
                stream, stream_object, captured)

    def comm_stream(self) -> torch.cuda.Stream:
        """The stream `async_finish` calls run on (made on first use)."""
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(self.device)
        return self._comm_stream

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple[torch.Tensor, Callable[[], None]]:
        """Launch the send phase on the current stream; return (the call word, the receive phase).

        Arguments:
            call: the validated `DispatchCall` (CUDA tensors on this transport's device).
            outputs: the `DispatchOutputs` the receive phase fills.

        Returns:
            private: `[1 + R + 3]` torch.int64 CUDA tensor: [0] the call number the device used (combine reads
                it), [1 + r] the send kernels' snapshot of whether peer r is writable, then the fused kernels'
                arrival counts.
            receive: callable that launches the receive kernels on the send's stream (the one current now, as
                DeepEP's and Mooncake EP's receive hooks do, whichever stream is current when it runs).
        """
        tokens, experts, hidden = call.num_max_dispatch_tokens_per_rank, call.num_experts, call.x.size(1)
        layout = self._layouts.fit(tokens, hidden, experts)
        if (tokens, hidden, experts) != self._layouts.latest:
            self.failed_sources  # a shape change: the masks the device made so far hold the layout first
        self._layouts.use((tokens, hidden, experts), self.dead_peers)  # refuses before anything is launched
        region = self._region(layout)
        top_k = call.topk_idx.size(1)
        scratch = self._scratch_for(tokens, hidden, experts, top_k)
        # [0] the call number the device used; [1 + r] the send kernels' snapshot of writable peers; then the
        # fused kernels' arrival counts (csrc/cuda/api.h Call::call_word)
        call_word = torch.empty(self._call_word_size, dtype=torch.int64, device=self.device)
        spec, stream, send_stream, captured = self._call(call.call, tokens, hidden, experts, call.active_ranks,
                                                         call_word, call.timeout_us)
        self.latest_dispatch = call.call
        self._dispatch_streams[call.call & 1] = (call.call, stream)
        # by position but the flag (pybind11 matches keywords by name: microseconds a call)
        _cuda.dispatch_send(spec, region, call.x.data_ptr(), call.x.size(0), call.topk_idx.data_ptr(), top_k,
                            scratch.data_ptr(), stream, use_fp8=call.use_fp8)

        def receive() -> None:
            if self._control is None:
                raise BufferDestroyed("dispatch: the transport was destroyed before this receive phase ran")
            check_half_not_reused("dispatch", call.call, self.latest_dispatch)
            scales = outputs.recv_scales.data_ptr() if outputs.recv_scales is not None else 0
            # top_k, scratch, recv_x, recv_scales, src_info, layout_range, recv_count, stream; the flag by name
            _cuda.dispatch_recv(spec, region, top_k, scratch.data_ptr(), outputs.recv_x.data_ptr(), scales,
                                outputs.src_info.data_ptr(), outputs.layout_range.data_ptr(),
                                outputs.recv_count.data_ptr(), self._order.on(stream, send_stream, captured),
                                use_fp8=call.use_fp8)

        return call_word, receive

    def dispatch_sync(self, call: DispatchCall, outputs: DispatchOutputs) -> torch.Tensor:
        """Send and receive phases launched back to back on the current stream (no host wait).

        Returns:
            private: the call word (see `dispatch`).
        """
        private, receive = self.dispatch(call, outputs)
        receive()
        return private

    # ------------------------------------------------------------------ combine
    def combine(self, call: CombineCall) -> Callable[[], None]:
        """Launch the combine send phase on the current stream; return the receive phase.

        Arguments:
            call: the validated `CombineCall`; `transport_plan` is the dispatch's call word.

        Returns:
            receive: callable that launches the wait and the weighted sum into `call.out` (starting from
                `call.bias`'s rows, read in place) on the send's stream, as `dispatch`'s.
        """
        tokens, hidden, experts = call.num_max_dispatch_tokens_per_rank, call.hidden, call.num_experts
        layout = self._layouts.fit(tokens, hidden, experts)
        self._layouts.use((tokens, hidden, experts), self.dead_peers)
        region = self._region(layout)
        spec, stream, send_stream, captured = self._call(call.call, tokens, hidden, experts, call.active_ranks,
                                                         call.transport_plan, call.timeout_us)
        if not captured and self._dispatch_streams[call.call & 1] != (call.call, stream):
            # On another stream than its dispatch's send, the dispatch's call word and the handle's tensors were made
            # on another stream than this one: the allocator must not hand them to anyone else before this stream has
            # read them (DeepEP's combine keeps them too). On the same stream, stream order does it (an async_finish
            # dispatch recorded the communication stream on its outputs already).
            for tensor in (call.transport_plan, call.src_info, call.layout_range):
                tensor.record_stream(send_stream)
        _cuda.combine_send(spec, region, call.x.data_ptr(), call.src_info.data_ptr(), call.layout_range.data_ptr(),
                           stream)

        def receive() -> None:
            if self._control is None:
                raise BufferDestroyed("combine: the transport was destroyed before this receive phase ran")
            check_half_not_reused("combine", call.call, self.latest_dispatch)
            _cuda.combine_recv(spec, region, call.topk_idx.data_ptr(), call.topk_weights.data_ptr(),
                               call.topk_idx.size(0), call.topk_idx.size(1), call.out.data_ptr(),
                               self._order.on(stream, send_stream, captured), *_bias_words(call.bias))

        return receive

    def combine_sync(self, call: CombineCall) -> None:
        """Combine send and receive launched back to back on the current stream (no host wait)."""
        self.combine(call)()

    def combine_buffer(self, call: int, shape, device) -> torch.Tensor:
        """Region-resident zero-copy combine buffer `[L, R*T, hidden]` bf16 (device memory) for `call`.

        Arguments:
            call: call number of the dispatch (selects the region half).
            shape: (L, R*T, hidden).
            device: unused (the region's device).

        Returns:
            buffer: `[L, R*T, hidden]` torch.bfloat16 on this transport's device, a view of the region.
        """
        if self.local is None:
            raise BufferDestroyed("combine buffer: the transport was destroyed")
        return self._layouts.combine_view(self.local, call, shape)

    # ------------------------------------------------------------------ value checks
    def value_problem(self, topk_idx: torch.Tensor, num_experts: int, active_ranks: torch.Tensor) -> str:
        """Check routing and mask values on the device (one host synchronisation); "" when valid.

        Arguments:
            topk_idx: `[N, K]` torch.int64 on this device.
            num_experts: `E`.
            active_ranks: `[R]` torch.int32 on this device.

        Returns:
            problem: str, "" or the error message naming the argument, what was expected and what came.
        """
        self.problem.zero_()
        _cuda.check_values(topk_idx.data_ptr(), topk_idx.size(0), topk_idx.size(1), num_experts,
                           active_ranks.data_ptr(), self.num_ranks, self.problem.data_ptr(),
                           current_raw_stream(self.device.index))
        code, row, column, value = self.problem.tolist()
        if code == 1:
            return (f"topk_idx: expected expert ids in [-1, {num_experts}), got {value} at row {row}, "
                    f"column {column}")
        if code == 2:
            return f"topk_idx: expected no expert twice in a row, got expert {value} twice in row {row}"
        if code == 3:
            return f"active_ranks: expected values 0 or 1, got {value} at index {row}"
        return ""
