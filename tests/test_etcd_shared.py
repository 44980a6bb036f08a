"""Reads and puts of one process's threads sharing etcd requests (store/etcd_shared.py, issue 40), with fake
requests: a read joins only a request sent after it began (linearizable), readers arriving together share one
(each taking its own keys of it),
a failed shared request leaves each reader to read alone; puts pending while a post is in the air go out in one
transaction, never with a key twice, and a failed post leaves each caller to send its own (and get its error)."""
import threading
import time

import pytest

from mooncake_ep_switch.store import etcd_shared

from tests.harness import wait_until


class Gate:
    """A fake request that blocks until released, recording what it was sent."""

    def __init__(self, answers=None):
        self.sent, self.lock = [], threading.Lock()
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.fail = False
        self.answers = answers

    def __call__(self, payload=None):
        with self.lock:
            self.sent.append(payload)
            number = len(self.sent)
        self.entered.release()
        assert self.release.wait(30), "the test never released the request"
        if self.fail:
            raise ConnectionError("member down")
        return [number]


def _thread(results, key, fn, *args):
    def run():
        try:
            results[key] = fn(*args)
        except Exception as error:  # noqa: BLE001 - checked by the test
            results[key] = error
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _read(gate):
    """A fake read on `gate`: each key's value names the request that read it; the revision is its number."""
    def read(keys):
        number = gate(list(keys))[0]
        return [f"{key}@{number}" for key in keys], number
    return read


def test_readers_share_only_a_request_sent_after_they_began_each_taking_its_keys():
    gate, results = Gate(), {}
    name = ("read", object())
    deadline = time.monotonic() + 60
    first = _thread(results, 0, etcd_shared.shared_read, name, ["a"], _read(gate), deadline, 30.0)
    assert gate.entered.acquire(timeout=30)  # request 1 is in the air
    later = [_thread(results, r, etcd_shared.shared_read, name, keys, _read(gate), deadline, 30.0)
             for r, keys in ((1, ["a"]), (2, ["b", "a"]), (3, ["c"]))]
    wait_until(lambda: etcd_shared._SLOTS[name].next is not None and etcd_shared._SLOTS[name].next.readers == 3)
    gate.release.set()
    for thread in [first] + later:
        thread.join(30)
    # Reader 0 got request 1; the three that began while it was in the air got request 2 (one read of all their
    # keys at one revision), not request 1's answer.
    assert results == {0: (["a@1"], 1), 1: (["a@2"], 2), 2: (["b@2", "a@2"], 2), 3: (["c@2"], 2)}
    assert gate.sent == [["a"], ["a", "b", "c"]] and name not in etcd_shared._SLOTS


def test_a_failed_shared_read_leaves_each_reader_to_read_alone():
    gate, results = Gate(), {}
    name = ("read", object())
    deadline = time.monotonic() + 60
    first = _thread(results, 0, etcd_shared.shared_read, name, ["a"], _read(gate), deadline, 30.0)
    assert gate.entered.acquire(timeout=30)
    gate.fail = True
    second = _thread(results, 1, etcd_shared.shared_read, name, ["a"], _read(gate), deadline, 30.0)
    third = _thread(results, 2, etcd_shared.shared_read, name, ["b"], _read(gate), deadline, 30.0)
    wait_until(lambda: etcd_shared._SLOTS[name].next is not None and etcd_shared._SLOTS[name].next.readers == 2)
    gate.release.set()
    for thread in (first, second, third):
        thread.join(30)
    assert all(isinstance(results[r], ConnectionError) for r in range(3))
    assert len(gate.sent) == 3  # request 1, request 2 (shared by two, failed), then its joiner's own


def _put(key, value="v"):
    return {"request_put": {"key": key, "value": value}}


def test_puts_pending_during_a_post_go_out_together_without_a_key_twice():
    gate, results = Gate(), {}
    name = ("puts", object())
    deadline = time.monotonic() + 60
    first = _thread(results, 0, etcd_shared.shared_write, name, [_put("a")], gate, deadline)
    assert gate.entered.acquire(timeout=30)  # post 1 ([a]) in the air
    more = [_thread(results, 1, etcd_shared.shared_write, name, [_put("b"), _put("c")], gate, deadline),
            _thread(results, 2, etcd_shared.shared_write, name, [_put("d")], gate, deadline),
            _thread(results, 3, etcd_shared.shared_write, name, [_put("b", "again")], gate, deadline)]
    wait_until(lambda: etcd_shared._WRITES.waiting(name) == 3)
    assert all(thread.is_alive() for thread in more)  # none returns before its puts were applied
    gate.release.set()
    for thread in [first] + more:
        thread.join(30)
    assert results == {0: None, 1: None, 2: None, 3: None}
    keys = [[put["request_put"]["key"] for put in sent] for sent in gate.sent]
    assert keys == [["a"], ["b", "c", "d"], ["b"]]  # "b" twice: its second put waits for the next transaction
    assert not etcd_shared._WRITES.has(name)


def test_a_failed_post_leaves_each_caller_to_send_its_own_and_get_its_error():
    gate, results = Gate(), {}
    name = ("puts", object())
    deadline = time.monotonic() + 60
    first = _thread(results, 0, etcd_shared.shared_write, name, [_put("a")], gate, deadline)
    assert gate.entered.acquire(timeout=30)
    gate.fail = True
    second = _thread(results, 1, etcd_shared.shared_write, name, [_put("b")], gate, deadline)
    wait_until(lambda: etcd_shared._WRITES.waiting(name) == 1)
    gate.release.set()
    first.join(30), second.join(30)
    assert isinstance(results[0], ConnectionError) and isinstance(results[1], ConnectionError)
    keys = [[put["request_put"]["key"] for put in sent] for sent in gate.sent]
    assert sorted(map(tuple, keys)) == [("a",), ("a",), ("b",), ("b",)]  # each post, then each caller alone
    with pytest.raises(ValueError, match="at most 128"):
        etcd_shared.shared_write(name, [_put(str(k)) for k in range(129)], gate, deadline)
