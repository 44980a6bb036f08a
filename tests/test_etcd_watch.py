"""EtcdStore waits on the process's one watch stream (issues 38 and 40), against the session's real
3-member etcd cluster (`etcd_cluster` in conftest.py).

A wait reads its keys once and is then woken by the stream, not by polling (the client's requests are
counted); the stream survives the kill of the member it reads from and a compaction of the revision
it resumes at; waits end at their timeout; stores of one prefix share one stream thread, which ends
with the last store's close().
"""
import os
import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore
from mooncake_ep_switch.elastic import connect_store
from mooncake_ep_switch.store import etcd_store
from tests import harness

SLACK_S = 2.0  # scheduling slack on a loaded 2-core box


def _store(cluster, prefix=None):
    return connect_store(cluster.url(prefix or f"w-{uuid.uuid4().hex[:10]}") + "?request_s=1", timeout_s=20,
                         job="watch-tests")


def _requests(store, monkeypatch) -> list:
    """The paths of the requests `store` makes from now on."""
    made, real = [], store.connection.call

    def call(path, *args, **kwargs):
        made.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store.connection, "call", call)
    return made


def _watch_threads():
    return [t for t in threading.enumerate() if t.name == "mep-etcd-watch"]


def _set_later(store, key, seconds):
    setter = threading.Timer(seconds, lambda: store.set(key, b"v"))
    setter.start()
    return setter


def test_a_wait_is_woken_by_the_watch_not_by_polling(etcd_cluster, monkeypatch):
    store, writer = _store(etcd_cluster), None
    try:
        writer = _store(etcd_cluster, store.prefix)
        made = _requests(store, monkeypatch)
        setter = _set_later(writer, "late", 1.0)
        start = time.monotonic()
        store.wait(["late"], timedelta(seconds=10))
        took = time.monotonic() - start
        setter.join()
        assert 0.9 <= took < 1.0 + SLACK_S
        # One read, one more when the stream was first created (it may have missed an event before): a polling
        # wait reads every 50 ms (20 reads a second).
        assert len(made) <= 3, made
        made.clear()
        # get and multi_get wait the same way; the timeouts stay exact.
        setter = _set_later(writer, "later", 0.5)
        assert store.get("later") == b"v" and store.multi_get(["later", "late"]) == [b"v", b"v"]
        setter.join()
        assert len(made) <= 4, made
        for seconds in (0.2, 0.6):
            start = time.monotonic()
            with pytest.raises(dist.DistStoreError, match=r"etcd://.*timed out after .* keys \['missing'\]"):
                store.wait(["missing"], timedelta(seconds=seconds))
            assert seconds <= time.monotonic() - start < seconds + SLACK_S
        # A KeyWait on the runtime's wrapper waits in the background on the stream (no check per poll).
        bounded = BoundedStore(dist.PrefixStore("grp", store))
        try:
            waiter = KeyWait(bounded, ["k"], 20)
            assert waiter.background and waiter.poll(0.2) is None
            made.clear()
            writer.set("grp/k", b"1")
            deadline = time.monotonic() + 5 + SLACK_S
            while waiter.poll(0.1) is None:
                assert time.monotonic() < deadline
            assert waiter.poll(0) is True and len(made) <= 1, made
        finally:
            bounded.close()
    finally:
        store.close()
        if writer is not None:
            writer.close()


def test_the_stream_survives_the_kill_of_its_member(etcd_cluster):
    store, writer = _store(etcd_cluster), None
    try:
        writer = _store(etcd_cluster, store.prefix)
        setter = _set_later(writer, "first", 0.3)
        store.wait(["first"], timedelta(seconds=10))
        setter.join()
        hub = store._watch
        assert hub.live and hub.events >= 1
        victim = hub._index
        etcd_cluster.kill(victim)
        try:
            before = hub.events
            setter = _set_later(writer, "after", 0.3)
            start = time.monotonic()
            store.wait(["after"], timedelta(seconds=20))
            setter.join()
            # A kill may cost an election (~0.5-1 s on the session's cluster) and the writer's failover.
            assert time.monotonic() - start < 3 + SLACK_S
            assert hub.events > before and hub._index != victim and hub.live, "woken by the stream on another member"
        finally:
            etcd_cluster.restart(victim)
    finally:
        store.close()
        if writer is not None:
            writer.close()


def test_a_stream_that_delivers_nothing_does_not_hold_a_wait_to_its_timeout(etcd_cluster):
    """A stream can be open and deliver nothing: its member far behind the others, or without a leader (an isolated
    member accepts a watch and applies nothing). Seen once in CI beside 2 CPU hogs: a ballot's wait for done/<e>
    ran to its 15 s deadline on one rank while the others, woken at once, decided in 0.3 s. A wait reads its keys
    again every `_RECHECK_S` (here: the stream stays open, its events are dropped)."""
    store, writer = _store(etcd_cluster), None
    try:
        writer = _store(etcd_cluster, store.prefix)
        store.set("first", b"1")
        store.wait(["first"], timedelta(seconds=10))
        hub = store._watch
        hub._hand_out = lambda key, revision, present: None  # the stream stays open; no event of it ever comes
        setter = _set_later(writer, "late", 0.3)
        start = time.monotonic()
        store.wait(["late"], timedelta(seconds=20))
        took = time.monotonic() - start
        setter.join()
        assert took < etcd_store._RECHECK_S + SLACK_S, f"woken after {took:.1f} s: the stream alone was trusted"
        assert hub.streams >= 1 and hub.events >= 1
    finally:
        store.close()
        if writer is not None:
            writer.close()


