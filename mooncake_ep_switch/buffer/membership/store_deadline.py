"""Store calls that end by the deadline of the operation in progress (a stalled store host).

A TCPStore client waits for the server's reply without a deadline of the caller's: when the
process hosting the store stops (SIGSTOP, a host lost without a TCP reset) the server's kernel
still accepts the request, and `check`, `get`, `compare_set`, `multi_get`, `add` and `wait` block
until the host answers again; `set_timeout()` does not bound that wait (torch 2.13: still blocked
after 8 s with a 1 s timeout), at best the client's own timeout (60 s from `connect_store`, 300 s
by default) does. Every membership operation (update_ep_member, a Buffer's construction and join,
switch_layout's decision, an online EPLB commit) must instead fail at its own deadline.

`BoundedStore` wraps the group's store (a `torch.distributed.Store` itself, so `PrefixStore` and
gloo take it as they took the store) and makes every call on a worker thread that owns a client of
its own (`clone()` of a TCPStore, so the caller's client is never left mid-protocol). The caller
waits until the deadline that the operation in progress set with `store_deadline()` (a context
variable: threads do not inherit it), at least `STORE_GRACE_S` for a call made at or past it (an
error path reading who was missing, a process that was frozen and wakes late); without one, until
the store's own timeout. A call that gets no answer in time raises `StoreUnavailable` naming the
store, the call and the deadline; its client (possibly mid-protocol) is never used again: the next
call gets a fresh client and worker. The abandoned worker ends when the host answers (or the connection fails); idle workers
end after `IDLE_S` (their client is kept for the next call: no burst of reconnections when every rank
calls at once), and at once on `close()`. `IDLE_S` is long enough that a group's next membership change
usually finds its workers running: with ranks as threads of one process (the membership bench at R=256)
restarting every rank's two workers when all call at once cost ~0.4 s of a 1.1-1.9 s view change (each
thread start waits for the new thread to run, behind every other rank's); a parked worker costs nothing. A write the stalled call had sent may still land when the host resumes, as
any delayed message would.
"""
import _thread
import contextlib
import contextvars
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Tuple

import torch.distributed as dist

from mooncake_ep_switch.errors import StoreUnavailable

__all__ = ["BoundedStore", "STORE_GRACE_S", "bounded", "reads_in_background", "remaining_s", "store_deadline",
           "waits_in_background"]

STORE_GRACE_S = 0.5  # a call an operation makes at or past its deadline (error paths) still gets this long
IDLE_S = 30.0  # a worker with nothing to do for this long ends (the next call starts one; close() ends it at once)

# (deadline as time.monotonic(), what set it, its budget in seconds) of the operation in progress.
_DEADLINE: "contextvars.ContextVar[Optional[Tuple[float, str, float]]]" = contextvars.ContextVar(
    "mep_store_deadline", default=None)


@contextlib.contextmanager
def store_deadline(deadline: Optional[float], what: str) -> Iterator[None]:
    """Bound every `BoundedStore` call made in this block (by this thread) by `deadline`.

    Nested blocks keep the earlier deadline (an operation inside another never outlives it).

    Arguments:
        deadline: `time.monotonic()` value, or None for no bound of its own (an enclosing one holds).
        what: the operation, named in the `StoreUnavailable` message (e.g. "update_ep_member").

    Returns:
        a context manager.
    """
    outer = _DEADLINE.get()
    if deadline is None or (outer is not None and outer[0] <= deadline):
        yield
        return
    token = _DEADLINE.set((deadline, what, max(0.0, deadline - time.monotonic())))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


# Set by `waits_in_background`: a list that a BoundedStore's wait() appends its started job to (and returns at once).
_BACKGROUND: "contextvars.ContextVar[Optional[list]]" = contextvars.ContextVar("mep_background_wait", default=None)
# Set by `reads_in_background`: how long a background `multi_get` waits for its keys (seconds).
_READ_S: "contextvars.ContextVar[Optional[float]]" = contextvars.ContextVar("mep_background_read", default=None)


