"""Whether a `Buffer(group, ...)` is a new Buffer of the group or a replacement of this rank (Mooncake's recovery).

Mooncake EP's recovery lifecycle hands a replacement a process group and lets it build a plain
`Buffer(group, num_ep_buffer_bytes)` while the other ranks call `update_ep_member()` on the Buffers
they have; its own test does the same in one process (rank 1 builds a second Buffer, the others
update theirs). A member Buffer built this way must be admitted as `elastic.join()` is, with no extra
call. The constructor tells the cases apart by what the other ranks do, never by what this process holds
(`group_keys.generation_prefix` keeps one generation counter per rank; generation n is every rank's
n-th Buffer of the group):

* this rank's counter is 0 (its first Buffer of the group): a new Buffer, generation 1;
* otherwise the Buffer takes generation `n + 1` (its counter moves, so the others can see it) and
  waits, until the connect timeout, for one of:
  - every other rank reached `n + 1`: they build theirs too (a second Buffer of the group, a rebuild,
    a whole job restarted on a store that outlived it): a new Buffer;
  - the members of its target generation `g` are inside `update_ep_member()`: a member's readiness for
    its next epoch carries its current incarnation and its member heartbeat (`alive/<rank>`, written
    while it waits) moves: the Buffer replaces this rank in `g`;
  - this rank was sealed out of `g` and no other rank's counter moved for `LEFT_OUT_GRACE_S`: it
    replaces this rank in `g` (it registers as joining, so the members' `pending_joiners()` list it
    and their serving loop admits it).
  The target is fixed by construction order, as `elastic.join()` does, never by which generation's
  members happen to update first: of the generations whose members still hold a Buffer (not every
  other rank `closed` it with `destroy()`), the first that no live Buffer of this process holds; when
  every one is held, the first held only by a member Buffer of this process (Mooncake's test: the Buffer
  it replaces). So a process rebuilding Buffers A and B replaces the rank in A, then in B, whatever order
  the members call `update_ep_member()` in (members that update B first wait for the rank there until
  their deadline and seal it out; it joins B afterwards as a left-out rank does).
  A replacement sets its counter back to `n`, takes a new incarnation of this rank in `g` from the one
  the members hold, by compare-and-set (two replacements of one rank: the second is refused, naming the
  incarnation that took it), and waits to be admitted; the Buffers of `g` this process still holds are
  then left out (their calls refuse; their `update_ep_member()` finds the rank taken over). If it is not
  admitted, the incarnation it took is given back while no sealed view binds it, so a Buffer of
  `g` this process still holds goes on as before, and the next replacement takes the rank from the
  incarnation the members hold. The incarnation taken is the one the members' view binds: when another
  replacement took the counter past it and still beats, this one's compare-and-set fails by name.
"""
import threading
import time
import weakref
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.group_keys import (generation_of, generation_prefix, held_generations,
                                                             hold_joined, joined_generations)
from mooncake_ep_switch.buffer.membership.protocol import (JOINER_BEAT_S, JOINER_PROOF_S, MEMBER_BEAT_MARK, Membership,
                                                            MembershipError)
from mooncake_ep_switch.buffer.membership.records import RecordStore

__all__ = ["GenerationChoice", "choose_generation", "not_admitted", "register_member", "supersede"]

LEFT_OUT_GRACE_S = 10.0  # sealed out of a generation and no other rank builds a new Buffer for this long:
# a replacement (longer than a member's destroy() before it rebuilds, DESTROY_WAIT_S plus the engine's close)
_POLL_MAX_S = 0.05
_BOUND_LOOKBACK = 16  # how many sealed views back a replacement looks for the incarnation the members last held

# Live Buffers of this process per (group prefix, rank, generation), to leave out when a replacement takes over.
_MEMBERS: Dict[Tuple[str, int, int], "weakref.WeakSet"] = {}
_MEMBERS_LOCK = threading.Lock()


class GenerationChoice(NamedTuple):
    """What `choose_generation` decided for a Buffer built from a process group.

    Fields:
        prefix: membership key prefix of the generation, `"<group prefix>/g<n>"`.
        release: call once when the Buffer is gone.
        generation: `n`.
        replacing: the Buffer replaces this rank in a live generation (it joins as `elastic.join()` does).
        superseding: it replaces a Buffer this process still holds (left out once this one is admitted).
        holder: the incarnation of this rank the members hold (a replacement takes the rank from it, by
            compare-and-set), or None.
    """

    prefix: str
    release: Callable[[], None]
    generation: int
    replacing: bool
    superseding: bool
    holder: Optional[int] = None


