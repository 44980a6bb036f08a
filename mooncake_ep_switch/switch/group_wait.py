"""Waits on a view group's gloo collectives, bounded by the caller's deadline and the peer watcher.

A gloo collective waits for its group's timeout (the world group's 120 s, or whatever the group was built
with), not for the caller's `timeout_us`: with a member that died (and was not seen dead yet when the call
started) or stalled, one survivor raised "Connection closed by peer" and another waited in gloo for the
group's timeout. `wait_work` instead polls the work until the caller's deadline, asking the peer watcher
(`buffer.dead_peers()`) between polls, and gives up with an error naming the dead ranks (`MembershipError`
with `missing`) or the deadline (`TimeoutError`).

A gloo work that was given up on keeps running in the group's worker thread until gloo's own timeout, and
the group is not usable after it (later collectives queue behind it, and its peers may be out of step):
the group is *abandoned*. It stays referenced here (destroying a gloo group joins its worker threads, which
would block the caller until gloo's timeout), `is_abandoned` tells the callers to refuse it by name, and a
group of the view built for a structure (`switch_group.epoch_group`) is dropped from the structure, so its
next call of the epoch meets under new keys. The fallback's own group of the view is replaced by the next
view (`update_ep_member()`).

The record of abandoned groups is bounded (a long-lived process gives groups up now and then, for good):
a group is held strongly only while the work it was abandoned on still runs; once that work completed
(gloo's timeout passed, or it failed) the record holds it by weak reference, and is dropped once the group
is gone (nobody else holds it, e.g. the fallback's group replaced by the next view). Past
`MAX_ABANDONED` records, the oldest whose work completed are dropped although their group may still be held
elsewhere (then `is_abandoned` no longer knows it: a group given up on that many abandonments ago). Records
whose work still runs are never dropped: their number is bounded by how many collectives can be given up
on within one gloo timeout.
"""
import pickle
import threading
import time
import weakref
from typing import Any, List, Optional, Sequence

import torch

from mooncake_ep_switch.errors import MembershipError
from mooncake_ep_switch.switch.switch_group import count_call_without_group, dead_members

__all__ = ["wait_work", "gather_objects", "is_abandoned", "abandoned_reason"]

_LOCK = threading.Lock()
MAX_ABANDONED = 64  # records of abandoned groups kept at most, beyond those whose work still runs (docstring)


class _Abandoned:
    """One abandoned group: held strongly while `work` runs, then by weak reference (module docstring)."""

    __slots__ = ("strong", "weak", "work", "why")

    def __init__(self, group, work, why: str):
        self.strong, self.weak, self.work, self.why = group, weakref.ref(group), work, why

    def group(self):
        return self.weak()

    def settle(self, released: list) -> bool:
        """Let the group go (weak reference only) once its work completed, its strong reference moved to
        `released` (dropped by the caller outside the lock); returns whether the work still runs."""
        if self.work is not None and not self.work.is_completed():
            return True
        if self.strong is not None:
            released.append(self.strong)
        self.strong = self.work = None
        return False


# Groups given up on, oldest first. One per failed collective.
_ABANDONED: List[_Abandoned] = []
_WATCHER_GRACE_S = 1.0  # after gloo's own error, how long the peer watcher gets to name the rank that ended


def is_abandoned(group) -> bool:
    """Whether a collective on `group` was given up on (the group must not be used again).

    Arguments:
        group: a process group.

    Returns:
        abandoned: bool.
    """
    return abandoned_reason(group) is not None


def abandoned_reason(group) -> Optional[str]:
    """Why `group` was abandoned, or None when it was not.

    Arguments:
        group: a process group.

    Returns:
        reason: str (the error its collective ended with), or None.
    """
    with _LOCK:
        return next((entry.why for entry in _ABANDONED if entry.group() is group), None)


def _prune(released: list) -> None:
    """Let go of the groups whose work completed (their strong references into `released`), drop the records
    whose group is gone, then the oldest whose work completed past `MAX_ABANDONED` (the caller holds `_LOCK`)."""
    kept = [entry for entry in _ABANDONED if entry.settle(released) or entry.group() is not None]
    excess = len(kept) - MAX_ABANDONED
    if excess > 0:
        oldest_done = [entry for entry in kept if entry.work is None][:excess]
        kept = [entry for entry in kept if not any(entry is done for done in oldest_done)]
    _ABANDONED[:] = kept


