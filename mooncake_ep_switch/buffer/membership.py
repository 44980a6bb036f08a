"""Membership that survives dead ranks: epochs, views, states and endpoints in the store.

A gloo or nccl group cannot lose a member, so membership lives in the torch.distributed store
(a TCPStore hosted by the launcher/agent), which outlives any rank. Keys (under the prefix of one
Buffer generation of one EP group, see `group_prefix` and `generation_prefix`):

    epoch                       current epoch number (0 before any change)
    view/<e>                    JSON list of the member ranks of epoch e (sealed once, by CAS)
    ready/<e>/<rank>            JSON {"incarnation", "call"}: rank asks to be in epoch e
    state/<rank>                JSON {"state", "incarnation", "epoch"}: active, inactive or joining
    incarnation/<rank>          counter, bumped by every process (or rejoining Buffer) taking the rank id
    endpoint/<rank>/<inc>       JSON endpoint of that incarnation (region pid/fd, TE session)
    evidence/<e>/<reporter>     JSON list of ranks the reporter saw fail in epoch e
    alive/<rank>                heartbeat of a joiner while it waits to be admitted
    regions/<i>/<rank>/<inc>    JSON {"kind", "regions": [[pid, fd, nbytes], ...]}: shared regions of
                                participant i of that incarnation (buffer/peer_regions.py)
    regions/state/<e>           JSON list, what the members' participants hand a replacement admitted in e

Rules that turn evidence into a new epoch e+1 (epoch e has the sealed view V_e; epoch 0 is every rank):

1. Only a member of V_e seals `view/<e+1>`. A member posts `ready/<e+1>` and waits, up to its
   deadline, for every member of V_e it has not seen fail; then it seals, with compare-and-set, the
   ranks whose `ready/<e+1>` record carries their current incarnation and that are members of V_e
   or joiners registered for e+1 whose heartbeat still moves (a joiner that died while waiting is
   not sealed in; checking costs the sealer at most `JOINER_PROOF_S`, only when joiners wait). The
   CAS picks one view; every rank adopts it, so no rank decides alone and all agree. The sealed
   view always holds its sealer, so it is never empty.
2. A joiner (a replacement process, or a member that was left out) never seals. It posts
   `ready/<e+1>`, then sets its state to joining for e+1 (so a member that sees it joining also
   finds it ready: members never wait for joiners), and waits up to its deadline for a member to
   seal. Sealed without it (it posted too late): it registers again for the next epoch. Deadline
   passed: it withdraws (state inactive) and reports that it was not admitted.
3. Adopting a view sets the adopter's state active and every non-member's state inactive, unless that
   rank has registered as joining for a later epoch. A joiner that died is therefore listed by
   `joining()` only until the next seal (which costs the members at most `JOINER_PROOF_S` for it),
   and never again unless a process registers for that rank anew.
4. A member that finds a view sealed without it was left out: it is no longer a member (dispatch
   and combine refuse) and comes back through rule 2: `update_ep_member()` takes a new incarnation
   (refused if another process took the rank over), republishes its endpoint and waits as a joiner.
   If every member of the current view is gone nobody can seal any more: the job must restart.

Records are validated when read and, with a per-job secret, authenticated; counters are bumped
with compare-and-set. That record layer (codec, `_valid_*` checks, HMAC) is `membership_records.py`;
this module is the epoch/view protocol on top of it.
"""
import hashlib
import math
import numbers
import time
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

# The record layer; names other modules import from here are re-exported.
from mooncake_ep_switch.buffer.membership_records import (ACTIVE, INACTIVE, JOINING, MAX_COUNTER,  # noqa: F401
                                                          MAX_RECORD_BYTES, MAX_STATE_BYTES, STATES, MembershipError,
                                                          RecordStore, _rank_list, _valid_endpoint, _valid_peer_state,
                                                          _valid_ready, _valid_region_record, _valid_state)

JOINER_BEAT_S = 0.02  # a waiting joiner refreshes alive/<rank> this often
JOINER_PROOF_S = 1.0  # a sealer admits only joiners whose heartbeat moved within this long
_MAX_EPOCH_SKIP = 1 << 12  # sealed views past the epoch counter that epoch() walks over


