"""`Buffer.shrink(ranks)`: remove ranks from the group for good (scale-down), dead ones or drained live ones.

Dead ranks (`drain=False`): every surviving member calls it with the same ranks, between steps.
Drained ranks (`drain=True`, live ranks that leave, as vLLM's and SGLang's elastic EP scale down): every
member of the view calls it, the drained ranks too, between steps, once no token of theirs is in
flight and the experts only they held were moved off them (`eplb.drain`). In order:

1. **Checks** (before anything is written; `ValueError`/`TypeError` naming `ranks`): a non-empty list
   of distinct ranks of the group, not removed already, leaving some member. Dead: not this rank, none
   live: a rank still in the current view must be seen dead by this rank's peer watcher
   (`Buffer.dead_peers()`, waited for up to `DEAD_WAIT_S`); a rank already out of the view (sealed out
   after a death, as the collective fallback does by itself) may be removed. Drain: members of the
   view that this rank has not seen end (this rank may be one of them).
2. **One decision** (`buffer/ballot.py`, keys `shrink/...` under the membership's prefix): every
   voter (the survivors; with a drain the drained ranks too) votes GO with a digest of (its epoch, the
   ranks, the survivors, drain or not); each proposes COMMIT if every other voter voted GO with its
   digest, ABORT otherwise (a voter that died before voting, one stalled past the vote deadline,
   another shrink's ranks); the first proposal stored wins and every rank adopts it. ABORT: nothing
   changed anywhere (`MembershipError`, call again); a voter that voted GO and then died still lets
   it commit everywhere. Attempts are numbered 1, 2, ... per Buffer (at most `MAX_ATTEMPTS` - 1): a
   retry after an ABORT votes on the next one.
3. **Commit**: the ranks are written to the removed-ranks record (`membership/removed.py`) by every
   voter, then the survivors agree on the next view without them (`update_ep_member`'s path, the
   ranks excluded as if seen failed, so nobody waits for them): the returned view never holds them,
   and no later one does (sealers never admit a removed joiner, a replacement is refused by name).
   A drained rank takes no part in that view: its Buffer refuses every later call by name
   (`BufferCore.drained`) and it waits for the survivors' view to be sealed (returned to it), after
   which nothing of the group needs it and it destroys its Buffer.

Rank ids stay sparse: the Buffer keeps `num_ranks`, and the removed ranks stay 0 in
`active_mask()` forever (NCCL EP's and Mooncake EP's `active_ranks` masks make this free: every
structure indexed by rank id keeps its shape). docs/recovery.md, "Shrinking the group".
"""
import logging
import numbers
import time
import zlib
from typing import Iterable, Optional, Tuple

from mooncake_ep_switch.buffer.ballot import DECISION_SLOTS, Ballot
from mooncake_ep_switch.buffer.core import BufferCore
from mooncake_ep_switch.buffer.membership import elastic_view, resize_guard
from mooncake_ep_switch.buffer.membership.protocol import MembershipError, View, check_seconds
from mooncake_ep_switch.buffer.membership.removed import record_removed, removed_ranks
from mooncake_ep_switch.buffer.membership.store_deadline import store_deadline

log = logging.getLogger("mooncake_ep_switch.buffer.membership")

__all__ = ["MAX_ATTEMPTS", "DEAD_WAIT_S", "VOTE_SHARE", "check_shrink", "shrink"]

MAX_ATTEMPTS = DECISION_SLOTS  # ballot epochs 1 .. 255: one decision slot each, never reused (no old keys to delete)
DEAD_WAIT_S = 0.5  # a rank of the view not seen dead yet is waited for this long before it is refused as live
VOTE_SHARE = 0.5  # the share of timeout_s the vote may take (the rest agrees the view and reconnects)
GO, ABORT = 1, 2  # votes; decisions COMMIT = 1, ABORT = 2 (the ballot's)
COMMIT = 1


def _ranks_argument(ranks, num_ranks: int) -> Tuple[int, ...]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks: expected a list of int ranks, got {type(ranks).__name__}")
    ranks = list(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)]
    if bad:
        raise TypeError(f"ranks: expected int ranks, got {bad[0]!r} ({type(bad[0]).__name__})")
    ranks = [int(r) for r in ranks]
    if not ranks:
        raise ValueError("ranks: expected at least one rank to remove, got none")
    unknown = [r for r in ranks if not 0 <= r < num_ranks]
    if unknown:
        raise ValueError(f"ranks: expected ranks of the group in [0, {num_ranks}), got {unknown}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks: expected distinct ranks, got {ranks}")
    return tuple(sorted(ranks))


