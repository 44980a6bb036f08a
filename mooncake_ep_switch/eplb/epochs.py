"""Agreement between ranks on an online rebalance's plan and chunk epochs (`eplb.online`).

Each rank numbers the chunks of a rebalance from its own count (`ExpertSlots.chunk_epoch`), and
`begin()` is a local call. Two misuses would otherwise lock the group out for good: `begin()` called
with different arguments on different ranks (their plans, and so their numbers of chunks, differ,
and every later rebalance votes on different epochs), and a rank whose count is behind or ahead of
its peers' (say a replacement given the wrong `epoch`). So:

- Every vote record carries its `Plan`: the epochs `base + 1 .. end` its rebalance numbered, a
  digest of `new_phy2log` and the values of `commit_step` and `steps_per_chunk`. A commit step
  whose vote wait did not end in every GO reads the peers' records and names what differs
  (`difference`): another argument of `begin()`, or the same rebalance numbered from another epoch.
- `begin()` numbers from the largest epoch the peers' records show they passed (`agreed_base`):
  the end of a peer's earlier rebalance whose last vote was decided (the plan is over: the chunks
  after an aborted one are dropped), else the base of the plan it is voting in or, with this
  rebalance's arguments, began here first. Counts that diverged therefore meet again at the next
  `begin()`, and a refused plan costs one aborted rebalance, never the ones after it. A rebalance is
  told from an earlier one by its arguments: the serving steps are numbered alike on every rank and
  go forward, so a later rebalance has a later `commit_step`.
"""
import zlib
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

_VOTED = (1, 2)  # GO, ABORT (eplb.online): a record of a real vote, not the initial all-zero one


class Plan(NamedTuple):
    """A rebalance as this rank planned it (published with every vote on its chunks).

    Fields:
        base: the chunk epoch before the plan; its chunks are `base + 1 .. end`.
        end: the last chunk epoch of the plan (`base` when nothing changes).
        target_digest: 31-bit checksum of `new_phy2log` (`target_digest`).
        commit_step: `begin`'s `commit_step`.
        steps_per_chunk: `begin`'s `steps_per_chunk`.
    """

    base: int
    end: int
    target_digest: int
    commit_step: int
    steps_per_chunk: int


def target_digest(target: np.ndarray) -> int:
    """31-bit checksum of a placement (its shape and int64 values).

    Arguments:
        target: `[L, S]` integer numpy array.

    Returns:
        digest: int in [0, 2**31).
    """
    values = np.ascontiguousarray(target, dtype=np.int64)
    return zlib.crc32(values.tobytes(), zlib.crc32(np.asarray(values.shape, dtype=np.int64).tobytes())) & 0x7FFFFFFF


def _plan_of(record: Optional[List[int]]) -> Optional[Plan]:
    """The plan of a peer's vote record, or None (no vote yet, malformed, or inconsistent)."""
    if record is None or record[1] not in _VOTED:
        return None
    plan = Plan(*record[3:8])
    return plan if plan.base < record[0] <= plan.end else None


def agreed_base(ballot, own: int, arguments: Tuple[int, int, int]) -> int:
    """The epoch a new rebalance numbers its chunks from: `own`, raised to what the peers passed.

    Arguments:
        ballot: the slots' `Ballot` (its vote keys exist: `Ballot.prepare`).
        own: this rank's chunk epoch.
        arguments: `(target_digest, commit_step, steps_per_chunk)` of this rebalance.

    Returns:
        base: max of `own` and, per peer with a vote record, the end of its plan if its last vote
            is decided and the plan is another rebalance (other arguments), else that plan's base
            (it still votes in it, or it is this rebalance, begun and aborted there first: this
            rank then numbers alike and adopts that decision). Two store round trips.
    """
    peers = [p for p in range(ballot.num_ranks) if p != ballot.rank]
    plans = [(record[0], plan) for record in ballot.records(peers).values()
             for plan in [_plan_of(record)] if plan is not None]
    decided = ballot.decisions(epoch for epoch, _ in plans) if plans else {}
    base = own
    for epoch, plan in plans:
        over = decided.get(epoch) is not None and tuple(plan[2:]) != tuple(arguments)
        base = max(base, plan.end if over else plan.base)
    return base


def difference(epoch: int, plan: Plan, records: Dict[int, Optional[List[int]]]) -> str:
    """Why the peers' votes cannot be on this chunk's plan, naming what differs; "" if nothing does.

    Arguments:
        epoch: this chunk's epoch.
        plan: this rank's `Plan`.
        records: peer -> its vote record (`Ballot.records`).

    Returns:
        reason: a sentence naming the first difference found (another argument of `begin()` on a
            peer voting on this epoch of a plan from the same base, or a peer voting on this or a
            later epoch of a plan from another base), or "".
    """
    names = (("new_phy2log", "target_digest", "digest {:#x}"), ("commit_step", "commit_step", "{}"),
             ("steps_per_chunk", "steps_per_chunk", "{}"))
    for peer in sorted(records):
        theirs = _plan_of(records[peer])
        if theirs is None:
            continue
        their_epoch = records[peer][0]
        if their_epoch == epoch and theirs.base == plan.base:  # the same rebalance: planned alike?
            for argument, field, form in names:
                if getattr(theirs, field) != getattr(plan, field):
                    return (f"the ranks' plans differ: rank {peer} called begin() with another {argument} "
                            f"({form.format(getattr(theirs, field))} there, {form.format(getattr(plan, field))} "
                            "here); nothing was committed: pass the same arguments to begin() on every rank")
        elif theirs.base != plan.base and their_epoch >= epoch:
            return (f"the ranks' chunk epochs differ: rank {peer} numbered its rebalance's chunks "
                    f"{theirs.base + 1}..{theirs.end}, this rank {plan.base + 1}..{plan.end}; the next begin() "
                    "numbers every rank's chunks from the largest epoch used")
    return ""


def behind_hint(plan: Plan, records: Dict[int, Optional[List[int]]], pending: List[int]) -> str:
    """For peers that did not vote in time: one whose latest vote is on an earlier numbering of this
    same plan (its chunk epochs are behind), named; "" if none.

    Arguments:
        plan: this rank's `Plan`.
        records: peer -> its vote record (`Ballot.records`).
        pending: peers whose vote the wait did not see.

    Returns:
        hint: a sentence to append to the timeout's reason, or "".
    """
    for peer in pending:
        theirs = _plan_of(records.get(peer))
        if theirs is not None and theirs.base < plan.base and theirs[2:] == plan[2:]:
            return (f"rank {peer} voted on epoch {records[peer][0]} of the same plan numbered from epoch "
                    f"{theirs.base + 1}, this rank's from {plan.base + 1}: the ranks' chunk epochs differ if that "
                    "was this rebalance; the next begin() numbers every rank's chunks from the largest epoch used")
    return ""
