"""Records of many ranks read together: a constant number of store calls, not a few per rank.

A Buffer's construction and a re-admission read, for every member, the incarnation whose records
count, its endpoint (with its host id) and its region records. Read rank by rank that costs each
rank a few store calls per peer, O(R^2) in the group; here each rank makes a constant number of
calls (`RecordStore.read_raws`: one `check` and one `multi_get` of every key when all are there) and,
while some are missing, one wait on all the missing keys (`key_wait.KeyWait`; on a store without
background waits a check of them per round, backoff to `POLL_MAX_S`), not a read of each. Records read here are
checked exactly as the one-rank reads check them (`Membership.incarnation_of`, `endpoint`, `region_record`).

A collective step (every rank of `ranks` and the caller publish their records, then read each other's: a
Buffer's construction, a participant's regions) names its epoch (`together`): the incarnations are then the
ones that epoch bound (each rank's own binding in epoch 0, the sealer's admission record after), and each
rank reads its peers' bindings and then their records each in one background read that waits until all are
there (`KeyWait(read=True)`: the wait and the read are one store call, made once, when all are there). At
R=256 ranks as threads each store call a rank makes one after the other costs 0.2-0.5 s (issue 40): two
calls, where the roll call that came before made seven (count in, wait, the epoch, then a check and a
`multi_get` of the bindings and of the records). A rank that never publishes keeps the others waiting until
their deadline, as before; a record read that way is still validated and authenticated one by one, and one
missing or invalid then is waited for and read as before (which names why). The ranks that run as threads of one
process (the scale bench) share those reads (`shared_reads`: one read of an exchange for the threads that came
while the one before was in the air, each record checked once per process, not once per thread); a record read
together keeps its nested lists shared with the other threads (read them, do not change them).
"""
import time
from typing import Callable, Dict, Iterable, List, Optional

from mooncake_ep_switch.buffer.membership import shared_reads
from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from mooncake_ep_switch.buffer.membership.records import (MembershipError, valid_endpoint,
                                                          valid_incarnation, valid_region_record)

__all__ = ["incarnations_of", "published_endpoints", "published_region_records"]

POLL_MAX_S = 0.02  # without a background wait: one check of the missing records at least this often
LOOK_S = 0.5  # with one: the incarnations are read again this often while records are missing
_ENDPOINT = "endpoint (dict: region [pid, fd, nbytes], host_id str, te_session str, te_base int)"
_BINDING = "admitted incarnation (int >= 1)"
_REGIONS = "region record (dict: kind str, regions list of [pid, fd or IPC handle hex, nbytes], te_bases list of int)"


def incarnations_of(membership, ranks: Iterable[int]) -> Dict[int, int]:
    """`Membership.incarnation_of` of every rank of `ranks`, in a constant number of store calls.

    Arguments:
        membership: the `Membership` to read with.
        ranks: iterable of int EP ranks.

    Returns:
        incarnations: rank -> incarnation (0 when no process took the rank yet).

    Raises:
        MembershipError: a counter or admitted record is malformed or fails authentication.
    """
    return membership.incarnations_at(membership.epoch(), ranks)


def _bound_incarnations(membership, epoch: int, ranks: List[int], deadline: float) -> Optional[Dict[int, int]]:
    """The incarnations `epoch` bound for `ranks` (epoch 0: each rank's own binding, waited for until `deadline`
    and read in that wait; later: the sealer's admission record), or None when some are not known by then."""
    if epoch > 0:
        try:
            admission = membership.admission(epoch)  # kept since the agreement: no store call
        except MembershipError:
            return None
        bound = dict(admission["ranks"]) if admission is not None else {}
        return {r: bound[r] for r in ranks} if all(r in bound for r in ranks) else None
    found = membership.known_bindings(0, ranks)
    rest = [r for r in ranks if r not in found]
    if rest:
        keys = [f"admitted/0/{r}" for r in rest]
        shared = shared_reads.read_checked(membership, "admitted/0", keys, valid_incarnation, _BINDING, deadline)
        if shared is not None:
            found.update(membership.keep_bindings(0, rest, [shared.get(k) for k in keys], checked=True))
        else:
            raws = _read_when_there(membership.store, keys, deadline)
            if raws is None:
                return None
            found.update(membership.keep_bindings(0, rest, raws))
    return found if len(found) == len(ranks) else None