def check_shrink(core: BufferCore, membership, ranks, drain: bool = False) -> Tuple[int, ...]:
    """The checks of `shrink` (module docstring, step 1); nothing is written.

    Arguments:
        core: the Buffer's `BufferCore`.
        membership: its `Membership`.
        ranks: the ranks to remove.
        drain: the ranks are live members that leave (a drain), not dead ones.

    Returns:
        ranks: sorted tuple of int.

    Raises:
        TypeError: `ranks` is not a list of ints, `drain` no bool.
        ValueError: empty, duplicates, outside the group, every member, removed already; without a
            drain this rank or a live rank, with one a rank outside the view or seen dead (named).
        MembershipError: this rank is not a member (a joiner, left out, or drained already).
    """
    if type(drain) is not bool:
        raise TypeError(f"drain: expected a bool, got {type(drain).__name__}")
    ranks = _ranks_argument(ranks, core.num_ranks)
    core.check_not_drained()
    if core.joining or core.rank not in core.members:
        raise MembershipError(f"shrink: rank {core.rank} is not a member of the group (a joiner or left out); only "
                              "members remove ranks")
    if not set(core.members) - set(ranks):
        raise ValueError(f"ranks: removing {list(ranks)} would leave no rank of the view {list(core.members)}")
    if core.rank in ranks and not drain:
        raise ValueError(f"ranks: rank {core.rank} (this rank) cannot remove itself as dead: a live rank leaves "
                         "through a drain (shrink(ranks, drain=True) on every member, the drained ranks too)")
    removed = removed_ranks(membership)
    again = [r for r in ranks if r in removed]
    if again:
        raise ValueError(f"ranks: {again} were removed already (by the view of epoch {removed[again[0]]})")
    if drain:
        outside = [r for r in ranks if r not in core.members]
        if outside:
            raise ValueError(f"ranks: {outside} are not members of epoch {core.epoch} (members {list(core.members)}): "
                             "a drain removes live members; remove ranks out of the view with shrink(ranks)")
        dead = sorted(set(ranks) & set(core.transport.dead_peers()))
        if dead:
            raise ValueError(f"ranks: {dead} are dead (this rank saw their process end): a drain needs them live "
                             "to hand their experts over; remove them as dead ranks with shrink(ranks)")
        return ranks
    in_view = [r for r in ranks if r in core.members]
    until = time.monotonic() + DEAD_WAIT_S
    while True:
        live = [r for r in in_view if r not in set(core.transport.dead_peers())]
        if not live or time.monotonic() >= until:
            break
        time.sleep(0.01)
    if live:
        raise ValueError(f"ranks: {live} are live (members of epoch {core.epoch} whose process this rank has not "
                         "seen end): removing a live rank is a drain (its tokens finish and its experts move "
                         "first): shrink(ranks, drain=True) on every member, the drained ranks too")
    return ranks


def _attempt(ballot: Ballot, members: Iterable[int]) -> int:
    """The ballot epoch of this shrink: the newest undecided attempt a member voted on, else the first undecided one
    after it (attempts after an ABORT go on counting; the epoch each belongs to is in its digest)."""
    voted = [record[0] for record in ballot.records(sorted(members)).values() if record is not None]
    attempt = max(max(voted, default=1), 1)
    while attempt < MAX_ATTEMPTS:
        if ballot.decisions([attempt])[attempt] is None:
            return attempt
        attempt += 1
    raise MembershipError(f"shrink: {MAX_ATTEMPTS - 1} shrinks of this Buffer were decided already (the ballot keeps "
                          f"{MAX_ATTEMPTS} decisions); build a new Buffer of the group")


