"""`BoundedStore.close()` (called by `Buffer.destroy()`) leaves no store worker thread behind.

A fresh-clone CI run once found a soak rank with one Python thread more after destroy() than before
the Buffer: close() woke the idle workers but did not wait for them, so a sample taken right after
could still see one. close() now joins them, bounded: a worker still waiting for a stalled store is
waited for at most `join_s` seconds.
"""
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore, store_deadline
from mooncake_ep_switch.errors import StoreUnavailable


def _workers(store: BoundedStore):
    return [t for t in threading.enumerate() if t.name.startswith(f"mep-store-{store.name}")]


@pytest.mark.parametrize("calls", [1, 5])
def test_close_ends_every_worker_before_it_returns(calls):
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store = BoundedStore(host)
    for index in range(calls):
        store.set(f"k{index}", b"v")
        assert store.get(f"k{index}") == b"v"
    assert _workers(store), "a call runs on a worker thread"
    store.close()
    assert _workers(store) == []
    assert store.get("k0") == b"v"  # a later call starts a new worker
    store.close(join_s=1.0)
    assert _workers(store) == []


class _StalledStore(dist.Store):
    """A store whose `get` blocks until released (a host that stopped answering)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.url = f"stalled-{id(self)}"

    def get(self, key):
        self.release.wait(30)
        return b"late"


def test_close_waits_for_a_stalled_call_at_most_join_s():
    inner = _StalledStore()
    store = BoundedStore(inner)
    with pytest.raises(StoreUnavailable):
        with store_deadline(time.monotonic() + 0.2, "a test"):
            store.get("k")
    started = time.monotonic()
    store.close(join_s=0.3)
    assert time.monotonic() - started < 0.3 + 1.0  # bounded by join_s, not by the stalled call
    inner.release.set()  # the host answers: the abandoned worker ends
    deadline = time.monotonic() + 10
    while _workers(store) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _workers(store) == []


def test_an_idle_worker_keeps_running_for_the_next_call_until_close():
    """Issue 40: an idle lane's worker stays (a group's next membership change finds it running: with ranks as
    threads, restarting every rank's workers at once cost ~0.4 s of a view change at R=256); close() ends it."""
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store = BoundedStore(host)
    try:
        store.set("idle", b"v")
        workers = _workers(store)
        assert workers, "a call runs on a worker thread"
        until = time.monotonic() + 3.0  # longer than the 2 s after which an idle worker used to end
        while time.monotonic() < until:
            assert all(t.is_alive() for t in workers), "an idle worker ended"
            time.sleep(0.05)
        assert store.get("idle") == b"v" and _workers(store) == workers  # the same workers made it
    finally:
        store.close()
    assert _workers(store) == []
