"""Readiness posts of one process's ranks sent together (issue 40, membership/combined_posts.py): a caller alone
sends its own post at once; posts made while others are in the air go out in one `multi_set`; a failed post leaves
each caller to send its own (raising its own error)."""
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake_ep_switch.buffer.membership import combined_posts
from mooncake_ep_switch.buffer.membership.beats import destination
from mooncake_ep_switch.buffer.membership.combined_posts import post_combined
from tests import harness


class _Gated(dist.Store):
    """A store (over `inner`) that records each `multi_set` and holds each until `gate` is set; `fail` makes a
    multi_set of more than one caller's keys raise."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.gate = threading.Event()
        self.calls = []
        self.fail = False
        self.lock = threading.Lock()

    def multi_set(self, keys, values):
        with self.lock:
            self.calls.append(sorted(keys))
        self.gate.wait(30)
        if self.fail and len(keys) > 2:
            raise RuntimeError("batch refused")
        return self.inner.multi_set(keys, values)

    def multi_get(self, keys):
        return self.inner.multi_get(keys)


@pytest.fixture(name="server")
def _server():
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield host


def _post_all(store, names):
    errors = {}

    def run(name):
        try:
            post_combined(store, [f"{name}/ready", f"{name}/alive"], [name.upper(), "1"])
        except Exception as error:  # noqa: BLE001 - reported
            errors[name] = error

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for thread in threads[:2]:  # the first alone (its own post at once), the second sends the queue's first post
        thread.start()
        harness.wait_until(lambda count=threads.index(thread) + 1: len(store.calls) == count)  # in the air
    for thread in threads[2:]:
        thread.start()
    harness.wait_until(lambda: combined_posts._POSTS.waiting(destination(store)) == len(names) - 2)
    store.gate.set()
    for thread in threads:
        thread.join(30)
    return errors


def test_posts_made_while_one_is_in_the_air_go_out_in_one_multi_set(server):
    store = _Gated(server)
    assert _post_all(store, ["a", "b", "c", "d"]) == {}
    assert store.calls == [["a/alive", "a/ready"], ["b/alive", "b/ready"],
                           ["c/alive", "c/ready", "d/alive", "d/ready"]], store.calls
    assert list(server.multi_get(["a/ready", "b/ready", "c/ready", "d/ready", "d/alive"])) == [b"A", b"B", b"C", b"D",
                                                                                           b"1"]


def test_a_failed_combined_post_leaves_each_caller_to_send_its_own(server):
    store = _Gated(server)
    store.fail = True  # a post of more than one caller's keys raises
    assert _post_all(store, ["d", "e", "f", "g"]) == {}  # f's and g's post failed: each sent its own, which landed
    assert store.calls[:3] == [["d/alive", "d/ready"], ["e/alive", "e/ready"],
                               ["f/alive", "f/ready", "g/alive", "g/ready"]], store.calls
    assert sorted(store.calls[3:]) == [["f/alive", "f/ready"], ["g/alive", "g/ready"]], store.calls
    assert list(server.multi_get(["d/ready", "e/ready", "f/ready", "g/ready"])) == [b"D", b"E", b"F", b"G"]


def test_posts_with_a_key_twice_or_values_missing_are_refused_before_anything_is_sent(server):
    store = _Gated(server)
    store.gate.set()
    post_combined(store, ["alone/ready"], ["R"])  # alone: its own post at once
    assert store.calls == [["alone/ready"]] and server.get("alone/ready") == b"R"
    store.calls.clear()
    with pytest.raises(ValueError, match="keys, values: expected as many values as keys, no key twice"):
        post_combined(store, ["x", "x"], ["1", "2"])
    with pytest.raises(ValueError, match="got 2 keys .2 distinct. and 1 values"):
        post_combined(store, ["x", "y"], ["1"])
    assert store.calls == []