def choose_generation(store, rank: int, num_ranks: int, base: str, secret, deadline: float) -> GenerationChoice:
    """The generation of a `Buffer(group, ...)` and whether it is a replacement (module docstring).

    Arguments:
        store: the group's store (used as given).
        rank: this EP rank.
        num_ranks: EP group size.
        base: the group's key prefix (`group_keys.group_prefix`).
        secret: the job secret of the membership records, or None.
        deadline: `time.monotonic()` value: how long a Buffer that is not the rank's first waits for the
            others to show what they do.

    Returns:
        choice: a `GenerationChoice`.

    Raises:
        MembershipError: the other ranks neither built their Buffer nor updated theirs before `deadline`
            (this rank's counter is set back: nothing changed).
    """
    counters = RecordStore(dist.PrefixStore(f"{base}/generation", store), f"{base}/generation")
    own = counters.read_counter(str(rank))
    choice = _member(store, rank, num_ranks, base)  # generation own + 1: the others see this rank build it
    if own == 0:  # this rank's first Buffer of the group
        return choice
    try:
        replaced = _wait_for_the_others(store, counters, rank, num_ranks, base, secret, own, choice.generation,
                                        deadline)
    except BaseException:
        choice.release()
        _step_back(counters, rank, choice.generation, own)
        raise
    if replaced is None:
        return choice
    choice.release()
    _step_back(counters, rank, choice.generation, own)
    replaced, holder = replaced
    held, _ = held_generations(base, rank)
    return GenerationChoice(f"{base}/g{replaced}", hold_joined(base, rank, replaced), replaced, True,
                            replaced in held, holder)


def _member(store, rank: int, num_ranks: int, base: str) -> GenerationChoice:
    prefix, release = generation_prefix(store, rank, num_ranks, base)
    return GenerationChoice(prefix, release, generation_of(prefix), False, False)


