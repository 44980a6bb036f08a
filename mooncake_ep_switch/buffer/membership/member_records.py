"""The records one rank keeps about itself and reads about its peers: state, incarnation, endpoint, regions.

`MemberRecords` is the typed layer between the record codec (`membership_records.RecordStore`:
validation, authentication, counters) and the epoch/view protocol (`membership.Membership`, which
builds on it). Every read is validated; a record that fails is refused with `MembershipError`.
"""
from typing import Dict, Iterable, List, Optional, Set

from mooncake_ep_switch.buffer.membership.key_prefix import KeyPrefix
from mooncake_ep_switch.buffer.membership.records import (ACTIVE, INACTIVE, JOINING, MAX_STATE_BYTES, STATES,  # noqa: F401
                                                          MembershipError, RecordStore, valid_admission, valid_endpoint,
                                                          valid_fallback_state, valid_incarnation,
                                                          valid_peer_state, valid_ready, valid_region_record,
                                                          valid_state)

JOINERS_KEY = "joiners"  # "r,r,...": every rank that registered as joining (Membership.joining reads only these)


def _joiner_entries(raw: bytes, num_ranks: int) -> Set[int]:
    """The ranks listed in a `joiners` record (garbage entries skipped: the state records decide)."""
    found = set()
    for entry in bytes(raw[:1 << 16]).decode(errors="replace").split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < num_ranks:
            found.add(int(entry))
    return found


