"""Flat combining: the calls that the threads of one process make on one name at once are applied in batches.

When the ranks of a group are threads of one process (the membership bench, tests), R of them make the
same kind of call at once: every rank posts its readiness (`etcd_shared.shared_write`), every voter adds to
one tally (`EtcdStore.add`). Each call alone is a request to the cluster (and its thread's share of the
interpreter); made one by one they queue behind each other. A `Combiner` queues the calls per name; the
thread that finds no batch under way applies the waiting ones in batches (flat combining: no thread of its
own), the ones that came meanwhile too, then hands the rest to one of their threads. A caller whose
deadline passes while its call still waits takes it back (never applied); one whose call is in a batch in
the air waits for that batch's answer, or not (`flight_grace_s`), as the kind of call needs.
"""
import threading
import time
from typing import Callable, Dict, Hashable, List, Optional, Tuple

__all__ = ["Combiner", "Waiting", "disjoint_batch"]


class Waiting:
    """One caller's call in a `Combiner`'s queue (subclasses carry the call and its outcome).

    Arguments:
        deadline: `time.monotonic()` value by which the caller wants an answer.
    """

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.done = threading.Event()  # set when its batch answered, or when its thread is to apply (`post`)
        self.answered = False  # a batch with this call in it answered (`error` says whether it failed)
        self.error: Optional[BaseException] = None
        self.post = False  # handed over: this caller's thread applies the rest (the last one to apply left)
        self.taken_until = 0.0  # the deadline of the batch it is in (set when taken)


class _Queue:
    def __init__(self):
        self.pending: List[Waiting] = []
        self.busy = False


Take = Callable[[List[Waiting]], Tuple[List[Waiting], List[Waiting]]]


def disjoint_batch(pending: List[Waiting], limit: int) -> Tuple[List[Waiting], List[Waiting]]:
    """A `take` for calls that write keys (each with a `keys` list): the waiting calls, in order, that fit one
    request of at most `limit` keys with no key twice, and the rest."""
    taken: List[Waiting] = []
    rest: List[Waiting] = []
    keys: set = set()
    for waiting in pending:
        if not keys.intersection(waiting.keys) and len(keys) + len(waiting.keys) <= limit:
            taken.append(waiting)
            keys.update(waiting.keys)
        else:
            rest.append(waiting)
    return taken, rest


class Combiner:
    """Per-name queues of waiting calls, applied in batches by the callers' own threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues: Dict[Hashable, _Queue] = {}

    def waiting(self, name: Optional[Hashable] = None) -> int:
        """Calls queued and not yet taken into a batch (for `name`, or for every name)."""
        with self._lock:
            queues = list(self._queues.values()) if name is None else [self._queues[name]] if name in self._queues else []
            return sum(len(queue.pending) for queue in queues)

    def has(self, name: Hashable) -> bool:
        """True while calls for `name` are queued or being applied."""
        with self._lock:
            return name in self._queues

    def submit(self, name: Hashable, mine: Waiting, take: Take, apply: Callable[[List[Waiting]], None],
               rounds: Optional[int] = None, flight_grace_s: Optional[float] = None) -> bool:
        """Queue `mine` and return once a batch with it answered, or once it is clear none will for this caller.

        Arguments:
            name: calls of equal names may share a batch.
            mine: this caller's call.
            take: `(waiting calls) -> (the calls of one batch, the rest)`, called under the combiner's lock.
            apply: applies one batch, setting each call's outcome; what it raises is each call's `error`.
            rounds: batches this caller applies at most (None: until none waits, or its own deadline passed
                with its call answered); then it hands the rest to a waiting caller.
            flight_grace_s: past its deadline, a caller whose call is in a batch in the air waits for that
                batch's answer until the batch's own deadline plus this long (None: it does not wait).

        Returns:
            True when a batch with `mine` answered (`mine.error` is None when it was applied); False when
            none did: never taken (it is not applied), or in a batch still unanswered at the wait's end.
        """
        with self._lock:
            queue = self._queues.setdefault(name, _Queue())
            queue.pending.append(mine)
            post = not queue.busy
            queue.busy = True
        if not post:
            mine.done.wait(max(mine.deadline - time.monotonic(), 0.0))
            with self._lock:
                if mine.post:
                    post = True
                elif mine.answered:
                    return True
                elif mine in queue.pending:
                    queue.pending.remove(mine)  # not taken by a batch: not applied
                    return False
            if not post:  # in a batch in the air
                if flight_grace_s is None:
                    return False
                mine.done.wait(max(mine.taken_until + flight_grace_s - time.monotonic(), 0.0))
                with self._lock:
                    return mine.answered
        return self._apply(name, queue, mine, take, apply, rounds)

    def _apply(self, name: Hashable, queue: _Queue, mine: Waiting, take: Take,
               apply: Callable[[List[Waiting]], None], rounds: Optional[int]) -> bool:
        batches = 0
        try:
            while rounds is None or batches < rounds:
                with self._lock:
                    taken, queue.pending = take(queue.pending)
                    for waiting in taken:
                        waiting.taken_until = mine.deadline  # its caller may wait for this batch until then
                if not taken:
                    break
                batches += 1
                try:
                    apply(taken)
                except BaseException as error:  # noqa: BLE001 - each caller of the batch gets it
                    for waiting in taken:
                        waiting.error = error
                with self._lock:
                    for waiting in taken:
                        waiting.answered = True
                for waiting in taken:
                    waiting.done.set()
                if mine.answered and time.monotonic() >= mine.deadline:
                    break  # past this caller's deadline: the rest is handed on
        finally:
            with self._lock:
                if mine in queue.pending:
                    queue.pending.remove(mine)  # never taken (e.g. a key also in another's batch): not applied
                if queue.pending:
                    heir = queue.pending[0]  # its thread applies the rest
                    heir.post = True
                    heir.done.set()
                else:
                    queue.busy = False
                    if self._queues.get(name) is queue:
                        del self._queues[name]
        return mine.answered
