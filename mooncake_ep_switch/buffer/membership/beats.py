"""Member beats of the ranks of one process, posted together (issue 40).

A member waiting in `agree_next_view()` refreshes `alive/<rank>` every `WAIT_SLICE_S` (the sealer every
`MEMBER_BEAT_S`), so that a replacement sees it waiting (replacement.py). Ranks as threads of one process
(the membership bench, tests) each posted their own: at R=256 on an etcd store those beats were 40-57%
of the cluster's requests during a membership change, each one an HTTP request and a worker hand-off
while every rank needs the interpreter.

`post_beat` keeps each beat's timing and value (the rank's own loop decides both, so a rank that dies or
hangs stops beating exactly as before) and only merges the requests: a beat joins the beats pending for
the same destination (the same store server and key prefix), and the rank that finds no post under way
posts every pending one in one `multi_set` (flat combining: no thread of its own). A beat that a post
under way takes is posted by that rank (at most `_ROUNDS` requests, then the next beat's rank posts what
is left); a pending beat older than `STALE_S` is dropped (its rank stopped waiting, or died). A post that
fails raises in the rank that made it, as its own `set` did; the other ranks of that post make their next
beat themselves (a `set` that raises in them if the store is still down).
With one rank per process (production) every post holds one beat: a plain `set`, as before.
"""
import threading
import time
from typing import Dict, Hashable, List, Optional, Tuple

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.key_prefix import KeyPrefix

__all__ = ["STALE_S", "destination", "post_beat"]

STALE_S = 0.5  # a pending beat older than this is dropped, not posted (its rank stopped waiting or died)
_MAX_KEYS = 128  # beats per post (etcd's default --max-txn-ops)
_ROUNDS = 2  # posts one rank makes for the others before it goes back to its own wait


class _Pending:
    """The beats waiting to be posted to one destination."""

    def __init__(self):
        self.lock = threading.Lock()
        self.beats: Dict[str, Tuple[str, float]] = {}  # key -> (value, monotonic time it was made)
        self.posting = False
        self.failed: Dict[str, BaseException] = {}  # key -> the error of the post that held its last beat


_PENDING: Dict[Hashable, _Pending] = {}
_PENDING_LOCK = threading.Lock()


def destination(store) -> Optional[Hashable]:
    """Where `store`'s keys land: the server (a TCPStore's host and port, an etcd store's cluster and prefix) and
    the key prefixes on the way; None when a layer of it is not known here (its beats are then posted alone).

    Arguments:
        store: a torch.distributed Store (`KeyPrefix`es and wrappers with an `inner` store over the server's).

    Returns:
        a hashable name, equal for two stores exactly when a key set through either lands on the same key.
    """
    prefixes: List[str] = []
    root = store
    for _ in range(64):  # bounded: a chain of prefixes and wrappers
        if isinstance(root, KeyPrefix):
            prefixes.append(root.prefix)
            root = root.inner
        elif isinstance(root, dist.TCPStore):
            return ("tcp", root.host, root.port, tuple(prefixes))
        elif isinstance(root, dist.PrefixStore):
            return None  # torch's PrefixStore does not tell its prefix
        elif getattr(root, "waits_cheaply", False) and isinstance(getattr(root, "url", None), str):
            return ("etcd", root.url, tuple(prefixes))  # an EtcdStore: its cluster and job prefix
        elif hasattr(root, "inner"):
            root = root.inner  # BoundedStore, a counting wrapper: the same keys
        else:
            return None
    return None


def post_beat(store, key: str, value: str) -> None:
    """Set `key` of `store` to `value`, in one request with the beats other threads of this process post to the same
    destination meanwhile (see the module's docstring).

    Arguments:
        store: the rank's store.
        key: its beat key (`alive/<rank>`).
        value: the beat.

    Raises:
        whatever the store raises for the post this beat was in when this thread made it (a timeout, an
        unavailable store); a beat another thread posted raises nothing here (the next one is posted alone).
    """
    name = destination(store)
    if name is None:
        store.set(key, value)
        return
    with _PENDING_LOCK:
        pending = _PENDING.setdefault(name, _Pending())
    with pending.lock:
        failed = pending.failed.pop(key, None)
        if failed is None:
            pending.beats[key] = (value, time.monotonic())
            if pending.posting:
                return  # the post under way takes it
            pending.posting = True
    if failed is not None:  # the last post holding this key's beat failed: this one alone, raising as a set does
        store.set(key, value)
        return
    try:
        for _ in range(_ROUNDS):
            if not _post_some(pending, store):
                break
    finally:
        with pending.lock:
            pending.posting = False


def _post_some(pending: _Pending, store) -> bool:
    """Post up to `_MAX_KEYS` pending beats (not stale) through `store`; False when there were none."""
    now = time.monotonic()
    with pending.lock:
        taken = []
        for key in list(pending.beats):
            made_value, made = pending.beats.pop(key)
            if now - made <= STALE_S:
                taken.append((key, made_value))
                if len(taken) == _MAX_KEYS:
                    break
    if not taken:
        return False
    try:
        if len(taken) == 1:
            store.set(*taken[0])
        else:
            store.multi_set([key for key, _ in taken], [value for _, value in taken])
    except BaseException as error:
        with pending.lock:
            for key, _ in taken:
                pending.failed[key] = error
        raise
    return True
