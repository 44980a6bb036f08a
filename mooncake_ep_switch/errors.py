"""Every error the runtime raises of its own, under one base class (issue 24 item 3).

A caller catches `MooncakeEpError` for "anything this runtime raised", `BufferDestroyed` for "the
Buffer is gone", or one family below. Each class also keeps the builtin base it had before
(`RuntimeError`, `ConnectionError`), so code that caught those goes on working. Bad arguments stay
`ValueError` / `TypeError`, as the peers' callers (DeepEP, Mooncake EP, vLLM) expect.

    MooncakeEpError
    ├── BufferDestroyed (RuntimeError)   a call, hook or event of a destroyed Buffer
    ├── MembershipError (RuntimeError)   not in the agreed view, a deadline passed, a bad record
    │   └── LeftOut                      this rank was left out of a sealed view
    ├── SwitchError (RuntimeError)       a layout switch failed; the layout is "invalid"
    │   └── SwitchFenced                 peers declared this rank dead during the switch
    ├── PeerLost (RuntimeError)          a collective failed because a peer of the group is gone
    ├── StoreUnavailable (TimeoutError)  the group's store did not answer by the operation's deadline
    ├── StoreRefused (RuntimeError)      the group's store (an etcd cluster) refused a request
    ├── PeerBusy (ConnectionError)       a transfer refused: abandoned transfers with that peer may still land
    ├── TransferFailed (ConnectionError) TE failed a transfer while the peer's engine answers
    └── SlotsNotLoaded (RuntimeError)    a peer's expert slots are not loaded yet: nothing was read from them

This module imports nothing of the package: every room may raise these.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["MooncakeEpError", "BufferDestroyed", "MembershipError", "LeftOut", "SwitchError", "SwitchFenced",
           "PeerLost", "PeerBusy", "TransferFailed", "StoreUnavailable", "StoreRefused", "SlotsNotLoaded"]


class MooncakeEpError(Exception):
    """Base class of every error the runtime raises of its own (not bad arguments)."""


class BufferDestroyed(MooncakeEpError, RuntimeError):
    """A call, hook or event of a Buffer (or its transport) that was destroyed, explicitly or by
    garbage collection, or a call in flight that destroy() aborted."""


class MembershipError(MooncakeEpError, RuntimeError):
    """Raised when this rank is not part of the agreed view, a deadline passed, or a record is bad.

    Attributes:
        missing: ranks that did not arrive where they were waited for (may be empty).
    """

    def __init__(self, message: str, missing=()):
        super().__init__(message)
        self.missing = tuple(missing)


class LeftOut(MembershipError):
    """This rank was left out of a sealed view: it is no longer a member.

    Attributes:
        epoch: the epoch whose sealed view lacks this rank.
        members: that view's member ranks.
    """

    def __init__(self, message: str, epoch: int, members: Sequence[int]):
        super().__init__(message)
        self.epoch = epoch
        self.members = tuple(members)


class SwitchError(MooncakeEpError, RuntimeError):
    """A switch failed in a way this rank cannot repair; its layout is "invalid"."""


class SwitchFenced(SwitchError):
    """Peers declared this rank dead during the switch (it was late); it must leave the group."""


class PeerLost(MooncakeEpError, RuntimeError):
    """A collective failed because a peer of the group is gone (gloo: connection reset)."""


class StoreUnavailable(MooncakeEpError, TimeoutError):
    """The group's store did not answer a call by the deadline of the operation in progress (its host is
    stalled or unreachable: `buffer/membership/store_deadline.py`). Not a `MembershipError` (no record was
    read, nothing was decided): the operation can be called again once the store answers; the data plane
    never needs the store.

    Attributes:
        store: the store, `"host:port"` when known.
        operation: the operation whose deadline passed (e.g. "update_ep_member").
        timeout_s: that operation's budget in seconds.
    """

    def __init__(self, message: str, store: str = "", operation: str = "", timeout_s: float = 0.0):
        super().__init__(message)
        self.store = store
        self.operation = operation
        self.timeout_s = timeout_s


class StoreRefused(MooncakeEpError, RuntimeError):
    """The group's store refused a request that reached it (an etcd cluster's answer other than "unavailable",
    "unauthenticated" or "permission denied", which raise `StoreUnavailable` and `PermissionError`); the
    message names the store, the call and the cluster's reason (`store/etcd_client.py`)."""


class PeerBusy(MooncakeEpError, ConnectionError):
    """A transfer refused before anything was submitted: transfers abandoned at an earlier deadline
    are still in flight inside the Transfer Engine, to or from that peer (or, for a read, into the
    same local bytes). Such a transfer may still land (a write over the peer's newer bytes, a read
    over local memory reused since), so nothing more goes to that peer, and no read lands in those
    bytes, until the engine has finished or failed every one of them (`TeEndpoint.abandoned_with`,
    `wait_reaped`)."""


class TransferFailed(MooncakeEpError, ConnectionError):
    """The Transfer Engine failed a transfer although the peer's engine answers a connection: a range
    outside the memory the peer registered (or unregistered since); a peer that stalled the transfer
    (TE's stall timeout; a stopped process's host still accepts connections); or the first transfer
    after TE lost its only connection to the peer (a link outage, `MC_TCP_LANES_PER_PEER=1`): TE fails it
    at once and starts its 1 s reconnect cooldown, after which it connects again. A caller that knows its
    ranges are valid (a connect probe, `one_sided.write_probe`) may try a fast failure again."""


class SlotsNotLoaded(MooncakeEpError, RuntimeError):
    """A peer's expert slots hold no weights yet (it has not finished `ExpertSlots.load`, or the copies
    of a grow or a replacement's restore): its frame table says so, and nothing was read from its
    frames. A rebalance staging from it waits for it, up to its deadline (`eplb/online.py`).

    Attributes:
        rank: the peer whose slots are not loaded.
    """

    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank
