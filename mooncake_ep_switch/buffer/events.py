"""Typed events of a Buffer, for the engine's policy: one place to learn what happened and decide.

`Buffer.subscribe()` (and `ElasticBuffer.subscribe()`) returns a `Subscription`: a callback called
with each event as it happens, or an iterator of them (`poll()` / `for event in subscription`).
Events come in the order they happened on this rank:

    PeerMasked(rank, reason, epoch)      a dispatch/combine masked `rank`: "dead" (its process
                                         ended), "stalled" (missed the call's deadline) or "cut"
                                         (the link to it failed)
    ExpertsUncovered(layers, ranks)      logical experts with no copy on an unmasked rank (an
                                         `ExpertSlots` of the Buffer derives it from its placement)
    CoverageRestored(epoch, layers, seconds)  an online EPLB coverage epoch committed: every
                                         expert has a copy on a live rank again; `seconds` since
                                         the experts were found uncovered
    JoinerPending(ranks, epoch)          ranks wait to be admitted (call `update_ep_member()`)
    JoinerAdmitted(ranks, epoch)         they are members of `epoch`
    RankLeftOut(ranks, epoch)            members no more (a view sealed without them; this rank
                                         itself when it was left out)

Events are delivered on the thread that found them (inside a dispatch/combine, a rebalancer's
`step()`, `update_ep_member()`, `pending_joiners()`); a callback must be quick and must not call
the Buffer (record, set a flag, or use the iterator form and act between steps). An exception a
callback raises is logged and dropped. Emission costs nothing on the steps where nothing happens.
"""
import logging
import queue
import threading
from collections import deque
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

__all__ = ["PeerMasked", "ExpertsUncovered", "CoverageRestored", "JoinerPending", "JoinerAdmitted", "RankLeftOut",
           "Subscription", "EventBus", "REASONS", "view_changed", "joiners_seen"]

log = logging.getLogger("mooncake_ep_switch.buffer")

REASONS = {"process_end": "dead", "deadline": "stalled", "link": "cut"}  # transport.mask_cause -> reason


class PeerMasked(NamedTuple):
    """A call masked a peer. Fields: rank; reason ("dead", "stalled" or "cut"); epoch (the view's)."""

    rank: int
    reason: str
    epoch: int


class ExpertsUncovered(NamedTuple):
    """Logical experts with no copy on an unmasked rank. Fields: layers ({layer: (experts, ...)});
    ranks (the masked ranks, ascending)."""

    layers: Dict[int, Tuple[int, ...]]
    ranks: Tuple[int, ...]


class CoverageRestored(NamedTuple):
    """A coverage epoch committed. Fields: epoch (the chunk epoch); layers (those it changed);
    seconds (from `ExpertsUncovered` to this commit, on this rank)."""

    epoch: int
    layers: Tuple[int, ...]
    seconds: float


class JoinerPending(NamedTuple):
    """Ranks wait to be admitted. Fields: ranks (ascending); epoch (the current view's)."""

    ranks: Tuple[int, ...]
    epoch: int


class JoinerAdmitted(NamedTuple):
    """Joiners became members. Fields: ranks (ascending); epoch (the view that admitted them)."""

    ranks: Tuple[int, ...]
    epoch: int


class RankLeftOut(NamedTuple):
    """Ranks are no members of `epoch` (a view sealed without them). Fields: ranks; epoch."""

    ranks: Tuple[int, ...]
    epoch: int


