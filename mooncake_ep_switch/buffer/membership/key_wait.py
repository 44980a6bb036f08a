"""A wait for store keys that its caller polls without store operations (issue 40).

A rank that waits for a key another rank sets (a ballot's `done/<e>`, a sealed view, the records of
its peers) either polls the store (one operation per round: at R=256 ranks that is most of the store's
work, and in a bench of ranks as threads most of the CPU) or blocks in one `wait`. A blocking wait
cannot look at anything else meanwhile (a peer seen dead, a beat to post, its own deadline), and cut
into slices it times out once per slice: a TCPStore `wait` that times out was seen to return seconds
late on this box when many do at once (ballot.py). `KeyWait` starts one blocking `wait` on a
`BoundedStore` lane of its own (`store_deadline.waits_in_background`) and lets its caller look at its
outcome locally, in slices as short as it likes, while it goes on using the store; it never times out
in honest use, because the caller that stops waiting sets the key itself (or another rank does).
On any other store (a client shared by threads, an etcd store) it checks the keys once per `poll`.

A waiter that needs the keys' values once they are there (a sealed view, a ballot's summary) asks for them
with `read=True`: the background wait is then the store's blocking read of the keys
(`store_deadline.reads_in_background`), whose outcome holds the values, one store operation instead of a
wait and a read after it (when R ranks wake at once, R reads fewer on the store and, with ranks as
threads, R fewer thread hand-offs while every rank needs the interpreter).

A reading wait made with `shared=True`, for keys written once and never changed (a sealed view), joins the
background read that another thread of this process has under way for the same keys of the same store and
prefix (`beats.destination`), if one does: ranks as threads (the bench, tests) then wake from one read where
each woke from its own (at R=256, 255 reads and worker wake-ups at the moment every rank needs the
interpreter). A value read by a read that began before this waiter did is the one it would read: the keys
never change once there. With one rank per process (production) there is nothing to join.
"""
import threading
import time
from datetime import timedelta
from typing import Dict, Hashable, Iterable, Optional

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.beats import destination
from mooncake_ep_switch.buffer.membership.store_deadline import (BoundedStore, reads_in_background,
                                                                  waits_in_background)

__all__ = ["KeyWait", "background_waits"]

POLL_MAX_S = 0.02  # without a background wait: the longest pause between two checks of the keys

# Shared reading waits under way in this process: (destination, keys) -> the background read's job.
_SHARED: Dict[Hashable, object] = {}
_SHARED_LOCK = threading.Lock()


def _joined(name: Hashable):
    """The shared read under way for `name`, or None; drops the entries of reads that ended."""
    with _SHARED_LOCK:
        for key in [k for k, job in _SHARED.items() if job.done.is_set()]:
            del _SHARED[key]
        return _SHARED.get(name)


def background_waits(store) -> bool:
    """Whether `store` (under any PrefixStores and wrappers with an `inner` store) is a `BoundedStore` that
    waits in the background (a cloned TCPStore).

    Arguments:
        store: a torch.distributed Store.

    Returns:
        bool.
    """
    root = store
    for _ in range(64):  # bounded: a chain of prefixes and wrappers
        if isinstance(root, BoundedStore):
            return root.background_waits
        if isinstance(root, dist.PrefixStore):
            root = root.underlying_store
        elif hasattr(root, "inner"):
            root = root.inner
        else:
            return False
    return False


class KeyWait:
    """Wait until every key of `keys` is in `store`, looked at by `poll()`.

    Arguments:
        store: the store the keys are in (the caller's, with its prefixes).
        keys: keys to wait for.
        seconds: the longest the wait lasts (a background wait times out then; its caller should set one
            of the keys before, or stop polling by then).
        background: None to decide by the store (`background_waits`); False to check the keys per poll.
        read: also read the keys' values (`values()`): in the background wait itself where it runs.
        shared: with `read`, for keys written once and never changed: join the background read of the same keys
            that another thread of this process has under way (see the module docstring). That read lasts as its
            starter asked: when it ends without the keys, `poll()` says False here too, maybe before `seconds`
            (wait again: a new `KeyWait`).
    """

    def __init__(self, store, keys: Iterable[str], seconds: float, background: Optional[bool] = None,
                 read: bool = False, shared: bool = False):
        self.store = store
        self.keys = list(keys)
        self._until = time.monotonic() + max(seconds, 0.0)
        self._there: Optional[bool] = None
        self._job = None
        self._pause = 0.0005
        self._values: Optional[list] = None
        if background is None:
            background = background_waits(store)
        if background and read and not background_waits(store):
            background = False  # a read made in place would block up to the store's own timeout: check per poll
        name = None
        if background and read and shared:
            where = destination(store)
            name = None if where is None else (where, tuple(self.keys))
        if name is not None:
            self._job = _joined(name)
            if self._job is not None:
                return
        if background:
            started = reads_in_background(seconds) if read else waits_in_background()
            with started as jobs:
                try:
                    if read:
                        values = store.multi_get(self.keys)
                    else:
                        store.wait(self.keys, timedelta(seconds=max(seconds, 0.001)))
                except dist.DistStoreError:
                    self._there = False  # made in place (not a background wait) and timed out
            if jobs:
                self._job = jobs[0]
                if name is not None:
                    with _SHARED_LOCK:
                        _SHARED[name] = self._job
            elif self._there is None:
                self._there = True  # made in place and returned: the keys are there
                if read:
                    self._values = list(values)

    @property
    def background(self) -> bool:
        """Whether a background wait runs (polls cost no store operation)."""
        return self._job is not None

    def poll(self, seconds: float) -> Optional[bool]:
        """Wait up to `seconds` for the outcome.

        Arguments:
            seconds: how long to block here at most (0: only look).

        Returns:
            True: the keys are there; False: the wait ended without them (timed out, the connection failed,
                or without a background wait its `seconds` passed); None: not known yet.
        """
        if self._there is not None:
            return self._there
        if self._job is not None:
            if not self._job.done.wait(max(seconds, 0.0)):
                return None
            self._there = not self._job.retry and self._job.error is None
            if self._there and isinstance(self._job.value, list):
                self._values = self._job.value  # a background read's values
            return self._there
        if self.store.check(self.keys):
            self._there = True
            return True
        now = time.monotonic()
        if now >= self._until:
            self._there = False
            return False
        time.sleep(max(0.0, min(seconds, self._pause, self._until - now)))
        self._pause = min(self._pause * 2, POLL_MAX_S)
        return None

    def values(self) -> list:
        """The keys' values (bytes, in the order of `keys`), once `poll()` returned True: those the background read
        got, else one `multi_get` (the keys are there).

        Returns:
            values: list of bytes.

        Raises:
            RuntimeError: called before `poll()` returned True.
        """
        if self._there is not True:
            raise RuntimeError(f"KeyWait.values(): the keys {self.keys[:4]} are not known to be there yet")
        if self._values is None:
            self._values = list(self.store.multi_get(self.keys))
        return [bytes(v) for v in self._values]
