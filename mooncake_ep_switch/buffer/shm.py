"""The `"shm"` transport: one-sided writes into peers' POSIX shared-memory regions (one host).

Each rank creates its EP region as a shared-memory segment (mode 0600, random name), exchanges
names through the group, maps every peer and, once every rank has mapped every segment, unlinks
its own name: from then on the memory lives only as long as the processes that map it, so a killed
rank leaves nothing in /dev/shm. The native code does the protocol of docs/protocol.md: data
writes into the peer's half, then a release-ordered signal; receivers poll their own region with
the call's deadline and write timed-out sources into the caller's `active_ranks`.
"""
import ctypes
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs
from mooncake_ep_switch.buffer.layout import region_layout

_TAG_SPACE = (1 << 32) - 1


def signal_tag(call: int) -> int:
    """The 32-bit, never-zero signal tag of call number `call` (wraps after 2**32 - 1 calls)."""
    return (call - 1) % _TAG_SPACE + 1


def region_tensor(base: int, nbytes: int) -> torch.Tensor:
    """A torch.uint8 view `[nbytes]` of mapped memory at `base` (valid while it stays mapped)."""
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(base), dtype=torch.uint8)


class ShmTransport:
    """Dispatch/combine over shared memory between the ranks of one host.

    Arguments:
        group: the process group (used for the name exchange only).
        rank: this rank in `group`.
        num_ranks: size of `group`.
        num_ep_buffer_bytes: size of every rank's region.
    """

    name = "shm"

    def __init__(self, group, rank: int, num_ranks: int, num_ep_buffer_bytes: int):
        if num_ep_buffer_bytes <= 0:
            raise ValueError("num_ep_buffer_bytes: the shm transport needs a region, expected > 0 "
                             f"(see Buffer.get_ep_buffer_size_hint), got {num_ep_buffer_bytes}")
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.nbytes = num_ep_buffer_bytes
        self.segment_name, self.base = _native.shm_create(num_ep_buffer_bytes)
        self._linked = True
        self.region = region_tensor(self.base, num_ep_buffer_bytes)
        self.peer_bases: List[int] = [0] * num_ranks
        self.peer_bases[rank] = self.base
        self.failed_sources: List[int] = []  # evidence for membership: sources that timed out

    # ------------------------------------------------------------------ connection
    def connect(self) -> None:
        """Exchange segment names, map every peer, then unlink our own name."""
        names: List[Optional[str]] = [None] * self.num_ranks
        dist.all_gather_object(names, self.segment_name, group=self.group)
        for peer, name in enumerate(names):
            if peer != self.rank and not self.peer_bases[peer]:
                self.peer_bases[peer] = _native.shm_open_peer(name, self.nbytes)
        # Every peer has mapped every segment once all pass this barrier: names can go.
        dist.barrier(group=self.group)
        self._unlink()

    def _unlink(self) -> None:
        if self._linked:
            _native.shm_unlink(self.segment_name)
            self._linked = False

    def destroy(self) -> None:
        """Unmap every mapping and unlink our name if still linked."""
        self._unlink()
        for peer, base in enumerate(self.peer_bases):
            if base and peer != self.rank:
                _native.shm_unmap(base, self.nbytes)
        self.peer_bases = [0] * self.num_ranks
        self.region = None
        if self.base:
            _native.shm_unmap(self.base, self.nbytes)
            self.base = 0

    # ------------------------------------------------------------------ helpers
    def _halves(self, call: int, num_ranks: int, tokens: int, hidden: int, experts: int):
        layout = region_layout(num_ranks, tokens, hidden, experts)
        if layout.total_bytes > self.nbytes:  # checked by the Buffer already; never write past a region
            raise ValueError(f"num_ep_buffer_bytes: call needs {layout.total_bytes}, region has {self.nbytes}")
        offset = layout.half_offset(call)
        return layout, offset, [base + offset if base else 0 for base in self.peer_bases]

    def _note_failures(self, newly_inactive: List[int]) -> None:
        self.failed_sources.extend(newly_inactive)

    def combine_buffer(self, call: int, shape, device) -> torch.Tensor:
        """Region-resident zero-copy combine buffer `[L, R*T, hidden]` bf16 for the half of `call`."""
        local, rows, hidden = shape
        layout, offset, _ = self._halves(call, self.num_ranks, rows // self.num_ranks, hidden,
                                         local * self.num_ranks)
        start = offset + layout.combine_send
        nbytes = local * rows * hidden * 2
        return self.region[start:start + nbytes].view(torch.bfloat16).view(local, rows, hidden)

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple[None, Callable[[], None]]:
        """Write this rank's tokens into every active peer's region; return the receive phase."""
        tokens, experts = call.num_max_dispatch_tokens_per_rank, call.num_experts
        hidden = call.x.size(1)
        _, offset, peer_halves = self._halves(call.call, self.num_ranks, tokens, hidden, experts)
        tag = signal_tag(call.call)
        _native.dispatch_send(call.x.data_ptr(), call.x.size(0), hidden, call.topk_idx.data_ptr(),
                              call.topk_idx.size(1), experts, self.num_ranks, self.rank, tokens,
                              call.active_ranks.data_ptr(), peer_halves, tag, call.use_fp8)

        def receive() -> None:
            scales = outputs.recv_scales.data_ptr() if outputs.recv_scales is not None else 0
            newly = _native.dispatch_recv(self.base + offset, self.num_ranks, self.rank, tokens, hidden, experts,
                                          tag, call.active_ranks.data_ptr(), call.timeout_us, call.use_fp8,
                                          outputs.recv_x.data_ptr(), scales, outputs.src_info.data_ptr(),
                                          outputs.layout_range.data_ptr(), outputs.recv_count.data_ptr())
            self._note_failures(newly)

        return None, receive

    def combine(self, call: CombineCall) -> Callable[[], None]:
        """Write expert outputs into their token owners' regions; return the receive phase."""
        _, offset, peer_halves = self._halves(call.call, self.num_ranks, call.num_max_dispatch_tokens_per_rank,
                                              call.hidden, call.num_experts)
        tag = signal_tag(call.call)
        _native.combine_send(call.x.data_ptr(), call.hidden, call.num_experts, self.num_ranks, self.rank,
                             call.num_max_dispatch_tokens_per_rank, call.src_info.data_ptr(),
                             call.layout_range.data_ptr(), call.active_ranks.data_ptr(), peer_halves, tag)

        def receive() -> None:
            newly = _native.combine_recv(self.base + offset, self.num_ranks, self.rank,
                                         call.num_max_dispatch_tokens_per_rank, call.hidden, call.num_experts, tag,
                                         call.active_ranks.data_ptr(), call.timeout_us, call.topk_idx.data_ptr(),
                                         call.topk_weights.data_ptr(), call.topk_idx.size(0), call.topk_idx.size(1),
                                         call.out.data_ptr())
            self._note_failures(newly)

        return receive