def _read_when_there(store, keys: List[str], deadline: float) -> Optional[List[bytes]]:
    """The values of `keys` once all are there (one background read where the store has one: `KeyWait`), or None
    when `deadline` passed first or the wait failed."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    waiter = KeyWait(store, keys, left + 1.0, read=True)
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        there = waiter.poll(left if waiter.background else min(left, POLL_MAX_S))
        if there:
            return waiter.values()
        if there is False or time.monotonic() >= deadline:
            return None


def _read_together(membership, ranks: List[int], epoch: int, deadline: float, key_of: Callable[[int, int], str],
                   valid, what: str, exchange: str) -> Dict[int, dict]:
    """A collective step's read (module docstring): the valid records of `ranks`' incarnations bound in `epoch`,
    read when all are there; {} or fewer ranks when some are not by `deadline` (the caller reads those again)."""
    incarnations = _bound_incarnations(membership, epoch, ranks, deadline)
    if incarnations is None:
        return {}
    keys = [key_of(r, incarnations[r]) for r in ranks]
    found: Dict[int, dict] = {}
    shared = shared_reads.read_checked(membership, f"{exchange}/{epoch}", keys, valid, what, deadline)
    if shared is not None:  # records shared by this process's threads: each gets its own dicts
        for rank, key in zip(ranks, keys):
            value = shared.get(key)
            if value is not None:
                found[rank] = dict(value, incarnation=incarnations[rank])
        return found
    for rank, key, raw in zip(ranks, keys, _read_when_there(membership.store, keys, deadline) or ()):
        value = _valid(membership, key, raw, valid, what)
        if value is not None:
            found[rank] = dict(value, incarnation=incarnations[rank])
    return found


def _valid(membership, key: str, raw: Optional[bytes], valid, what: str) -> Optional[dict]:
    """The record `raw` read at `key` checked (`Membership.checked`), None when absent, malformed or forged (read
    again by the caller: a valid one may replace it)."""
    try:
        return membership.checked(key, raw, valid, what)
    except MembershipError:
        return None


def _published(membership, ranks: List[int], deadline: float, key_of: Callable[[int, int], str], valid, what: str,
               together: Optional[int] = None, exchange: str = "") -> Dict[int, dict]:
    """The valid records `key_of(rank, incarnation)` of `ranks`, waited for until `deadline`; a rank whose record is
    missing or invalid then is left out (its one-rank read names why). `together`: the epoch of a collective step
    (module docstring), or None."""
    found: Dict[int, dict] = {}
    pending, waiter, waited = list(dict.fromkeys(ranks)), None, None
    if pending and together is not None:
        found.update(_read_together(membership, pending, together, deadline, key_of, valid, what, exchange))
        pending = [r for r in pending if r not in found]
    while pending:
        incarnations = incarnations_of(membership, pending)
        keys = {r: key_of(r, incarnations[r]) for r in pending}
        wanted = [keys[r] for r in pending]
        left = deadline - time.monotonic()
        # Not all there yet: one wait on them (`KeyWait`: in the background, no store operation while it lasts),
        # looked at until they are there or `LOOK_S` passed (then the incarnations are read again: a rank may have
        # been taken over meanwhile); not a check of the missing ones per round. At the deadline, what is there is
        # read.
        if left > 0:
            if waiter is None or wanted != waited:
                waiter, waited = KeyWait(membership.store, wanted, left + 1.0), wanted
            there = waiter.poll(min(left, LOOK_S))
            if there is False:  # the wait ended without them (the store's error): the next round starts another
                waiter = None
                time.sleep(min(POLL_MAX_S, max(deadline - time.monotonic(), 0.0)))
            if not there:
                continue
        for rank, raw in zip(pending, membership.read_raws([keys[r] for r in pending])):
            try:
                value = membership.checked(keys[rank], raw, valid, what)
            except MembershipError:
                value = None  # malformed or forged: waited for like a missing one (a valid one may replace it)
            if value is not None:
                found[rank] = dict(value, incarnation=incarnations[rank])
        pending = [r for r in pending if r not in found]
        if deadline - time.monotonic() <= 0:
            break
        if pending:  # present but not valid (yet): read again shortly
            time.sleep(min(0.01, max(deadline - time.monotonic(), 0.0)))
    return found


def published_endpoints(membership, ranks: Iterable[int], deadline: float,
                        together: Optional[int] = None) -> Dict[int, dict]:
    """The published endpoints of `ranks`' current incarnations, waited for until `deadline`.

    Arguments:
        membership: the `Membership` whose store holds the endpoints.
        ranks: iterable of int EP ranks.
        deadline: `time.monotonic()` deadline in seconds (the records are read at least once).
        together: the epoch of a collective step (every rank of `ranks` and this one publish their endpoint, bound
            to their incarnation in that epoch, then read: the module docstring), or None.

    Returns:
        endpoints: rank -> endpoint dict plus `"incarnation"` (as `Membership.endpoint`), for the ranks
            whose valid endpoint was there by `deadline` (the others are absent).
    """
    return _published(membership, list(ranks), deadline, lambda r, inc: f"endpoint/{r}/{inc}", valid_endpoint,
                      _ENDPOINT, together, "endpoint")


def published_region_records(membership, index: int, ranks: Iterable[int], deadline: float,
                             together: Optional[int] = None) -> Dict[int, dict]:
    """The region records of participant `index` that `ranks`' current incarnations published, waited for
    until `deadline`.

    Arguments:
        membership: the `Membership` whose store holds the records.
        index: participant index, >= 0.
        ranks: iterable of int EP ranks.
        deadline: `time.monotonic()` deadline in seconds (the records are read at least once).
        together: the epoch of a collective step (every rank of `ranks` and this one publish their record, then
            read: the module docstring), or None.

    Returns:
        records: rank -> record (as `Membership.region_record`, plus `"incarnation"`), for the ranks whose
            valid record was there by `deadline` (the others are absent).
    """
    return _published(membership, list(ranks), deadline, lambda r, inc: f"regions/{index}/{r}/{inc}",
                      valid_region_record, _REGIONS, together, f"regions/{index}")
