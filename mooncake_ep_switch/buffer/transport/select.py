"""Which transport a Buffer runs on: the `transport=` argument resolved and built (docs/transports.md).

`"auto"`: no EP region -> the collective fallback; a usable CUDA device here, every rank on one
host and p2p allowed -> `"cuda"` (device kernels over CUDA IPC; the Buffer then takes CUDA tensors
on the current device); every rank on one host (and p2p allowed) -> `"shm"`; else the Mooncake
Transfer Engine when it imports here (`"mooncake"`: shm inside a host, the engine across), else the
collective fallback. `"host"`: the same choice among the transports that move host memory (CPU
tensors on a machine with a GPU), never `"cuda"`.
"""
from typing import Callable, Sequence

from mooncake_ep_switch.buffer.transport.collective import CollectiveTransport
from mooncake_ep_switch.buffer.transport.contract import Transport
from mooncake_ep_switch.buffer.transport.cuda import CudaTransport, cuda_unavailable_reason
from mooncake_ep_switch.buffer.transport.one_sided import OneSidedTransport

TRANSPORTS = ("auto", "host", "cuda", "shm", "mooncake", "collective")
# The transports that map peers' memory on this host, and what disable_p2p=True forbids in them.
PEER_MEMORY = {"cuda": "maps peers' device memory (CUDA IPC)", "shm": "uses peer-to-peer shared memory"}


def transfer_engine_available() -> bool:
    """Whether the Mooncake Transfer Engine imports here (it needs Debian's libibverbs1)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def make_transport(requested: str, *, group, rank: int, num_ranks: int, num_ep_buffer_bytes: int, settings,
                   disable_p2p: bool, host_ids: Callable[[], Sequence], view_change) -> Transport:
    """Resolve `requested` and build the transport.

    Arguments:
        requested: one of `TRANSPORTS` (checked by the Buffer).
        group: the process group (None for a replacement; only the collective uses it).
        rank: this EP rank.
        num_ranks: EP group size.
        num_ep_buffer_bytes: the Buffer's region bytes (0: no region).
        settings: the Buffer's `config.Settings`.
        disable_p2p: the Buffer's `disable_p2p` (forbids shared memory between ranks).
        host_ids: returns every rank's host id (collective over the group: called only when needed).
        view_change: the collective's callback that agrees on the survivors' view.

    Returns:
        transport: a `Transport`.

    Raises:
        ValueError: `"shm"` or `"cuda"` with `disable_p2p`, or with ranks on several hosts.
        RuntimeError: `"cuda"` where no CUDA device can be used (the reason).
    """
    asked = requested
    if requested in ("auto", "host"):
        same_host = len(set(host_ids())) == 1  # collective: every rank asks, whatever it then picks
        if num_ep_buffer_bytes == 0:
            requested = "collective"  # no region to write into: only collectives can run
        elif same_host and not disable_p2p:
            requested = "cuda" if requested == "auto" and not cuda_unavailable_reason() else "shm"
        elif transfer_engine_available():
            requested = "mooncake"
        else:
            requested = "collective"
    if requested == "collective":
        # The fallback survives a peer lost mid-collective: it agrees on the survivors' view.
        return CollectiveTransport(group, rank, num_ranks, view_change=view_change, settings=settings)
    if requested in PEER_MEMORY and requested == asked:  # "auto"/"host" found one host already
        if disable_p2p:
            raise ValueError(f"transport: '{requested}' {PEER_MEMORY[requested]}, which disable_p2p=True forbids")
        found = set(host_ids())
        if len(found) != 1:
            raise ValueError(f"transport: '{requested}' needs every rank on this host, got host ids {sorted(found)}")
    if requested == "cuda":
        return CudaTransport(rank, num_ranks, num_ep_buffer_bytes, settings)
    return OneSidedTransport(requested, rank, num_ranks, num_ep_buffer_bytes, settings, allow_shm=not disable_p2p)
