"""A grow's waits in the store (buffer/membership/grow.py): the build's own client and the count barriers of its ranks.

The members build the grown Buffer on a background thread while their current Buffer serves and polls the
switch-over through its store worker; the build's waits (the gloo group's rendezvous blocks its store client
until every rank came) therefore go through a client of their own. The ranks of a build meet in counts in the
store rather than in gloo barriers, so that the grow's failed record, or a rank seen ended, ends every wait at
once (a gloo rendezvous or barrier waits for a rank that died or stalls until its deadline).
"""
import time
from typing import Callable, Optional

from mooncake_ep_switch.buffer.membership.protocol import MembershipError
from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore

__all__ = ["own_client", "store_barrier"]

_POLL_MAX_S = 0.05


def own_client(store):
    """A client of `store`'s server of its own.

    Arguments:
        store: the group's store (a `BoundedStore`, or a store as given).

    Returns:
        client: `clone()` of the store under the `BoundedStore` (a TCPStore's, under its PrefixStores, or an
            EtcdStore's), else `store` itself (a store that cannot be cloned).
    """
    inner = store.inner if isinstance(store, BoundedStore) else store
    try:
        return inner.clone()
    except (AttributeError, RuntimeError):  # no clone() (a Python Store's is pure virtual in torch)
        return store


def store_barrier(store, keys: str, name: str, num_ranks: int, deadline: float, what: str,
                  dead: Optional[Callable[[], list]] = None) -> None:
    """Wait until the `num_ranks` ranks of a grow's build have `what` (each adds one to `<keys>/<name>`).

    Arguments:
        store: a client of the group's store.
        keys: the grow attempt's key prefix (`<group>/grow/<attempt>`; its failure record is `<keys>/failed`).
        name: the count's key under `keys`.
        num_ranks: ranks of the grown group.
        deadline: `time.monotonic()` value of the build's deadline.
        what: what every rank has done, for messages (e.g. "been built and loaded").
        dead: optional callable returning the ranks seen ended (e.g. the new Buffer's `dead_peers`).

    Raises:
        MembershipError: the grow failed elsewhere (its failed record, named), a rank `dead()` names ended, or
            the deadline passed first (how many ranks were missing).
    """
    count = f"{keys}/{name}"
    store.add(count, 1)
    pause = 0.001
    while True:
        failed = store.get(f"{keys}/failed").decode() if store.check([f"{keys}/failed"]) else ""
        if failed:
            raise MembershipError(f"the grow failed meanwhile ({failed})")
        if store.add(count, 0) >= num_ranks:
            return
        ended = dead() if dead is not None else []
        if ended:
            raise MembershipError(f"ranks {ended} of the grown group ended before every rank had {what}")
        if time.monotonic() >= deadline:
            raise MembershipError(f"{num_ranks - store.add(count, 0)} of the {num_ranks} ranks had not {what} by the "
                                  "build's deadline (stalled, or slower than timeout_s)")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)
