"""Entry points for elastic EP groups: a replacement rank joins, survivors re-admit it.

A replacement process (same rank id as the dead one) does::

    ticket = mooncake_ep_switch.elastic.join(store, rank, num_ranks)
    buffer = Buffer(ticket, num_ep_buffer_bytes)     # maps nothing yet; not a member
    ...                                               # warm up (load weights, build graphs)
    buffer.update_ep_member()                         # registers as joining, waits to be admitted

and every survivor, when `buffer.pending_joiners()` is non-empty (the joiner is waiting inside
`update_ep_member()`) or after it saw failures, calls `buffer.update_ep_member()` too: only members
seal the next view, a joiner never does. The store must outlive every rank (a TCPStore hosted by
the launcher or the torchrun agent, or an etcd cluster); `connect_store()` opens a client to it.

The ticket names the group as the members' Buffers did: `group_ranks` (the global ranks of the
EP group, default every rank of a `num_ranks` world) and, when the members passed `store=` to
Buffer, `keep_prefix=True` with a handle to that same store (its PrefixStore prefixes count).
Without `store=` the members used the default group's store, whose torch-internal prefixes are
removed, so any client of the server will do.

Growing the group with new processes (new rank ids): every member calls `grow(buffer, R')` and polls
it at each step boundary, each newcomer calls `join_grow(store, rank, R', bytes, old_num_ranks=R)`.
"""
from datetime import timedelta
from typing import Optional, Sequence

from mooncake_ep_switch.buffer.membership.join_ticket import JoinTicket  # noqa: F401  (re-exported: the public name)
from mooncake_ep_switch.checks import check_int


