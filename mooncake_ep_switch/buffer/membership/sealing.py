"""Sealing the next view in a bounded number of store operations (rules 1 and 5 of protocol.py).

One member seals (the lowest member a waiting member does not know dead, see
`Membership.agree_next_view`); the others block on the view's keys. Its work does not grow with
rounds of polling: one batched `check` of the ready keys it waits for (each other rank alone),
one `multi_get` of the ready records and one of the incarnation counters, one admission record
(`admitted/<e>`, compare-and-set) that binds every rank of the view to the incarnation found
ready and carries the largest call counter, one view (compare-and-set); the sealer whose view won
then advances the epoch counter and sets every member's state with one `multi_set`. A malformed
record keeps its rank out; it never breaks the seal.
"""
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from mooncake_ep_switch.buffer.membership.member_records import MemberRecords
from mooncake_ep_switch.buffer.membership.removed import removed_ranks
from mooncake_ep_switch.buffer.membership.records import (ACTIVE, INACTIVE, JOINING, MAX_COUNTER, MembershipError,
                                                          valid_ready, valid_state)

__all__ = ["SealingRecords", "posted", "quorum"]


def _ready_keys(target: int, ranks: Iterable[int]) -> List[str]:
    return [f"ready/{target}/{r}" for r in ranks]



def posted(records, target: int, ranks: Sequence[int]) -> bool:
    """Whether every rank of `ranks` posted readiness for `target` (one store call; True for none)."""
    ranks = list(ranks)
    return not ranks or bool(records.store.check(_ready_keys(target, ranks)))



def quorum(ready: Iterable[int], members: Sequence[int], gone: Iterable[int] = ()) -> bool:
    """Rule 5: `ready` is a strict majority of the members not known dead, or exactly half of them
    including the lowest such rank (see `Membership.quorum`)."""
    gone, ready = set(gone), set(ready)
    counted = [r for r in members if r not in gone]
    have = [r for r in counted if r in ready]
    if not counted:
        return bool(have)
    return 2 * len(have) > len(counted) or (2 * len(have) == len(counted) and min(counted) in have)



def _count(raw) -> Optional[int]:
    try:
        value = int(bytes(raw).decode().split(":", 1)[0])
    except (UnicodeDecodeError, ValueError):
        return None
    return value if 0 <= value < MAX_COUNTER else None