class MemberRecords(RecordStore):
    """Per-rank records of one EP group generation (keys listed in membership.py).

    Arguments:
        store: a torch.distributed Store shared by every rank (and replacements); used as given.
        rank: this process's EP rank.
        num_ranks: EP group size.
        prefix: key prefix (one EP group generation per prefix).
        secret: per-job secret (bytes or str) that authenticates every record, or None.
        take_incarnation: take a new incarnation of `rank` (a Buffer); False: a read-only observer.
        replaces: take the incarnation only from this one (compare-and-set: a plain `Buffer(group)` that
            replaces the rank takes it from the incarnation the members hold), or None: from whichever is current.

    Raises:
        MembershipError: with `replaces`, another process or Buffer took the rank from that incarnation
            first (the error names the incarnation that holds it now); nothing was written.
    """

    def __init__(self, store, rank: int, num_ranks: int, prefix: str = "mep", secret=None,
                 take_incarnation: bool = True, replaces: Optional[int] = None):
        super().__init__(KeyPrefix(prefix, store), prefix, secret)  # not torch's PrefixStore: key_prefix.py
        self.rank = rank
        self.num_ranks = num_ranks
        self._admissions = {}  # epoch -> admission record (written once, by compare-and-set: cached when read)
        self._views = {}  # epoch -> sealed view ranks (sealed once, by compare-and-set: cached when read)
        self._bindings = {}  # (epoch, rank) -> incarnation bound by admitted/<epoch>/<rank> (written once: cached)
        # An observer (take_incarnation=False) only reads: it takes no incarnation and writes nothing.
        self.incarnation = None
        if take_incarnation:
            self.incarnation = self.bump_counter(f"incarnation/{rank}", expected=replaces)
            if self.incarnation < 0:
                holder = self.read_counter(f"incarnation/{rank}")
                raise MembershipError(
                    f"rank {rank} is already taken over: incarnation {holder} (another replacement process or "
                    f"Buffer) took it from incarnation {replaces}, which this Buffer was replacing. Exactly one "
                    "replacement of a rank is admitted; this one was not built")

    def _state_record(self, rank: int) -> Optional[dict]:
        return self._read(f"state/{rank}", valid_state, "state record")

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
        incarnation = self.incarnation_of(rank)
        found = self._read(f"endpoint/{rank}/{incarnation}", valid_endpoint,
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
        return self.read_counter(f"incarnation/{rank}")

    def admitted_incarnation(self, epoch: int, rank: int) -> Optional[int]:
        """The incarnation of `rank` that the sealer of `epoch` admitted (`bind_incarnation`), or None.

        Arguments:
            epoch: epoch number (>= 1).
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            incarnation: int, or None when that epoch bound no incarnation of the rank.

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        admission = self.admission(epoch)
        if admission is not None:
            return dict(admission["ranks"]).get(rank)
        return self._read(f"admitted/{epoch}/{rank}", valid_incarnation, "admitted incarnation (int >= 1)")

    def incarnations_at(self, epoch: int, ranks: Iterable[int]) -> Dict[int, int]:
        """`incarnation_of` of every rank of `ranks` in `epoch`, in a constant number of store calls (bindings
        written once are kept when read).

        Arguments:
            epoch: the current epoch (`Membership.epoch()`).
            ranks: iterable of int EP ranks.

        Returns:
            incarnations: rank -> the incarnation `epoch` admitted (its admission record, else the rank's own
                binding), else the newest one taken (its counter; 0 when no process took the rank yet).

        Raises:
            MembershipError: a counter or admitted record is malformed or fails authentication.
        """
        ranks = list(dict.fromkeys(int(r) for r in ranks))
        found: Dict[int, int] = {}
        admission = self.admission(epoch)
        if admission is not None:
            bound = dict(admission["ranks"])
            found.update((r, bound[r]) for r in ranks if r in bound)
        else:
            found.update((r, self._bindings[epoch, r]) for r in ranks if (epoch, r) in self._bindings)
            rest = [r for r in ranks if r not in found]
            keys = [f"admitted/{epoch}/{r}" for r in rest]
            for rank, key, raw in zip(rest, keys, self.read_raws(keys)):
                value = self.checked(key, raw, valid_incarnation, "admitted incarnation (int >= 1)")
                if value is not None:
                    found[rank] = self._bindings[epoch, rank] = value
        rest = [r for r in ranks if r not in found]
        keys = [f"incarnation/{r}" for r in rest]
        for rank, key, raw in zip(rest, keys, self.read_raws(keys)):
            found[rank] = self.counter_of(key, raw)[0]
        return {r: found[r] for r in ranks}

    def known_bindings(self, epoch: int, ranks: Iterable[int]) -> Dict[int, int]:
        """rank -> incarnation of the bindings of `ranks` in `epoch` known here (written or read once: kept)."""
        return {int(r): self._bindings[epoch, int(r)] for r in ranks if (epoch, int(r)) in self._bindings}

    def keep_bindings(self, epoch: int, ranks: Iterable[int], raws: Iterable[Optional[bytes]],
                      checked: bool = False) -> Dict[int, int]:
        """rank -> incarnation of the bindings `admitted/<epoch>/<rank>` of `ranks` read as `raws` (in that order,
        None: absent; `checked`: incarnations checked already, by a read `shared_reads` shared) that are valid, kept
        as `incarnations_at` keeps those it reads (a malformed or forged one is left out: the caller reads that rank
        again, which names why)."""
        found: Dict[int, int] = {}
        for rank, raw in zip(ranks, raws):
            try:
                value = raw if checked else self.checked(f"admitted/{epoch}/{rank}", raw, valid_incarnation,
                                                         "admitted incarnation")
            except MembershipError:
                continue
            if value is not None:
                found[int(rank)] = self._bindings[epoch, int(rank)] = value
        return found

    def admission(self, epoch: int) -> Optional[dict]:
        """The admission record the sealer of `epoch` wrote before its view (`admitted/<epoch>`), or None.

        One record binds every rank of the view to one incarnation, by compare-and-set (the first sealer's
        binding holds for every later one), and carries the largest call counter of those ranks. It is
        written once, so a record read is kept.

        Arguments:
            epoch: epoch number (>= 1).

        Returns:
            admission: dict with `"ranks"` (list of `[rank, incarnation]`, ascending) and `"call"` (int), or
                None when that epoch has none (yet).

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        found = self._admissions.get(epoch)
        if found is None and epoch > 0:  # epoch 0 (every rank) is never sealed: no admission record to read
            found = self._read(f"admitted/{epoch}", lambda v: valid_admission(v, self.num_ranks),
                               "admission record (dict: ranks [[rank, incarnation], ...] ascending, call int)")
            if found is not None:
                self._admissions[epoch] = found
        return found

    def keep_admission(self, epoch: int, raw: bytes) -> Optional[dict]:
        """Decode, check and keep the admission record of `epoch` read as `raw` (None: not valid)."""
        try:
            found = self._decode(f"admitted/{epoch}", raw)
        except MembershipError:
            return None
        if not valid_admission(found, self.num_ranks):
            return None
        self._admissions[epoch] = found
        return found

    def bind_incarnation(self, epoch: int, rank: int, incarnation: int) -> int:
        """Bind `rank` to `incarnation` in `epoch`, once (compare-and-set): a sealer does it for every rank of
        its view before sealing, so a rank of a sealed view has exactly one incarnation.

        Arguments:
            epoch: the epoch being sealed.
            rank: EP rank in `[0, num_ranks)`.
            incarnation: the incarnation the sealer found ready.

        Returns:
            bound: the incarnation the rank is bound to (another sealer's, when it bound one first).

        Raises:
            MembershipError: the record already there is malformed or fails authentication.
        """
        key = f"admitted/{epoch}/{rank}"
        text = self.encode_record(key, int(incarnation))
        stored = self.store.compare_set(key, "", text)
        if stored.decode(errors="replace") == text:
            self._bindings[epoch, rank] = int(incarnation)  # written once: `incarnations_at` need not read it
            return int(incarnation)
        value = self._decode(key, stored)
        if not valid_incarnation(value):
            raise MembershipError(f"store record {self.prefix}/{key} is not a valid admitted incarnation: "
                                  f"{str(value)[:120]!r}; refused")
        self._bindings[epoch, rank] = value
        return value

    def _bound(self, target: int, rank: int, incarnation: int) -> bool:
        """Bind `rank` to `incarnation` in `target` (`bind_incarnation`); False when another incarnation was bound
        first or the record is malformed (the rank stays out of this sealer's view)."""
        try:
            return self.bind_incarnation(target, rank, incarnation) == incarnation
        except MembershipError:
            return False

    def _check_admitted(self, target: int) -> None:
        """Raise when the view of `target` admitted another incarnation of this rank (another process or Buffer
        took it over): this one is no member and must not act as one."""
        try:
            bound = self.admitted_incarnation(target, self.rank)
        except MembershipError:
            bound = None  # no readable binding: a view sealed without one (the counter decides, as before)
        if bound is not None and bound != self.incarnation:
            raise MembershipError(
                f"rank {self.rank} is held by incarnation {bound} (another replacement process or Buffer), admitted "
                f"into epoch {target}; this Buffer is incarnation {self.incarnation} and was not admitted. Exactly "
                "one replacement of a rank is admitted: destroy this Buffer")

    def _still_mine(self, target: int, call: int) -> None:
        """A waiting joiner: raise once another incarnation took this rank (another replacement process or Buffer),
        before it writes anything more; else re-post its readiness if that other one overwrote it."""
        holder = self.read_counter(f"incarnation/{self.rank}")
        if holder != self.incarnation:
            raise MembershipError(
                f"rank {self.rank} is held by incarnation {holder} (another replacement process or Buffer took it "
                f"while this one, incarnation {self.incarnation}, waited to be admitted into epoch {target}). Exactly "
                "one replacement of a rank is admitted: destroy this Buffer")
        try:
            record = self._read(f"ready/{target}/{self.rank}", valid_ready, "ready record")
        except MembershipError:
            record = None
        if record is None or record["incarnation"] != self.incarnation:
            self._put(f"ready/{target}/{self.rank}", {"incarnation": self.incarnation, "call": int(call)})

    def region_record(self, index: int, rank: int) -> Optional[dict]:
        """The shared regions `rank`'s current incarnation published for participant `index`.

        Arguments:
            index: participant index (see `buffer/peer_regions.py`), >= 0.
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            record: dict with `"kind"` (str), `"regions"` (list of `[pid, fd or CUDA IPC handle hex, nbytes]`) and, on the
                `"mooncake"` transport, `"te_bases"` (list of int, each region's Transfer Engine
                address), or None when that incarnation has published none (yet).

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        incarnation = self.incarnation_of(rank)
        return self._read(f"regions/{index}/{rank}/{incarnation}", valid_region_record,
                          "region record (dict: kind str, regions list of [pid, fd or IPC handle hex, nbytes], te_bases list of int)")

    def peer_state(self, epoch: int) -> Optional[list]:
        """What the members published for the replacements admitted into `epoch` (see `publish_peer_state`).

        Arguments:
            epoch: the epoch that admitted the replacement.

        Returns:
            states: list of dicts (`"index"`, `"kind"`, `"state"`), or None when not published (yet).

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        return self._read(f"regions/state/{epoch}", valid_peer_state, "peer state list", limit=MAX_STATE_BYTES)

    def publish_endpoint(self, endpoint: dict) -> None:
        """Publish this incarnation's endpoint (region pid/fd, TE session, host identity).

        Arguments:
            endpoint: JSON-serialisable dict (the transport's `endpoint()` plus `"host_id"`).

        Raises:
            ValueError: `endpoint` is not a valid endpoint record.
        """
        if not valid_endpoint(endpoint):
            raise ValueError(f"endpoint: expected a dict with region [pid, fd, nbytes], host_id str, te_session "
                             f"str, te_base int, got {endpoint!r}")
        self._put(f"endpoint/{self.rank}/{self.incarnation}", endpoint)

    def publish_region_record(self, index: int, record: dict) -> None:
        """Publish this incarnation's shared regions of participant `index` (see `region_record`).

        Arguments:
            index: participant index, >= 0.
            record: dict with `"kind"` (str), `"regions"` (list of `[pid, fd or CUDA IPC handle hex, nbytes]`) and optionally
                `"te_bases"` (one int address >= 1 per region, the region inside 64 bits).

        Raises:
            ValueError: `record` is not a valid region record.
        """
        if not valid_region_record(record):
            raise ValueError(f"record: expected a dict with kind str and regions list of [pid, fd or IPC handle hex, nbytes], got "
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
        if not valid_peer_state(states):
            raise ValueError(f"states: expected a list of dicts with index int, kind str and state dict, got "
                             f"{str(states)[:120]!r}")
        key = f"regions/state/{epoch}"
        text = self.encode_record(key, states)
        if len(text) > MAX_STATE_BYTES:
            raise ValueError(f"states: {len(text)} bytes encoded, at most {MAX_STATE_BYTES}")
        self.store.set(key, text)

    def publish_fallback_state(self, epoch: int, on: bool, switches: int) -> None:
        """Publish the members' `_use_fallback` switch for the joiners admitted into `epoch` (every member
        writes the same record: the members switch together).

        Arguments:
            epoch: the epoch just agreed.
            on: whether the members' calls run on the collective fallback.
            switches: how many switches the members made (their next switch's barrier carries it).
        """
        self._put(f"use_fallback/{epoch}", {"on": bool(on), "switches": int(switches)})

    def fallback_state(self, epoch: int) -> Optional[dict]:
        """The members' `_use_fallback` switch in `epoch` (see `publish_fallback_state`).

        Arguments:
            epoch: the epoch that admitted the joiner.

        Returns:
            state: dict with `"on"` (bool) and `"switches"` (int), or None when not published (yet).

        Raises:
            MembershipError: the record is malformed or fails authentication.
        """
        return self._read(f"use_fallback/{epoch}", valid_fallback_state, "fallback state (dict: on bool, switches int)")

    def close(self) -> None:
        """Record that this incarnation's Buffer was destroyed (`closed/<rank>`), so a plain `Buffer(group)`
        of a replacement does not wait for this generation (replacement.py). Observers write nothing."""
        if self.incarnation is not None:
            self._put(f"closed/{self.rank}", self.incarnation)

    def closed(self, rank: int) -> bool:
        """Whether `rank`'s current incarnation destroyed its Buffer of this generation (`close`); a malformed
        record counts as not closed.

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            closed: bool.
        """
        try:
            found = self._read(f"closed/{rank}", valid_incarnation, "closed incarnation (int >= 1)")
            return found is not None and found == self.incarnation_of(rank)
        except MembershipError:
            return False

    def reincarnate(self) -> int:
        """Take a new incarnation of this rank (a left-out rank that rejoins).

        Returns:
            incarnation: the new incarnation number.

        Raises:
            MembershipError: another process took this rank over (its incarnation is newer).
        """
        new = self.bump_counter(f"incarnation/{self.rank}", expected=self.incarnation)
        if new < 0:
            raise MembershipError(f"rank {self.rank} was taken over by another process or Buffer (incarnation "
                                  f"{self.read_counter(f'incarnation/{self.rank}')}, this one {self.incarnation}): "
                                  "this Buffer cannot rejoin; destroy it")
        self.incarnation = new
        return new

    def give_back_incarnation(self) -> bool:
        """Set this rank's incarnation counter back by one, when it still holds this Buffer's (a replacement
        that was not admitted hands the rank back to the incarnation before it).

        Returns:
            given_back: whether the counter was set back (False: another process or Buffer took a newer one).
        """
        key = f"incarnation/{self.rank}"
        value, text = self.read_counter_raw(key)
        if self.incarnation is None or value != self.incarnation or value < 1:
            return False
        back = str(value - 1)
        return self.store.compare_set(key, "" if text is None else text, back).decode(errors="replace") == back

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
        incarnation = self.incarnation if rank == self.rank else self.read_counter(f"incarnation/{rank}")
        if state == JOINING:  # listed first: whoever sees the rank joining finds it listed
            self._list_joiner(rank)
        self._put(f"state/{rank}", {"state": state, "incarnation": incarnation, "epoch": epoch})

    def listed_joiners(self) -> List[int]:
        """The ranks that ever registered as joining (`joiners`: "r,r,...", one entry per rank, added by
        compare-and-set), ascending; entries that are no rank of the group are skipped. One or two store calls.

        Returns:
            ranks: list of int (a superset of the ranks joining now: their state records decide).
        """
        raw = self.read_raw(JOINERS_KEY)
        return [] if raw is None else sorted(_joiner_entries(raw, self.num_ranks))

    def _list_joiner(self, rank: int) -> None:
        """Add `rank` to `joiners` unless it is there (compare-and-set over the text read; bounded retries)."""
        for _ in range(100):  # each failed compare-and-set means another joiner was added
            raw = self.read_raw(JOINERS_KEY)
            if raw is not None and rank in _joiner_entries(raw, self.num_ranks):
                return
            text = "" if raw is None else raw.decode(errors="replace")
            if self.store.compare_set(JOINERS_KEY, text, f"{text}{rank},").decode(errors="replace") == f"{text}{rank},":
                return
        raise MembershipError(f"store record {self.prefix}/{JOINERS_KEY} kept changing under 100 attempts")

    def deactivate(self, ranks: Iterable[int]) -> None:
        """Mark ranks inactive (an operator's or a survivor's decision after evidence).

        Arguments:
            ranks: iterable of int EP ranks.
        """
        for rank in ranks:
            self.set_state(INACTIVE, rank)
