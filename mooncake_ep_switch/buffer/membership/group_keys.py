"""Which EP group a Buffer belongs to, and the store keys that name it.

A Buffer is built from a process group (a member) or a `JoinTicket` (a replacement); either way
its membership keys are `<caller's prefix>/grp-<hash of the group's global ranks>/g<generation>`,
so several EP groups of one job share a store without meeting, and a replacement names the same
keys as the members it joins. `view_group` builds the gloo group of one sealed view.
"""
import hashlib
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.join_ticket import JoinTicket
from mooncake_ep_switch.buffer.membership.protocol import View, check_seconds
from mooncake_ep_switch.buffer.membership.records import RecordStore


class GroupIdentity(NamedTuple):
    """What `resolve_group` found: who this rank is, in which group, under which keys.

    Fields:
        group: the process group (None for a replacement built from a `JoinTicket`).
        rank: this rank in the EP group.
        num_ranks: EP group size.
        prefix: membership key prefix of the EP group (`group_prefix`), before the generation.
        store: the store the membership lives in, or None when there is none.
        joining: built from a `JoinTicket` (a replacement, not a member yet).
        buffer_index: the ticket's `buffer_index` (which Buffer of the group it joins), else None.
    """

    group: Any
    rank: int
    num_ranks: int
    prefix: str
    store: Any
    joining: bool
    buffer_index: Optional[int] = None


def resolve_group(group, store=None) -> GroupIdentity:
    """Resolve `Buffer(group, ..., store=)` into this rank's place in its EP group and its store.

    Arguments:
        group: a torch.distributed process group, None (the default group) or a `JoinTicket`.
        store: the store the caller passed, or None for the default group's (torch's prefixes
            removed, so a replacement's client of the same server names the same keys).

    Returns:
        identity: a `GroupIdentity`.

    Raises:
        ValueError: no group and torch.distributed is not initialized, or this process is not in `group`.
    """
    if isinstance(group, JoinTicket):
        group_ranks = group.group_ranks if group.group_ranks is not None else range(group.num_ranks)
        store = group.store if group.keep_prefix else root_store(group.store)
        return GroupIdentity(None, group.rank, group.num_ranks, group_prefix(group_ranks, group.prefix), store, True,
                             group.buffer_index)
    if group is None:
        if not dist.is_initialized():
            raise ValueError("group: expected a process group (torch.distributed is not initialized), got None")
        group = dist.group.WORLD
    try:
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError):  # a group built from a store, not registered (a grown group: grow.py)
        if not callable(getattr(group, "rank", None)) or not callable(getattr(group, "size", None)):
            raise
        rank, num_ranks = group.rank(), group.size()
    if rank < 0:
        raise ValueError("group: this process is not a member of the group it passed")
    try:
        group_ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, KeyError, AttributeError):
        group_ranks = range(num_ranks)
    # The group's identity keys its membership: several groups (attention DP, EP, several models)
    # share one store without meeting. A store the caller passes keeps its own prefixes; the
    # default group's store loses torch's, which a replacement's client lacks.
    if store is None:
        default = default_store()
        store = None if default is None else root_store(default)
    return GroupIdentity(group, rank, num_ranks, group_prefix(group_ranks, "mep"), store, False)


def default_store():
    """The default group's store (the launcher's TCPStore), or None if there is none."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def root_store(store):
    """The store under any PrefixStore wrappers: every handle to one server gives the same keys.

    The default group's store arrives wrapped by torch.distributed's own prefixes, a replacement
    rank's store client does not; membership keys of a group on the default store must not depend
    on which handle a rank holds. (A store the caller passes explicitly keeps its prefixes.)

    Arguments:
        store: a torch.distributed Store, possibly wrapped in PrefixStores.

    Returns:
        store: the innermost Store (the argument itself when not a PrefixStore).
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def group_prefix(group_ranks: Sequence[int], base: str = "mep") -> str:
    """Key prefix of one EP group: its identity is the global ranks it was built from, in group order.

    Two groups of one job (attention DP and EP, several models) never share membership keys, even
    on one store; a replacement names its group by the same ranks (`elastic.join(group_ranks=...)`).

    Arguments:
        group_ranks: the group's global ranks in group-rank order (`dist.get_process_group_ranks`).
        base: the caller's key prefix.

    Returns:
        prefix: str, `"<base>/grp-<16 hex digits>"`.
    """
    text = ",".join(str(int(r)) for r in group_ranks)
    return f"{base}/grp-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


# Generations of an EP group (key prefix, rank) that live joined Buffers of this process hold.
_JOINED: Dict[Tuple[str, int], Dict[int, int]] = {}
# The same for the member Buffers (built from a process group) of this process.
_MEMBER_HELD: Dict[Tuple[str, int], Dict[int, int]] = {}
_BUILT: Set[Tuple[str, int]] = set()  # groups (key prefix, rank) this process has built any Buffer of
_JOINED_LOCK = threading.Lock()


def held_generations(base: str, rank: int) -> Tuple[Set[int], bool]:
    """The generations of group `base` that live Buffers of this process hold as `rank`, and whether this
    process ever built a Buffer of that group (`replacement.choose_generation` reads both).

    Arguments:
        base: key prefix of the EP group (see `group_prefix`).
        rank: this EP rank.

    Returns:
        held: set of int generations with a live Buffer (member or joined) of this process.
        built: bool, this process built (and perhaps destroyed) a Buffer of the group.
    """
    key = (base, rank)
    with _JOINED_LOCK:
        held = {n for n, count in _JOINED.get(key, {}).items() if count > 0}
        held |= {n for n, count in _MEMBER_HELD.get(key, {}).items() if count > 0}
        return held, key in _BUILT