def _digest(epoch: int, ranks: Tuple[int, ...], survivors: Tuple[int, ...], drain: bool) -> int:
    text = f"{epoch}|{','.join(map(str, ranks))}|{','.join(map(str, survivors))}" + ("|drain" if drain else "")
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _vote(core: BufferCore, membership, ranks: Tuple[int, ...], deadline: float, drain: bool = False) -> None:
    """Step 2 of the module docstring: one decision; returns on COMMIT, raises on ABORT."""
    survivors = tuple(r for r in core.members if r not in ranks)
    voters = core.members if drain else survivors  # a drain's ranks take part
    peers = [r for r in voters if r != core.rank]
    ballot = Ballot(membership, "shrink", core.rank, core.num_ranks, what="shrink")
    epoch = _attempt(ballot, core.members)
    ballot.prepare([epoch], votes=True)
    digest = _digest(core.epoch, ranks, survivors, drain)
    if core.fault is not None:
        core.fault.hit("shrink_before_vote", core.rank)
    ballot.vote(epoch, GO, digest, voters=len(voters))
    if core.fault is not None:
        core.fault.hit("shrink_after_vote", core.rank)
    timeout_us = max(1, int((deadline - time.monotonic()) * 1e6))

    def ended(pending):
        return sorted(set(pending) & set(core.transport.dead_peers()))

    votes, gone, decided = ballot.wait_votes(peers, epoch, timeout_us, ended)
    reason = ""
    for peer in peers:
        if peer in votes and votes[peer][0] != GO:  # 0: its record is of a later attempt (this one was decided)
            reason = f"rank {peer} voted to abort" if votes[peer][0] else f"rank {peer} went on to a later attempt"
            break
    other = [p for p in peers if p in votes and votes[p][0] == GO and votes[p][1] != digest]
    if not reason and other:  # named first: the caller's mistake, whatever else happened
        reason = (f"rank {other[0]} asked for another shrink (other ranks, survivors or epoch than {list(ranks)} "
                  f"of epoch {core.epoch}): two shrinks at once; every survivor must pass the same ranks")
    pending = [p for p in peers if p not in votes]
    if not reason and gone:
        reason = (f"ranks {gone} ended (their process is gone) before voting: "
                  + ("remove them as dead ranks with shrink(ranks)" if drain and set(gone) <= set(ranks)
                     else "remove them too"))
    elif not reason and pending:
        reason = (f"ranks {pending} did not vote before a peer decided" if decided is not None
                  else f"ranks {pending} did not vote within the vote's deadline (stalled, or not calling shrink)")
    outcome = ballot.propose(epoch, ABORT if reason else COMMIT)
    if outcome != COMMIT:
        raise MembershipError(f"shrink of ranks {list(ranks)} aborted on every rank ({reason or 'a peer decided ABORT'}); "
                              "nothing changed: call shrink() again on every survivor (with any rank that died since)")


def shrink(core: BufferCore, ranks, timeout_s: Optional[float] = None, drain: bool = False) -> View:
    """The work of `Buffer.shrink()` (see its docstring and the module docstring), for the Buffer of `core`."""
    core.check_alive()
    timeout_s = check_seconds("timeout_s", timeout_s, allow_none=True)
    membership = core.require_membership("shrink")
    resize_guard.begin(membership, "shrink")  # a shrink or a grow of this Buffer in progress: refused by name
    try:
        budget = core.settings.connect_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        with store_deadline(deadline, "shrink"):
            ranks = check_shrink(core, membership, ranks, drain)
            _vote(core, membership, ranks, time.monotonic() + VOTE_SHARE * (deadline - time.monotonic()), drain)
            record_removed(membership, ranks, core.epoch + 1)
            if core.rank in ranks:  # drained: out for good from here, whatever the survivors' view does
                return _leave(core, membership, deadline)
        left = max(deadline - time.monotonic(), 1.0)
        # Not waited for: the removed ranks, and a survivor whose process ends meanwhile (it voted GO, then died).
        return elastic_view.update_ep_member(core, left, exclude=ranks, skip_dead=True)
    finally:
        resize_guard.end(membership, "shrink")


def _leave(core: BufferCore, membership, deadline: float) -> View:
    """A drained rank after the COMMIT (step 3): refuse every later call, wait for the survivors' view."""
    target = core.epoch + 1
    core.drained = (f"rank {core.rank} was drained out of the EP group for good (Buffer.shrink(drain=True), the view "
                    f"of epoch {target} leaves it out): this Buffer serves no more calls; destroy() it")
    before = core.members
    core.members, core.joining, core.last_plan, core.prev_plan = (), True, None, None
    view = membership.wait_for(lambda: membership.view(target) if membership.sealed(target) else None,
                               deadline,
                               f"the survivors' view of epoch {target} (rank {core.rank} drained)")
    core.epoch = view.epoch
    log.info("rank %d drained out of the group: epoch %d, members %s (were %s)", core.rank, view.epoch,
             list(view.ranks), list(before))
    return view
