"""A collective step's records read once per process, shared by the ranks that run as its threads (issue 40).

At a Buffer's construction every rank reads every peer's binding, then endpoint, then region record, each in one
background read that waits until all are there (`batch_reads` with `together`), and checks each record it read
(decoding, validation, authentication). With R ranks as threads of one process (the scale bench; a host that
runs several ranks in one interpreter) that is R reads of R records, O(R^2) checks under one interpreter lock for
each exchange: at R=256 most of construction's time. Here the threads of one process that read the records of
one exchange (same store server and key prefixes, same group prefix and secret, same exchange) share one
background read and check each record it returned once; each thread takes the records of its own keys.

Linearizable: a thread joins only a read that is sent after it began. The read being collected (not yet sent)
takes every thread that comes while another read of the exchange is in the air; it is sent, with the keys of all
of them, by one of them when that read ended (or at once when none is in the air). With one rank per process
(production) the only reader sends its read at once: the same store call as a read of its own.

A thread that gives up (its deadline passed, the read failed) gets None and reads on its own as before
(`batch_reads`), so a rank that never publishes is still named and a record refused here is read again alone,
which says why. Records are checked with the reading thread's `Membership.checked` (prefix and secret are part
of what a read is shared by): every record is validated and authenticated, once per process.
"""
import threading
import time
from typing import Any, Dict, List, Optional

from mooncake_ep_switch.buffer.membership.beats import destination
from mooncake_ep_switch.buffer.membership.key_wait import KeyWait, background_waits
from mooncake_ep_switch.buffer.membership.records import MembershipError

__all__ = ["LOOK_S", "read_checked"]

LOOK_S = 0.5  # a thread waiting for a read looks at its deadline at least this often

_LOCK = threading.Lock()
_EXCHANGES: Dict[tuple, "_Exchange"] = {}  # (store, prefix, secret, exchange, check) -> its reads; while used
_SENDING = object()  # a read's waiter while the thread that sends it starts it


class _Read:
    """One read of an exchange: the keys of the threads that joined it, then its background read, its records
    checked once, and the threads asleep until it ends."""

    __slots__ = ("keys", "until", "readers", "check", "checked", "waiter", "sent", "watched", "sleepers", "there",
                 "found")

    def __init__(self, check, checked: dict):
        self.keys: Dict[str, None] = {}
        self.until = 0.0  # the latest deadline of the threads that joined it
        self.readers = 0  # threads waiting for it
        self.check = check  # check(key, raw) -> record (`Membership.checked` of the thread that made it)
        self.checked = checked  # key -> (bytes, record) checked by the reads of its exchange
        self.waiter: Optional[KeyWait] = None  # its background read, once sent
        self.sent: List[str] = []  # the keys it read, in order
        self.watched = False  # a thread waits for its background read (the others sleep until that one wakes them)
        self.sleepers: list = []  # locks held for threads asleep until it ends
        self.there: Optional[bool] = None  # once it ended: whether its keys were all there and read
        self.found: Dict[str, Any] = {}  # key -> checked record, once it ended with them

    def ended(self) -> bool:
        return self.there is not None or (isinstance(self.waiter, KeyWait) and self.waiter.poll(0) is not None)

    def finish(self, there: bool) -> None:
        """Check the records read (when `there`; a record read before by a read of this exchange, the same bytes at
        the same key, is not checked again), then mark it ended and wake every thread asleep on it."""
        found = {}
        if there:
            for key, raw in zip(self.sent, self.waiter.values()):
                before = self.checked.get(key)
                if before is not None and before[0] == raw:
                    found[key] = before[1]
                    continue
                try:
                    value = self.check(key, raw)
                except MembershipError:
                    continue  # read again alone by the caller, which names why
                if value is not None:
                    found[key] = value
                    self.checked[key] = (raw, value)
        with _LOCK:
            self.found, self.there = found, bool(there)
            sleepers, self.sleepers, self.watched = self.sleepers, [], False
        _wake(sleepers)


def _wake(sleepers: list) -> None:
    # One lock per sleeper, released here: they wake together, not one after another (a lock or an Event shared
    # by 255 threads wakes them in a chain, each waiting for the interpreter lock before it wakes the next).
    for sleeper in sleepers:
        try:
            sleeper.release()
        except RuntimeError:  # woken already
            pass


class _Exchange:
    """The reads of one exchange in this process: the one in the air and the one being collected."""

    __slots__ = ("collecting", "in_air", "users", "checked")

    def __init__(self):
        self.collecting: Optional[_Read] = None
        self.in_air: Optional[_Read] = None
        self.users = 0
        self.checked: Dict[str, tuple] = {}  # key -> (bytes, record) its reads checked


