"""Readiness posts of the ranks of one process, sent together (issue 40).

Every member of a view posts its readiness for the next epoch (with its first beat) in one `multi_set` when
a peer dies, all at once. With ranks as threads of one process (the membership bench, tests) each post was a
hand-off to the rank's store worker and back while every other rank needed the interpreter too: at R=256
those 255 posts were much of the time before the view could be sealed. `post_combined` queues a post with
the posts other threads of this process make to the same destination (`beats.destination`: the same store
server and key prefixes) meanwhile, and the thread that finds none under way sends the waiting ones in one
`multi_set` (`store.combining.Combiner`, flat combining: no thread of its own). Each caller returns once a
post holding its keys was applied; when that post failed, or none answered by the caller's store deadline
(`store_deadline.remaining_s`), it sends its own, which raises as its own `multi_set` did. With one rank per
process (production) every post holds one caller's keys: its own `multi_set`, as before; a caller that finds no
other post to its destination in progress sends it at once (no queue: what a lone rank costs is one lock), and
the callers that come while it is in the air are queued.
"""
import threading
import time
from typing import Dict, Hashable, List

from mooncake_ep_switch.buffer.membership.beats import destination
from mooncake_ep_switch.buffer.membership.store_deadline import remaining_s
from mooncake_ep_switch.store.combining import Combiner, Waiting, disjoint_batch

__all__ = ["post_combined"]

MAX_KEYS = 128  # keys per post (etcd's default --max-txn-ops)
_ROUNDS = 2  # posts one caller sends for the others before it hands the rest to one of them
_NO_DEADLINE_S = 300.0  # without a store deadline: the longest a caller waits for another's post (its store's bound)
_POSTS = Combiner()
_ACTIVE: Dict[Hashable, int] = {}  # destination -> callers of post_combined in progress
_ACTIVE_LOCK = threading.Lock()


class _Post(Waiting):
    def __init__(self, keys: List[str], values: list, deadline: float):
        super().__init__(deadline)
        self.keys, self.values = keys, values


def post_combined(store, keys: List[str], values: list) -> None:
    """`store.multi_set(keys, values)`, in one request with the posts other threads of this process make to the same
    destination meanwhile (see the module docstring).

    Arguments:
        store: the rank's store.
        keys: the keys to set (at most `MAX_KEYS`, no key twice).
        values: their values (str or bytes).

    Raises:
        ValueError: keys and values differ in length, a key comes twice, or more than `MAX_KEYS` keys.
        what the store raises for this caller's own post.
    """
    keys, values = list(keys), list(values)
    if len(keys) != len(values) or len(set(keys)) != len(keys) or len(keys) > MAX_KEYS:
        raise ValueError(f"keys, values: expected as many values as keys, no key twice and at most {MAX_KEYS} keys, "
                         f"got {len(keys)} keys ({len(set(keys))} distinct) and {len(values)} values")
    name: Hashable = destination(store)
    if name is None:
        store.multi_set(keys, values)
        return
    with _ACTIVE_LOCK:
        others = _ACTIVE.get(name, 0)
        _ACTIVE[name] = others + 1
    try:
        if not others:  # alone (one rank per process): its own post at once
            store.multi_set(keys, values)
            return
        left = remaining_s()
        mine = _Post(keys, values, time.monotonic() + (_NO_DEADLINE_S if left is None else max(left, 0.0)))

        def send(taken: List[Waiting]) -> None:
            store.multi_set([k for post in taken for k in post.keys], [v for post in taken for v in post.values])

        if _POSTS.submit(name, mine, lambda pending: disjoint_batch(pending, MAX_KEYS), send, rounds=_ROUNDS) and mine.error is None:
            return
        store.multi_set(keys, values)  # its post failed, was never taken, or none answered in time: alone, its error
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE[name] -= 1
            if not _ACTIVE[name]:
                del _ACTIVE[name]