@contextlib.contextmanager
def waits_in_background() -> Iterator[list]:
    """Make the `wait()` calls this thread makes in the block on a `BoundedStore` that clones a TCPStore start
    the wait on a lane of its own (a client of its own) and return at once; the started jobs are appended to the
    list this yields (`_Job`: `done` is set when the wait returned, `error` is None when the keys were there).

    The caller then waits on `done` locally (no store operation per round) while it goes on calling the store on
    the store's other lane; ending the wait early is setting one of the keys (the caller's own, or any rank's).
    A wait through anything else (a store that is not a cloned TCPStore) is made as usual and blocks; the list
    then stays empty.

    Returns:
        a context manager yielding the list of started jobs.
    """
    jobs: list = []
    token = _BACKGROUND.set(jobs)
    try:
        yield jobs
    finally:
        _BACKGROUND.reset(token)


@contextlib.contextmanager
def reads_in_background(seconds: float) -> Iterator[list]:
    """As `waits_in_background`, for the `multi_get()` calls this thread makes in the block: each starts on the wait
    lane a read that blocks until every key is there (the TCPStore's read waits for absent keys), for at most
    `seconds`, and returns at once (placeholder values); its job's `value` is the values read (`error` set when it
    timed out). One store operation where a wait and then a read of the keys were two: a waiter that needs the
    value of the key it waits for (a sealed view, a ballot's summary) has it as soon as the wait ends.

    Only for a store whose `background_waits` is true (`key_wait.background_waits`): elsewhere the read is made in
    place, and blocks until the keys are there or the store's own timeout.

    Arguments:
        seconds: the longest the read waits for its keys (> 0).

    Returns:
        a context manager yielding the list of started jobs.
    """
    with waits_in_background() as jobs:
        token = _READ_S.set(max(float(seconds), 0.001))
        try:
            yield jobs
        finally:
            _READ_S.reset(token)


def remaining_s() -> Optional[float]:
    """Seconds left until the deadline of the operation in progress (`store_deadline`), or None without one.

    Returns:
        seconds: float (negative once past it), or None.
    """
    found = _DEADLINE.get()
    return None if found is None else found[0] - time.monotonic()


