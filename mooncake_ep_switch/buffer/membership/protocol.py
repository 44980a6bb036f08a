"""Membership that survives dead ranks: epochs, views, states and endpoints in the store.

A gloo or nccl group cannot lose a member, so membership lives in the torch.distributed store
(a TCPStore hosted by the launcher/agent), which outlives any rank. Keys (under the prefix of one
Buffer generation of one EP group, see `group_prefix` and `generation_prefix`):

    epoch                       current epoch number (0 before any change)
    view/<e>                    the member ranks of epoch e (sealed once, by CAS): a sealer writes
                                {"view": [ranks], "admission": the admission record below}; a plain
                                JSON list of ranks is read too
    ready/<e>/<rank>            JSON {"incarnation", "call"}: rank asks to be in epoch e
    admitted/<e>                JSON {"ranks": [[rank, incarnation], ...], "call"}: the incarnation of every
                                rank view/<e> admits and their largest call (bound once, by CAS, before the seal)
    admitted/<e>/<rank>         the incarnation of rank bound in epoch e by itself (epoch 0, the Buffer's construction)
    closed/<rank>               the incarnation whose Buffer of this generation was destroyed
    state/<rank>                JSON {"state", "incarnation", "epoch"}: active, inactive or joining
    joiners                     "r,r,...": every rank that ever registered as joining (listed before its
                                state says so; `joining()` reads only these ranks' states)
    incarnation/<rank>          counter, bumped by every process (or rejoining Buffer) taking the rank id
    endpoint/<rank>/<inc>       JSON endpoint of that incarnation (region pid/fd, TE session)
    evidence/<e>/<reporter>     JSON list of ranks the reporter saw fail in epoch e
    alive/<rank>                heartbeat of a joiner: "<inc>:w:<n>" while it waits to be admitted,
                                "<inc>:p:<n>" while it is registered but not waiting (pending);
                                of a member: "<inc>:m:<n>" while it waits in agree_next_view
    regions/<i>/<rank>/<inc>    JSON {"kind", "regions": [[pid, fd, nbytes], ...]}: shared regions of
                                participant i of that incarnation (buffer/peer_regions.py)
    regions/state/<e>           JSON list, what the members' participants hand a replacement admitted in e
    use_fallback/<e>            JSON {"on", "switches"}: the members' `_use_fallback` switch, which a joiner
                                admitted in e takes before it connects (buffer/mooncake_runtime.py)

Rules that turn evidence into a new epoch e+1 (epoch e has the sealed view V_e; epoch 0 is every rank):

1. Only a member of V_e seals `view/<e+1>`. A member posts `ready/<e+1>` and waits, up to its
   deadline, for every member of V_e it has not seen fail; then it seals, with compare-and-set, the
   ranks whose `ready/<e+1>` record carries their current incarnation and that are members of V_e
   or joiners registered for e+1 whose heartbeat still moves (a joiner that died while waiting is
   not sealed in; checking costs the sealer at most `JOINER_PROOF_S`, only when joiners wait). The
   CAS picks one view; every rank adopts it, so no rank decides alone and all agree. The sealed
   view always holds its sealer, so it is never empty. Before the view, the sealer binds every rank
   of it to the incarnation it found ready (`admitted/<e+1>/<rank>`, by CAS: one incarnation per rank
   and epoch); a process whose incarnation is not the bound one never adopts the view (it raises,
   naming the incarnation that holds the rank), and peers read the bound incarnation's endpoint.
   One member does that work before the deadline: the lowest rank of the ranks it waits for that it
   does not know dead (it checks their readiness with one batched call per round); the others make one
   wait on `view/<e+1>` (`key_wait.py`, looked at locally, beating between) and read it with one call, so
   a change costs O(R) store operations in all (sealing.py). At the deadline every member seals with whoever is ready
   (after giving that lowest rank `LEADER_GRACE_S`), as before.
2. A joiner (a replacement process, or a member that was left out) never seals. It posts
   `ready/<e+1>`, then sets its state to joining for e+1 (so a member that sees it joining also
   finds it ready: members never wait for joiners), and waits up to its deadline for a member to
   seal. Sealed without it (it posted too late): it registers again for the next epoch. Deadline
   passed: it reports that it was not admitted but stays registered (pending): a daemon thread
   keeps a pending beat and re-registers it for each next epoch, so `joining()` keeps listing it;
   sealers admit only joiners whose beat says they wait, so it is admitted once it calls
   `update_ep_member()` again. It withdraws (state inactive) when its Buffer is destroyed.
3. The sealer whose view won sets every member's state active (one `multi_set`), advances the epoch
   counter and sets every non-member's state inactive, unless that rank has registered as joining for a
   later epoch (an adopter of a view sealed without an admission record does it itself, as before; a
   sealer that dies in between leaves the states of the epoch before, which no rule reads). A joiner that died is therefore listed by
   `joining()` only until the next seal (which costs the members at most `JOINER_PROOF_S` for it),
   and never again unless a process registers for that rank anew.
4. A member that finds a view sealed without it was left out: it is no longer a member (dispatch
   and combine refuse) and comes back through rule 2: `update_ep_member()` takes a new incarnation
   (refused if another process took the rank over), republishes its endpoint and waits as a joiner.
   If every member of the current view is gone nobody can seal any more: the job must restart.
5. A view is sealed only by a quorum: its ready members must be a strict majority of the current view's
   members not known dead (their process seen to end by the peer watcher), or exactly half of them
   including the lowest such rank. A rank cut off from its peers (it sees every other rank fail) can
   therefore not seal the healthy majority out; when a group splits in two, only the side with a
   majority (or the half with the lowest rank) seals, and the other side's ranks rejoin. A member
   without a quorum at its deadline raises (nothing sealed) and calls again.

Records are validated when read and, with a per-job secret, authenticated; counters are bumped
with compare-and-set. That record layer (codec, `valid_*` checks, HMAC) is `membership_records.py`,
the per-rank records on it (state, incarnation, endpoint, regions) `member_records.py`; this module
is the epoch/view protocol on top of them.
"""
import atexit
import math
import numbers
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence

import torch.distributed as dist

# The record layer; names other modules import from here are re-exported.
from mooncake_ep_switch.buffer.membership.records import (ACTIVE, INACTIVE, JOINING, MAX_COUNTER,  # noqa: F401
                                                          MAX_RECORD_BYTES, MAX_STATE_BYTES, STATES, MembershipError,
                                                          RecordStore, rank_list, valid_ready, valid_state, view_record)
from mooncake_ep_switch.buffer.membership.beats import post_beat
from mooncake_ep_switch.buffer.membership.combined_posts import post_combined
from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from mooncake_ep_switch.buffer.membership.member_records import MemberRecords  # noqa: F401 (re-exported)
from mooncake_ep_switch.buffer.membership.removed import removed_ranks
from mooncake_ep_switch.buffer.membership.sealing import SealingRecords, posted, quorum
from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore, remaining_s, store_deadline
from mooncake_ep_switch.errors import LeftOut  # noqa: F401 (re-exported)

JOINER_BEAT_S = 0.02  # a waiting joiner refreshes alive/<rank> this often
PENDING_BEAT_S = 0.1  # a joiner that gave up waiting for now (still registered) beats this often
PENDING_STOP_S = 5.0  # how long stopping that beat waits for its thread (one store call)
PENDING_CALL_S = 1.0  # deadline of one pending beat's store calls (a stalled store host: it skips that beat)
WAITING_BEAT, PENDING_BEAT, MEMBER_BEAT = "w", "p", "m"  # alive/<rank> = "<incarnation>:<w|p|m>:<count>"
MEMBER_BEAT_MARK = f":{MEMBER_BEAT}:".encode()  # a member waiting in agree_next_view (replacement.py reads it)
_PENDING: "weakref.WeakSet[Membership]" = weakref.WeakSet()  # memberships with a pending beat running
JOINER_CHECK_BEATS = 5  # a waiting joiner checks that it still holds its rank every this many beats
WAIT_SLICE_S = 0.5  # a member waiting for the sealer beats this often
SEALED_LOOK_S = 0.1  # and looks at its wait for the view (and whether the leader is seen dead) at least this often
MEMBER_BEAT_S = 0.1  # a waiting member refreshes alive/<rank> at most this often
LEADER_GRACE_S = 0.2  # past its deadline a member gives the lowest waiting member this long to seal first
JOINER_PROOF_S = 1.0  # a sealer admits only joiners whose heartbeat moved within this long
_MAX_EPOCH_SKIP = 1 << 12  # sealed views past the epoch counter that epoch() walks over