def _abandon(group, owner, epoch: int, why: str, work=None) -> None:
    """Keep `group` referenced (while `work`, the collective given up on, runs) and refused from now on; drop
    it from `owner` (a structure's group of the view). Prunes the records (module docstring)."""
    released = []
    with _LOCK:
        if not any(entry.group() is group for entry in _ABANDONED):
            _ABANDONED.append(_Abandoned(group, work, why))
        _prune(released)
    released.clear()  # groups nobody else holds are destroyed here, outside the lock (their work completed)
    with _LOCK:
        _ABANDONED[:] = [entry for entry in _ABANDONED if entry.work is not None or entry.group() is not None]
    if owner is not None and getattr(owner, "view_group", None) is not None and owner.view_group[1] is group:
        owner.view_group = None
        count_call_without_group(owner, epoch)  # its next rendezvous of the epoch meets under keys of its own


def wait_work(work, group, deadline: Optional[float], buffer, members: Sequence[int], caller: str,
              owner=None) -> None:
    """Wait for `work` (a collective on `group`) until `deadline`, stopping early when a member is seen dead.

    Arguments:
        work: the `torch.distributed.Work` of the collective.
        group: the process group it runs on (abandoned when the wait gives up or the work failed).
        deadline: `time.monotonic()` deadline in seconds, or None (only the peer watcher and gloo end it).
        buffer: the `Buffer` whose peer watcher is asked (`dead_peers()`) and whose epoch is current.
        members: the EP ranks of `group`.
        caller: the name errors start with.
        owner: the structure `group` was built for by `epoch_group` (dropped from it on failure), or None.

    Raises:
        MembershipError: a member of `group` is known dead (`missing` names them), before or after the
            work failed in gloo.
        TimeoutError: the work did not complete by `deadline` (message names the deadline and the members),
            or gloo's own timeout of the group came first.
        RuntimeError: gloo's other errors, when no member is known dead.
    """
    members = set(members)
    pause = 1e-4
    while not work.is_completed():
        dead = [r for r in dead_members(buffer) if r in members]
        if dead:
            message = (f"{caller}: ranks {dead} ended while this rank waited in a collective of the view (epoch "
                       f"{buffer.epoch}); seal them out with update_ep_member() first")
            _abandon(group, owner, buffer.epoch, message, work)
            raise MembershipError(message, missing=dead)
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            message = (f"{caller}: a collective of the view (epoch {buffer.epoch}, members {sorted(members)}) did not "
                       "complete by the caller's deadline: a member stalled or ended unseen; its group is abandoned "
                       "(update_ep_member() agrees on the next view)")
            _abandon(group, owner, buffer.epoch, message, work)
            raise TimeoutError(message)
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
        pause = min(2 * pause, 0.005)
    try:
        work.wait()
    except RuntimeError as error:  # gloo's own ("Connection closed by peer"): name the rank once the watcher saw it
        grace = time.monotonic() + _WATCHER_GRACE_S
        if deadline is not None:
            grace = min(grace, max(deadline, time.monotonic()))
        dead = [r for r in dead_members(buffer) if r in members]
        while not dead and time.monotonic() < grace:
            time.sleep(0.005)
            dead = [r for r in dead_members(buffer) if r in members]
        message = f"{caller}: a collective of the view (epoch {buffer.epoch}) failed in gloo ({error})"
        _abandon(group, owner, buffer.epoch, message, work)
        if dead:
            raise MembershipError(f"{message}; ranks {dead} ended: seal them out with update_ep_member() first",
                                  missing=dead) from error
        if "Timed out" in str(error):  # the group's own timeout came first (a group built with a shorter one)
            raise TimeoutError(f"{message}: the group's timeout passed before the caller's deadline; a member "
                               "stalled or ended unseen (update_ep_member() agrees on the next view)") from error
        raise


def gather_objects(obj: Any, group, deadline: Optional[float], buffer, members: Sequence[int], caller: str,
                   owner=None) -> List[Any]:
    """`all_gather_object` on `group` with every wait bounded as `wait_work`'s.

    Arguments:
        obj: a picklable object.
        group: the process group (group rank = position in `members`).
        deadline: `time.monotonic()` deadline in seconds, or None.
        buffer, members, caller, owner: as `wait_work`'s.

    Returns:
        objects: list of every group rank's `obj`, in group-rank order.

    Raises:
        MembershipError, TimeoutError, RuntimeError: as `wait_work`.
    """
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = group.size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    wait_work(group.allgather([lengths], [torch.tensor([data.numel()], dtype=torch.int64)]), group, deadline, buffer,
              members, caller, owner)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    wait_work(group.allgather([parts], [padded]), group, deadline, buffer, members, caller, owner)
    return [pickle.loads(part[:int(n.item())].numpy().tobytes()) for part, n in zip(parts, lengths)]