def connect_store(host: str, port: Optional[int] = None, timeout_s: float = 60.0, *, user: Optional[str] = None,
                  password: Optional[str] = None, ca_cert: Optional[str] = None, cert: Optional[str] = None,
                  key: Optional[str] = None, job: Optional[str] = None):
    """Open a client of the group's store: the launcher's TCPStore, or an etcd cluster by URL.

    `connect_store(host, port)` opens a TCPStore client. `connect_store("etcd://h1:2379,h2:2379,h3:2379/prefix")`
    opens an `EtcdStore` (no single point of failure: any one member of a 3-member cluster may be
    lost), checks that the cluster answers and claims `prefix` for this job (docs/recovery.md, "The
    etcd store"); `etcds://` for HTTPS. Every check comes before the one write (the prefix's owner record).

    Arguments:
        host: store host (the launcher's or agent's address), or an etcd URL
            `etcd://[user:password@]host:port[,host:port...]/prefix[?job=&ca=&cert=&key=]`.
        port: the TCPStore's port (None with an etcd URL).
        timeout_s: deadline for connecting and for each store operation (finite, > 0).
        user, password: etcd credentials (instead of the URL's `user:password@`).
        ca_cert, cert, key: etcd TLS files: CA bundle, client certificate and its key (with `etcds://`).
        job: the job's identity on the etcd prefix (default: `MEP_JOB_ID`, else derived from
            `MEP_JOB_SECRET`); a prefix claimed by another job is refused.

    Returns:
        store: a `torch.distributed.TCPStore` client, or a `mooncake_ep_switch.store.EtcdStore`.

    Raises:
        TypeError, ValueError: `timeout_s` is not a finite number of seconds > 0; a malformed etcd URL
            (naming `host`), a port with an etcd URL or none without, etcd options with a TCPStore, a
            prefix another job owns.
        FileNotFoundError: a TLS file that does not exist.
        StoreUnavailable: no etcd member answered within `timeout_s`.
        PermissionError: the etcd cluster refused the credentials or certificate.
    """
    import torch.distributed as dist

    from mooncake_ep_switch.buffer.membership.protocol import check_seconds
    from mooncake_ep_switch.store.connect import connect_etcd, is_etcd_url

    timeout_s = check_seconds("timeout_s", timeout_s)
    etcd_options = dict(user=user, password=password, ca_cert=ca_cert, cert=cert, key=key, job=job)
    if is_etcd_url(host) or (isinstance(host, str) and "://" in host):
        if port is not None:
            raise ValueError(f"port: expected None with an etcd URL (its ports are in the URL), got {port!r}")
        return connect_etcd(host, timeout_s, argument="host", **etcd_options)
    given = [name for name, value in etcd_options.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: etcd options, but host {host!r} is not an etcd:// URL")
    if port is None:
        raise ValueError(f"port: expected the TCPStore's port with host {host!r}, got None")
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def join(store, rank: int, num_ranks: int, *, prefix: str = "mep", group_ranks: Optional[Sequence[int]] = None,
         keep_prefix: bool = False, buffer_index: Optional[int] = None) -> JoinTicket:
    """Take over `rank` of an elastic EP group as a replacement process.

    Arguments:
        store: client of the group's store (see `connect_store`).
        rank: the group rank to take over, in [0, num_ranks).
        num_ranks: EP group size.
        prefix: membership key prefix (as the group's Buffers use; default "mep").
        group_ranks: global ranks of the EP group in group-rank order, as
            `torch.distributed.get_process_group_ranks(group)` gave the members; None (default)
            for a group of the whole world, `range(num_ranks)`.
        keep_prefix: True when the members passed `store=` to Buffer and `store` is that store
            (its PrefixStore prefixes are part of the keys); False (default) when they used the
            default group's store (prefixes removed: any client of the server names the same keys).
        buffer_index: with several Buffers of one EP group (two models, two streams), which one this
            ticket joins: its place, counted from 1, in the order every member built its Buffers of the
            group. None (default): this process's n-th joined Buffer of the group joins the n-th (a
            replacement that builds its Buffers in the members' order needs nothing more); pass it
            when the members destroyed and rebuilt Buffers of the group (each rebuild counts).

    Returns:
        ticket: pass it to `Buffer(ticket, num_ep_buffer_bytes)`, then call `update_ep_member()`.

    Raises:
        TypeError: a non-int rank, num_ranks, group rank or buffer_index, a non-str prefix, a non-bool keep_prefix.
        ValueError: rank outside [0, num_ranks), num_ranks < 1, group_ranks not num_ranks
            distinct non-negative ranks, or buffer_index < 1.
    """
    num_ranks = check_int("num_ranks", num_ranks, 1)
    rank = check_int("rank", rank, 0)
    if rank >= num_ranks:
        raise ValueError(f"rank: expected 0 <= rank < num_ranks={num_ranks}, got {rank}")
    if not isinstance(prefix, str) or not prefix:
        raise TypeError(f"prefix: expected a non-empty str, got {prefix!r}")
    if not isinstance(keep_prefix, bool):
        raise TypeError(f"keep_prefix: expected a bool, got {type(keep_prefix).__name__}")
    if group_ranks is not None:
        group_ranks = tuple(check_int("group_ranks[i]", r, 0) for r in group_ranks)
        if len(group_ranks) != num_ranks or len(set(group_ranks)) != num_ranks:
            raise ValueError(f"group_ranks: expected {num_ranks} distinct global ranks, got {list(group_ranks)}")
    if buffer_index is not None:
        buffer_index = check_int("buffer_index", buffer_index, 1)
    return JoinTicket(store, rank, num_ranks, prefix, group_ranks, keep_prefix, buffer_index)


def admit(buffer, joiner: int, timeout_s: float = 60.0):
    """Re-admit `joiner`'s replacement: a member waits until it is waiting to join, then every rank
    (the replacement too) calls `update_ep_member()`.

    Arguments:
        buffer: this rank's `Buffer` (a member's, or the replacement's own, made from a `join` ticket).
        joiner: the rank being replaced.
        timeout_s: seconds for the replacement to show up and for the agreement (finite, > 0).

    Returns:
        view: the agreed `View` (epoch, ranks).

    Raises:
        TimeoutError: the replacement never asked to join.
    """
    import time

    deadline = time.monotonic() + timeout_s
    while buffer.rank != joiner and joiner not in buffer.pending_joiners():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {joiner}'s replacement never asked to join within {timeout_s} s")
        time.sleep(0.01)
    return buffer.update_ep_member(timeout_s=timeout_s)


def grow(buffer, num_ranks: int, build=None, timeout_s: Optional[float] = None):
    """Grow the EP group to `num_ranks` ranks with new processes (scale-up); a member's side.

    Every member of the view calls it with the same arguments, between steps, at the same step; the
    newcomers (ranks `M .. num_ranks - 1` of the grown group, `M` the members of the view) call
    `join_grow`. The members are ranks `0 .. M-1` of the grown group in the order of their ids: the
    same ids without a shrink before, renumbered densely after one (`eplb.renumber_placement` maps
    the placement alike). The grown Buffer runs on the collective fallback where the members' did
    (`_use_fallback`), on every rank of it. The next Buffer of the grown
    group is built in the background while `buffer` keeps serving; then call the returned operation's
    `poll(step)` at every step boundary: it returns None (serve the step on `buffer`) until every rank
    is built and the members agree the step to switch at, then a `GrowResult` to serve that step on
    (buffer/membership/grow.py; docs/recovery.md, "Growing the group").

    Arguments:
        buffer: this member's current `Buffer` (a member of its view, after a shrink too; a store).
        num_ranks: the grown size, in `(M, MAX_EP_RANKS]` (`MAX_EP_RANKS` = 64).
        build: optional `build(new_buffer)` run on every rank once the new Buffer exists, e.g. the grown
            placement's slots (`eplb.grow_placement.grow_slots`); its value is `GrowResult.built`.
        timeout_s: deadline of the build in seconds (default: the connect timeout setting).

    Returns:
        operation: a `GrowOperation`; `operation.poll(step)` at every step boundary.

    Raises:
        TypeError, ValueError: `num_ranks` not an int larger than the view, or past `MAX_EP_RANKS` (named).
        MembershipError: this rank is no member.
        RuntimeError: a grow or a shrink of this Buffer in progress, or another member asked another resize
            (two resizes at once). Nothing changed in any of these cases.
    """
    from mooncake_ep_switch.buffer.buffer import Buffer
    from mooncake_ep_switch.buffer.membership.grow import GrowOperation

    return GrowOperation(buffer, num_ranks, Buffer, build=build, timeout_s=timeout_s)


def join_grow(store, rank: int, num_ranks: int, num_ep_buffer_bytes: int, *, old_num_ranks: int,
              group_ranks: Optional[Sequence[int]] = None, prefix: str = "mep", build=None, timeout_s: float = 60.0):
    """A newcomer's side of `grow`: wait for the members' request, build the grown Buffer with them.

    Arguments:
        store: client of the job's store (as `join`'s; torch's prefixes are removed).
        rank: this newcomer's rank id in the grown group, in `[old_num_ranks, num_ranks)`.
        num_ranks: the grown size (the members' request must name it).
        num_ep_buffer_bytes: this newcomer's buffer size (must equal the members').
        old_num_ranks: the members of the view the group grows from: its size, or fewer after a shrink
            (then pass `group_ranks`).
        group_ranks: the members' group's global ranks in group order, removed ones too (None:
            `range(old_num_ranks)`).
        prefix: the members' key prefix (default "mep").
        build: as `grow`'s (e.g. `grow_slots(new, shape, target, old_num_ranks, None)`: copies from the members).
        timeout_s: deadline of the whole join in seconds.

    Returns:
        result: a `GrowResult`: serve from `result.step` on `result.buffer`.

    Raises:
        TypeError, ValueError: a bad argument, or `num_ranks`, `old_num_ranks` or `num_ep_buffer_bytes` other
            than the members' request (named; the grow then fails on every member, whose Buffers serve on).
        MembershipError: no request before the deadline, the grow failed elsewhere (named), or this newcomer
            stalled past the switch-over and the members sealed a view without it meanwhile (named).
    """
    from mooncake_ep_switch.buffer.buffer import Buffer
    from mooncake_ep_switch.buffer.membership.grow import join_grow as join

    return join(store, rank, num_ranks, num_ep_buffer_bytes, Buffer, old_num_ranks=old_num_ranks,
                group_ranks=group_ranks, prefix=prefix, build=build, timeout_s=timeout_s)