def _wait_for_the_others(store, counters: RecordStore, rank: int, num_ranks: int, base: str, secret, own: int,
                         mine: int, deadline: float) -> Optional[Tuple[int, int]]:
    """None once every other rank reached generation `mine` (a new Buffer); else (generation, holder): the
    target generation (`_target`) once its members are inside `update_ep_member()` (a member's readiness for
    its next epoch, with its current incarnation, and its heartbeat moving), or once this rank was sealed
    out of it while no other rank moves on for `LEFT_OUT_GRACE_S`; `holder` is the incarnation of this
    rank the members hold there."""
    others = [r for r in range(num_ranks) if r != rank]
    first = [counters.read_counter(str(r)) for r in others]
    observers: Dict[int, Membership] = {}
    beats: Dict[Tuple[int, int], bytes] = {}
    baselines: Dict[int, Tuple[int, Optional[int]]] = {}  # per target: (epoch, incarnation bound) when first seen
    pause, quiet_since = 0.001, time.monotonic()
    while True:
        reached = [counters.read_counter(str(r)) for r in others]
        if all(value >= mine for value in reached):
            return None
        if reached != first:
            first, quiet_since = reached, time.monotonic()
        target = _target(store, rank, num_ranks, base, secret, max(reached + [0]), observers)
        if target is not None:
            observer = observers[target]
            epoch = observer.epoch()
            members = observer.view(epoch).ranks
            if target not in baselines:
                baselines[target] = (epoch, _last_bound(observer, rank, epoch))
            _refuse_if_taken(observer, rank, target, mine, epoch, members, baselines[target])
            for member in members:
                if member == rank or observer.ready_record(epoch + 1, member) is None:
                    continue
                beat = observer.read_raw(f"alive/{member}")
                if beat is not None and MEMBER_BEAT_MARK in beat:
                    if beats.get((target, member), beat) != beat:
                        # its members are waiting for this rank in update_ep_member()
                        holder = _members_holder(observer, rank, epoch)
                        if holder is not None:
                            return target, holder
                    beats[(target, member)] = beat
            if rank not in members and time.monotonic() - quiet_since >= LEFT_OUT_GRACE_S:
                holder = _members_holder(observer, rank, epoch)
                if holder is not None:
                    return target, holder
        if time.monotonic() >= deadline:
            behind = [r for r, value in zip(others, reached) if value < mine]
            where = "" if target is None else f" (it replaces rank {rank} in Buffer #{target}, the first of the group " \
                "this process holds none of, by construction order, as elastic.join() does)"
            where += _held_by_another(observers.get(target), rank, target)
            raise MembershipError(
                f"Buffer: rank {rank} builds Buffer #{mine} of its group: ranks {behind} neither built theirs nor "
                f"called update_ep_member() on a Buffer of the group that this one could replace rank {rank} in, "
                f"before the deadline{where}. A new Buffer is built by every rank; a replacement is admitted by the "
                "others' update_ep_member(), called while it is being built")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _refuse_if_taken(observer: Membership, rank: int, target: int, mine: int, epoch: int, members: tuple,
                     baseline: Tuple[int, Optional[int]]) -> None:
    """Raise at once when a view of generation `target` sealed since this Buffer first looked (`baseline`: that
    epoch and the incarnation of `rank` it bound) admitted another incarnation of `rank`: another replacement
    of this rank was admitted while this one waited (two at once; exactly one is admitted). Without this the
    loser waited for its whole deadline: the members, done with their `update_ep_member()`, never beat again.

    A replacement that starts after the other was admitted cannot tell it from a dead holder (an idle member
    writes nothing): it waits for the members' next `update_ep_member()` or its deadline, whose error names
    the holder (`_held_by_another`)."""
    first, bound = baseline
    if epoch <= first or rank not in members:
        return
    try:
        holder = observer.admitted_incarnation(epoch, rank)
    except MembershipError:
        return
    if holder is None or holder == bound or (bound is not None and holder < bound):
        return
    raise MembershipError(
        f"Buffer: rank {rank} builds Buffer #{mine} of its group as a replacement of rank {rank} in Buffer "
        f"#{target}, and another replacement of rank {rank} was admitted there while it waited: incarnation "
        f"{holder} holds it (admitted in epoch {epoch} of Buffer #{target}); exactly one replacement of a rank is "
        "admitted, and this one was not")


def _members_holder(observer: Membership, rank: int, epoch: int) -> Optional[int]:
    """The incarnation of `rank` a replacement takes the rank from (compare-and-set), decided in `epoch`; None
    when a view was sealed since (decide again: another replacement may have been admitted meanwhile).

    The members hold the incarnation their newest view with the rank bound (`_last_bound`; the rank may have been
    sealed out since). When the counter moved past it, another replacement took the rank after that view: while
    its heartbeat moves (it waits to be admitted, or stays registered) the members' incarnation is returned, so
    this replacement's compare-and-set fails and names the one that took it; a replacement that died before it
    was admitted (no beat for `JOINER_PROOF_S`) is taken over."""
    bound = _last_bound(observer, rank, epoch)
    counter = observer.read_counter(f"incarnation/{rank}")
    if bound is not None and counter > bound and _beating(observer, rank, counter):
        counter = bound  # a live competing replacement holds the rank: this one is refused, by name
    return counter if observer.epoch() == epoch else None


def _last_bound(observer: Membership, rank: int, epoch: int) -> Optional[int]:
    """The incarnation of `rank` bound in the newest of epochs `epoch`, `epoch - 1`, ... (at most
    `_BOUND_LOOKBACK` of them) whose view holds the rank; None when none does or a record is unreadable."""
    try:
        for back in range(epoch, max(-1, epoch - _BOUND_LOOKBACK), -1):
            if back == 0 or rank in observer.view(back).ranks:
                return observer.admitted_incarnation(back, rank)
    except MembershipError:
        return None
    return None


def _beating(observer: Membership, rank: int, incarnation: int) -> bool:
    """Whether `incarnation` of `rank` beats (`alive/<rank>` moves under its number) within `JOINER_PROOF_S`."""
    mark = f"{incarnation}:".encode()
    first = observer.read_raw(f"alive/{rank}")
    stop = time.monotonic() + JOINER_PROOF_S
    while time.monotonic() < stop:
        time.sleep(JOINER_BEAT_S)
        now = observer.read_raw(f"alive/{rank}")
        if now is not None and now != first and bytes(now).startswith(mark):
            return True
    return False