class SealingRecords(MemberRecords):
    """The sealer's side of the agreement (see the module docstring); `Membership` builds on it."""

    def _ready_ranks(self, target: int, likely: Sequence[int]) -> List[int]:
        """Ranks whose ready key exists: `likely` with one batched check (one by one when not all are there),
        every other rank of the group one by one (the dead and the non-members: few)."""
        likely = sorted(set(likely))
        found = set(likely) if posted(self, target, likely) else {r for r in likely if posted(self, target, [r])}
        found.update(r for r in range(self.num_ranks) if r not in likely and posted(self, target, [r]))
        return sorted(found)

    def read_ready(self, target: int, ranks: Sequence[int]) -> Dict[int, dict]:
        """The ready records of `ranks` (keys known to exist) that read back intact and carry their rank's
        current incarnation, in two `multi_get` calls (records, counters)."""
        ranks = list(ranks)
        if not ranks:
            return {}
        raws = self.store.multi_get(_ready_keys(target, ranks))
        counters = [f"incarnation/{r}" for r in ranks]
        if self.store.check(counters):
            counts = self.store.multi_get(counters)
        else:
            counts = [self.read_raw(key) for key in counters]
        found = {}
        for rank, raw, count in zip(ranks, raws, counts):
            try:
                record = self._decode(f"ready/{target}/{rank}", bytes(raw))
            except MembershipError:
                continue
            if valid_ready(record) and count is not None and record["incarnation"] == _count(count):
                found[rank] = record
        return found

    def _bind_admission(self, target: int, incarnations: Dict[int, int], call: int) -> dict:
        """Write the admission record of `target` once (compare-and-set): returns the record as bound, this
        sealer's or the one another sealer wrote first."""
        key = f"admitted/{target}"
        record = {"ranks": [[r, incarnations[r]] for r in sorted(incarnations)], "call": int(call)}
        text = self.encode_record(key, record)
        stored = self.store.compare_set(key, "", text)
        if stored.decode(errors="replace") == text:
            self._admissions[target] = record
            return record
        found = self.keep_admission(target, stored)
        if found is None:
            raise MembershipError(f"store record {self.prefix}/{key} is not a valid admission record: "
                                  f"{bytes(stored)[:120]!r}; refusing to seal epoch {target}")
        return found

    def seal_view(self, target: int, members: Sequence[int], gone: Iterable[int], likely: Sequence[int],
             alive: Callable[[List[int]], set], required: Sequence[int] = ()) -> bool:
        """Seal `view/<target>` (rule 1): ready members of the current view and ready registered joiners
        whose heartbeat moves (`alive`), when they are a quorum of the members (rule 5).

        Arguments:
            self: the sealer's `Membership`.
            target: the epoch to seal.
            members: the current view's ranks.
            gone: ranks known dead (they do not count for the quorum).
            likely: ranks expected ready (checked in one call).
            alive: returns the joiners of a list whose heartbeat moves (`Membership._alive`).
            required: ranks whose readiness must read back valid for this seal (before the deadline, every rank the
                sealer waits for): when one's record is not its current incarnation's (two replacements of a rank,
                the other one's post read last; the holder posts again), nothing is written and the sealer waits.

        Returns:
            attempted: whether the view's compare-and-set was made (it picked one view, this one or
                another sealer's); False: no quorum, nothing written.

        Raises:
            MembershipError: this rank's own readiness does not read back, or another incarnation of this
                rank was bound for `target`.
        """
        gone = set(gone)
        ready = self.read_ready(target, self._ready_ranks(target, likely))
        if any(r not in ready for r in required):
            return False
        candidates = []
        for rank in sorted(ready):
            if rank not in members:
                try:
                    state = self._state_record(rank)
                except MembershipError:
                    continue
                if state is None or state["state"] != JOINING or state["epoch"] != target:
                    continue
            candidates.append(rank)
        # A rank a shrink removed is never sealed in again (removed.py), not even a replacement of a member of the
        # current view that registered before the shrink's view; an unreadable record admits no joiner.
        try:
            out = removed_ranks(self)
        except MembershipError:
            out = {r for r in candidates if r not in members}
        candidates = [r for r in candidates if r not in out or r == self.rank]
        joiners = [r for r in candidates if r not in members]
        if joiners:
            proven = alive(joiners)
            candidates = [r for r in candidates if r in members or r in proven]
        if self.rank not in candidates:  # own readiness unreadable: the store was tampered with
            raise MembershipError(f"rank {self.rank}'s own readiness for epoch {target} does not read back "
                                  "intact; refusing to seal")
        if not quorum([r for r in candidates if r in members], members, gone):
            return False
        # The ranks the view leaves out, read now: once the view is there every member wakes, and the sealer's
        # store calls after it (its settling, rule 3) wait behind theirs; only its writes come after.
        outside = self._read_non_members([r for r in range(self.num_ranks) if r not in candidates])
        # One incarnation per rank of the view (two replacements of one rank: the one another sealer bound
        # first, or the one ready now; the other is never sealed in).
        admission = self._bind_admission(target, {r: ready[r]["incarnation"] for r in candidates},
                          max(ready[r]["call"] for r in candidates))
        bound = {r: inc for r, inc in admission["ranks"]}
        candidates = [r for r in candidates if bound.get(r) == ready[r]["incarnation"]]
        if self.rank not in candidates:
            raise MembershipError(f"rank {self.rank} was bound to incarnation {bound.get(self.rank)} in epoch "
                                  f"{target}, this one is {self.incarnation}: another process or Buffer holds this "
                                  "rank; refusing to seal")
        if not quorum([r for r in candidates if r in members], members, gone):
            return False
        key = f"view/{target}"
        text = self.encode_record(key, {"view": candidates, "admission": admission})  # adopters read both at once
        if self.store.compare_set(key, "", text).decode(errors="replace") == text:
            self._views[target] = tuple(candidates)  # this sealer's view won: its adoption reads it from here
            self._settle(target, candidates, bound, outside)
        return True

    def _settle(self, target: int, ranks: List[int], bound: Dict[int, int],
                read: Optional[Dict[int, tuple]] = None) -> None:
        """The sealer whose view won (rule 3): advance the epoch counter, set the members active (one
        `multi_set`) and every other rank inactive unless it registered as joining for a later epoch."""
        try:
            self._advance_epoch(target)
        except MembershipError:
            pass  # a garbage counter: epoch() reports it; the views stay readable
        keys = [f"state/{r}" for r in ranks]
        self.store.multi_set(keys, [self.encode_record(k, {"state": ACTIVE, "incarnation": bound[r], "epoch": target})
                                       for k, r in zip(keys, ranks)])
        self._deactivate_non_members(ranks, target, skip_unreadable=True, read=read)

    def _advance_epoch(self, target: int) -> None:
        """Move the epoch counter to `target` unless it holds `target` or more: one compare-and-set from the text the
        counter holds when the previous change was settled (`str(target - 1)`; absent before the first), which
        returns what the counter holds; only when that was something else, a second one from the text it returned
        (never backwards: a CAS from a value read before another sealer's advance does nothing)."""
        expected = str(target - 1) if target > 1 else ""
        raw = self.store.compare_set("epoch", expected, str(target))
        if raw.decode(errors="replace") == str(target):
            return
        # The CAS failed: it returned the counter's text, or `expected` itself when the counter is absent.
        absent = expected != "" and raw.decode(errors="replace") == expected
        value, text = (0, None) if absent else self.counter_of("epoch", bytes(raw))
        if value < target:
            self.store.compare_set("epoch", "" if text is None else text, str(target))

    def _read_non_members(self, ranks: List[int]) -> Dict[int, tuple]:
        """rank -> (state record, incarnation counter) as stored (None where absent), in one batched read (a check
        and a multi_get when all exist)."""
        if not ranks:
            return {}
        raws = self.read_raws([f"state/{r}" for r in ranks] + [f"incarnation/{r}" for r in ranks])
        return {rank: (raws[i], raws[len(ranks) + i]) for i, rank in enumerate(ranks)}

    def _deactivate_non_members(self, members, epoch: int, skip_unreadable: bool,
                                read: Optional[Dict[int, tuple]] = None) -> None:
        """Rule 3 for the ranks outside `members`: set each inactive for `epoch` (CAS on its state record) unless
        it already is, or registered as joining for a later epoch. `skip_unreadable`: a rank whose incarnation
        counter does not read as a count is left as it is (else the MembershipError propagates). `read`: what
        `_read_non_members` read of some of them before (a sealer reads them before its view wakes every member:
        only the writes come after; a record changed since fails its CAS, as one changed after any read)."""
        others = [r for r in range(self.num_ranks) if r not in members]
        found = dict(read or {})
        found.update(self._read_non_members([r for r in others if r not in found]))
        for rank in others:
            raw, counter = found[rank]
            key = f"state/{rank}"
            try:
                record = None if raw is None else self._decode(key, raw)
            except MembershipError:
                record = None
            if valid_state(record) and record["state"] == INACTIVE:
                continue
            if valid_state(record) and record["state"] == JOINING and record["epoch"] > epoch:
                continue  # registered for a later epoch: still joining
            try:
                incarnation = self.counter_of(f"incarnation/{rank}", counter)[0]
            except MembershipError:
                if skip_unreadable:
                    continue
                raise
            inactive = self.encode_record(key, {"state": INACTIVE, "incarnation": incarnation, "epoch": epoch})
            self.store.compare_set(key, "" if raw is None else raw.decode(errors="replace"), inactive)