def joined_generations(base: str, rank: int) -> Set[int]:
    """The generations of group `base` that live joined Buffers (replacements) of this process hold as `rank`."""
    with _JOINED_LOCK:
        return {n for n, count in _JOINED.get((base, rank), {}).items() if count > 0}


def generation_of(prefix: str) -> int:
    """The generation `n` of a key prefix `"<group prefix>/g<n>"` (what `generation_prefix` returns)."""
    return int(prefix.rsplit("/g", 1)[1])


def hold_joined(base: str, rank: int, generation: int) -> Callable[[], None]:
    """Count one joined Buffer of this process in `generation` of group `base` (`held_generations`).

    Arguments:
        base: key prefix of the EP group.
        rank: this EP rank.
        generation: the generation it joins.

    Returns:
        release: call once when the Buffer is gone.
    """
    with _JOINED_LOCK:
        return _hold(_JOINED, (base, rank), generation)


def _hold(table: Dict[Tuple[str, int], Dict[int, int]], key: Tuple[str, int], generation: int) -> Callable[[], None]:
    """Count one live Buffer of `generation` in `table` (the caller holds the lock); returns its release."""
    held = table.setdefault(key, {})
    held[generation] = held.get(generation, 0) + 1
    _BUILT.add(key)

    def release() -> None:
        with _JOINED_LOCK:
            count = held.get(generation, 0) - 1
            if count > 0:
                held[generation] = count
            else:
                held.pop(generation, None)

    return release


def generation_prefix(store, rank: int, num_ranks: int, base: str = "mep", joining: bool = False,
                      buffer_index: Optional[int] = None) -> Tuple[
        str, Callable[[], None]]:
    """Key prefix of the Buffer being built: one membership record per Buffer generation.

    Every rank constructs its Buffers of one group in the same order, so the n-th Buffer of every
    rank gets generation n and never reads an endpoint a previous Buffer left in the store. A
    joining rank does the same with the generations the members have reached: its first joined
    Buffer of the group takes generation 1, its second generation 2, ..., skipping generations a
    live joined Buffer of this process already holds (so a replacement that rebuilds the Buffers of
    an engine with two of them, in the order the members built theirs, lands each in its own, and a
    joined Buffer destroyed after a failed join frees its generation for the next attempt; when
    every generation is held, a Buffer abandoned in this process is being replaced: the newest).

    Arguments:
        store: a torch.distributed Store, used as given.
        rank: this EP rank.
        num_ranks: EP group size.
        base: key prefix of the EP group (see `group_prefix`).
        joining: a replacement rank: take a generation the members reached instead of advancing its own counter.
        buffer_index: a joining rank's explicit generation (>= 1), or None for the rule above.

    Returns:
        prefix: str, `"<base>/g<n>"` for generation `n`.
        release: call once when the Buffer is gone (frees the generation it holds in this process).

    Raises:
        MembershipError: a generation counter in the store holds something other than a count, or
            `buffer_index` names a generation no member has reached.
    """
    from mooncake_ep_switch.buffer.membership.protocol import MembershipError

    counters = RecordStore(dist.PrefixStore(f"{base}/generation", store), f"{base}/generation")  # no incarnation
    if not joining:
        generation = counters.bump_counter(str(rank))
        with _JOINED_LOCK:
            return f"{base}/g{generation}", _hold(_MEMBER_HELD, (base, rank), generation)
    newest = max(counters.read_counter(str(r)) for r in range(num_ranks))
    if newest == 0:  # no member has built a Buffer of this group yet
        return f"{base}/g0", lambda: None
    key = (base, rank)
    with _JOINED_LOCK:
        held = _JOINED.setdefault(key, {})  # generation -> live joined Buffers of this process in it
        if buffer_index is not None:
            if buffer_index > newest:
                raise MembershipError(f"buffer_index: expected one of the group's Buffers 1..{newest} (the generations "
                                      f"its members reached), got {buffer_index}")
            generation = buffer_index
        else:
            # Every generation already held: a Buffer abandoned in this process is being replaced; the newest.
            generation = next((n for n in range(1, newest + 1) if n not in held), newest)
        release = _hold(_JOINED, key, generation)
    counters.store.set(str(rank), str(newest))
    return f"{base}/g{generation}", release


def view_group(store, view: View, rank: int, timeout_s: float, prefix: str = "mep"):
    """A gloo process group over the members of `view` (group rank = position in `view.ranks`).

    Built from the store with the epoch in its key prefix, so it never meets a previous epoch's
    group. Collective over the members.

    Arguments:
        store: the torch.distributed Store shared by the members.
        view: the `View` whose members form the group; `rank` must be one of them.
        rank: this EP rank.
        timeout_s: the group's timeout in seconds (finite, > 0).
        prefix: key prefix of the EP group.

    Returns:
        group: a `torch.distributed.ProcessGroupGloo`.

    Raises:
        TypeError, ValueError: `timeout_s` is not a finite number of seconds > 0.
    """
    from datetime import timedelta

    timeout_s = check_seconds("timeout_s", timeout_s)
    prefixed = dist.PrefixStore(f"{prefix}/group/{view.epoch}", store)
    return dist.ProcessGroupGloo(prefixed, view.ranks.index(rank), len(view.ranks), timedelta(seconds=timeout_s))
