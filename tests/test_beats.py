"""Member beats of thread ranks posted together (membership/beats.py, issue 40): every beat lands with its own
rank's value, a beat made while another rank's post is under way rides on the next post of that rank (one
request for both), a rank that stops beating stops moving its key, and a failed post raises in the rank that
made it while the others' next beat is posted alone."""
import threading
from collections import Counter

import pytest
import torch.distributed as dist

from mooncake_ep_switch.buffer.membership import beats
from mooncake_ep_switch.buffer.membership.key_prefix import KeyPrefix
from mooncake_ep_switch.launcher.launch import host_store


class Gated(dist.Store):
    """Passes calls to `inner`, counting them; a `multi_set`/`set` holds at `gate` while `hold` is set; `fail` makes
    the next post raise."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = Counter()
        self.hold, self.entered, self.gate = threading.Event(), threading.Event(), threading.Event()
        self.fail = False

    def _post(self, name, call):
        self.calls[name] += 1
        if self.hold.is_set():
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("store down")
        return call()

    def set(self, key, value):
        return self._post("set", lambda: self.inner.set(key, value))

    def multi_set(self, keys, values):
        return self._post("multi_set", lambda: self.inner.multi_set(keys, values))

    def get(self, key):
        return self.inner.get(key)


@pytest.fixture
def server():
    store = host_store("127.0.0.1", 0, None, timeout_s=10)
    yield store


def _rank_store(server):
    client = dist.TCPStore("127.0.0.1", server.port, None, False, wait_for_workers=False)
    return KeyPrefix("job", Gated(client))


def test_destination_names_the_server_and_prefixes(server):
    a, b = _rank_store(server), _rank_store(server)
    assert beats.destination(a) == beats.destination(b) == ("tcp", "127.0.0.1", server.port, ("job",))
    assert beats.destination(KeyPrefix("other", a.inner)) != beats.destination(a)
    assert beats.destination(dist.PrefixStore("job", server)) is None  # its prefix is not readable: posted alone


def test_a_beat_made_during_another_ranks_post_rides_on_its_next_post(server):
    first, second = _rank_store(server), _rank_store(server)
    first.inner.hold.set()
    poster = threading.Thread(target=beats.post_beat, args=(first, "alive/0", "1:m:1"))
    poster.start()
    assert first.inner.entered.wait(30)
    beats.post_beat(second, "alive/1", "1:m:1")  # a post is under way: this one is left to it, no request
    assert second.inner.calls == Counter()
    first.inner.hold.clear()
    first.inner.gate.set()
    poster.join(30)
    assert (first.inner.calls["set"], first.inner.calls["multi_set"]) == (2, 0)  # its own, then rank 1's
    assert server.get("job/alive/0") == b"1:m:1" and server.get("job/alive/1") == b"1:m:1"
    # Both pending at once: one request for both.
    first.inner.hold.set(), first.inner.gate.clear(), first.inner.entered.clear()
    poster = threading.Thread(target=beats.post_beat, args=(first, "alive/0", "1:m:2"))
    poster.start()
    assert first.inner.entered.wait(30)
    beats.post_beat(second, "alive/1", "1:m:2")
    beats.post_beat(KeyPrefix("job", second.inner), "alive/2", "1:m:1")
    first.inner.hold.clear()
    first.inner.gate.set()
    poster.join(30)
    assert first.inner.calls["multi_set"] == 1
    assert [server.get(f"job/alive/{r}") for r in range(3)] == [b"1:m:2", b"1:m:2", b"1:m:1"]


def test_a_stale_pending_beat_is_dropped_not_posted(server):
    first, second = _rank_store(server), _rank_store(server)
    beats.post_beat(second, "alive/1", "1:m:1")
    first.inner.hold.set()
    poster = threading.Thread(target=beats.post_beat, args=(first, "alive/0", "1:m:1"))
    poster.start()
    assert first.inner.entered.wait(30)
    beats.post_beat(second, "alive/1", "1:m:2")  # left to rank 0's post; rank 1 then dies, making no beat more
    pending = beats._PENDING[beats.destination(second)]
    with pending.lock:
        value, made = pending.beats["alive/1"]
        pending.beats["alive/1"] = (value, made - beats.STALE_S - 1.0)  # as if rank 0's post took that long
    first.inner.hold.clear()
    first.inner.gate.set()
    poster.join(30)
    assert server.get("job/alive/0") == b"1:m:1"
    assert server.get("job/alive/1") == b"1:m:1"  # its key stopped moving with its last beat that was posted


def test_a_failed_post_raises_in_its_poster_and_the_others_next_beat_goes_alone(server):
    first, second = _rank_store(server), _rank_store(server)
    first.inner.hold.set()
    raised = []

    def post():
        try:
            beats.post_beat(first, "alive/0", "1:m:1")
        except RuntimeError as error:
            raised.append(error)

    poster = threading.Thread(target=post)
    poster.start()
    assert first.inner.entered.wait(30)
    beats.post_beat(second, "alive/1", "1:m:1")  # left to rank 0's post, which fails
    first.inner.fail = True
    first.inner.hold.clear()
    first.inner.gate.set()
    poster.join(30)
    assert [str(e) for e in raised] == ["store down"]  # the poster's own call raised
    second.inner.fail = True
    with pytest.raises(RuntimeError, match="store down"):
        beats.post_beat(second, "alive/1", "1:m:2")  # alone, through its own store: it raises as a set does
    second.inner.fail = False
    beats.post_beat(second, "alive/1", "1:m:3")
    assert server.get("job/alive/1") == b"1:m:3"
