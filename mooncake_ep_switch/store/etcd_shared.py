"""Identical reads of one process's threads share one etcd request, and their puts go out together (issue 40).

When the ranks of a group are threads of one process (the membership bench, tests), R of them read
the same keys at once: every survivor waits for the same `view/<e>` and reads it when it is sealed.
Each read is an HTTP request (and its thread's share of the interpreter), so at R=256 the cluster and
the client drained ~500 identical reads one by one; at construction every rank reads its R-1 peers'
records. `shared_read` lets a read join a request of the same kind that is not sent yet, adding its keys
to it (the request reads them all at one revision, each reader takes its own), and stays linearizable: a read joins only a request sent after
it began (while one is in the air the next one collects the later readers and is sent when the one in
the air answers, or after `connection.request_s` at most), so its answer is a state of the store
between the call and its return. A reader whose request failed, or did not answer by the reader's
own deadline, reads alone (and gets its own error).

`shared_write` does the same for puts (`set`, `multi_set`): R ranks post their readiness at once. A put
joins the puts pending for the cluster and prefix, and the thread that finds no post under way sends
every pending one in one transaction (up to `MAX_PUTS` puts, no key twice: flat combining, no thread of
its own; it posts what came meanwhile too, `_ROUNDS` times at most, then hands the rest to one of their
threads). Each caller's puts stay atomic (one transaction) and its call returns after they were applied.
A caller whose post failed, or did not answer by its deadline, sends its own puts (and gets its own
error). With one rank per process nothing is shared.
"""
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from mooncake_ep_switch.store.combining import Combiner, Waiting, disjoint_batch

__all__ = ["MAX_PUTS", "shared_read", "shared_write"]

MAX_PUTS = 128  # puts per transaction (etcd's default --max-txn-ops)
_ROUNDS = 8  # posts one caller makes for the others before it hands the rest on
MAX_SHARED_KEYS = 1024  # keys one shared read asks for at most (a reader that would pass it reads alone)


class _Flight:
    """One request and the readers that take its answer: it reads the keys of all of them."""

    def __init__(self, keys: List[Any]):
        self.keys: Dict[Any, None] = dict.fromkeys(keys)  # grows while it collects readers, frozen when sent
        self.done = threading.Event()
        self.values: Dict[Any, Any] = {}
        self.revision: Any = None
        self.error: Optional[BaseException] = None
        self.readers = 1

    def answer(self, keys: List[Any]) -> Tuple[List[Any], Any]:
        return [self.values[key] for key in keys], self.revision


class _Slot:
    """The requests of one kind of read: the one in the air and the next one (collecting readers)."""

    def __init__(self):
        self.air: Optional[_Flight] = None
        self.next: Optional[_Flight] = None


_SLOTS: Dict[Hashable, _Slot] = {}
_LOCK = threading.Lock()


def shared_read(name: Hashable, keys: List[Any], read: Callable[[List[Any]], Tuple[List[Any], Any]], deadline: float,
                wait_s: float) -> Tuple[List[Any], Any]:
    """The values of `keys` and the revision they were read at, read by `read(keys)` or by a request of the same
    kind (`name`) for these keys and others, sent after this call began.

    Arguments:
        name: the kind of read (cluster, prefix, values or presence): equal names may share a request.
        keys: the keys to read.
        read: reads a list of keys at one revision; returns (their values in order, the revision).
        deadline: `time.monotonic()` value by which this reader wants an answer (past it, it reads alone).
        wait_s: the longest a request waits for the one in the air before it is sent anyway.

    Returns:
        (values of `keys` in order, revision).

    Raises:
        what `read()` raises when this reader reads alone or sends the request.
    """
    with _LOCK:
        slot = _SLOTS.setdefault(name, _Slot())
        if slot.air is None:
            flight, role, ahead = _Flight(keys), "send", None
            slot.air = flight
        elif slot.next is not None and len(slot.next.keys) + len(keys) <= MAX_SHARED_KEYS:
            flight, role, ahead = slot.next, "join", None
            flight.readers += 1
            flight.keys.update(dict.fromkeys(keys))
        elif slot.next is not None:
            flight, role, ahead = None, "alone", None
        else:
            flight, role, ahead = _Flight(keys), "send", slot.air
            slot.next = flight
    if role == "alone":
        return read(keys)
    if role == "join":
        if flight.done.wait(max(deadline - time.monotonic(), 0.0)) and flight.error is None:
            return flight.answer(keys)
        return read(keys)  # its request failed or is late for this reader: alone, with its own error
    if ahead is not None:
        ahead.done.wait(max(min(wait_s, deadline - time.monotonic()), 0.0))
    with _LOCK:
        if slot.next is flight:
            slot.next = None  # later readers collect for another request
        slot.air = flight
        asked = list(flight.keys)  # frozen: no reader joins it any more
    try:
        values, flight.revision = read(asked)
        flight.values = dict(zip(asked, values))
        return flight.answer(keys)
    except BaseException as error:
        flight.error = error
        raise
    finally:
        with _LOCK:
            if slot.air is flight:
                slot.air = None
            if slot.air is None and slot.next is None and _SLOTS.get(name) is slot:
                del _SLOTS[name]
        flight.done.set()


class _Puts(Waiting):
    """One caller's puts, waiting to be sent (by whichever thread posts)."""

    def __init__(self, puts: List[Dict[str, Any]], deadline: float):
        super().__init__(deadline)
        self.puts = puts
        self.keys = [put["request_put"]["key"] for put in puts]


_WRITES = Combiner()


def shared_write(name: Hashable, puts: List[Dict[str, Any]], send: Callable[[List[Dict[str, Any]]], Any],
                 deadline: float) -> None:
    """Apply `puts` (etcd `request_put` operations, at most `MAX_PUTS`, no key twice) in one transaction, sent with
    the puts other threads of this process make for the same `name` meanwhile.

    Arguments:
        name: the cluster and prefix (equal names: the puts may share a transaction).
        puts: `{"request_put": {"key": ..., "value": ...}}` operations.
        send: sends a list of puts as one transaction (raises when it was not applied or not answered).
        deadline: `time.monotonic()` value by which this caller wants its puts applied.

    Raises:
        ValueError: more than `MAX_PUTS` puts.
        what `send` raises for this caller's own puts.
    """
    if len(puts) > MAX_PUTS:
        raise ValueError(f"puts: expected at most {MAX_PUTS} operations per transaction, got {len(puts)}")
    mine = _Puts(puts, deadline)
    if _WRITES.submit(name, mine, lambda pending: disjoint_batch(pending, MAX_PUTS),
                      lambda taken: send([put for item in taken for put in item.puts]), rounds=_ROUNDS) and mine.error is None:
        return
    send(puts)  # its post failed, was never taken, or none answered by this caller's deadline: alone, with its own error