class LeftOut(MembershipError):
    """This rank was left out of a sealed view: it is no longer a member (see rule 4).

    Attributes:
        epoch: the epoch whose sealed view lacks this rank.
        members: that view's member ranks.
    """

    def __init__(self, message: str, epoch: int, members: Sequence[int]):
        super().__init__(message)
        self.epoch = epoch
        self.members = tuple(members)


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


class Membership(RecordStore):
    """Read and change the EP membership kept in a store.

    Arguments:
        store: a torch.distributed Store shared by every rank (and replacements); used as given
            (the Buffer decides which prefixes to keep, see `group_prefix`).
        rank: this process's EP rank.
        num_ranks: EP group size (fixed; a dead rank's id is taken by its replacement).
        prefix: key prefix (one EP group generation per prefix).
        secret: per-job secret (bytes or str) that authenticates every record, or None (records
            are then only validated).
    """

    def __init__(self, store, rank: int, num_ranks: int, prefix: str = "mep", secret=None):
        import torch.distributed as dist

        super().__init__(dist.PrefixStore(prefix, store), prefix, secret)
        self.rank = rank
        self.num_ranks = num_ranks
        self.incarnation = self._bump(f"incarnation/{rank}")


    # ------------------------------------------------------------------ reads
    def epoch(self) -> int:
        """Current epoch number.

        The counter is a hint (a store writer could set it back, and it moves after the view is
        sealed): the epoch is past every well-formed (with a job secret: authentic) view sealed
        after it, looked up one epoch at a time.

        Returns:
            epoch: int, 0 before any change.

        Raises:
            MembershipError: the epoch key holds something other than a count.
        """
        epoch = self._counter("epoch")
        for _ in range(_MAX_EPOCH_SKIP):  # bounded: the counter lags by one in honest use
            try:
                if self._view_record(epoch + 1) is None:
                    break
            except MembershipError:
                break  # a malformed or forged view is no epoch; agree_next_view() reports it
            epoch += 1
        return epoch

    def _view_record(self, epoch: int) -> Optional[tuple]:
        return self._read(f"view/{epoch}", lambda v: _rank_list(v, self.num_ranks) is not None,
                          f"view (non-empty ascending list of distinct ranks in [0, {self.num_ranks}))")

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

    def _state_record(self, rank: int) -> Optional[dict]:
        return self._read(f"state/{rank}", _valid_state, "state record")

    def state(self, rank: int) -> str:
        """State of `rank`: active, inactive or joining.

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            state: `"active"` (also when never set), `"inactive"` or `"joining"`.

        Raises:
            MembershipError: the state record is malformed or fails authentication.
        """
        found = self._state_record(rank)
        return ACTIVE if found is None else found["state"]

    def joining(self, epoch: Optional[int] = None) -> List[int]:
        """Ranks waiting to be admitted into `epoch` (default: the one after the current epoch).

        A rank counts when its state says joining for that epoch, with its current incarnation,
        and its readiness for that epoch is posted. Malformed or forged records of a rank are
        skipped (that rank is not listed), so they cannot break the members' loop.

        Arguments:
            epoch: the epoch the joiners wait for, or None for `epoch() + 1`.

        Returns:
            ranks: list of int, ascending.
        """
        epoch = self.epoch() + 1 if epoch is None else epoch
        found = []
        for rank in range(self.num_ranks):
            try:
                record = self._state_record(rank)
                if record is None or record["state"] != JOINING or record["epoch"] != epoch:
                    continue
                if self._ready(epoch, rank) is not None:
                    found.append(rank)
            except MembershipError:
                continue
        return found

    def _ready(self, epoch: int, rank: int) -> Optional[dict]:
        """`rank`'s readiness for `epoch` when it carries the rank's current incarnation, else None."""
        record = self._read(f"ready/{epoch}/{rank}", _valid_ready, "ready record")
        if record is None or record["incarnation"] != self._counter(f"incarnation/{rank}"):
            return None
        return record

    def endpoint(self, rank: int) -> dict:
        """The published endpoint of `rank`'s current incarnation.

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            endpoint: dict as published (see `publish_endpoint`) plus `"incarnation"` (int).

        Raises:
            MembershipError: that incarnation has published no endpoint yet, or the record is
                malformed or fails authentication.
        """
        incarnation = self._counter(f"incarnation/{rank}")
        found = self._read(f"endpoint/{rank}/{incarnation}", _valid_endpoint,
                           "endpoint (dict: region [pid, fd, nbytes], host_id str, te_session str, te_base int)")
        if found is None:
            raise MembershipError(f"rank {rank} (incarnation {incarnation}) has published no endpoint")
        return dict(found, incarnation=incarnation)

    def incarnation_of(self, rank: int) -> int:
        """The current incarnation number of `rank` (bumped by every process taking the rank id).

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            incarnation: int, 0 when no process took the rank yet.

        Raises:
            MembershipError: the counter holds something other than a count.
        """
        return self._counter(f"incarnation/{rank}")

    def region_record(self, index: int, rank: int) -> Optional[dict]:
        """The shared regions `rank`'s current incarnation published for participant `index`.

        Arguments:
            index: participant index (see `buffer/peer_regions.py`), >= 0.
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            record: dict with `"kind"` (str), `"regions"` (list of `[pid, fd, nbytes]`) and, on the
                `"mooncake"` transport, `"te_bases"` (list of int, each region's Transfer Engine
                address), or None when that incarnation has published none (yet).

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        incarnation = self._counter(f"incarnation/{rank}")
        return self._read(f"regions/{index}/{rank}/{incarnation}", _valid_region_record,
                          "region record (dict: kind str, regions list of [pid, fd, nbytes], te_bases list of int)")

    def peer_state(self, epoch: int) -> Optional[list]:
        """What the members published for the replacements admitted into `epoch` (see `publish_peer_state`).

        Arguments:
            epoch: the epoch that admitted the replacement.

        Returns:
            states: list of dicts (`"index"`, `"kind"`, `"state"`), or None when not published (yet).

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        return self._read(f"regions/state/{epoch}", _valid_peer_state, "peer state list", limit=MAX_STATE_BYTES)

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
                ranks = self._read(f"evidence/{epoch}/{reporter}", lambda v: _rank_list(v, self.num_ranks) is not None,
                                   "evidence list")
            except MembershipError:
                continue
            if ranks is not None:
                found[reporter] = list(ranks)
        return found

    # ------------------------------------------------------------------ writes
    def publish_endpoint(self, endpoint: dict) -> None:
        """Publish this incarnation's endpoint (region pid/fd, TE session, host identity).

        Arguments:
            endpoint: JSON-serialisable dict (the transport's `endpoint()` plus `"host_id"`).

        Raises:
            ValueError: `endpoint` is not a valid endpoint record.
        """
        if not _valid_endpoint(endpoint):
            raise ValueError(f"endpoint: expected a dict with region [pid, fd, nbytes], host_id str, te_session "
                             f"str, te_base int, got {endpoint!r}")
        self._put(f"endpoint/{self.rank}/{self.incarnation}", endpoint)

    def publish_region_record(self, index: int, record: dict) -> None:
        """Publish this incarnation's shared regions of participant `index` (see `region_record`).

        Arguments:
            index: participant index, >= 0.
            record: dict with `"kind"` (str), `"regions"` (list of `[pid, fd, nbytes]`) and optionally
                `"te_bases"` (one int address >= 1 per region, the region inside 64 bits).

        Raises:
            ValueError: `record` is not a valid region record.
        """
        if not _valid_region_record(record):
            raise ValueError(f"record: expected a dict with kind str and regions list of [pid, fd, nbytes], got "
                             f"{str(record)[:120]!r}")
        self._put(f"regions/{index}/{self.rank}/{self.incarnation}", record)

    def publish_peer_state(self, epoch: int, states: list) -> None:
        """Publish, once per epoch, what replacements admitted into `epoch` take over (see `peer_state`).

        Arguments:
            epoch: the epoch that admits the replacements.
            states: list of dicts with `"index"` (int), `"kind"` (str) and `"state"` (JSON dict).

        Raises:
            ValueError: `states` is not a valid list or is larger than `MAX_STATE_BYTES`.
        """
        if not _valid_peer_state(states):
            raise ValueError(f"states: expected a list of dicts with index int, kind str and state dict, got "
                             f"{str(states)[:120]!r}")
        key = f"regions/state/{epoch}"
        text = self._encode(key, states)
        if len(text) > MAX_STATE_BYTES:
            raise ValueError(f"states: {len(text)} bytes encoded, at most {MAX_STATE_BYTES}")
        self.store.set(key, text)

    def reincarnate(self) -> int:
        """Take a new incarnation of this rank (a left-out rank that rejoins).

        Returns:
            incarnation: the new incarnation number.

        Raises:
            MembershipError: another process took this rank over (its incarnation is newer).
        """
        new = self._bump(f"incarnation/{self.rank}", expected=self.incarnation)
        if new < 0:
            raise MembershipError(f"rank {self.rank} was taken over by another process (incarnation "
                                  f"{self._counter(f'incarnation/{self.rank}')}, this one {self.incarnation}): "
                                  "this Buffer cannot rejoin; destroy it")
        self.incarnation = new
        return new

    def set_state(self, state: str, rank: Optional[int] = None, epoch: int = 0) -> None:
        """Set `rank`'s (default this rank's) state.

        Arguments:
            state: `"active"`, `"inactive"` or `"joining"`.
            rank: EP rank, or None for this rank.
            epoch: the epoch the state refers to (for joining: the epoch it asks to enter).

        Raises:
            ValueError: an unknown state.
        """
        if state not in STATES:
            raise ValueError(f"state: expected one of active, inactive, joining, got {state!r}")
        rank = self.rank if rank is None else rank
        incarnation = self.incarnation if rank == self.rank else self._counter(f"incarnation/{rank}")
        self._put(f"state/{rank}", {"state": state, "incarnation": incarnation, "epoch": epoch})

    def report_failures(self, ranks: Iterable[int]) -> None:
        """Publish the ranks this rank saw fail in the current epoch (data-plane evidence).

        Replaces this rank's earlier evidence for the epoch; nothing is written for no ranks.

        Arguments:
            ranks: iterable of int EP ranks (duplicates are dropped).
        """
        ranks = sorted(set(int(r) for r in ranks))
        if ranks:
            self._put(f"evidence/{self.epoch()}/{self.rank}", ranks)

    def deactivate(self, ranks: Iterable[int]) -> None:
        """Mark ranks inactive (an operator's or a survivor's decision after evidence).

        Arguments:
            ranks: iterable of int EP ranks.
        """
        for rank in ranks:
            self.set_state(INACTIVE, rank)

    # ------------------------------------------------------------------ agreement
    def agree_next_view(self, current: int, expected: Iterable[int], deadline: float, call: int = 0,
                        joining: bool = False) -> View:
        """Post readiness for epoch `current + 1`, wait, and adopt the sealed view (module rules 1-3).

        Arguments:
            current: the epoch this rank is in (a joiner: the store's current epoch).
            expected: members this rank waits for (besides itself) before sealing (ignored by a joiner).
            deadline: `time.monotonic()` value: a member seals with whoever is ready then; a joiner
                gives up then.
            call: this rank's call counter (the next epoch's counters start above every one).
            joining: this rank is a joiner: it never seals, it waits for a member to.

        Returns:
            view: the agreed `View` of the next epoch (this rank is a member).

        Raises:
            LeftOut: the view was sealed without this rank.
            MembershipError: a joiner's deadline passed before any member sealed (it withdrew), a
                non-joiner is not a member of `current`, or the sealed view is malformed or forged.
        """
        target = current + 1
        members = self.view(current).ranks
        if not joining and self.rank not in members:
            raise LeftOut(f"rank {self.rank} is not a member of epoch {current} (members {list(members)}); "
                          "call update_ep_member() to rejoin", current, members)
        self._put(f"ready/{target}/{self.rank}", {"incarnation": self.incarnation, "call": int(call)})
        if joining:  # after the readiness: whoever sees this rank joining also finds it ready
            self.set_state(JOINING, epoch=target)
        waiting = sorted(set(int(r) for r in expected if r in members) | {self.rank})
        pause = 0.001
        beats = 0
        while not self.sealed(target):
            if joining:  # proof of life for the sealer (rule 2): a dead joiner is never sealed in
                beats += 1
                self.store.set(f"alive/{self.rank}", f"{self.incarnation}:{beats}")
            if time.monotonic() >= deadline:
                if joining:
                    self._withdraw(target)
                    if self.sealed(target):
                        break  # a member sealed meanwhile: adopt it (this rank may be in it)
                    raise MembershipError(
                        f"rank {self.rank} was not admitted: no member of epoch {current} (members "
                        f"{list(members)}) sealed epoch {target} before the deadline. The members admit "
                        "a joiner when they call update_ep_member() (their pending_joiners() lists this "
                        "rank while it waits); call update_ep_member() again to keep waiting")
                self._seal(target, members)
                break
            if not joining and all(self.store.check([f"ready/{target}/{r}"]) for r in waiting):
                self._seal(target, members)
                break
            time.sleep(pause)
            pause = min(pause * 2, JOINER_BEAT_S if joining else 0.02)
        ranks = self._view_record(target)
        if ranks is None:
            raise MembershipError(f"the view of epoch {target} disappeared from the store after it was sealed")
        ranks = tuple(ranks)
        unready = [r for r in ranks if self._read(f"ready/{target}/{r}", _valid_ready, "ready record") is None]
        if unready:
            raise MembershipError(f"the sealed view of epoch {target} ({list(ranks)}) lists ranks {unready} that "
                                  "posted no readiness for it: not sealed by this job's ranks; refused")
        if not set(ranks) & set(members):
            raise MembershipError(f"the sealed view of epoch {target} ({list(ranks)}) holds no member of epoch "
                                  f"{current} ({list(members)}): not sealed by this job's ranks; refused")
        if self.rank not in ranks:
            raise LeftOut(f"rank {self.rank} was left out of epoch {target} (members {list(ranks)}): it was not "
                          "ready before the view was sealed, so it is no longer a member. Call "
                          "update_ep_member() to rejoin: it registers this rank as joining (the members' "
                          "pending_joiners() lists it) and returns once a member's update_ep_member() "
                          "admits it", target, ranks)
        self._adopt(current, View(target, ranks))
        return View(target, ranks)

    def _seal(self, target: int, members: tuple) -> None:
        """Seal `view/<target>` (rule 1): ready members of the current view and ready registered joiners."""
        candidates = []
        for rank in range(self.num_ranks):
            try:
                if self._ready(target, rank) is None:
                    continue
                if rank not in members:
                    record = self._state_record(rank)
                    if record is None or record["state"] != JOINING or record["epoch"] != target:
                        continue
            except MembershipError:
                continue  # a malformed record keeps that rank out; it never breaks the seal
            candidates.append(rank)
        joiners = [r for r in candidates if r not in members]
        if joiners:
            alive = self._alive(joiners)
            candidates = [r for r in candidates if r in members or r in alive]
        if self.rank not in candidates:  # own readiness unreadable: the store was tampered with
            raise MembershipError(f"rank {self.rank}'s own readiness for epoch {target} does not read back "
                                  "intact; refusing to seal")
        self.store.compare_set(f"view/{target}", "", self._encode(f"view/{target}", candidates))

    def _alive(self, joiners: List[int]) -> set:
        """The joiners whose heartbeat moves within `JOINER_PROOF_S` (they are waiting, not dead)."""
        def beat(rank):
            raw = self._raw(f"alive/{rank}")
            return None if raw is None else bytes(raw[:64])

        first = {r: beat(r) for r in joiners}
        alive, stop = set(), time.monotonic() + JOINER_PROOF_S
        while len(alive) < len(joiners) and time.monotonic() < stop:
            time.sleep(JOINER_BEAT_S)
            alive.update(r for r in joiners if r not in alive and beat(r) != first[r])
        return alive

    def _withdraw(self, target: int) -> None:
        """A joiner gives up waiting for `target`: its joining state becomes inactive (CAS on its own record)."""
        key = f"state/{self.rank}"
        raw = self._raw(key)
        if raw is not None:
            self.store.compare_set(key, raw.decode(errors="replace"),
                                   self._encode(key, {"state": INACTIVE, "incarnation": self.incarnation,
                                                      "epoch": target}))

    def _adopt(self, current: int, view: View) -> None:
        """Advance the epoch counter, set this rank active and non-members inactive (rule 3)."""
        value, text = self._counter_raw("epoch")
        if value == current:  # the first adopter advances it; a CAS from a stale value does nothing
            self.store.compare_set("epoch", "" if text is None else text, str(view.epoch))
        self.set_state(ACTIVE, epoch=view.epoch)
        for rank in range(self.num_ranks):
            if rank in view.ranks:
                continue
            key = f"state/{rank}"
            raw = self._raw(key)
            try:
                record = None if raw is None else self._decode(key, raw)
            except MembershipError:
                record = None
            if _valid_state(record) and record["state"] == INACTIVE:
                continue
            if _valid_state(record) and record["state"] == JOINING and record["epoch"] > view.epoch:
                continue  # registered for a later epoch: still joining
            inactive = self._encode(key, {"state": INACTIVE, "incarnation": self._counter(f"incarnation/{rank}"),
                                          "epoch": view.epoch})
            self.store.compare_set(key, "" if raw is None else raw.decode(errors="replace"), inactive)

    def max_call(self, epoch: int, ranks: Iterable[int]) -> int:
        """Largest call counter the members of `epoch` posted with their readiness.

        Arguments:
            epoch: epoch number whose `ready` records are read.
            ranks: iterable of int EP ranks (ranks without a valid record are skipped).

        Returns:
            call: int, the maximum, or 0 when none posted.
        """
        best = 0
        for rank in ranks:
            try:
                record = self._read(f"ready/{epoch}/{rank}", _valid_ready, "ready record")
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
        try:
            self.wait_for(lambda: True if self.store.check(keys) else None, deadline,
                          f"barrier {name!r} of {ranks}")
        except MembershipError as error:
            missing = [r for r in ranks if not self.store.check([f"barrier/{name}/{r}"])]
            raise MembershipError(f"{error}; missing ranks {missing}", missing) from None

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
    import torch.distributed as dist

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