@atexit.register
def _stop_pending_at_exit() -> None:
    # A daemon thread inside a store call while the interpreter finalizes can abort the process.
    for membership in list(_PENDING):
        try:
            membership.stop_pending(wait_s=1.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


# LeftOut lives in errors.py (one hierarchy), re-exported here.


class View(NamedTuple):
    """Members of one epoch.

    Fields:
        epoch: the epoch number.
        ranks: member ranks, ascending.
    """

    epoch: int
    ranks: tuple


def check_seconds(name: str, value, allow_none: bool = False) -> Optional[float]:
    """Check a duration argument: a real number of seconds, finite and > 0.

    Arguments:
        name: argument name used in error messages.
        value: the value to check.
        allow_none: accept None (returned unchanged).

    Returns:
        seconds: float (or None when allowed and given).

    Raises:
        TypeError: not a real number (str, bool, tensor, ...).
        ValueError: NaN, infinite, zero or negative.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a finite number of seconds > 0, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
    return seconds


class Membership(SealingRecords):
    """Read and change the EP membership kept in a store.

    Arguments:
        store: a torch.distributed Store shared by every rank (and replacements); used as given
            (the Buffer decides which prefixes to keep, see `group_prefix`).
        rank: this process's EP rank.
        num_ranks: EP group size (fixed; a dead rank's id is taken by its replacement).
        prefix: key prefix (one EP group generation per prefix).
        secret: per-job secret (bytes or str) that authenticates every record, or None (records
            are then only validated).
        take_incarnation: take a new incarnation of `rank` (default); False: a read-only observer.
    """

    _blocking_waits: Optional[bool] = None  # whether the store is a BoundedStore (a client of its own per call lane)
    _sealed_wait: Optional[KeyWait] = None  # agree_next_view's wait for the view (`_wait_sealed`)

    # ------------------------------------------------------------------ reads
    def incarnation_of(self, rank: int) -> int:
        """The incarnation of `rank` whose endpoint and regions count: the one the current epoch's sealed view
        admitted (`admitted/<e>/<rank>`), else the newest one taken (the counter: no view bound the rank, e.g.
        a joiner not admitted yet; epoch 0 of a group's Buffer binds the incarnation that built it).

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            incarnation: int, 0 when no process took the rank yet.

        Raises:
            MembershipError: the counter or the admitted record is malformed or fails authentication.
        """
        bound = self.admitted_incarnation(self.epoch(), rank)
        return bound if bound is not None else self.read_counter(f"incarnation/{rank}")

    def epoch(self) -> int:
        """Current epoch number.

        Views are sealed one after the other, so the epoch is the newest sealed view's number: the
        view after the newest one this process knows is looked up first (one store call when there
        is none). Only past it is the counter read, as a hint (a store writer could set it back, and
        it moves after the view is sealed): the epoch is past every well-formed (with a job secret:
        authentic) view sealed after it, looked up one epoch at a time.

        Returns:
            epoch: int, 0 before any change.

        Raises:
            MembershipError: the epoch key holds something other than a count.
        """
        # Views are sealed one after the other: with no view after the newest one known here (read or sealed;
        # epoch 0 needs none), that is the epoch, in one store call. The counter (two more) only skips ahead.
        known = max(self._views, default=0)
        try:
            if self._view_record(known + 1) is None:
                return known
        except MembershipError:
            return known  # a malformed or forged view is no epoch; agree_next_view() reports it
        epoch = max(known + 1, self.read_counter("epoch"))
        for _ in range(_MAX_EPOCH_SKIP):  # bounded: the counter lags by one in honest use
            try:
                if self._view_record(epoch + 1) is None:
                    break
            except MembershipError:
                break  # a malformed or forged view is no epoch; agree_next_view() reports it
            epoch += 1
        return epoch

    def _view_record(self, epoch: int) -> Optional[tuple]:
        found = self._views.get(epoch)  # sealed once, by compare-and-set: a view read is kept
        if found is None and epoch > 0:  # epoch 0 is every rank: no view of it is ever sealed
            raw = self.read_raw(f"view/{epoch}")
            if raw is not None:
                found = self._decode_view(epoch, raw)
        return found

    def _decode_view(self, epoch: int, raw: bytes) -> tuple:
        """The ranks of the view record `raw` of `epoch` (kept, with the admission record it carries)."""
        value = self._decode(f"view/{epoch}", raw)
        found = view_record(value, self.num_ranks)
        if found is None:
            raise MembershipError(f"store record {self.prefix}/view/{epoch} is not a valid view (non-empty ascending "
                                  f"list of distinct ranks in [0, {self.num_ranks}), or a sealer's record of one): "
                                  f"{str(value)[:120]!r}; refused")
        ranks, admission = found
        self._views[epoch] = ranks
        if admission is not None:
            self._admissions.setdefault(epoch, admission)
        return ranks

    def sealed(self, epoch: int) -> bool:
        """Whether a view of `epoch` was sealed (its content is not checked).

        Arguments:
            epoch: epoch number.

        Returns:
            sealed: bool.
        """
        return bool(self.store.check([f"view/{epoch}"]))

    def view(self, epoch: Optional[int] = None) -> View:
        """Members of `epoch` (default the current one); epoch 0 is every rank.

        Arguments:
            epoch: epoch number, or None for the current one.

        Returns:
            view: a `View`; every rank when no view of that epoch was sealed.

        Raises:
            MembershipError: the sealed view is malformed or fails authentication.
        """
        epoch = self.epoch() if epoch is None else epoch
        found = self._view_record(epoch)
        return View(epoch, tuple(range(self.num_ranks)) if found is None else tuple(found))

    def joining(self, epoch: Optional[int] = None) -> List[int]:
        """Ranks waiting to be admitted into `epoch` (default: the one after the current epoch).

        A rank counts when its state says joining for that epoch, with its current incarnation,
        and its readiness for that epoch is posted. Malformed or forged records of a rank are
        skipped (that rank is not listed), so they cannot break the members' loop. Only the ranks that
        ever registered as joining are read (`listed_joiners`, their states with one `multi_get`): a
        constant number of store calls while nobody joins, not two per rank.

        Arguments:
            epoch: the epoch the joiners wait for, or None for `epoch() + 1`.

        Returns:
            ranks: list of int, ascending.
        """
        epoch = self.epoch() + 1 if epoch is None else epoch
        listed = self.listed_joiners()  # every rank that ever registered as joining (set_state lists it first)
        keys = [f"state/{r}" for r in listed]
        found = []
        for rank, key, raw in zip(listed, keys, self.read_raws(keys)):
            try:
                record = self.checked(key, raw, valid_state, "state record")
                if record is None or record["state"] != JOINING or record["epoch"] != epoch:
                    continue
                if self.ready_record(epoch, rank) is not None:
                    found.append(rank)
            except MembershipError:
                continue
        if found:  # a rank a shrink removed is never listed (nor admitted) again; an unreadable record: none is
            try:
                out = removed_ranks(self)
            except MembershipError:
                return []
            found = [r for r in found if r not in out]
        return found

    def ready_record(self, epoch: int, rank: int) -> Optional[dict]:
        """`rank`'s readiness for `epoch` when it carries the rank's current incarnation, else None."""
        record = self._read(f"ready/{epoch}/{rank}", valid_ready, "ready record")
        if record is None or record["incarnation"] != self.read_counter(f"incarnation/{rank}"):
            return None
        return record

    def evidence(self, epoch: Optional[int] = None) -> Dict[int, List[int]]:
        """Failures reported in `epoch`: reporter -> ranks it saw fail.

        Arguments:
            epoch: epoch number, or None for the current one.

        Returns:
            evidence: dict int -> list of int, for reporters that posted valid evidence only
                (malformed or forged records are skipped).
        """
        epoch = self.epoch() if epoch is None else epoch
        found = {}
        for reporter in range(self.num_ranks):
            try:
                ranks = self._read(f"evidence/{epoch}/{reporter}", lambda v: rank_list(v, self.num_ranks) is not None,
                                   "evidence list")
            except MembershipError:
                continue
            if ranks is not None:
                found[reporter] = list(ranks)
        return found

    # ------------------------------------------------------------------ writes
    def report_failures(self, ranks: Iterable[int]) -> None:
        """Publish the ranks this rank saw fail in the current epoch (data-plane evidence).

        Replaces this rank's earlier evidence for the epoch; nothing is written for no ranks.

        Arguments:
            ranks: iterable of int EP ranks (duplicates are dropped).
        """
        ranks = sorted(set(int(r) for r in ranks))
        if ranks:
            self._put(f"evidence/{self.epoch()}/{self.rank}", ranks)

    # ------------------------------------------------------------------ agreement
    def agree_next_view(self, current: int, expected: Iterable[int], deadline: float, call: int = 0,
                        joining: bool = False, dead: Optional[Callable[[], Iterable[int]]] = None,
                        stall_deadline: Optional[float] = None) -> View:
        """Post readiness for epoch `current + 1`, wait, and adopt the sealed view (module rules 1-3).

        Arguments:
            current: the epoch this rank is in (a joiner: the store's current epoch).
            expected: members this rank waits for (besides itself) before sealing (ignored by a joiner).
            deadline: `time.monotonic()` value: a member seals with whoever is ready then; a joiner
                gives up then.
            call: this rank's call counter (the next epoch's counters start above every one).
            joining: this rank is a joiner: it never seals, it waits for a member to.
            dead: returns the ranks whose process is known to have ended (they do not count for the
                quorum, rule 5), or None.
            stall_deadline: with `dead`: a member does not wait for ranks known dead, and past
                `deadline` keeps waiting, until this `time.monotonic()` value, for expected ranks that
                are not known dead (slow to notice a failure is not gone); None: it waits for every
                expected rank until `deadline` and seals then.

        Returns:
            view: the agreed `View` of the next epoch (this rank is a member).

        Raises:
            LeftOut: the view was sealed without this rank.
            MembershipError: a joiner's deadline passed before any member sealed (it withdrew), a
                non-joiner is not a member of `current`, or the sealed view is malformed or forged.
        """
        self.stop_pending()  # a joiner that gave up earlier waits again now (or a member goes on)
        target = current + 1
        members = self.view(current).ranks
        if not joining and self.rank not in members:
            raise LeftOut(f"rank {self.rank} is not a member of epoch {current} (members {list(members)}); "
                          "call update_ep_member() to rejoin", current, members)
        waiting = sorted(set(int(r) for r in expected if r in members) | {self.rank})
        if joining:
            self._put(f"ready/{target}/{self.rank}", {"incarnation": self.incarnation, "call": int(call)})
            self.set_state(JOINING, epoch=target)  # after the readiness: whoever sees it joining finds it ready
            self._await_admission(current, target, members, deadline, call)
            fast = False
        else:  # readiness and the first member beat in one call (with this process's other ranks' posts)
            post_combined(self.store, [f"ready/{target}/{self.rank}", f"alive/{self.rank}"],
                          [self.encode_record(f"ready/{target}/{self.rank}",
                                              {"incarnation": self.incarnation, "call": int(call)}),
                           f"{self.incarnation}:{MEMBER_BEAT}:1"])
            fast = self._await_seal(target, members, waiting, deadline, dead, stall_deadline)
        return self._take_view(current, target, members, fast, joining)

    def _await_admission(self, current: int, target: int, members: tuple, deadline: float, call: int) -> None:
        """A joiner waits for a member to seal `target` (rule 2), beating `JOINER_BEAT_S`; at its deadline it
        stays registered with a pending beat and raises."""
        pause = 0.001
        beats = 0
        while not self.sealed(target):
            # Proof of life for the sealer (rule 2: a dead joiner is never sealed in); every few beats, whether
            # another incarnation took the rank (four reads: not on every beat).
            if beats % JOINER_CHECK_BEATS == 0:
                self._still_mine(target, call)
            beats += 1
            self.store.set(f"alive/{self.rank}", f"{self.incarnation}:{WAITING_BEAT}:{beats}")
            if time.monotonic() >= deadline:
                if self.sealed(target):
                    break  # a member sealed meanwhile: adopt it (this rank may be in it)
                self._start_pending(target, call)
                if self.sealed(target):  # sealed between the check and the pending beat: adopt it
                    self.stop_pending()
                    break
                raise MembershipError(
                    f"rank {self.rank} was not admitted: no member of epoch {current} (members "
                    f"{list(members)}) sealed epoch {target} before the deadline. It stays registered: "
                    "the members' pending_joiners() keep listing this rank, and it is admitted when it "
                    "waits again; call update_ep_member() again (with the members calling theirs), or "
                    "destroy() the Buffer to give up")
            time.sleep(pause)
            pause = min(pause * 2, JOINER_BEAT_S)

    def _await_seal(self, target: int, members: tuple, waiting: List[int], deadline: float, dead,
                    stall_deadline: Optional[float]) -> bool:
        """A member waits until `view/<target>` is sealed (rule 1). The lowest rank of `waiting` it does not
        know dead seals: it polls the readiness of `waiting` (one batched check per round) and seals once
        every one posted (the others make one wait on the view's key and look at it locally, beating between);
        at the deadline whoever is ready seals (the others give that sealer `LEADER_GRACE_S` first).
        Returns True when the view was seen by that wait (which read it: `_take_view`)."""
        pause, graced, beats = 0.001, False, 1
        next_beat = None  # the first beat: after MEMBER_BEAT_S for the leader, WAIT_SLICE_S for the others
        self._sealed_wait = None  # a KeyWait on view/<target> (a non-leader's: looked at locally, no poll)
        while True:
            gone = set(dead()) if dead is not None else set()
            # With a stall deadline (a collective lost a peer) ranks known dead are not waited for; without,
            # they are waited for until the deadline as before (a replacement may be registering for them).
            skip = gone if stall_deadline is not None else set()
            leads = min(r for r in waiting if r == self.rank or r not in gone) == self.rank
            now = time.monotonic()
            if next_beat is None:
                next_beat = now + (MEMBER_BEAT_S if leads else WAIT_SLICE_S)
            past = now >= deadline
            if past and not self._still_coming(waiting, target, dead, stall_deadline):
                if not leads and not graced:
                    graced = True
                    if self._wait_sealed(target, LEADER_GRACE_S, deadline):
                        return True
                    continue
                if self.sealed(target) or self.seal_view(target, members, gone, waiting, self._alive) or self.sealed(target):
                    return False
                raise MembershipError(self._no_quorum(target, members, gone))
            if leads:
                if self.sealed(target):
                    return False
                expected_now = [r for r in waiting if r not in skip]
                if posted(self, target, expected_now):
                    # Before the deadline every awaited rank's readiness must be valid: a replacement's record that
                    # another replacement of that rank overwrote (it lost the rank, the holder posts again) is not.
                    if self.seal_view(target, members, gone, waiting, self._alive, required=expected_now):
                        return False
                    # Not a quorum yet (this rank was told not to wait for members that may be alive), or an awaited
                    # rank's readiness is not its current incarnation's: wait for more members, for the holder's
                    # post, or for another side's seal, until the deadline.
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
            else:  # one wait on the view's key, looked at every `pause` (whether the leader is seen dead, the beat)
                until = stall_deadline if past else deadline
                if self._wait_sealed(target, min(pause, max(until - time.monotonic(), 0.001)),
                                     max(deadline, stall_deadline or deadline)):
                    return True
                pause = min(pause * 2, SEALED_LOOK_S)
            seen = self._sealed_wait is not None and self._sealed_wait.background and self._sealed_wait.poll(0.0)
            if time.monotonic() >= next_beat and not seen:  # none once the view is there (adopted next round)
                # (for a plain Buffer(group) of a rank being replaced, replacement.py)
                beats += 1
                post_beat(self.store, f"alive/{self.rank}", f"{self.incarnation}:{MEMBER_BEAT}:{beats}")  # with this
                # process's other ranks' beats (ranks as threads): one request
                next_beat = time.monotonic() + (MEMBER_BEAT_S if leads else WAIT_SLICE_S)

    def _wait_sealed(self, target: int, seconds: float, until: float) -> bool:
        """Wait up to `seconds` until the view of `target` is there; False when it is not. The first call starts
        one wait on its key (`KeyWait`, lasting past `until`, a `time.monotonic()` value, by `LEADER_GRACE_S` and a
        second), which the later ones look at: no store operation per call where the wait runs in the background
        (a rank that seals sets the key; a wait that times out is not cut into slices that would). That wait is the
        store's blocking read of the key, so the view's record comes with it (`_take_view`)."""
        waiter = self._sealed_wait
        if waiter is None or waiter.poll(0.0) is False:
            waiter = self._sealed_wait = KeyWait(self.store, [f"view/{target}"],
                                                 max(until - time.monotonic(), 0.0) + LEADER_GRACE_S + 1.0,
                                                 read=True, shared=True)  # the wait is the view's read (no get after
            # it), one for the ranks of this process (a view never changes once sealed)
        return bool(waiter.poll(seconds))

    def wait_keys(self, keys: List[str], seconds: float) -> bool:
        """Block up to `seconds` (within the operation's store deadline) until every key of `keys` is there.

        One store call on a `BoundedStore` (a client of its own per lane, so blocking holds no other caller);
        a check of `keys` with backoff on any other store.

        Arguments:
            keys: keys under this membership's prefix.
            seconds: the longest wait (at least 1 ms; cut to the operation's store deadline).

        Returns:
            there: whether every key was there in time.
        """
        left = remaining_s()
        if left is not None:
            seconds = min(seconds, max(left - 0.05, 0.001))
        seconds = max(seconds, 0.001)
        if self._blocking_waits is None:
            root = self.store
            while isinstance(root, dist.PrefixStore) or hasattr(root, "inner"):  # prefixes, wrappers (counting)
                root = root.underlying_store if isinstance(root, dist.PrefixStore) else root.inner
                if isinstance(root, BoundedStore):
                    break
            self._blocking_waits = isinstance(root, BoundedStore)
        if not self._blocking_waits:
            # A client shared by several threads (tests, observers): a blocking wait would hold its lock.
            until, pause = time.monotonic() + seconds, 0.001
            while not self.store.check(keys):
                if time.monotonic() >= until:
                    return False
                time.sleep(min(pause, max(until - time.monotonic(), 0.0)))
                pause = min(pause * 2, 0.02)
            return True
        try:
            self.store.wait(keys, timedelta(seconds=seconds))  # the wrapper's own client: blocking holds nobody
            return True
        except dist.DistStoreError:
            return False

    def _take_view(self, current: int, target: int, members: tuple, fast: bool, joining: bool) -> View:
        """Read, check and adopt the sealed view of `target` (rules 1, 3 and 4); `fast`: its keys are there."""
        if fast:  # the wait for the view read it (KeyWait(read=True)): decoded from there, no store call
            ranks = self._decode_view(target, self._sealed_wait.values()[0])
        else:
            ranks = self._view_record(target)
        admission = self._admissions.get(target)  # the one the view carries (a sealer's record of it)
        if ranks is None:
            raise MembershipError(f"the view of epoch {target} disappeared from the store after it was sealed")
        ranks = tuple(ranks)
        self._views[target] = ranks
        # A view whose admission record covers it was sealed by a member that read every rank ready.
        covered = admission is not None and set(ranks) <= {r for r, _ in admission["ranks"]}
        if not covered:
            unready = [r for r in ranks if self._read(f"ready/{target}/{r}", valid_ready, "ready record") is None]
            if unready:
                raise MembershipError(f"the sealed view of epoch {target} ({list(ranks)}) lists ranks {unready} that "
                                      "posted no readiness for it: not sealed by this job's ranks; refused")
        if not set(ranks) & set(members):
            raise MembershipError(f"the sealed view of epoch {target} ({list(ranks)}) holds no member of epoch "
                                  f"{current} ({list(members)}): not sealed by this job's ranks; refused")
        if self.rank in ranks:
            self._check_admitted(target)
        if self.rank not in ranks:
            raise LeftOut(f"rank {self.rank} was left out of epoch {target} (members {list(ranks)}): it was not "
                          "ready before the view was sealed, so it is no longer a member. Call "
                          "update_ep_member() to rejoin: it registers this rank as joining (the members' "
                          "pending_joiners() lists it) and returns once a member's update_ep_member() "
                          "admits it", target, ranks)
        view = View(target, ranks)
        if not covered:
            self._adopt(current, view)  # a view sealed without an admission record: every adopter settles it
        elif joining:
            self.set_state(ACTIVE, epoch=target)  # the sealer set it too (rule 3); a joiner's own write is cheap
        return view

    def _still_coming(self, waiting: Sequence[int], target: int, dead, stall_deadline: Optional[float]) -> bool:
        """Past its deadline, whether a member keeps waiting: some expected rank not known dead has not
        posted readiness yet and the stall deadline has not passed."""
        if dead is None or stall_deadline is None or time.monotonic() >= stall_deadline:
            return False
        gone = set(dead())
        return not posted(self, target, [r for r in waiting if r not in gone])

    @staticmethod
    def quorum(ready: Iterable[int], members: Sequence[int], gone: Iterable[int] = ()) -> bool:
        """Whether `ready` may seal the next view of `members` (rule 5): a strict majority of the members
        not known dead, or exactly half of them including the lowest such rank.

        Arguments:
            ready: member ranks ready for the next epoch.
            members: the current view's ranks.
            gone: ranks whose process is known to have ended (they do not count).

        Returns:
            sealable: bool.
        """
        return quorum(ready, members, gone)

    def _no_quorum(self, target: int, members: tuple, gone: set) -> str:
        counted = [r for r in members if r not in gone]
        ready = [r for r in counted if self.store.check([f"ready/{target}/{r}"])]
        return (f"rank {self.rank} cannot seal epoch {target}: only members {ready} of {counted} (the members of "
                f"epoch {target - 1} not known dead) are ready, not a majority (half of them must include rank "
                f"{min(counted)}). The others may be alive behind a cut link or stalled: the side with a majority "
                "seals, and a rank it leaves out rejoins. Call update_ep_member() again")

    def _alive(self, joiners: List[int]) -> set:
        """The joiners whose heartbeat moves within `JOINER_PROOF_S` while they wait inside
        `update_ep_member()` (not dead, and not a pending joiner that gave up waiting for now)."""
        def beat(rank):
            raw = self.read_raw(f"alive/{rank}")
            return None if raw is None else bytes(raw[:64])

        waiting = f":{WAITING_BEAT}:".encode()
        first = {r: beat(r) for r in joiners}
        alive, stop = set(), time.monotonic() + JOINER_PROOF_S
        while len(alive) < len(joiners) and time.monotonic() < stop:
            time.sleep(JOINER_BEAT_S)
            for r in joiners:
                now = beat(r)
                if r not in alive and now != first[r] and now is not None and waiting in now:
                    alive.add(r)
        return alive

    def _start_pending(self, target: int, call: int) -> None:
        """A joiner's deadline passed: stay registered (listed by `joining()`) with a pending beat, in a
        daemon thread, re-registering for the next epoch whenever members seal one without this rank,
        until `stop_pending()` (this rank waits again, or gives up)."""
        self.stop_pending()
        stop = threading.Event()
        incarnation = self.incarnation

        def run() -> None:
            beats, epoch = 0, target
            while not stop.wait(PENDING_BEAT_S):
                try:  # a stalled store host holds one beat at most PENDING_CALL_S (+ the grace), never forever
                    with store_deadline(time.monotonic() + PENDING_CALL_S, "a pending joiner's beat"):
                        if self.read_counter(f"incarnation/{self.rank}") != incarnation:
                            return  # another process or Buffer took this rank: write nothing more for it
                        beats += 1
                        self.store.set(f"alive/{self.rank}", f"{incarnation}:{PENDING_BEAT}:{beats}")
                        moved = False
                        for _ in range(_MAX_EPOCH_SKIP):
                            if stop.is_set() or not self.sealed(epoch):
                                break
                            epoch, moved = epoch + 1, True
                        if moved and not stop.is_set():  # sealed without this rank: register for the next one
                            self._put(f"ready/{epoch}/{self.rank}", {"incarnation": incarnation, "call": int(call)})
                            self.set_state(JOINING, epoch=epoch)
                        self._pending_epoch = epoch
                except Exception:  # noqa: BLE001 - the store is unreachable for now: keep beating
                    continue

        self._pending_epoch = target
        thread = threading.Thread(target=run, name=f"mep-pending-joiner-{self.rank}", daemon=True)
        self._pending = (stop, thread)
        _PENDING.add(self)
        thread.start()

    def stop_pending(self, withdraw: bool = False, wait_s: float = PENDING_STOP_S) -> None:
        """Stop the pending beat of a joiner that gave up waiting (no-op if none); with `withdraw`, also
        give up joining (state inactive), as `Buffer.destroy()` does.

        Arguments:
            withdraw: set this rank's joining state inactive (it is no longer listed).
            wait_s: seconds to wait for the beat's thread to end (0: only tell it to stop).
        """
        pending = getattr(self, "_pending", None)
        if pending is None:
            return
        self._pending = None
        _PENDING.discard(self)
        stop, thread = pending
        stop.set()
        if wait_s > 0:
            thread.join(wait_s)
        if withdraw:
            self._withdraw(getattr(self, "_pending_epoch", 0))

    def _withdraw(self, target: int) -> None:
        """A joiner gives up waiting for `target`: its joining state becomes inactive (CAS on its own record)."""
        key = f"state/{self.rank}"
        raw = self.read_raw(key)
        if raw is not None:
            self.store.compare_set(key, raw.decode(errors="replace"),
                                   self.encode_record(key, {"state": INACTIVE, "incarnation": self.incarnation,
                                                      "epoch": target}))

    def _adopt(self, current: int, view: View) -> None:
        """Advance the epoch counter, set this rank active and non-members inactive (rule 3)."""
        value, text = self.read_counter_raw("epoch")
        if value == current:  # the first adopter advances it; a CAS from a stale value does nothing
            self.store.compare_set("epoch", "" if text is None else text, str(view.epoch))
        self.set_state(ACTIVE, epoch=view.epoch)
        self._deactivate_non_members(view.ranks, view.epoch, skip_unreadable=False)

    def max_call(self, epoch: int, ranks: Iterable[int]) -> int:
        """Largest call counter the members of `epoch` posted with their readiness (the one the sealer's
        admission record carries when it admitted every rank of `ranks`: one read, the same for every member).

        Arguments:
            epoch: epoch number whose `ready` records are read.
            ranks: iterable of int EP ranks (ranks without a valid record are skipped).

        Returns:
            call: int, the maximum, or 0 when none posted.
        """
        ranks = list(ranks)
        try:  # the sealer's admission record carries the largest call of the ranks it admitted
            admission = self.admission(epoch)
        except MembershipError:
            admission = None
        if admission is not None and set(ranks) <= {r for r, _ in admission["ranks"]}:
            return admission["call"]
        best = 0
        for rank in ranks:
            try:
                record = self._read(f"ready/{epoch}/{rank}", valid_ready, "ready record")
            except MembershipError:
                continue
            if record is not None:
                best = max(best, record["call"])
        return best

    def barrier(self, name: str, ranks: Iterable[int], deadline: float) -> None:
        """Wait until every rank of `ranks` reached the barrier `name` (store keys, no collective).

        Arguments:
            name: barrier name, unique per use (e.g. `"connect/<epoch>"`).
            ranks: iterable of int EP ranks to wait for (include this rank).
            deadline: `time.monotonic()` deadline in seconds.

        Raises:
            MembershipError: the deadline passed; `missing` names the ranks that did not arrive.
        """
        ranks = list(ranks)
        self.store.set(f"barrier/{name}/{self.rank}", "1")
        keys = [f"barrier/{name}/{r}" for r in ranks]
        # One wait on every rank's key (`KeyWait`), looked at until the deadline, not a poll of them per round; not
        # a blocking wait that times out at the deadline either: one was seen to return seconds late here when
        # many do at once.
        waiter = KeyWait(self.store, keys, max(deadline - time.monotonic(), 0.0) + 1.0)
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            there = waiter.poll(left if waiter.background else min(left, 0.02))
            if there:
                return
            if there is False and left > 0:  # the wait ended without them (the store's error): check per round
                waiter = KeyWait(self.store, keys, left, background=False)
            if time.monotonic() >= deadline:
                missing = [r for r in ranks if not self.store.check([f"barrier/{name}/{r}"])]
                if not missing:
                    return
                raise MembershipError(f"deadline passed while waiting for barrier {name!r} of {ranks}; missing "
                                      f"ranks {missing}", missing)

    def wait_for(self, predicate, deadline: float, what: str):
        """Poll `predicate()` (returns a value or None) with backoff until `deadline`.

        Arguments:
            predicate: callable with no arguments, returning None while not ready.
            deadline: `time.monotonic()` deadline in seconds (the predicate runs at least once).
            what: description for the error message.

        Returns:
            value: the first non-None value of `predicate()`.

        Raises:
            MembershipError: the deadline passed first.
        """
        pause = 0.001
        while True:
            value = predicate()
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise MembershipError(f"deadline passed while waiting for {what}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
