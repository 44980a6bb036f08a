"""One etcd v3 watch stream per process and key prefix, shared by every waiting thread (issues 38, 40).

An `EtcdStore.wait` that polls costs one read per round per waiter: 256 ranks waiting at once (ranks
as threads, or one process per rank) saturate a 3-member cluster. `WatchHub` keeps ONE stream on the
gateway's `/v3/watch` for a key range (a job's keys) and hands each event to the waiters of its key,
so a waiter costs one read when it starts (after registering: no update is lost between the read
and the watch, see `Waiter`) and nothing while it waits.

The stream is kept by one thread: resumed from the last revision seen + 1 on another member when
its member dies, stops answering or has no leader (no event lost), re-created from the present when that revision
was compacted (every waiter then reads again), and re-opened after `IDLE_S` of silence (a stalled
member is left then). The thread ends when the last store using the hub is closed, or when the hub
has had no waiter for `IDLE_S` (the next waiter starts it again). Hubs are shared through
`hub_for()`, counted by `acquire`/`release`.
"""
import json
import socket
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

from mooncake_ep_switch.store.etcd_client import EtcdConnection, b64, unb64

__all__ = ["IDLE_S", "Waiter", "WatchHub", "hub_for"]

IDLE_S = 3.0  # a stream silent this long is opened again (a stalled member is left); without waiters it ends

_HUBS: Dict[Tuple, "WatchHub"] = {}
_HUBS_LOCK = threading.Lock()


def hub_for(connection: EtcdConnection, start: bytes, end: bytes) -> "WatchHub":
    """The process's hub of the key range [`start`, `end`) on `connection`'s cluster, acquired once
    (call `release()` when done).

    Arguments:
        connection: the cluster (its options make the hub's own connection).
        start, end: the key range watched.

    Returns:
        WatchHub.
    """
    options = connection.options()
    key = (tuple(options["endpoints"]), options["secure"], options["user"], options["password"],
           options["ca_cert"], options["cert"], options["key"], start, end)
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = _HUBS[key] = WatchHub(EtcdConnection(**options), start, end, key)
        hub.users += 1
        return hub


class Waiter:
    """One wait for keys: registered with a hub before its read, settled by the read, then kept by
    the hub's events.

    The hub records the events of its keys from registration on; `settle(present, revision)` takes
    the read's answer (made after registering, at `revision`) and applies the recorded events newer
    than it, so an update between the read and the watch is never lost. `done` is set when every key
    is present, or when the waiter must read again (`stale`: the stream was re-created with a gap).
    """

    def __init__(self, keys: List[bytes]):
        self.keys = keys
        self.done = threading.Event()
        self.revision: Optional[int] = None  # the settling read's revision (None: not settled)
        self.seen: Dict[bytes, Tuple[int, bool]] = {}  # key -> (revision, present) of its newest event
        self.missing: Set[bytes] = set(keys)
        self.stale = False