class Subscription:
    """One subscriber of an `EventBus`: a callback, or a queue read as an iterator.

    Arguments:
        bus: the `EventBus`.
        callback: called with each event, or None (events queue up for `poll()` / iteration).
    """

    def __init__(self, bus: "EventBus", callback: Optional[Callable] = None):
        self._bus = bus
        self.callback = callback
        self._queue: "queue.Queue" = queue.Queue()
        self.closed = False

    def deliver(self, event) -> None:
        """Hand `event` to the callback or the queue (the bus calls it)."""
        if self.callback is None:
            self._queue.put(event)
            return
        try:
            self.callback(event)
        except Exception:  # a subscriber's error never breaks the call that found the event
            log.exception("event subscriber %r raised on %r", self.callback, event)

    def poll(self, timeout_s: float = 0.0):
        """The next queued event, waiting at most `timeout_s` seconds.

        Arguments:
            timeout_s: seconds to wait (0: do not wait).

        Returns:
            event: the next event, or None when none came in time.

        Raises:
            ValueError: this subscription has a callback (its events are not queued).
        """
        if self.callback is not None:
            raise ValueError("poll: this subscription delivers to its callback; subscribe() without one to poll")
        try:
            return self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator:
        """The events queued so far (does not wait)."""
        while True:
            event = self.poll()
            if event is None:
                return
            yield event

    def emit(self, event) -> None:
        """Post a derived event to the bus (after the one being delivered), e.g. `ExpertsUncovered`."""
        self._bus.emit(event)

    def close(self) -> None:
        """Stop receiving events; idempotent."""
        self.closed = True
        self._bus.unsubscribe(self)


class EventBus:
    """Delivers events to subscribers, in the order emitted; an event emitted while another is being
    delivered (by a subscriber, e.g. `ExpertSlots` deriving `ExpertsUncovered`) follows it."""

    def __init__(self):
        self._subscribers: List[Subscription] = []
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._delivering = False
        self.announced = set()  # joiners a JoinerPending named (not admitted yet)

    def subscribe(self, callback: Optional[Callable] = None) -> Subscription:
        """Add a subscriber (see `Subscription`).

        Arguments:
            callback: a callable taking one event, or None for an iterator.

        Returns:
            subscription: its `close()` unsubscribes.

        Raises:
            TypeError: `callback` is neither None nor callable.
        """
        if callback is not None and not callable(callback):
            raise TypeError(f"callback: expected a callable or None, got {type(callback).__name__}")
        subscription = Subscription(self, callback)
        with self._lock:
            self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Remove `subscription` (no error if absent)."""
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    @property
    def active(self) -> bool:
        """True when anyone subscribed (emitters may skip building events otherwise)."""
        return bool(self._subscribers)

    def emit(self, event) -> None:
        """Deliver `event` to every subscriber, after any event being delivered now."""
        with self._lock:
            if not self._subscribers:
                return
            self._pending.append(event)
            if self._delivering:
                return
            self._delivering = True
        while True:
            with self._lock:
                if not self._pending:
                    self._delivering = False
                    return
                event = self._pending.popleft()
                subscribers = list(self._subscribers)
            for subscription in subscribers:
                subscription.deliver(event)


def view_changed(bus: EventBus, rank: int, before: Tuple[int, ...], was_joining: bool, epoch: int,
                 members: Tuple[int, ...]) -> None:
    """Emit the events of a view this rank took: `JoinerPending` (for joiners not announced yet, so
    every admission is preceded by one), `JoinerAdmitted`, `RankLeftOut`.

    Arguments:
        bus: the Buffer's `EventBus`.
        rank: this rank.
        before: the members before (empty for a joiner).
        was_joining: this rank was a joiner (it is among those admitted).
        epoch: the new view's epoch.
        members: its members.
    """
    if not bus.active:
        return
    joined = tuple(sorted(set(members) - set(before) if not was_joining else {rank}))
    left = tuple(sorted(set(before) - set(members)))
    fresh = tuple(r for r in joined if r not in bus.announced)
    if fresh:
        bus.emit(JoinerPending(fresh, epoch - 1))
    if joined:
        bus.emit(JoinerAdmitted(joined, epoch))
    bus.announced.difference_update(joined)
    if left:
        bus.emit(RankLeftOut(left, epoch))


def joiners_seen(bus: EventBus, ranks, epoch: int) -> None:
    """Emit `JoinerPending` for the ranks of `ranks` not announced yet (`Buffer.pending_joiners()`)."""
    fresh = tuple(r for r in sorted(ranks) if r not in bus.announced)
    if fresh and bus.active:
        bus.announced.update(fresh)
        bus.emit(JoinerPending(fresh, epoch))
