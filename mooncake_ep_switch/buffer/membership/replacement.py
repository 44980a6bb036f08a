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
  - the members of a generation `g` are inside `update_ep_member()`: a member's readiness for its next
    epoch carries its current incarnation and its member heartbeat (`alive/<rank>`, written while it
    waits) moves: the Buffer replaces this rank in `g`;
  - this rank was sealed out of a generation `g` and no other rank's counter moved for
    `LEFT_OUT_GRACE_S`: it replaces this rank in `g` (it registers as joining, so the members'
    `pending_joiners()` list it and their serving loop admits it).
  A replacement sets its counter back to `n`, joins `g` as a new incarnation of this rank and waits
  to be admitted; the Buffers of `g` this process still holds are then left out (their calls refuse;
  their `update_ep_member()` finds the rank taken over). If it is not admitted, the incarnation it took
  is given back while no view was sealed meanwhile, so a Buffer of `g` this process still holds
  goes on as before.
"""
import threading
import time
import weakref
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.group_keys import generation_of, generation_prefix, held_generations, hold_joined
from mooncake_ep_switch.buffer.membership.protocol import MEMBER_BEAT_MARK, Membership, MembershipError
from mooncake_ep_switch.buffer.membership.records import RecordStore

__all__ = ["GenerationChoice", "choose_generation", "register_member", "supersede"]

LEFT_OUT_GRACE_S = 10.0  # sealed out of a generation and no other rank builds a new Buffer for this long:
# a replacement (longer than a member's destroy() before it rebuilds, DESTROY_WAIT_S plus the engine's close)
_POLL_MAX_S = 0.05

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
    """

    prefix: str
    release: Callable[[], None]
    generation: int
    replacing: bool
    superseding: bool


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
    held, _ = held_generations(base, rank)
    return GenerationChoice(f"{base}/g{replaced}", hold_joined(base, rank, replaced), replaced, True,
                            replaced in held)


def _member(store, rank: int, num_ranks: int, base: str) -> GenerationChoice:
    prefix, release = generation_prefix(store, rank, num_ranks, base)
    return GenerationChoice(prefix, release, generation_of(prefix), False, False)


def _wait_for_the_others(store, counters: RecordStore, rank: int, num_ranks: int, base: str, secret, own: int,
                         mine: int, deadline: float) -> Optional[int]:
    """None once every other rank reached generation `mine` (a new Buffer); else the generation this Buffer
    replaces this rank in: one whose members are inside `update_ep_member()` (a member's readiness for its
    next epoch, with its current incarnation, and its heartbeat moving), or one this rank was sealed out
    of while no other rank moves on for `LEFT_OUT_GRACE_S`."""
    others = [r for r in range(num_ranks) if r != rank]
    first = [counters.read_counter(str(r)) for r in others]
    generations = range(1, max([own] + first) + 1)
    observers: Dict[int, Membership] = {}
    beats: Dict[Tuple[int, int], bytes] = {}
    pause, quiet_since = 0.001, time.monotonic()
    while True:
        reached = [counters.read_counter(str(r)) for r in others]
        if all(value >= mine for value in reached):
            return None
        if reached != first:
            first, quiet_since = reached, time.monotonic()
        sealed_out = None
        for generation in generations:
            observer = observers.get(generation)
            if observer is None:
                observer = observers[generation] = Membership(store, rank, num_ranks, f"{base}/g{generation}",
                                                              secret=secret, take_incarnation=False)
            epoch = observer.epoch()
            members = observer.view(epoch).ranks
            for member in members:
                if member == rank or observer.ready_record(epoch + 1, member) is None:
                    continue
                beat = observer.read_raw(f"alive/{member}")
                if beat is not None and MEMBER_BEAT_MARK in beat:
                    if beats.get((generation, member), beat) != beat:
                        return generation  # its members are waiting for this rank in update_ep_member()
                    beats[(generation, member)] = beat
            if sealed_out is None and rank not in members:
                sealed_out = generation
        if sealed_out is not None and time.monotonic() - quiet_since >= LEFT_OUT_GRACE_S:
            return sealed_out
        if time.monotonic() >= deadline:
            behind = [r for r, value in zip(others, reached) if value < mine]
            raise MembershipError(
                f"Buffer: rank {rank} builds Buffer #{mine} of its group: ranks {behind} neither built theirs nor "
                f"called update_ep_member() on a Buffer of the group that this one could replace rank {rank} in, "
                "before the deadline. A new Buffer is built by every rank; a replacement is admitted by the "
                "others' update_ep_member(), called while it is being built")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


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