def test_the_stream_leaves_a_member_without_a_leader(etcd_cluster):
    """The other two members stopped: the stream's member has no leader and applies nothing. It must not keep the
    stream (a plain etcd watch stays open and silent there, and is re-created there each time it is quiet): the hub
    asks for a member with a leader (etcd's require-leader metadata), which refuses or cancels the stream, so it
    moves on to the next member."""
    store, others, waiting = _store(etcd_cluster), [], None
    try:
        store.set("a", b"1")
        store.wait(["a"], timedelta(seconds=10))
        hub = store._watch
        member = hub._index
        waiter = store.clone()

        def wait_released():
            try:
                waiter.wait(["released"], timedelta(seconds=60))
            finally:
                waiter.close()

        waiting = threading.Thread(target=wait_released, daemon=True)
        waiting.start()  # a waiter keeps the stream's thread running
        others = [i for i in range(len(etcd_cluster.processes)) if i != member]
        for index in others:
            harness.stop_process(etcd_cluster.processes[index].pid)
        deadline = time.monotonic() + 15 + SLACK_S
        while hub._index == member:
            assert time.monotonic() < deadline, "the stream stayed on a member without a leader"
            time.sleep(0.02)
    finally:
        for index in others:
            os.kill(etcd_cluster.processes[index].pid, signal.SIGCONT)
        if waiting is not None:
            etcd_cluster.wait_healthy(range(len(etcd_cluster.processes)), 30.0)
            store.set("released", b"1")
            waiting.join(20)
            assert not waiting.is_alive()
        store.close()


def test_a_compacted_resume_revision_reads_again(etcd_cluster):
    store = _store(etcd_cluster)
    try:
        store.set("a", b"1")
        store.wait(["a"], timedelta(seconds=10))
        hub = store._watch
        for i in range(3):
            store.set(f"pad{i}", b"x")
        revision = int(store.connection.call("kv/range", {"key": "AA=="}, time.monotonic() + 10, "t")["header"]["revision"])
        store.connection.call("kv/compaction", {"revision": revision}, time.monotonic() + 10, "compact")
        waiting = threading.Thread(target=store.wait, args=(["b"], timedelta(seconds=20)))
        waiting.start()
        with hub._lock:
            hub._last = 1  # as a stream that lost its member long ago: its resume revision is compacted
        hub._interrupt()
        deadline = time.monotonic() + 5 + SLACK_S
        while not (hub.live and (hub._last or 0) >= revision):
            assert time.monotonic() < deadline, "the stream did not come back from the present"
            time.sleep(0.01)
        store.clone().set("b", b"2")
        waiting.join(5 + SLACK_S)
        assert not waiting.is_alive()
    finally:
        store.close()


def test_one_stream_thread_per_prefix_ended_by_close(etcd_cluster):
    before = len(_watch_threads())
    prefix = f"w-{uuid.uuid4().hex[:10]}"
    stores = [_store(etcd_cluster, prefix) for _ in range(3)]
    stores[0].set("k", b"1")
    done = []
    threads = [threading.Thread(target=lambda s=s: done.append(s.wait(["k"], timedelta(seconds=10))))
               for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(done) == 3 and stores[0]._watch is stores[1]._watch is stores[2]._watch
    assert len(_watch_threads()) == before + 1
    stores[0].close()
    stores[1].close()
    assert len(_watch_threads()) == before + 1, "still used by the third store"
    stores[2].close()
    assert len(_watch_threads()) == before
    with pytest.raises(ValueError, match="is closed"):
        stores[2].wait(["k"], timedelta(seconds=1))


def test_contended_adds_apply_once_each(etcd_cluster, monkeypatch):
    """Threads adding to one key at once (a vote tally): every add applied once, each new value returned to
    exactly one caller, and no swap failed: a process's adds to one key go one at a time (R threads adding at
    once made O(R) failed swaps each: ~14 requests an add at R=64)."""
    prefix, threads_n, adds = f"w-{uuid.uuid4().hex[:10]}", 8, 5
    stores = [_store(etcd_cluster, prefix) for _ in range(threads_n)]
    made = [_requests(store, monkeypatch) for store in stores]
    got, errors = [], []
    start = threading.Barrier(threads_n)

    def add(store):
        try:
            start.wait(10)
            for _ in range(adds):
                got.append(int(store.add("tally", 1)))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    workers = [threading.Thread(target=add, args=(s,)) for s in stores]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    try:
        assert not errors and sorted(got) == list(range(1, threads_n * adds + 1)), (errors, sorted(got))
        txns = sum(paths.count("kv/txn") for paths in made)
        assert stores[0].get("tally") == str(threads_n * adds).encode()
        assert txns <= 2 * threads_n * adds, "each add: at most one snapshot read and one swap that succeeded " \
            "(adds waiting together share one swap)"
    finally:
        for store in stores:
            store.close()


def test_a_background_read_keeps_the_stores_timeout(etcd_cluster):
    """KeyWait(read=True) on the runtime's wrapper of an EtcdStore: the read waits on the stream and returns the
    values, and the store (shared with the caller's other calls: there is no clone of an EtcdStore) keeps its own
    timeout (the TCPStore's wait lane sets its clone's timeout to the wait's)."""
    store, writer = _store(etcd_cluster), None
    bounded = BoundedStore(store)
    try:
        writer = _store(etcd_cluster, store.prefix)
        waiter = KeyWait(bounded, ["r"], 0.7, read=True)
        assert waiter.background and waiter.poll(0.1) is None
        writer.set("r", b"value")
        deadline = time.monotonic() + 5 + SLACK_S
        while waiter.poll(0.1) is None:
            assert time.monotonic() < deadline
        assert waiter.values() == [b"value"]
        assert store.timeout == timedelta(seconds=20), "a wait's timeout became every later call's"
    finally:
        bounded.close()
        store.close()
        if writer is not None:
            writer.close()