def read_checked(membership, exchange: str, keys: List[str], valid, what: str,
                 deadline: float) -> Optional[Dict[str, Any]]:
    """The records at `keys` once all are there, read in one background read shared with this process's other
    threads reading the same exchange (module docstring), each checked once (`Membership.checked`).

    Arguments:
        membership: the reading rank's `Membership` (its store, prefix and secret).
        exchange: names the exchange (e.g. `"endpoint/0"`): reads of one exchange are shared.
        keys: the keys to read (under the membership's prefix).
        valid: the records' validity check (`records.valid_*`).
        what: the records' description, for an error.
        deadline: `time.monotonic()` deadline in seconds.

    Returns:
        records: key -> checked record (a record shared by the threads: copy it before changing it; keys whose
            record is malformed or forged are absent), or None when the store cannot share reads (the caller reads
            on its own), the keys were not all there by `deadline`, or the read failed.
    """
    identity = destination(membership.store)
    if identity is None or not background_waits(membership.store):
        return None
    name = (identity, membership.prefix, membership.secret, exchange, valid, what)
    with _LOCK:
        shared = _EXCHANGES.get(name)
        if shared is None:
            shared = _EXCHANGES[name] = _Exchange()
        shared.users += 1
        read = shared.collecting
        if read is None:
            read = shared.collecting = _Read(lambda key, raw: membership.checked(key, raw, valid, what), shared.checked)
        read.keys.update(dict.fromkeys(keys))
        read.until = max(read.until, deadline)
        read.readers += 1
    try:
        return read.found if _wait(membership, shared, read, deadline) else None
    finally:
        with _LOCK:
            read.readers -= 1
            if shared.collecting is read and read.readers == 0:
                shared.collecting = None  # nobody waits for it: never sent
            shared.users -= 1
            if shared.users == 0 and _EXCHANGES.get(name) is shared:
                del _EXCHANGES[name]  # a read still in the air ends by itself (its own timeout)


def _wait(membership, shared: _Exchange, read: _Read, deadline: float) -> bool:
    """Send `read` once no read of the exchange is in the air (this thread, with its store), then wait until it
    ended or `deadline`; True when its keys were all there and read. One thread watches a read's background read
    (and checks its records when it ends); the others sleep until it wakes them (or `LOOK_S` passed: a watcher
    that left wakes them, and one of them watches from then on)."""
    watching: Optional[_Read] = None
    try:
        while True:
            sleeper = None
            with _LOCK:
                target = read
                if read.waiter is None:
                    busy = shared.in_air
                    if busy is not None and busy.ended():
                        shared.in_air = busy = None
                    if busy is None:  # sent by this thread, which watches it
                        shared.collecting, shared.in_air = None, read
                        read.sent, read.waiter = list(read.keys), _SENDING
                        if watching is not None:
                            _unwatch(watching)
                        read.watched, watching = True, read
                    else:
                        target = busy  # this one is sent once that one ended: until then wait for it
                if read.there is not None:
                    return read.there
                if watching is not None and watching is not target:
                    _unwatch(watching)
                    watching = None
                if target.there is None and watching is None:
                    if target.watched:
                        sleeper = _held_lock()
                        target.sleepers.append(sleeper)
                    else:
                        target.watched, watching = True, target
            if target.waiter is _SENDING and watching is target:
                try:  # started outside the lock: a thread hand-off, many at once under one interpreter lock
                    target.waiter = KeyWait(membership.store, target.sent,
                                            max(target.until - time.monotonic(), 0.0) + 1.0, read=True)
                except BaseException:
                    watching = None
                    target.finish(False)
                    raise
            if target.there is not None:
                continue  # the read in the air ended: send this one
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if sleeper is not None:
                sleeper.acquire(timeout=min(left, LOOK_S))
                continue
            there = target.waiter.poll(min(left, LOOK_S))
            if there is not None:
                watching = None
                target.finish(there)
    finally:
        if watching is not None:
            with _LOCK:
                _unwatch(watching)


def _unwatch(read: _Read) -> None:
    """Called holding `_LOCK` by a thread that stops watching `read` before it ended: wakes its sleepers (one of them
    watches it from then on)."""
    read.watched = False
    sleepers, read.sleepers = read.sleepers, []
    _wake(sleepers)


def _held_lock():
    lock = threading.Lock()
    lock.acquire()
    return lock
