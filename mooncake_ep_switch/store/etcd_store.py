"""`EtcdStore`: a `torch.distributed.Store` kept by an etcd v3 cluster (no single point of failure).

The membership records, join tickets, switch decisions and EPLB ballots that the runtime keeps in
the launcher's TCPStore can live in an etcd cluster instead, which survives the loss of any member
while a quorum remains. `EtcdStore` subclasses torch's Store, so `PrefixStore`, `BoundedStore` and
gloo's rendezvous take it as they take a TCPStore (keep a reference to it: torch's wrappers hold
only its C++ half).

Keys live under `<prefix>/k/` of one job's prefix (`num_keys` counts those); `<prefix>/owner` names
the job that claimed the prefix (`connect.connect_etcd`), `<prefix>/ops/` holds the results of
recent `add`/`append` calls under a lease (so a call retried after a lost answer returns its first
result instead of applying twice). Every operation is one etcd transaction, or a loop of
compare-and-swap transactions on the key's revision (`add`, `append`), hence atomic; reads are
linearizable (etcd's default). `get`, `wait` and `multi_get` wait for their keys up to the timeout,
then raise `DistStoreError` as a TCPStore does: one read, then the events of the process's one watch
stream of the prefix (`etcd_watch.WatchHub`, shared by every store of the prefix and cluster in the
process); polling (1 ms, doubling to 50 ms) only while no stream is open. `close()` releases it. A request
that meets a dead or leaderless member goes to the next one (`etcd_client.EtcdConnection`); with no
member answering, `StoreUnavailable` names the store when the operation's timeout passes. The threads of
one process (ranks as threads) share requests: reads made at once go out as one read of all their keys,
puts as one transaction, `add`/`append`s of one key as one swap (`etcd_shared`, `_update`).
"""
import random
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from mooncake_ep_switch.errors import StoreRefused, StoreUnavailable
from mooncake_ep_switch.store.combining import Combiner, Waiting
from mooncake_ep_switch.store.etcd_client import EtcdConnection, b64, unb64
from mooncake_ep_switch.store.etcd_shared import shared_read, shared_write
from mooncake_ep_switch.store.etcd_watch import WatchHub, hub_for

__all__ = ["EtcdStore"]

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
_POLL_MAX_S = 0.05
_CAS_PAUSE_MAX_S = 0.05  # the longest pause after a failed compare-and-swap of add/append
_MAX_CHANGES = 60  # add/append calls applied in one swap (2 + 2 per call operations: under etcd's 128 per transaction)


class _Change(Waiting):
    """One add/append call waiting to be applied (by whichever thread of the process swaps the key)."""

    def __init__(self, change, deadline: float):
        super().__init__(deadline)
        self.change = change
        self.value: bytes = b""


_CHANGES = Combiner()  # (cluster, key) -> this process's add/append calls on it
_SLICE_S = 0.5  # a watched wait looks at the stream's health this often (no store operation)
_LAST_READ_S = 2.0  # a wait's read made at or past its timeout still gets this long (then: the timeout error); more
# than etcd's 1 s election timeout and the stalls of a loaded host (a read of a 0.3 s wait got no answer in 1 s once)
_RECHECK_S = 2.0  # a watched wait reads its keys again this often: a stream can be open and deliver nothing (its
# member far behind the cluster, or without a leader until etcd cancels the stream), and the read fails over


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of every key starting with `prefix` (its last byte + 1)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _range_result(response: Dict[str, Any]) -> List[Dict[str, Any]]:
    return response.get("response_range", {}).get("kvs", []) or []