class WatchHub:
    """The watch stream of one key range and the waiters of its keys (see the module's docstring).

    Arguments:
        connection: the hub's own connection (endpoints, credentials, TLS).
        start, end: the key range watched.
        name: the key of `_HUBS` it is registered under.
    """

    def __init__(self, connection: EtcdConnection, start: bytes, end: bytes, name: Tuple):
        self.connection = connection
        self.start, self.end = start, end
        self._name = name
        self.users = 0
        self._lock = threading.Lock()
        self._waiters: Dict[bytes, Set[Waiter]] = {}
        self._count = 0  # waiters registered
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._live = threading.Event()  # a stream is created and read
        self._last: Optional[int] = None  # the newest revision every event up to which was handed out
        self._index = connection.preferred
        self._response = None
        self.streams = 0  # streams opened (tests, diagnostics)
        self.events = 0  # events handed out

    # ------------------------------------------------------------------ users and waiters
    def release(self) -> None:
        """One user less; the last one stops the stream and joins its thread (at most 2 s)."""
        with _HUBS_LOCK:
            self.users -= 1
            if self.users > 0:
                return
            if _HUBS.get(self._name) is self:
                del _HUBS[self._name]
        with self._lock:
            self._stop = True
            thread = self._thread
        self._interrupt()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        self.connection.close()

    @property
    def live(self) -> bool:
        """Whether a stream is open (events reach the waiters)."""
        return self._live.is_set()

    def register(self, keys: List[bytes]) -> Waiter:
        """A waiter for `keys`, registered (its events recorded from now on); starts the stream if needed."""
        waiter = Waiter(keys)
        with self._lock:
            for key in set(keys):
                self._waiters.setdefault(key, set()).add(waiter)
            self._count += 1
            if self._thread is None and not self._stop:
                self._live.clear()
                self._thread = threading.Thread(target=self._run, name="mep-etcd-watch", daemon=True)
                self._thread.start()
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        with self._lock:
            for key in set(waiter.keys):
                found = self._waiters.get(key)
                if found is not None:
                    found.discard(waiter)
                    if not found:
                        del self._waiters[key]
            self._count -= 1

    def settle(self, waiter: Waiter, present: List[bool], revision: int) -> bool:
        """Take the waiter's read (`present` per key, at `revision`) and the events newer than it.

        Returns:
            True when every key is present.
        """
        with self._lock:
            waiter.missing = {key for key, there in zip(waiter.keys, present) if not there}
            for key, (seen, there) in waiter.seen.items():
                if seen > revision:
                    (waiter.missing.discard if there else waiter.missing.add)(key)
            waiter.revision, waiter.seen, waiter.stale = revision, {}, False
            if waiter.missing:
                waiter.done.clear()
                return False
            return True

    def unsettle(self, waiter: Waiter) -> None:
        """The waiter reads again: record events from now on (as before its first read)."""
        with self._lock:
            waiter.revision, waiter.seen, waiter.stale = None, {}, False
            waiter.done.clear()

    def wait_live(self, seconds: float) -> bool:
        """Whether a stream is open within `seconds`."""
        return self._live.wait(max(seconds, 0.0))

    # ------------------------------------------------------------------ events
    def _hand_out(self, key: bytes, revision: int, present: bool) -> None:
        for waiter in self._waiters.get(key, ()):
            if waiter.revision is None:
                if revision > waiter.seen.get(key, (0, False))[0]:
                    waiter.seen[key] = (revision, present)
            elif revision > waiter.revision:
                if present:
                    waiter.missing.discard(key)
                    if not waiter.missing:
                        waiter.done.set()
                else:
                    waiter.missing.add(key)

    def _wake_all(self) -> None:
        """Every waiter reads again (the stream was re-created with a gap)."""
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.stale = True
                waiter.done.set()

    def _handle(self, message: dict) -> bool:
        """Take one message of the stream; False when the stream must be opened again."""
        if "error" in message:
            raise ConnectionError(f"watch stream error: {str(message['error'])[:200]}")
        result = message.get("result") or {}
        header = int((result.get("header") or {}).get("revision", 0) or 0)
        if int(result.get("compact_revision", 0) or 0) > 0:
            with self._lock:
                self._last = None  # compacted past what we saw: start from the present, everyone reads again
            return False
        if result.get("canceled"):
            return False
        if result.get("created"):
            with self._lock:
                if self._last is None:
                    self._last = header  # events after it come on this stream; earlier ones: read again
                    self._wake_all()
            self._live.set()
            return True
        events = result.get("events") or []
        with self._lock:
            newest = self._last or 0
            for event in events:
                kv = event.get("kv") or {}
                revision = int(kv.get("mod_revision", 0) or 0)
                self._hand_out(unb64(kv.get("key")), revision, event.get("type") != "DELETE")
                newest = max(newest, revision)
            self.events += len(events)
            if not events and header:
                newest = max(newest, header)  # a progress notification: nothing up to it is missing
            self._last = newest
        return True

    # ------------------------------------------------------------------ the stream
    def _interrupt(self) -> None:
        response = self._response
        if response is None:
            return
        try:  # wakes the thread blocked reading it (a close() would not)
            response.raw.connection.sock.shutdown(socket.SHUT_RDWR)
        except Exception:  # noqa: BLE001 - the stream is gone already
            pass

    def _stream(self, session) -> None:
        """Open one stream on the current member and read it until it ends (raises on failures)."""
        import requests

        host, port = self.connection.endpoints[self._index]
        request = {"key": b64(self.start), "range_end": b64(self.end), "progress_notify": True}
        with self._lock:
            if self._last is not None:
                request["start_revision"] = self._last + 1
        # etcd's require-leader metadata (clientv3.WithRequireLeader): a member without a leader refuses the stream,
        # and cancels an open one ("no leader") a few election timeouts after it lost it, instead of keeping it open
        # and silent (an isolated member applies nothing); the stream then moves on to the next member.
        headers = {"Grpc-Metadata-Hasleader": "true"}
        if self.connection.user is not None:
            headers["Authorization"] = self.connection.token(time.monotonic() + self.connection.request_s, "watch")
        url = f"{'https' if self.connection.secure else 'http'}://{host}:{port}/v3/watch"
        response = session.post(url, json={"create_request": request}, headers=headers, stream=True,
                                timeout=(self.connection.request_s, IDLE_S))
        self._response = response
        try:
            if self._stop:
                return
            if response.status_code != 200:
                raise ConnectionError(f"watch: HTTP {response.status_code} {response.text[:200]}")
            self.streams += 1
            buffer = b""
            try:
                for chunk in response.iter_content(chunk_size=None):
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip() and not self._handle(json.loads(line)):
                            return
                    if self._stop:
                        return
            except requests.exceptions.ConnectionError as error:  # a read timeout: silent for IDLE_S
                if "timed out" not in str(error).lower() and "timeout" not in type(error).__name__.lower():
                    raise
                if not self._live.is_set():
                    raise  # never created: the member does not answer
        finally:
            self._response = None
            self._live.clear()
            response.close()

    def _run(self) -> None:
        import requests

        session = requests.Session()
        if self.connection.secure:
            session.verify = self.connection.ca_cert or True
            if self.connection.cert:
                session.cert = (self.connection.cert, self.connection.key)
        failures = 0
        try:
            while True:
                with self._lock:
                    if self._stop or self._count == 0 and failures == 0 and self.streams > 0:
                        self._thread = None
                        self._last = None  # the next thread starts from the present (its waiters read again)
                        return  # closed, or idle (the next waiter starts a new thread)
                try:
                    self._stream(session)
                    failures = 0
                except Exception:  # noqa: BLE001 - the member is down, stalled or refused: the next one
                    failures += 1
                    self._index = (self._index + 1) % len(self.connection.endpoints)
                    if failures % len(self.connection.endpoints) == 0:
                        time.sleep(0.05)  # a full round failed: a breath
        finally:
            self._live.clear()
            session.close()