class _Done:
    """A one-shot event on one lock (set once, by the job's worker or by `abandon`): lighter than a
    `threading.Event`, whose set and wait go through a Condition (a store call costs two of them)."""

    __slots__ = ("_lock", "_flag")

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._flag = False

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            try:
                self._lock.release()
            except RuntimeError:  # set twice at once: released already
                pass

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether it was set within `timeout` seconds (None: no limit)."""
        if self._flag:
            return True
        if timeout is not None and timeout <= 0:
            return False
        if self._lock.acquire(timeout=-1 if timeout is None else timeout):
            try:
                self._lock.release()
            except RuntimeError:
                pass
            return True
        return self._flag


class _Job:
    """One store call: run on a worker, waited for by its caller."""

    __slots__ = ("fn", "done", "value", "error", "retry")

    def __init__(self, fn: Callable[[Any], Any]):
        self.fn = fn
        self.done = _Done()
        self.value = None
        self.error: Optional[BaseException] = None
        self.retry = False  # its worker was abandoned before it ran: run it on the next one


class _Lane:
    """A client of the store and the worker thread that makes its calls, one at a time."""

    def __init__(self, make_client: Callable[[], Any], name: str):
        self._make_client = make_client
        self._client = None
        self._jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._lock = _thread.allocate_lock()
        self._thread: Optional[threading.Thread] = None
        self._name = name
        self.abandoned = False

    def submit(self, job: _Job) -> bool:
        """Queue `job`; False when this lane was abandoned (use another)."""
        with self._lock:
            if self.abandoned:
                return False
            self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"mep-store-{self._name}", daemon=True)
                self._thread.start()
        return True

    def abandon(self) -> Optional[threading.Thread]:
        """Never use this lane again: queued calls go to the next lane, the worker ends after its call.

        Returns:
            thread: the lane's worker (to join), or None when it had none.
        """
        jobs = []
        with self._lock:
            self.abandoned = True
            thread = self._thread
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    jobs.append(job)
            self._jobs.put(None)  # wakes the worker, which ends
        for job in jobs:
            job.retry = True
            job.done.set()
        return thread

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_S)
            except queue.Empty:
                job = None
            if job is None:
                with self._lock:
                    if self.abandoned or self._jobs.empty():
                        self._thread = None
                        if self.abandoned:
                            self._client = None
                        # An idle lane keeps its client (no call is in flight on it): when every rank of a group
                        # calls again at once (update_ep_member after a death), nobody reconnects, so the store
                        # host sees no burst of connections (R at once took seconds at R=64).
                        return
                continue
            try:
                if self._client is None:
                    self._client = self._make_client()
                job.value = job.fn(self._client)
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                job.error = error
                if isinstance(error, dist.DistNetworkError):
                    self._client = None  # the connection broke: the next call connects anew
            finally:
                job.done.set()


def _root(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class BoundedStore(dist.Store):
    """A `torch.distributed.Store` whose calls end by the deadline of the operation in progress.

    Arguments:
        store: the store to delegate to (a TCPStore, possibly under PrefixStores, or any Store).
            A TCPStore is cloned (a client of this wrapper's own); other stores are called as given.
    """

    def __init__(self, store):
        super().__init__()
        self.inner = store
        root = _root(store)
        host, port = getattr(root, "host", None), getattr(root, "port", None)
        self.name = f"{host}:{port}" if host is not None and port is not None else getattr(
            root, "url", type(root).__name__)  # an EtcdStore names its cluster and prefix
        default = getattr(store, "timeout", None)
        self.default_s = default.total_seconds() if default is not None and default.total_seconds() > 0 else 300.0
        if default is not None:
            super().set_timeout(default)
        clone = isinstance(root, dist.TCPStore)
        self._make_client = (lambda: store.clone()) if clone else (lambda: store)
        self._clones = clone
        # waits_in_background(): on a lane with a client of its own, or on a store whose blocked waits cost no
        # store operation (an EtcdStore: a watch) and whose client threads may share
        self.background_waits = clone or bool(getattr(root, "waits_cheaply", False))
        self._lock = threading.Lock()
        self._lane: Optional[_Lane] = None
        self._wait_lane: Optional[_Lane] = None  # background waits (`waits_in_background`), a client of its own
        self._last_wait: Optional[_Job] = None  # the last background wait (its lane is left to it while it lasts)

    def close(self, join_s: float = 1.0) -> None:
        """Let the workers end and wait up to `join_s` seconds for them; later calls start a new one.

        An idle worker ends at once; one still waiting for a stalled store ends when it answers (the
        wait for it ends at `join_s`, so destroy() stays bounded).

        Arguments:
            join_s: the longest wait for the workers, in seconds (0: do not wait).
        """
        with self._lock:
            lanes, self._lane, self._wait_lane = (self._lane, self._wait_lane), None, None
        threads = [lane.abandon() for lane in lanes if lane is not None]
        until = time.monotonic() + max(0.0, join_s)
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, until - time.monotonic()))

    def _current(self) -> _Lane:
        with self._lock:
            if self._lane is None:
                self._lane = _Lane(self._make_client, self.name)
                if self.background_waits and self._wait_lane is None:
                    # The wait lane connects now, in the background: when every rank of a group first waits at
                    # once (update_ep_member after a death), none connects then (R at once took seconds at R=64).
                    self._wait_lane = _Lane(self._make_client, f"{self.name}-wait")
                    self._wait_lane.submit(_Job(lambda s: None))
            return self._lane

    def _call(self, op: str, key, fn: Callable[[Any], Any]):
        found = _DEADLINE.get()
        now = time.monotonic()
        if found is None:
            what, budget = "a store call", self.default_s
            until = now + budget
        else:  # a call made past the deadline (an error path, a process that was frozen) still gets the grace
            deadline, what, budget = found
            until = max(deadline, now + STORE_GRACE_S)
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            lane, job = self._current(), _Job(fn)
            if not lane.submit(job):
                continue
            if not job.done.wait(remaining):
                with self._lock:
                    if self._lane is lane:
                        self._lane = None
                lane.abandon()
                break
            if job.retry:
                continue
            if job.error is not None:
                raise job.error
            return job.value
        raise StoreUnavailable(
            f"the store at {self.name} did not answer {op}({key!r}) by the deadline of {what} ({budget:.3g} s): its "
            "host is stalled or unreachable. Nothing waits on it any more; the data plane (dispatch/combine) goes "
            "on, and the operation can be called again once the store answers", store=self.name, operation=what,
            timeout_s=budget)

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key, value):
        return self._call("set", key, lambda s: s.set(key, value))

    def get(self, key):
        return self._call("get", key, lambda s: s.get(key))

    def check(self, keys):
        return self._call("check", keys, lambda s: s.check(keys))

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, lambda s: s.compare_set(key, expected, desired))

    def add(self, key, amount):
        return self._call("add", key, lambda s: s.add(key, amount))

    def append(self, key, value):
        return self._call("append", key, lambda s: s.append(key, value))

    def delete_key(self, key):
        return self._call("delete_key", key, lambda s: s.delete_key(key))

    def multi_get(self, keys):
        jobs, read_s = _BACKGROUND.get(), _READ_S.get()
        if jobs is not None and read_s is not None and self.background_waits:
            timeout = timedelta(seconds=read_s)

            def read(client):
                if not self._clones:  # a client shared with the caller's lane (an EtcdStore): its timeout stays
                    client.wait(keys, timeout)
                    return client.multi_get(keys)
                client.set_timeout(timeout)  # the wait lane's own client: its reads and waits only
                return client.multi_get(keys)

            self._background_job(_Job(read), jobs)
            return [b""] * len(keys)  # placeholders (a PrefixStore above needs a list): the job's value holds the read
        return self._call("multi_get", keys, lambda s: s.multi_get(keys))

    def multi_set(self, keys, values):
        return self._call("multi_set", keys, lambda s: s.multi_set(keys, values))

    def num_keys(self):
        return self._call("num_keys", "", lambda s: s.num_keys())

    def _background_wait(self, keys, timeout, jobs: list) -> None:
        """Start `wait(keys, timeout)` on the wait lane and append its job to `jobs` (`waits_in_background`). A wait
        lane still busy with an earlier wait (one its caller stopped waiting for) is left to end by itself (the
        wait gets a new lane)."""
        self._background_job(_Job(lambda s: s.wait(keys, timeout)), jobs)

    def _background_job(self, job: _Job, jobs: list) -> None:
        """Start `job` on the wait lane (a new one while the last background job still runs) and append it to `jobs`."""
        while True:
            with self._lock:
                lane, last = self._wait_lane, self._last_wait
                if lane is None or lane.abandoned or (last is not None and not last.done.is_set()):
                    if lane is not None:
                        lane.abandon()
                    lane = self._wait_lane = _Lane(self._make_client, f"{self.name}-wait")
                self._last_wait = job
            if lane.submit(job):
                jobs.append(job)
                return

    def wait(self, keys, timeout=None):
        # A wait legitimately lasts its timeout (the keys are not there yet): the store's own timeout
        # error ends it then; StoreUnavailable only when the store does not even answer that.
        jobs = _BACKGROUND.get()
        if jobs is not None and self.background_waits and timeout is not None:
            return self._background_wait(keys, timeout, jobs)
        if timeout is None:
            return self._call("wait", keys, lambda s: s.wait(keys))
        return self._call("wait", keys, lambda s: s.wait(keys, timeout))


def bounded(store):
    """`store` wrapped in a `BoundedStore` (None and an already wrapped store are returned as given).

    Arguments:
        store: a torch.distributed Store, or None.

    Returns:
        store: a `BoundedStore`, or None.
    """
    if store is None or isinstance(store, BoundedStore):
        return store
    return BoundedStore(store)
