"""Votes and one decision per epoch of a group-wide step, kept in the job's store.

The online rebalance (`eplb.online`) needs, at every chunk's commit step, every rank's vote and
plan digest, and then exactly one outcome that every rank adopts, also when a rank is frozen or
dead; a layout switch (`switch.switcher`) needs the same for its GO/ABORT. Both live in the
torch.distributed store the Buffer's membership uses (the launcher hosts it, so it outlives any
rank): the same protocol for ranks of one host and across hosts, and the decision survives the
death of any rank (there is no arbiter whose memory could vanish).

Keys, under the membership's prefix and the ballot's name (`eplb/<participant index>/` for an
`ExpertSlots`, `switch/<participant index>/` for a `UnifiedWeights`: the participant's index in the
Buffer's peer regions, the same on every rank and for a replacement):

    vote/<rank>          [epoch, vote, digest, base, end, target, commit_step, steps_per_chunk]
                                                 this rank's latest vote (GO 1 / ABORT 2), the chunk's
                                                 digest and its plan: the chunk epochs `base + 1 .. end`
                                                 and a digest and the values of `begin`'s arguments
    decision/<e % 256>   [epoch, decision]       the decision of chunk epoch `e` (COMMIT 1 / ABORT 2);
                                                 an older epoch's record means "undecided"
    tally/<e>            counter                 votes cast on chunk epoch `e` (`add`, one per vote)
    done/<e>             summary or "1"          set by the vote that completes the tally (a summary: every
                                                 rank's vote on `e` as `read` reads it, grouped by vote and
                                                 digest), by an ABORT vote ("1"), and where absent by the
                                                 proposal that decides `e` and by a voter that stops
                                                 waiting (these two: a summary where it is an ABORT or the
                                                 wait's end, as its writer may vote on a later epoch before
                                                 a slow voter reads): what a waiting voter waits for

Store operations per vote are O(1) per rank: a rank creates its own vote key only (an absent vote
key reads as the initial all-zero record), and while it waits for the others it makes one wait on
the key `done/<e>` (`membership/key_wait.py`: a blocking wait on a store lane of its own, looked at
locally while the voter asks `stop` about dead ranks; it never times out in honest use, because a
voter that stops waiting, at its deadline or for a dead rank, sets `done/<e>` itself). That wait is
the store's blocking read of `done/<e>` and the decision slot (`KeyWait(read=True)`), so once it is
there the voter has the summary and the decision with no further round trip (one record instead of
R votes; the votes themselves, with one `multi_get`, only when the summary does not name every rank
it waits for, e.g. after an ABORT vote), and its proposal starts from the slot it read. A vote that
completes a unanimous tally of the ranks its caller names (`vote(commit_if=...)`, online EPLB's
rule) proposes COMMIT before it stores the summary: the others find the decision in that read and
their proposals make no store call (vote, tally, wait: three operations per rank).
The tally is only a wake-up: the vote records decide. The first voter of `e` deletes the keys of
`e - 256`.

A decision is stored by compare-and-set over the exact text read (the store's `compare_set`), so
the first proposal of an epoch wins and every later one reads it back. A rank that finds a
decision slot already holding a later epoch is 256 or more epochs behind and raises. Records are
JSON and, with a job secret, authenticated like every membership record (`membership/records.py`);
a malformed or forged vote counts as no GO, a malformed decision slot as undecided (a proposal
replaces it).
"""
import time
from typing import Dict, Iterable, List, Optional, Tuple

from mooncake_ep_switch.buffer.membership.key_prefix import KeyPrefix
from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from mooncake_ep_switch.buffer.membership.protocol import MembershipError
from mooncake_ep_switch.buffer.membership.records import RecordStore

