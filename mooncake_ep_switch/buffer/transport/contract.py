"""The contract every transport under a `Buffer` keeps (one-sided shm / Transfer Engine, collective).

`Buffer` resolves the transport once (`transport/select.py make_transport`, rules in docs/transports.md) and
then calls only what `Transport` declares; nothing is probed with `hasattr`. The implementations:
`buffer.transport.one_sided.OneSidedTransport` (`"shm"`, `"mooncake"`),
`buffer.transport.cuda.CudaTransport` (`"cuda"`),
`buffer.transport.collective.CollectiveTransport` (`"collective"`), and
`buffer.transport.fallback.FallbackSwitch` (a Buffer switched by `_use_fallback`). Every one also
answers Mooncake's runtime queries (`RuntimeQueries`), which callers reach as `buffer.runtime`.
"""
from typing import Callable, List, Optional, Protocol, Tuple

import torch

from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs


class Transport(Protocol):
    """What a `Buffer` calls on its transport.

    Attributes:
        name: `"cuda"`, `"shm"`, `"mooncake"` or `"collective"` (`Buffer.transport`).
        abort_ptr: address of the Buffer's abort word (set by the Buffer; native waits stop once
            it is raised), 0 for none.
        failed_sources: ranks calls found dead since the last view (evidence for membership; the
            Buffer clears it when a view is agreed).
        device: the CUDA torch.device whose tensors calls take (`"cuda"`), or None (CPU tensors).
    """

    name: str
    device: Optional[torch.device]
    abort_ptr: int
    failed_sources: List[int]

    def endpoint(self) -> dict:
        """What peers need to reach this rank (published in the membership store)."""

    def connect_members(self, view, membership, deadline: float, construction: bool = False) -> None:
        """Reach every member of `view` (and drop everything else) before `deadline`; `construction`: at the
        Buffer's construction (every member connects at once), False after a membership change."""

    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple[object, Callable[[], None]]:
        """Send phase; returns (the transport's private plan for combine, the receive phase)."""

    def dispatch_sync(self, call: DispatchCall, outputs: DispatchOutputs) -> object:
        """Send and receive phases at once (a synchronous call); returns the private plan."""

    def combine(self, call: CombineCall) -> Callable[[], None]:
        """Send phase of a combine; returns the receive phase (which fills `call.out`)."""

    def combine_sync(self, call: CombineCall) -> None:
        """Send and receive phases of a combine at once (fills `call.out`)."""

    def combine_buffer(self, call: int, shape, device) -> torch.Tensor:
        """The zero-copy combine buffer `[L, R*T, hidden]` torch.bfloat16 of dispatch `call`."""

    def latest_call(self, host_call: int) -> int:
        """The last call number this rank used (`host_call`, or more where calls ran without the host,
        as CUDA graph replays do); recovery agrees on a number above it."""

    def dead_peers(self) -> List[int]:
        """Ranks whose process this transport saw end (never a live rank; [] where it cannot tell)."""

    def mask_cause(self, rank: int) -> str:
        """Why a call masked `rank` (it is in `failed_sources`): "process_end", "link" or "deadline"."""

    def peer_routes(self) -> List[Optional[str]]:
        """How this rank reaches each rank now: "self", "shm", "te", "cuda" or "collective" (None:
        not reached, a rank outside the view). A list of `num_ranks` entries, a copy."""

    def transfer_engine(self):
        """The `TeEndpoint` that memory peers reach over the Transfer Engine must be registered with
        (regions beyond the EP region, `peer_regions.py`), or None when this transport has none."""

    def te_peer(self, peer: int):
        """How `peer` is reached over the Transfer Engine (`one_sided.TePeer`: its session and region
        base), or None when it is not (its shared memory is mapped instead, or no TE at all)."""

    def destroy(self) -> None:
        """Release every resource (idempotent)."""


class RuntimeQueries:
    """Mooncake's `ep.Buffer` queries (its diagnostic scripts call them on `buffer.runtime`), answered for
    what the transport does here. Mixed into every transport; each says two facts about itself:
    `maps_peer_memory()` (same-host peers are reached through memory mapped from them) and
    `fast_path` (calls take the one-sided path rather than the collective fallback)."""

    fast_path = True

    def mask_cause(self, rank: int) -> str:
        """Why a call masked `rank` (not one of Mooncake's queries; every transport answers it for
        `Buffer.stats()` and the log line of the mask): its process ended (`dead_peers()`), else its
        deadline passed. Transports that also see failed links say `"link"` for those.

        Arguments:
            rank: a rank this transport appended to `failed_sources`.

        Returns:
            cause: `"process_end"` or `"deadline"`.
        """
        return "process_end" if rank in self.dead_peers() else "deadline"

    def maps_peer_memory(self) -> bool:
        """Whether same-host peers may be reached through their mapped memory (shm, CUDA IPC)."""
        return True

    def ibgda_disabled(self) -> bool:
        """Mooncake's `ibgda_disabled()`: True here on every transport, truthfully: no transport of this
        runtime posts RDMA from GPU kernels (the Transfer Engine's writes are host-initiated).

        Returns:
            disabled: bool, True.
        """
        return True

    def is_roce(self) -> bool:
        """Mooncake's `is_roce()`: whether the IBGDA NIC runs RoCE; False, there is no IBGDA NIC in use.

        Returns:
            roce: bool, False.
        """
        return False

    def p2p_enabled(self) -> bool:
        """Mooncake's `p2p_enabled()` (its `not disable_p2p`): whether same-host peers may be reached
        through peer-to-peer memory: True on `"shm"` and `"cuda"`, `not disable_p2p` on `"mooncake"`,
        False on `"collective"` (it never maps a peer's memory).

        Returns:
            enabled: bool.
        """
        return bool(self.maps_peer_memory())

    def use_fast_path(self) -> bool:
        """Mooncake's `use_fast_path()`: whether calls take the one-sided path (True on `"shm"`,
        `"mooncake"` and `"cuda"`) rather than the collective fallback (False on `"collective"`). Like
        Mooncake's, it describes the runtime the Buffer was built on, not its `_use_fallback` switch.

        Returns:
            fast: bool.
        """
        return bool(self.fast_path)


class HostMemoryTransport(RuntimeQueries):
    """What the transports that move host memory share: they take CPU tensors (`device` None) and
    every call runs through the Buffer, so its count of dispatches is the last call number."""

    device = None

    def latest_call(self, host_call: int) -> int:
        """The last call number this rank used: the Buffer's own count.

        Arguments:
            host_call: the Buffer's count of dispatches.

        Returns:
            call: int, `host_call`.
        """
        return host_call

    def transfer_engine(self):
        """None: no Transfer Engine (the one-sided transport over TE overrides this)."""
        return None

    def te_peer(self, peer: int):
        """None: no peer is reached over the Transfer Engine."""
        return None