class EtcdStore(dist.Store):
    """A `torch.distributed.Store` whose keys live in an etcd v3 cluster under one job's prefix.

    Build it with `elastic.connect_store("etcd://h1:2379,h2:2379,h3:2379/prefix")`, which checks the
    cluster and claims the prefix for the job; the constructor itself sends nothing.

    Arguments:
        connection: the cluster (`etcd_client.EtcdConnection`: endpoints, credentials, TLS).
        prefix: the job's key prefix (non-empty, no leading or trailing "/").
        timeout: default timeout of every operation (as a TCPStore's `timeout`).
    """

    waits_cheaply = True  # a blocked wait costs no store operation (a watch): BoundedStore may run it in the background

    def __init__(self, connection: EtcdConnection, prefix: str, timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.connection = connection
        self.prefix = prefix
        self.url = f"{connection.name}/{prefix}"
        self._keys = f"{prefix}/k/".encode()
        self.owner_key = f"{prefix}/owner".encode()
        self._ops = f"{prefix}/ops/".encode()
        self.reads = 0  # reads made (tests, diagnostics)
        self._hub_lock = threading.Lock()
        self._watch: Optional[WatchHub] = None  # the process's watch stream of this prefix, acquired at the first wait
        self._closed = False
        super().set_timeout(timeout)

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r})"

    # ------------------------------------------------------------------ plumbing
    def _timeout_s(self, timeout: Optional[timedelta] = None) -> float:
        value = (timeout if timeout is not None else self.timeout).total_seconds()
        return value if value > 0 else 300.0

    def _key(self, key: str) -> bytes:
        return self._keys + _bytes(key)

    def _txn(self, compare: List[Dict[str, Any]], success: List[Dict[str, Any]], failure: List[Dict[str, Any]],
             deadline: float, what: str) -> Dict[str, Any]:
        return self.connection.call("kv/txn", {"compare": compare, "success": success, "failure": failure},
                                    deadline, what)

    def _read(self, keys: Sequence[str], deadline: float, what: str, count_only: bool = False) -> List[Optional[bytes]]:
        """Values of `keys` (None where missing), read at one revision."""
        return self._read_at(keys, deadline, what, count_only)[0]

    def _read_at(self, keys: Sequence[str], deadline: float, what: str,
                 count_only: bool = False) -> Tuple[List[Optional[bytes]], int]:
        """Values of `keys` (None where missing) and the revision they were read at: one request, which the
        reads of other threads of this process may share (`etcd_shared`: ranks as threads that wait for the
        same key, or read their peers' records, read at once)."""
        self.reads += 1
        return shared_read((self.connection.name, self._keys, count_only), list(keys),
                           lambda asked: self._read_alone(asked, deadline, what, count_only), deadline,
                           self.connection.request_s)

    def _read_alone(self, keys: List[str], deadline: float, what: str,
                    count_only: bool) -> Tuple[List[Optional[bytes]], int]:
        out: List[Optional[bytes]] = []
        revision = None
        for start in range(0, len(keys), MAX_TXN_OPS):
            ranges = []
            for key in keys[start:start + MAX_TXN_OPS]:
                request = {"key": b64(self._key(key))}
                if count_only:
                    request["count_only"] = True
                if revision is not None:
                    request["revision"] = revision
                ranges.append({"request_range": request})
            reply = self._txn([], ranges, [], deadline, what)
            if revision is None:
                revision = reply.get("header", {}).get("revision")
            for response in reply.get("responses", []):
                if count_only:
                    out.append(b"" if int(response.get("response_range", {}).get("count", 0) or 0) else None)
                else:
                    kvs = _range_result(response)
                    out.append(unb64(kvs[0].get("value")) if kvs else None)
        return out, int(revision or 0)

    def _hub(self) -> WatchHub:
        with self._hub_lock:
            if self._closed:
                raise ValueError(f"the etcd store {self.url} is closed")
            if self._watch is None:
                self._watch = hub_for(self.connection, self._keys, _prefix_end(self._keys))
            return self._watch

    def _wait_for(self, keys: Sequence[str], timeout_s: float, what: str) -> None:
        """Return once every key of `keys` exists; `DistStoreError` after `timeout_s`.

        The keys are read once after registering with the process's watch stream (`etcd_watch`), then
        their events wake the wait; while no stream is open (no member answers it) the keys are polled
        (1 ms, doubling to 50 ms). An open stream is not trusted alone: the keys are read again every
        `_RECHECK_S` (a stream's member can lag or lose its leader while the others decide; the read fails
        over to a member that answers). A read at or past the timeout still gets `_LAST_READ_S`.
        """
        deadline = time.monotonic() + timeout_s
        hub = self._hub()
        names = [self._key(key) for key in keys]
        waiter = hub.register(names)
        pause, final = 0.001, False
        try:
            while True:
                found, revision = self._read_at(keys, max(deadline, time.monotonic() + _LAST_READ_S), what,
                                                count_only=True)
                if hub.settle(waiter, [value is not None for value in found], revision):
                    return
                recheck = time.monotonic() + _RECHECK_S
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 and not final:
                        final = True  # a last read (a stream that stalls for a while is not trusted with a no)
                        break
                    if left <= 0:
                        missing = [k for k, name in zip(keys, names) if name in waiter.missing]
                        raise dist.DistStoreError(f"the etcd store {self.url}: {what} timed out after "
                                                  f"{timeout_s:.3g} s waiting for keys {missing}")
                    if hub.live:
                        if waiter.done.wait(max(0.0, min(left, _SLICE_S, recheck - time.monotonic()))):
                            if not waiter.stale and not waiter.missing:
                                return
                            break  # the stream was re-created with a gap: read again
                        if hub.live and time.monotonic() < recheck:
                            continue
                    else:
                        hub.wait_live(min(left, pause))
                        pause = min(pause * 2, _POLL_MAX_S)
                    break  # no stream (or it just failed), or time to look past the stream: read again
                hub.unsettle(waiter)
        finally:
            hub.unregister(waiter)

    def close(self) -> None:
        """Release this store's share of the process's watch stream (the last one stops its thread) and
        this thread's HTTP sessions. Later waits raise ValueError."""
        with self._hub_lock:
            hub, self._watch, self._closed = self._watch, None, True
        if hub is not None:
            hub.release()
        self.connection.close()

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key, value) -> None:
        """Set `key` to `value` (str or bytes)."""
        deadline = time.monotonic() + self._timeout_s()
        self._puts([{"request_put": {"key": b64(self._key(key)), "value": b64(_bytes(value))}}], deadline, "set")

    def _puts(self, puts: List[Dict[str, Any]], deadline: float, what: str) -> None:
        """Apply `puts` in one transaction, which the puts of this process's other threads may share
        (`etcd_shared.shared_write`: ranks as threads posting at once)."""
        shared_write((self.connection.name, self._keys), puts,
                     lambda operations: self._txn([], operations, [], deadline, what), deadline)

    def get(self, key) -> bytes:
        """The value of `key`, waiting up to the store's timeout for it to be set.

        Raises:
            DistStoreError: the key was not set within the timeout.
        """
        timeout_s = self._timeout_s()
        deadline = time.monotonic() + timeout_s
        while True:
            value = self._read([key], max(deadline, time.monotonic() + _LAST_READ_S), "get")[0]
            if value is not None:
                return value
            try:
                self._wait_for([key], max(deadline - time.monotonic(), 0.0), "get")
            except dist.DistStoreError:
                raise dist.DistStoreError(f"the etcd store {self.url}: get timed out after {timeout_s:.3g} s "
                                          f"waiting for key {key!r}") from None

    def check(self, keys) -> bool:
        """True when every key of `keys` is set (no wait)."""
        deadline = time.monotonic() + self._timeout_s()
        return all(value is not None for value in self._read(list(keys), deadline, "check", count_only=True))

    def wait(self, keys, timeout: Optional[timedelta] = None) -> None:
        """Wait until every key of `keys` is set, up to `timeout` (the store's timeout by default).

        Raises:
            DistStoreError: a key was still missing at the timeout.
        """
        self._wait_for(list(keys), self._timeout_s(timeout), "wait")

    def multi_get(self, keys) -> List[bytes]:
        """The values of `keys`, read at one revision once every one is set (waits as `get`)."""
        keys = list(keys)
        timeout_s = self._timeout_s()
        deadline = time.monotonic() + timeout_s
        while True:
            values = self._read(keys, max(deadline, time.monotonic() + _LAST_READ_S), "multi_get")
            if all(value is not None for value in values):  # usually at once: one transaction
                return values  # type: ignore[return-value]
            self._wait_for([k for k, v in zip(keys, values) if v is None], max(deadline - time.monotonic(), 0.0),
                           "multi_get")

    def multi_set(self, keys, values) -> None:
        """Set every key of `keys` to its value, in one transaction (per 128 keys)."""
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(f"values: expected {len(keys)} values (one per key), got {len(values)}")
        deadline = time.monotonic() + self._timeout_s()
        for start in range(0, len(keys), MAX_TXN_OPS):
            puts = [{"request_put": {"key": b64(self._key(k)), "value": b64(_bytes(v))}}
                    for k, v in zip(keys[start:start + MAX_TXN_OPS], values[start:start + MAX_TXN_OPS])]
            self._puts(puts, deadline, "multi_set")

    def compare_set(self, key, expected, desired) -> bytes:
        """Set `key` to `desired` if its value is `expected` (or it is missing and `expected` is empty).

        Returns:
            the value after the call: `desired` when set, else the current value (`expected` when the
            key is missing and `expected` is not empty, as a TCPStore answers).
        """
        expected, desired = _bytes(expected), _bytes(desired)
        deadline = time.monotonic() + self._timeout_s()
        name = b64(self._key(key))
        put = [{"request_put": {"key": name, "value": b64(desired)}}]
        read = [{"request_range": {"key": name}}]
        absent = [{"key": name, "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
        equal = [{"key": name, "result": "EQUAL", "target": "VALUE", "value": b64(expected)}]
        # A retried request whose first attempt was applied finds `desired` and returns it: success either way.
        while True:
            if not expected:
                reply = self._txn(absent, put, read, deadline, "compare_set")
                if reply.get("succeeded"):
                    return desired
                kvs = _range_result(reply["responses"][0])
                if kvs and unb64(kvs[0].get("value")):
                    return unb64(kvs[0].get("value"))
                # present with an empty value: compare that value below
            reply = self._txn(equal, put, read, deadline, "compare_set")
            if reply.get("succeeded"):
                return desired
            kvs = _range_result(reply["responses"][0])
            if kvs:
                return unb64(kvs[0].get("value"))
            if expected:
                return expected  # missing: a TCPStore answers `expected` (and sets nothing)
            # deleted between the two transactions: start again

    def _update(self, key: str, change, what: str) -> bytes:
        """Apply `change(old value or None) -> new value` atomically; the new value, applied once.

        A compare-and-swap loop on the key's revision. The threads of one process do not race each other's
        swaps (ranks as threads, all adding to a vote tally at once): their changes of one key
        wait in a queue, and the thread that finds none under way applies every waiting one in one swap
        (each change to the previous one's result, each caller answered with its own intermediate value,
        each with its own result marker), then the ones that came meanwhile. A failed swap reads the key and
        the markers again in the same transaction (one request per attempt), and the next attempt waits a
        random pause that doubles with each failure (up to `_CAS_PAUSE_MAX_S`), spreading the swaps of
        processes that contend.
        """
        mine = _Change(change, time.monotonic() + self._timeout_s())

        def apply(taken: List[Waiting]) -> None:
            for waiting, value in zip(taken, self._swap(key, [c.change for c in taken], what, mine.deadline)):
                waiting.value = value

        if not _CHANGES.submit((self.connection.name, self._key(key)), mine,
                               lambda pending: (pending[:_MAX_CHANGES], pending[_MAX_CHANGES:]), apply,
                               flight_grace_s=1.0):
            raise StoreUnavailable(
                f"the etcd store {self.url} did not answer {what}({key!r}) within {self._timeout_s():.3g} s: "
                f"another {what} of this process on the key is still unanswered", store=self.url,
                operation=what, timeout_s=self._timeout_s())
        if mine.error is not None:
            raise mine.error
        return mine.value

    def _swap(self, key: str, changes, what: str, deadline: float) -> List[bytes]:
        name = b64(self._key(key))
        markers = [b64(self._ops + uuid.uuid4().hex.encode()) for _ in changes]
        snapshot = [{"request_range": {"key": name}}] + [{"request_range": {"key": m}} for m in markers]
        reply = None
        failures = 0
        while True:
            try:
                # The key and the calls' result markers at one revision: an attempt whose answer was lost (sent
                # again, or applied late by a new leader) either left its markers here, or has the same guard as
                # the next attempt (the key unchanged since), so at most one of them applies.
                if reply is None:
                    reply = self._txn([], snapshot, [], deadline, what)
                kvs, *done = (_range_result(response) for response in reply["responses"])
                if done[0]:
                    return [unb64(found[0].get("value")) if found else b"" for found in done]
                value = unb64(kvs[0].get("value")) if kvs else None
                new = []
                for change in changes:
                    value = change(value)
                    new.append(value)
                guard = ({"key": name, "result": "EQUAL", "target": "MOD", "mod_revision": kvs[0]["mod_revision"]}
                         if kvs else {"key": name, "result": "EQUAL", "target": "CREATE", "create_revision": 0})
                lease = self.connection.lease(deadline, what)
                success = [{"request_put": {"key": name, "value": b64(new[-1])}}]
                success += [{"request_put": {"key": marker, "value": b64(result), "lease": lease}}
                            for marker, result in zip(markers, new)]
                reply = self._txn([guard], success, snapshot, deadline, what)
                if reply.get("succeeded"):
                    return new
                failures += 1  # another process changed it first: its snapshot is in `reply`
                time.sleep(random.uniform(0, min(_CAS_PAUSE_MAX_S, 0.0005 * 2 ** min(failures, 10))))
            except StoreRefused as error:
                if "lease not found" not in str(error):
                    raise
                self.connection.forget_lease()  # refused as a whole (nothing applied): a new lease, again
                reply = None

    def add(self, key, amount) -> int:
        """Add `amount` to the integer at `key` (0 when missing); the new value."""
        amount = int(amount)
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode(), "add"))

    def append(self, key, value) -> None:
        """Append `value` to the bytes at `key` (created when missing)."""
        value = _bytes(value)
        self._update(key, lambda old: (old or b"") + value, "append")

    def delete_key(self, key) -> bool:
        """Delete `key`; True when it existed."""
        deadline = time.monotonic() + self._timeout_s()
        reply = self.connection.call("kv/deleterange", {"key": b64(self._key(key))}, deadline, "delete_key")
        return int(reply.get("deleted", 0) or 0) > 0

    def num_keys(self) -> int:
        """Number of keys set under this store's prefix."""
        deadline = time.monotonic() + self._timeout_s()
        reply = self.connection.call("kv/range", {"key": b64(self._keys), "range_end": b64(_prefix_end(self._keys)),
                                                  "count_only": True}, deadline, "num_keys")
        return int(reply.get("count", 0) or 0)

    def has_extended_api(self) -> bool:
        """True: `append`, `multi_get`, `multi_set` are implemented."""
        return True

    def clone(self) -> "EtcdStore":
        """A store of the same cluster, prefix and timeout with HTTP sessions of its own."""
        return EtcdStore(EtcdConnection(**self.connection.options()), self.prefix, self.timeout)