DECISION_SLOTS = 256
POLL_MAX_S = 0.005  # a voter waiting for the others asks `stop` at least this often (backoff from 0.5 ms)
WAIT_FOREVER_S = 3600.0  # the background wait of a voter without a deadline (renewed when it ends)
_CAS_ATTEMPTS = 1000  # each failed compare-and-set means another rank stored something: bounded
VOTE_FIELDS = 8  # epoch, vote, digest and the five plan fields (see the module docstring)
SUPERSEDED = -1  # `decisions()`: the slot holds a later epoch (this one was decided long ago)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


class Ballot:
    """The votes and decisions of one participant's group-wide steps (see the module docstring).

    Arguments:
        membership: the Buffer's `Membership` (its store, prefix and secret are used).
        name: the keys' folder, e.g. `"eplb/3"` (the participant's kind and index).
        rank: this rank.
        num_ranks: ranks of the group.
        what: what decides here, for error messages (e.g. "online EPLB").
    """

    def __init__(self, membership, name: str, rank: int, num_ranks: int, what: str = "online EPLB"):
        self.what = what
        self._records = RecordStore(KeyPrefix(name, membership.store), f"{membership.prefix}/{name}",
                                    membership.secret)
        self.store = self._records.store
        self.rank = rank
        self.num_ranks = num_ranks
        self._there: set = set()  # keys seen to exist (never deleted while this ballot can read them)
        self._votes = False  # prepared with votes: proposals wake the voters (done/<e>)
        self._slot_seen: Dict[int, bytes] = {}  # epoch -> its decision slot as wait_votes read it (for propose)
        self._woken: set = set()  # epochs whose done/<e> wait_votes saw (a proposal need not set it)

    @staticmethod
    def _vote_key(rank: int) -> str:
        return f"vote/{rank}"

    @staticmethod
    def _decision_key(epoch: int) -> str:
        return f"decision/{epoch % DECISION_SLOTS}"

    def _decode(self, key: str, raw: bytes, length: int) -> Optional[list]:
        try:
            value = self._records._decode(key, raw)
        except MembershipError:
            return None
        if isinstance(value, list) and len(value) == length and all(_is_int(v) for v in value):
            return value
        return None

    # ------------------------------------------------------------------ set-up
    def prepare(self, epochs: Iterable[int], votes: bool = True) -> None:
        """Create, where absent, every rank's vote key and the decision slots of `epochs`.

        Called by every rank when it plans a rebalance; creating is compare-and-set from "absent",
        so it never overwrites a vote or a decision. Afterwards every decision slot the commit step
        reads exists (the store's reads of an absent key would block); a peer's vote key that does
        not exist yet reads as the initial all-zero record (`records`, `read`).

        Arguments:
            epochs: the chunk epochs about to be voted on.
            votes: also this rank's vote key (False: decisions only, as a layout switch, whose votes
                are words in shared memory, needs).
        """
        epochs = sorted(set(epochs))
        keys = sorted({self._decision_key(e) for e in epochs})
        if votes:  # this rank's own vote key only: the others' read as the initial record while absent
            self._votes = True
            keys.insert(0, self._vote_key(self.rank))
        found = {}
        for key in keys:
            initial = [0] * VOTE_FIELDS if key.startswith("vote/") else [0, 0]
            found[key] = self.store.compare_set(key, "", self._records.encode_record(key, initial))
        self._there.update(keys)  # created (or found) by the compare-and-set: never deleted
        # The slot as the compare-and-set answered (what it holds now): `propose` starts from it instead of a read
        # (a stale one fails its compare-and-set, which answers what the slot holds then). The latest epochs only.
        for epoch in epochs[-DECISION_SLOTS:]:
            self._slot_seen[epoch] = bytes(found[self._decision_key(epoch)])
        for epoch in sorted(self._slot_seen)[:-DECISION_SLOTS]:
            del self._slot_seen[epoch]

    # ------------------------------------------------------------------ votes
    def vote(self, epoch: int, vote: int, digest: int, plan: Tuple[int, ...] = (0, 0, 0, 0, 0),
             voters: Optional[int] = None, commit_if: Optional[Iterable[int]] = None) -> None:
        """Publish this rank's vote and plan digest for `epoch` (one record, replaced per epoch).

        Arguments:
            epoch: the chunk epoch.
            vote: 1 (GO) or 2 (ABORT).
            digest: the chunk's 31-bit plan digest.
            plan: `(base, end, target_digest, commit_step, steps_per_chunk)` of the rebalance the
                chunk belongs to (`eplb.epochs`): how peers name a different plan and agree on epochs.
            voters: how many ranks vote on `epoch` (default every rank): the vote that completes them
                wakes the voters' `wait_votes`.
            commit_if: the ranks whose GO with `digest` makes this rank propose COMMIT (its rule, as online EPLB's:
                every voter GO with its digest), or None. When this GO completes the tally and the summary it
                stores shows every one of them GO with `digest`, this rank proposes COMMIT (`propose`: the first
                proposal stored wins) before it wakes the voters, so their wait reads the decision with the
                summary and their own `propose` finds it stored (no store call).
        """
        key = self._vote_key(self.rank)
        self.store.set(key, self._records.encode_record(key, [epoch, vote, digest, *plan]))
        cast = self.store.add(f"tally/{epoch}", 1)
        if cast == 1 and epoch >= DECISION_SLOTS:  # the first voter of the epoch: forget the ones of its slot before
            for old in (f"tally/{epoch - DECISION_SLOTS}", f"done/{epoch - DECISION_SLOTS}"):
                self.store.delete_key(old)
        if vote != 1 or cast >= (self.num_ranks if voters is None else voters):
            # Every vote is in, or an ABORT ends it: wake the voters' wait. The vote completing the tally stores the
            # votes as a waiter would read them (one record, read once by each waiter instead of every vote).
            key = f"done/{epoch}"
            summary = None if vote != 1 else self._summary(epoch)
            if summary is not None and commit_if is not None and self._unanimous(summary, commit_if, digest):
                self._propose_early(epoch)
            self.store.set(key, "1" if summary is None else self._records.encode_record(key, summary))

    @staticmethod
    def _unanimous(summary: dict, ranks: Iterable[int], digest: int) -> bool:
        """Whether the summary `summary` shows every rank of `ranks` voting GO with `digest`."""
        go = {rank for vote, found, members in summary["groups"] if vote == 1 and found == digest for rank in members}
        return all(rank in go for rank in ranks)

    def _propose_early(self, epoch: int) -> None:
        """The completing GO of a unanimous tally proposes COMMIT (see `vote`), by compare-and-set from the slot's
        initial record (the slot as `prepare` created it; otherwise the CAS returns what it holds and `propose`
        goes on from there). A slot of a later epoch (this rank fell behind) is left to `wait_votes`/`propose`."""
        key = self._decision_key(epoch)
        if key not in self._there:
            return  # no slot known to exist (a CAS from a guessed text on an absent key returns the guess)
        self._slot_seen[epoch] = self._records.encode_record(key, [0, 0]).encode()
        try:
            self._propose(epoch, 1, wake=False)  # the summary set next wakes the voters
        except RuntimeError:
            pass  # behind, or the slot is not this job's: the voters' own proposals find it and raise

    def _summary(self, epoch: int) -> dict:
        """Every rank's vote on `epoch` as `read` reads it, grouped: {"epoch", "groups": [[vote, digest, [ranks]]]}
        (ranks whose record is of an earlier epoch, or absent, are not in it)."""
        ranks = list(range(self.num_ranks))
        keys = [self._vote_key(r) for r in ranks]
        groups: Dict[Tuple[int, int], List[int]] = {}
        for rank, key, raw in zip(ranks, keys, self._raws(keys)):
            if raw is None:
                continue
            record = self._decode(key, raw, VOTE_FIELDS)
            if record is None or record[0] > epoch:
                groups.setdefault((0, 0), []).append(rank)
            elif record[0] == epoch:
                groups.setdefault((record[1], record[2]), []).append(rank)
        return {"epoch": epoch, "groups": [[vote, digest, members] for (vote, digest), members in groups.items()]}

    def _summarized(self, epoch: int, raw: Optional[bytes], ranks: List[int]) -> Optional[Dict[int, Tuple[int, int]]]:
        """The votes of `ranks` from the summary `raw` stored at `done/<epoch>`, or None when it is not a valid
        summary of `epoch` naming a vote of every rank of `ranks` (then the votes are read one by one)."""
        if raw is None or raw == b"1":
            return None
        try:
            value = self._records._decode(f"done/{epoch}", raw)
        except MembershipError:
            return None
        if not isinstance(value, dict) or value.get("epoch") != epoch or not isinstance(value.get("groups"), list):
            return None
        found: Dict[int, Tuple[int, int]] = {}
        for group in value["groups"]:
            if not (isinstance(group, list) and len(group) == 3 and _is_int(group[0]) and _is_int(group[1])
                    and isinstance(group[2], list)):
                return None
            for rank in group[2]:
                if not (_is_int(rank) and rank < self.num_ranks):
                    return None
                found[rank] = (group[0], group[1])
        if any(rank not in found for rank in ranks):
            return None
        return {rank: found[rank] for rank in ranks}

    def records(self, ranks: List[int]) -> Dict[int, Optional[List[int]]]:
        """The latest vote records of `ranks` as stored, in one store round trip.

        Arguments:
            ranks: ranks whose records to read.

        Returns:
            records: rank -> the record's `VOTE_FIELDS` ints (see the module docstring; all zero
                while the rank has not prepared its key), or None when malformed or forged.
        """
        keys = [self._vote_key(r) for r in ranks]
        raws = self._raws(keys)
        return {rank: [0] * VOTE_FIELDS if raw is None else self._decode(key, raw, VOTE_FIELDS)
                for rank, key, raw in zip(ranks, keys, raws)}

    def _raws(self, keys: List[str]) -> List[Optional[bytes]]:
        """The values of `keys`, None where absent: one `multi_get` once every key was seen to exist."""
        if not keys:
            return []
        if all(key in self._there for key in keys):
            return list(self.store.multi_get(keys))
        raws = self._records.read_raws(keys)
        self._there.update(key for key, raw in zip(keys, raws) if raw is not None)
        return raws

    def decisions(self, epochs: Iterable[int]) -> Dict[int, Optional[int]]:
        """The decisions stored for `epochs`, in one store round trip.

        Arguments:
            epochs: chunk epochs.

        Returns:
            decisions: epoch -> 1 (COMMIT), 2 (ABORT), None (undecided, or no slot yet) or `SUPERSEDED` (the slot
                holds an epoch 256 or more later: this one was decided long ago).
        """
        epochs = sorted(set(epochs))
        keys = [self._decision_key(e) for e in epochs]
        out: Dict[int, Optional[int]] = {}
        for epoch, raw in zip(epochs, self._raws(keys)):
            try:
                out[epoch] = None if raw is None else self._decision_of(epoch, raw)
            except RuntimeError:
                out[epoch] = SUPERSEDED
        return out

    def read(self, ranks: List[int], epoch: int) -> Tuple[Dict[int, Tuple[int, int]], Optional[int]]:
        """The votes of `ranks` on `epoch` and its decision, in one store round trip (once every key was seen).

        Arguments:
            ranks: ranks whose votes to read (a rank without a vote key yet has not voted).
            epoch: the chunk epoch.

        Returns:
            votes: rank -> (vote, digest) for the ranks whose record is of `epoch` or later (a later
                epoch's record reads as vote 0: not a GO on this one); a malformed record reads as
                (0, 0). Ranks still on an earlier epoch are absent.
            decided: the stored decision of `epoch`, or None.

        Raises:
            RuntimeError: this rank is 256 or more epochs behind (see `decided`).
        """
        keys = [self._vote_key(r) for r in ranks] + [self._decision_key(epoch)]
        raws = self._raws(keys)
        votes = {}
        for rank, key, raw in zip(ranks, keys, raws):
            if raw is None:
                continue  # no key yet: the initial record, no vote on any epoch
            record = self._decode(key, raw, VOTE_FIELDS)
            if record is None:
                votes[rank] = (0, 0)
            elif record[0] == epoch:
                votes[rank] = (record[1], record[2])
            elif record[0] > epoch:
                votes[rank] = (0, 0)
        return votes, None if raws[-1] is None else self._decision_of(epoch, raws[-1])

    # ------------------------------------------------------------------ decisions
    def _decision_of(self, epoch: int, raw: bytes) -> Optional[int]:
        record = self._decode(self._decision_key(epoch), raw, 2)
        if record is None or record[0] < epoch:
            return None
        if record[0] > epoch:
            raise RuntimeError(f"{self.what}: rank {self.rank} is {record[0] - epoch} epochs behind (epoch {epoch}'s "
                               f"decision slot was reused by epoch {record[0]}); its placement is unknown, replace "
                               "this rank")
        return record[1]

    def decided(self, epoch: int) -> Optional[int]:
        """The decision stored for `epoch` (1 COMMIT, 2 ABORT), or None while undecided.

        Arguments:
            epoch: the chunk epoch (its slot exists: `prepare`).

        Returns:
            decision: int or None.

        Raises:
            RuntimeError: the slot holds an epoch 256 or more later (this rank fell behind:
                replace it).
        """
        return self._decision_of(epoch, self.store.get(self._decision_key(epoch)))

    def propose(self, epoch: int, decision: int) -> int:
        """Store `decision` for `epoch` unless one is stored; return the stored one (every rank's).

        Arguments:
            epoch: the chunk epoch (its slot exists: `prepare`).
            decision: 1 (COMMIT) or 2 (ABORT).

        Returns:
            decision: the decision that won (this proposal or an earlier one).

        Raises:
            RuntimeError: this rank fell 256 epochs behind, or the slot kept changing under
                `_CAS_ATTEMPTS` attempts (something other than this job's ranks writes it).
        """
        return self._propose(epoch, decision, wake=True)

    def _propose(self, epoch: int, decision: int, wake: bool) -> int:
        """`propose`; `wake`: a proposal that stores the decision sets `done/<epoch>` (wakes the voters)."""
        key = self._decision_key(epoch)
        raw = self._slot_seen.pop(epoch, None)  # the slot as `wait_votes` last read it: a stale one fails the CAS
        if raw is None:
            raw = self.store.get(key)
        desired = self._records.encode_record(key, [epoch, decision])
        for _ in range(_CAS_ATTEMPTS):
            stored = self._decision_of(epoch, raw)
            if stored is not None:
                return stored
            try:
                expected = raw.decode()
            except UnicodeDecodeError:
                expected = None
            if expected is None:
                break
            raw = self.store.compare_set(key, expected, desired)
            if wake and self._votes and epoch not in self._woken and raw.decode(errors="replace") == desired:
                self._wake(epoch, summary=decision != 1)  # decided: wake the voters still waiting
        raise RuntimeError(f"{self.what}: the decision slot {self._records.prefix}/{key} of epoch {epoch} holds "
                           f"{bytes(raw[:40])!r} and could not be replaced: something other than this job's ranks "
                           "writes it")

    def _wake(self, epoch: int, summary: bool = True) -> None:
        """Set `done/<epoch>` unless it is set: wake the voters still waiting. With `summary` (a voter that stops
        waiting, a proposal that stores ABORT: no complete tally, rare) the votes as stored now, so a voter woken
        after a peer moved on to a later epoch (its vote record replaced) still reads that peer's vote on this one
        (e.g. another digest, the reason worth naming); "1" otherwise (the waiters read the votes)."""
        key = f"done/{epoch}"
        self.store.compare_set(key, "", self._records.encode_record(key, self._summary(epoch)) if summary else "1")

    def wait_votes(self, ranks: List[int], epoch: int, timeout_us: int, stop=None) -> Tuple[
            Dict[int, Tuple[int, int]], List[int], Optional[int]]:
        """Wait until every rank of `ranks` voted on `epoch`, it was decided, or the deadline (see the module
        docstring: one wait on `done/<epoch>`, then its summary or the votes read once).

        Arguments:
            ranks: ranks to wait for.
            epoch: the chunk epoch.
            timeout_us: deadline in microseconds from now, -1 for none.
            stop: optional callable(pending ranks) -> ranks to stop waiting for (e.g. dead
                processes); when it returns any, the wait ends.

        Returns:
            votes: rank -> (vote, digest) of the ranks that voted.
            gone: the ranks `stop` named (empty unless it ended the wait).
            decided: the stored decision of `epoch` if one was seen, else None.
        """
        deadline = None if timeout_us < 0 else time.monotonic() + timeout_us / 1e6
        done_key = f"done/{epoch}"
        # One wait on done/<epoch> (in the background where the store allows: no store operation per round), not a
        # read of every vote per round; the rounds here only ask `stop` and watch the deadline.
        slot_key = self._decision_key(epoch)
        # The wait is a read of done/<epoch> and the decision slot (which exists: `prepare`) where the slot is known:
        # woken, the voter has the summary and the decision (a unanimous tally's completing vote proposed first).
        keys = [done_key, slot_key] if slot_key in self._there else [done_key]
        waiter = KeyWait(self.store, keys, (WAIT_FOREVER_S if deadline is None else timeout_us / 1e6) + 1.0,
                         read=len(keys) == 2)
        pause, done, summary_read = 0.0005, False, False
        while True:
            if not done:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                slice_s = pause if stop is not None or not waiter.background else (left or WAIT_FOREVER_S)
                got = waiter.poll(slice_s if left is None else min(slice_s, left))
                done = bool(got)
                if got is False:  # the wait ended without the key (the store's error): one check per round from now
                    waiter = KeyWait(self.store, keys, WAIT_FOREVER_S if left is None else left, background=False,
                                     read=len(keys) == 2)
            now = time.monotonic()
            late = deadline is not None and now >= deadline
            # Read the votes once done/<epoch> is there, at the deadline, or when `stop` names a rank (whether
            # it voted decides whether it ends the wait).
            if done or late or (stop is not None and list(stop(list(ranks)))):
                votes = None
                if done and not summary_read:  # the completing vote's summary and the decision: read by the wait
                    summary_read = True
                    self._woken.add(epoch)
                    raw, slot = (waiter.values() if len(keys) == 2
                                 else self._raws([done_key, slot_key]))  # done/<epoch> is there: the wait said so
                    raw, slot = (None if raw is None else bytes(raw)), (None if slot is None else bytes(slot))
                    votes = self._summarized(epoch, raw, ranks)
                    decided = None if slot is None else self._decision_of(epoch, slot)
                    if slot is not None:
                        self._slot_seen[epoch] = slot
                if votes is None:
                    votes, decided = self.read(ranks, epoch)
                pending = [r for r in ranks if r not in votes]
                if decided is not None or not pending:
                    return votes, [], decided
                if any(vote != 1 for vote, _ in votes.values()):
                    return votes, [], None  # an ABORT (or foreign) vote: no need to wait for the rest
                gone = list(stop(pending)) if stop is not None else []
                if gone or late:
                    if not done:  # end this rank's own wait (and wake the others: its caller decides now)
                        self._wake(epoch)
                    return votes, gone, None
            if done:
                time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))
            pause = min(pause * 2, POLL_MAX_S if not done else 0.002)
