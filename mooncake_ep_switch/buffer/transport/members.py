"""Connecting a one-sided transport to the members of a view: one loop for every such transport.

The shm / Transfer Engine transport and the cuda transport both wait for each member's endpoint in
the store, reach it (map its region, open its IPC handle, connect its engine), drop every rank
outside the view, and meet the others at a barrier before returning, so that no rank destroys a
region a slower peer is about to map.
"""
from typing import Callable, Dict, Optional, Tuple, Type

from mooncake_ep_switch.buffer.membership import batch_reads
from mooncake_ep_switch.buffer.membership.protocol import MembershipError


def published_endpoint(membership, peer: int, deadline: float) -> dict:
    """`peer`'s endpoint as published in the store, waited for until `deadline`.

    Arguments:
        membership: the `Membership` whose store holds the endpoints.
        peer: the peer's rank.
        deadline: `time.monotonic()` deadline in seconds.

    Returns:
        endpoint: dict (what the peer's transport published, plus `"host_id"`).

    Raises:
        MembershipError: nothing valid was published before `deadline`.
    """
    def published():
        try:
            return membership.endpoint(peer)
        except MembershipError:
            return None

    return membership.wait_for(published, deadline, f"rank {peer}'s endpoint")


def connect_view(rank: int, num_ranks: int, view, membership, deadline: float, route: Callable[[int, dict], None],
                 drop: Callable[[int], None], unreachable_errors: Tuple[Type[BaseException], ...],
                 before_barrier: Optional[Callable[[], None]] = None, what: str = "the one-sided transports", *,
                 construction: bool, before_routes: Optional[Callable[[Dict[int, dict]], None]] = None) -> None:
    """Reach every member of `view` but this rank, drop every other rank, then a barrier of the view.

    Arguments:
        rank: this rank.
        num_ranks: group size.
        view: the membership `View` (epoch, ranks) to connect.
        membership: the `Membership` whose store holds the endpoints (None is refused).
        deadline: `time.monotonic()` deadline in seconds.
        route: `route(peer, endpoint)` reaches a member at its published endpoint (dict).
        drop: `drop(peer)` forgets a rank outside the view.
        unreachable_errors: exceptions of waiting or `route` that mean the member died since it
            was sealed into the view (it is named in the final error); any other propagates.
        before_barrier: called once every member was reached, before the barrier, or None.
        before_routes: called once with the endpoints read in one batch (rank -> endpoint; a member whose
            endpoint was not there yet is missing), before any `route`, or None. It must not raise for a peer.
        what: the transport's name in the error for a missing store.
        construction: True at the Buffer's construction (every member connects at once, its endpoint published
            and its incarnation bound before: each member's endpoint is read once all are there, in one wait);
            False after a membership change (a member that died after the seal never publishes: the endpoints
            are read as they are, and one missing is found at once, not at the deadline).

    Raises:
        RuntimeError: `membership` is None (no store).
        MembershipError: members that cannot be reached (named in the error), or a member missing
            from the final barrier.
    """
    if membership is None:
        raise RuntimeError(f"connect: {what} exchange endpoints through the store; pass store= to Buffer")
    unreachable, why = [], []
    # Every member's endpoint in a constant number of store calls (not a few per member); one still missing at the
    # deadline is read alone, which names why. At construction every member connects at once, its endpoint
    # published before: the bindings and then the endpoints are read when all are there, one wait each. After a
    # membership change a member that died after the seal never publishes and must be found missing at once, not
    # at the deadline: the endpoints are read as they are.
    found = batch_reads.published_endpoints(membership, [p for p in view.ranks if p != rank], deadline,
                                            together=view.epoch if construction else None)
    if before_routes is not None:
        before_routes(found)
    for peer in range(num_ranks):
        if peer == rank:
            continue
        if peer not in view.ranks:
            drop(peer)
            continue
        try:
            route(peer, found[peer] if peer in found else published_endpoint(membership, peer, deadline))
        except unreachable_errors as error:
            unreachable.append(peer)  # died since it was sealed into the view
            why.append(f"rank {peer}: {type(error).__name__}: {error}")
    if before_barrier is not None:
        before_barrier()
    # Nobody returns (and could destroy its region, closing what a slower peer is about to map)
    # before every member has reached every region.
    membership.barrier(f"connect/{view.epoch}", view.ranks, deadline)
    if unreachable:
        raise MembershipError(f"members {unreachable} of epoch {view.epoch} cannot be reached ({'; '.join(why)})",
                              unreachable)
