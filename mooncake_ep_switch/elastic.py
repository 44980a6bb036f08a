"""Entry points for elastic EP groups: a replacement rank joins, survivors re-admit it.

A replacement process (same rank id as the dead one) does::

    ticket = mooncake_ep_switch.elastic.join(store, rank, num_ranks)
    buffer = Buffer(ticket, num_ep_buffer_bytes)     # maps nothing yet; state "joining"
    ...                                               # warm up (load weights, build graphs)
    buffer.update_ep_member()                         # admitted: full membership from here on

and every survivor, when `buffer.pending_joiners()` is non-empty (or after it saw failures),
calls `buffer.update_ep_member()` too. The store must outlive every rank (a TCPStore hosted by the
launcher or the torchrun agent); `connect_store()` opens a client to it.
"""
from datetime import timedelta
from typing import Any, NamedTuple


class JoinTicket(NamedTuple):
    """What a replacement rank passes to `Buffer(...)` in place of a process group.

    Fields:
        store: client of the group's store.
        rank: the EP rank id this process takes over.
        num_ranks: EP group size.
        prefix: membership key prefix of the EP group.
    """

    store: Any
    rank: int
    num_ranks: int
    prefix: str = "mep"


def connect_store(host: str, port: int, timeout_s: float = 60.0):
    """Open a client of the group's TCPStore.

    Arguments:
        host: store host (the launcher's or agent's address).
        port: store port.
        timeout_s: deadline for connecting and for each store operation.

    Returns:
        store: a `torch.distributed.TCPStore` client.
    """
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def join(store, rank: int, num_ranks: int, *, prefix: str = "mep") -> JoinTicket:
    """Take over `rank` of an elastic EP group as a replacement process.

    Arguments:
        store: client of the group's store (see `connect_store`).
        rank: the rank id to take over, in [0, num_ranks).
        num_ranks: EP group size.
        prefix: membership key prefix (as the group's Buffers use; default "mep").

    Returns:
        ticket: pass it to `Buffer(ticket, num_ep_buffer_bytes)`, then call `update_ep_member()`.
    """
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank: expected 0 <= rank < num_ranks={num_ranks}, got {rank}")
    return JoinTicket(store, rank, num_ranks, prefix)
