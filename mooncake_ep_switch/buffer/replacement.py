"""Whether a `Buffer(group, ...)` is a new Buffer of the group or a replacement of this rank (Mooncake's recovery).

Mooncake EP's recovery lifecycle hands a replacement a process group and lets it build a plain
`Buffer(group, num_ep_buffer_bytes)` while the other ranks call `update_ep_member()` on the Buffers
they have; its own test does the same in one process (rank 1 builds a second Buffer, the others
update theirs). A member Buffer built this way must be admitted as `elastic.join()` is, with no extra
call. The constructor tells the cases apart from the group's generation counters (one per rank, see
`group_keys.generation_prefix`) and the process's own Buffers of the group:

* this rank never built a Buffer of the group (its counter is 0): a new Buffer (generation 1);
* this process built none but the rank's counter is past 0: an earlier process held the rank and is
  gone; a replacement, of the generation the join rule gives (`generation_prefix(joining=True)`);
* this process holds a live Buffer of the newest generation `n` it built (the earlier one was
  abandoned, or the engine builds a second Buffer of the group): the other ranks decide. The new
  Buffer takes generation `n + 1` and waits until either every other rank reached `n + 1` (they
  build theirs: a new Buffer), or a member of generation `n` posts readiness for its next epoch
  (they are in `update_ep_member()`), or this rank has been sealed out of generation `n` and no other
  rank moves on for `LEFT_OUT_GRACE_S` (a replacement): then it steps back to generation `n`,
  joins it as a new incarnation of this rank, and the Buffers of generation `n` this process still
  holds are left out (their calls refuse; their `update_ep_member()` finds the rank taken over);
* otherwise (this process destroyed its Buffers of the group): a new Buffer.
"""
import threading
import time
import weakref
from typing import Callable, Dict, NamedTuple, Tuple

import torch.distributed as dist

from mooncake_ep_switch.buffer.group_keys import generation_prefix, held_generations
from mooncake_ep_switch.buffer.membership import Membership, MembershipError
from mooncake_ep_switch.buffer.membership_records import RecordStore

__all__ = ["GenerationChoice", "choose_generation", "register_member", "supersede"]

LEFT_OUT_GRACE_S = 1.0  # sealed out of its generation and nobody builds a new one for this long: a replacement
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
        deadline: `time.monotonic()` value: how long a Buffer built beside a live one waits for the others.

    Returns:
        choice: a `GenerationChoice`.

    Raises:
        MembershipError: beside a live Buffer of the group, the other ranks neither built theirs nor
            updated theirs before `deadline` (this rank's counter is set back: nothing changed).
    """
    counters = RecordStore(dist.PrefixStore(f"{base}/generation", store), f"{base}/generation")
    own = counters._counter(str(rank))
    held, built = held_generations(base, rank)
    if own == 0:
        return _member(store, rank, num_ranks, base)
    if not built:  # an earlier process held this rank: this one replaces it
        prefix, release = generation_prefix(store, rank, num_ranks, base, joining=True)
        return GenerationChoice(prefix, release, _generation_of(prefix), True, False)
    if own not in held:  # this process destroyed its Buffers of the group: a new one
        return _member(store, rank, num_ranks, base)
    choice = _member(store, rank, num_ranks, base)  # let the others see this rank build generation own + 1
    try:
        decided = _wait_for_the_others(store, counters, rank, num_ranks, base, secret, own, deadline)
    except BaseException:
        choice.release()
        _step_back(counters, rank, own)
        raise
    if decided == "new":
        return choice
    choice.release()
    _step_back(counters, rank, own)
    prefix, release = generation_prefix(store, rank, num_ranks, base, joining=True, buffer_index=own)
    return GenerationChoice(prefix, release, own, True, True)


def _member(store, rank: int, num_ranks: int, base: str) -> GenerationChoice:
    prefix, release = generation_prefix(store, rank, num_ranks, base)
    return GenerationChoice(prefix, release, _generation_of(prefix), False, False)


def _generation_of(prefix: str) -> int:
    return int(prefix.rsplit("/g", 1)[1])


def _wait_for_the_others(store, counters: RecordStore, rank: int, num_ranks: int, base: str, secret, own: int,
                         deadline: float) -> str:
    """"new" once every other rank reached generation own + 1; "replace" once the members of generation
    `own` update theirs (or this rank was sealed out of it and nobody moves on)."""
    observer = Membership(store, rank, num_ranks, f"{base}/g{own}", secret=secret, take_incarnation=False)
    others = [r for r in range(num_ranks) if r != rank]
    pause, sealed_out_since = 0.001, None
    while True:
        reached = [counters._counter(str(r)) for r in others]
        if all(value > own for value in reached):
            return "new"
        epoch = observer.epoch()
        members = observer.view(epoch).ranks
        if any(observer.store.check([f"ready/{epoch + 1}/{r}"]) for r in members if r != rank):
            return "replace"  # the members of generation `own` are in update_ep_member()
        if rank not in members and all(value == own for value in reached):
            sealed_out_since = time.monotonic() if sealed_out_since is None else sealed_out_since
            if time.monotonic() - sealed_out_since >= LEFT_OUT_GRACE_S:
                return "replace"
        else:
            sealed_out_since = None
        if time.monotonic() >= deadline:
            behind = [r for r, value in zip(others, reached) if value <= own]
            raise MembershipError(
                f"Buffer: rank {rank} built a new Buffer of its group while this process still holds one (Buffer "
                f"#{own} of the group): ranks {behind} neither built their Buffer #{own + 1} nor called "
                f"update_ep_member() on their Buffer #{own} before the deadline. A new Buffer is built by every "
                "rank; a replacement is admitted by the others' update_ep_member()")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _step_back(counters: RecordStore, rank: int, own: int) -> None:
    """Set this rank's generation counter back to `own` (it moved to own + 1 while the others decided)."""
    value, text = counters._counter_raw(str(rank))
    if value == own + 1:
        counters.store.compare_set(str(rank), "" if text is None else text, str(own))


def register_member(buffer, base: str, generation: int) -> None:
    """Remember a live Buffer of this process in generation `generation` of group `base`."""
    with _MEMBERS_LOCK:
        _MEMBERS.setdefault((base, buffer.rank, generation), weakref.WeakSet()).add(buffer)


def supersede(buffer, base: str, generation: int) -> int:
    """`buffer` was admitted in place of this rank's earlier Buffers of the generation held by this process:
    leave them out (their dispatch/combine refuse; their `update_ep_member()` finds the rank taken over).

    Returns:
        count: how many Buffers were left out.
    """
    from mooncake_ep_switch.buffer.elastic_view import left_out_by_replacement

    with _MEMBERS_LOCK:
        earlier = [b for b in _MEMBERS.get((base, buffer.rank, generation), ()) if b is not buffer]
    for old in earlier:
        left_out_by_replacement(old)
    return len(earlier)