def _target(store, rank: int, num_ranks: int, base: str, secret, newest: int,
            observers: Dict[int, Membership]) -> Optional[int]:
    """The generation a replacement's Buffer replaces this rank in, by construction order: of generations
    1..`newest` that are not closed (every other member destroyed its Buffer of it), the first no live Buffer
    of this process holds, else the first only a member Buffer of this process holds (the one it replaces);
    None when there is none."""
    held, _ = held_generations(base, rank)
    joined = joined_generations(base, rank)
    live = []
    for generation in range(1, newest + 1):
        observer = observers.get(generation)
        if observer is None:
            observer = observers[generation] = Membership(store, rank, num_ranks, f"{base}/g{generation}",
                                                          secret=secret, take_incarnation=False)
        others = [r for r in observer.view(observer.epoch()).ranks if r != rank]
        if others and all(observer.closed(r) for r in others):
            continue  # every other member destroyed its Buffer of this generation: nobody to replace it with
        live.append(generation)
    return next((g for g in live if g not in held), next((g for g in live if g not in joined), None))


def _held_by_another(observer: Optional[Membership], rank: int, generation: Optional[int]) -> str:
    """Why a replacement that timed out was not needed, when the store says so: `rank` is a member of the
    generation's current view with an incarnation admitted there after a change (another replacement of the
    rank was admitted first); "" otherwise (the records are only read to name the holder)."""
    if observer is None:
        return ""
    try:
        epoch = observer.epoch()
        if epoch < 1 or rank not in observer.view(epoch).ranks:
            return ""
        holder = observer.admitted_incarnation(epoch, rank)
    except MembershipError:
        return ""
    if holder is None:
        return ""
    where = "" if generation is None else f" of Buffer #{generation}"
    return (f". Rank {rank} is already taken over there: incarnation {holder} holds it (admitted in epoch {epoch}"
            f"{where}); exactly one replacement of a rank is admitted, and this one was not")


def not_admitted(membership: Membership) -> Tuple[bool, str]:
    """A replacement's Buffer was not admitted: give the rank back to the incarnation before it while no sealed
    view binds this one (so a Buffer of it this process holds goes on, and the next replacement takes the rank
    from the incarnation the members hold), and name the incarnation the newest view admitted in its place.

    Arguments:
        membership: the replacement Buffer's `Membership` (before `destroy()`).

    Returns:
        gave_back: whether the rank's earlier incarnation is current again.
        holder: "" or a sentence naming the incarnation that holds the rank in the newest view.
    """
    try:
        epoch = membership.epoch()
        bound = membership.admitted_incarnation(epoch, membership.rank) if epoch >= 1 else None
    except MembershipError:
        return False, ""
    gave_back = bound != membership.incarnation and membership.give_back_incarnation()
    held = "" if bound is None or bound == membership.incarnation else _held_by_another(
        membership, membership.rank, None)
    return gave_back, held


def _step_back(counters: RecordStore, rank: int, mine: int, own: int) -> None:
    """Set this rank's generation counter back from `mine` to `own` (it moved while the others decided)."""
    value, text = counters.read_counter_raw(str(rank))
    if value == mine:
        counters.store.compare_set(str(rank), "" if text is None else text, str(own))


def register_member(core, base: str, generation: int) -> None:
    """Remember a live Buffer of this process (its `BufferCore`) in generation `generation` of group `base`."""
    with _MEMBERS_LOCK:
        _MEMBERS.setdefault((base, core.rank, generation), weakref.WeakSet()).add(core)


def supersede(core, base: str, generation: int) -> int:
    """The Buffer of `core` was admitted in place of this rank's earlier Buffers of the generation held by this process:
    leave them out (their dispatch/combine refuse; their `update_ep_member()` finds the rank taken over).

    Returns:
        count: how many Buffers were left out.
    """
    from mooncake_ep_switch.buffer.membership.elastic_view import left_out_by_replacement

    with _MEMBERS_LOCK:
        earlier = [c for c in _MEMBERS.get((base, core.rank, generation), ()) if c is not core]
    for old in earlier:
        left_out_by_replacement(old)
    return len(earlier)
