"""Records of many ranks read together: a constant number of store calls, not a few per rank.

A Buffer's construction and a re-admission read, for every member, the incarnation whose records
count, its endpoint (with its host id) and its region records. Read rank by rank that costs each
rank a few store calls per peer, O(R^2) in the group; here each rank makes a constant number of
calls (`RecordStore.read_raws`: one `check` and one `multi_get` of every key when all are there) and,
while some are missing, one wait on all the missing keys (`key_wait.KeyWait`; on a store without
background waits a check of them per round, backoff to `POLL_MAX_S`), not a read of each. Records read here are checked exactly as the one-rank reads check them
(`Membership.incarnation_of`, `endpoint`, `region_record`). A collective step (every rank of `ranks`
and the caller read each other's records) names its `roll` call (`roll_call.py`): each rank then
counts itself in and waits for one key before it reads, so that it reads every record once, when all
are there, instead of finding out which are missing while they come in.
"""
import time
from typing import Callable, Dict, Iterable, List, Optional

from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from mooncake_ep_switch.buffer.membership.records import MembershipError, valid_endpoint, valid_region_record
from mooncake_ep_switch.buffer.membership.roll_call import roll_call

__all__ = ["incarnations_of", "published_endpoints", "published_region_records"]

POLL_MAX_S = 0.02  # without a background wait: one check of the missing records at least this often
LOOK_S = 0.5  # with one: the incarnations are read again this often while records are missing
_ENDPOINT = "endpoint (dict: region [pid, fd, nbytes], host_id str, te_session str, te_base int)"
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


def _published(membership, ranks: List[int], deadline: float, key_of: Callable[[int, int], str], valid, what: str,
               roll: Optional[str] = None) -> Dict[int, dict]:
    """The valid records `key_of(rank, incarnation)` of `ranks`, waited for until `deadline`; a rank whose record is
    missing or invalid then is left out (its one-rank read names why). `roll`: the roll call to count in at first
    (every rank of `ranks` and the caller make it), or None."""
    found: Dict[int, dict] = {}
    pending, waiter, waited = list(dict.fromkeys(ranks)), None, None
    # Everyone counted in (their records published before): read them all at once, with no wait for them first.
    read_now = bool(pending) and roll is not None and roll_call(
        membership.store, roll, len(set(pending) | {membership.rank}), deadline)
    while pending:
        incarnations = incarnations_of(membership, pending)
        keys = {r: key_of(r, incarnations[r]) for r in pending}
        wanted = [keys[r] for r in pending]
        left = -1.0 if read_now else deadline - time.monotonic()
        read_now = False
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


def published_endpoints(membership, ranks: Iterable[int], deadline: float, roll: Optional[str] = None) -> Dict[int, dict]:
    """The published endpoints of `ranks`' current incarnations, waited for until `deadline`.

    Arguments:
        membership: the `Membership` whose store holds the endpoints.
        ranks: iterable of int EP ranks.
        deadline: `time.monotonic()` deadline in seconds (the records are read at least once).
        roll: the name of a roll call (`roll_call.py`) that every rank of `ranks` and this one make once its own
            endpoint is published (a collective step), or None.

    Returns:
        endpoints: rank -> endpoint dict plus `"incarnation"` (as `Membership.endpoint`), for the ranks
            whose valid endpoint was there by `deadline` (the others are absent).
    """
    return _published(membership, list(ranks), deadline, lambda r, inc: f"endpoint/{r}/{inc}", valid_endpoint,
                      _ENDPOINT, roll)


def published_region_records(membership, index: int, ranks: Iterable[int], deadline: float,
                             roll: Optional[str] = None) -> Dict[int, dict]:
    """The region records of participant `index` that `ranks`' current incarnations published, waited for
    until `deadline`.

    Arguments:
        membership: the `Membership` whose store holds the records.
        index: participant index, >= 0.
        ranks: iterable of int EP ranks.
        deadline: `time.monotonic()` deadline in seconds (the records are read at least once).
        roll: the name of a roll call (`roll_call.py`) that every rank of `ranks` and this one make once its own
            record is published (a collective step), or None.

    Returns:
        records: rank -> record (as `Membership.region_record`, plus `"incarnation"`), for the ranks whose
            valid record was there by `deadline` (the others are absent).
    """
    return _published(membership, list(ranks), deadline, lambda r, inc: f"regions/{index}/{r}/{inc}",
                      valid_region_record, _REGIONS, roll)