def generation_prefix(store, rank: int, num_ranks: int, base: str = "mep", joining: bool = False) -> str:
    """Key prefix of the Buffer being built: one membership record per Buffer generation.

    Every rank constructs its Buffers of one group in the same order, so the n-th Buffer of every
    rank gets generation n and never reads an endpoint a previous Buffer left in the store. A
    joining rank adopts the newest generation any rank has reached.

    Arguments:
        store: a torch.distributed Store, used as given.
        rank: this EP rank.
        num_ranks: EP group size.
        base: key prefix of the EP group (see `group_prefix`).
        joining: a replacement rank: adopt the newest generation instead of advancing its own counter.

    Returns:
        prefix: str, `"<base>/g<n>"` for generation `n`.

    Raises:
        MembershipError: a generation counter in the store holds something other than a count.
    """
    import torch.distributed as dist

    counters = RecordStore(dist.PrefixStore(f"{base}/generation", store), f"{base}/generation")  # no incarnation
    if joining:
        newest = max(counters._counter(str(r)) for r in range(num_ranks))
        counters.store.set(str(rank), str(newest))
        return f"{base}/g{newest}"
    return f"{base}/g{counters._bump(str(rank))}"


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

    import torch.distributed as dist

    timeout_s = check_seconds("timeout_s", timeout_s)
    prefixed = dist.PrefixStore(f"{prefix}/group/{view.epoch}", store)
    return dist.ProcessGroupGloo(prefixed, view.ranks.index(rank), len(view.ranks), timedelta(seconds=timeout_s))
