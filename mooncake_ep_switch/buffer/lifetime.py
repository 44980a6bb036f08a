"""What a `Buffer` shares with the hooks, events and background receive phases of its calls.

`Lifetime` says whether the Buffer was destroyed, holds the abort word its native waits poll, and
counts the calls using its memory, so that `destroy()` is bounded and the memory is released by
the last running call. `guarded`, `once` and `with_receipt` wrap a call's deferred receive phase.
None of them keeps the Buffer itself alive.
"""
import threading
from typing import Callable, Optional, Tuple

import torch

from mooncake_ep_switch.buffer.handle import ReceiveReceipt
from mooncake_ep_switch.errors import BufferDestroyed

_I64 = torch.int64


def with_receipt(receive: Callable[[], None]) -> Tuple[Callable[[], None], ReceiveReceipt]:
    """Wrap a deferred receive phase so that its receipt records when it has run."""
    receipt = ReceiveReceipt()

    def run() -> None:
        try:
            receive()
        finally:
            receipt.done = True

    return run, receipt


# How long destroy() waits for running calls (whose native waits it has told to stop) before it
# returns and leaves the release of their memory to the last of them.
DESTROY_WAIT_S = 5.0


class Lifetime:
    """What a Buffer shares with its hooks, events and background receive phases (not the Buffer
    itself, which they must not keep alive): whether it was destroyed, the abort word every native
    wait of its calls polls, and how many calls are using its memory right now.

    A call `enter()`s before it touches the transport (send phase, receive phase, hook) and
    `leave()`s after; `enter()` refuses once the Buffer is destroyed. `end()` marks it destroyed,
    raises the abort word (waits with no deadline stop with RuntimeError), waits a bounded time
    for running calls, and runs the release at once when none is left, else when the last one leaves.
    """

    __slots__ = ("destroyed", "abort", "abort_ptr", "_lock", "_idle", "_running", "_release")

    def __init__(self):
        self.destroyed = False
        self.abort = torch.zeros(1, dtype=_I64)  # the native waits poll this word
        self.abort_ptr = self.abort.data_ptr()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0
        self._release: Optional[Callable[[], None]] = None

    def enter(self) -> None:
        with self._lock:
            if self.destroyed:
                raise BufferDestroyed("Buffer: this buffer was destroyed (destroy() or garbage collection); "
                                   "its hooks, events and calls can no longer run")
            self._running += 1

    def leave(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running or not self.destroyed:  # only end() (which set destroyed) waits or left a release
                return
            self._idle.notify_all()
            release, self._release = self._release, None
        if release is not None:
            release()

    def end(self, release: Callable[[], None], wait_s: float) -> bool:
        """Destroy: stop the running calls' waits, run `release` once none is running.

        Returns:
            released: True if `release` ran here, False if the last running call will run it.
        """
        with self._lock:
            self.destroyed = True
            self.abort[0] = 1
            if wait_s > 0:
                self._idle.wait_for(lambda: self._running == 0, wait_s)
            if self._running:
                self._release = release
                return False
        release()
        return True


def guarded(life: Lifetime, function: Callable[[], None]) -> Callable[[], None]:
    """A receive phase that runs only while its Buffer lives (BufferDestroyed, a RuntimeError, after destroy())."""

    def run() -> None:
        life.enter()
        try:
            function()
        except RuntimeError as error:
            if life.destroyed and not isinstance(error, BufferDestroyed):
                # a native wait stopped by destroy()'s abort word (it raises a plain RuntimeError)
                raise BufferDestroyed(str(error)) from error
            raise
        finally:
            life.leave()

    return run


def once(function: Callable[[], None]) -> Callable[[], None]:
    """Wrap a receive phase so that a hook and an event may both complete it, once."""
    lock = threading.Lock()
    state = {"done": False, "error": None}

    def run() -> None:
        with lock:
            if not state["done"]:
                state["done"] = True
                try:
                    function()
                except BaseException as error:
                    state["error"] = error
            if state["error"] is not None:
                raise state["error"]

    return run
