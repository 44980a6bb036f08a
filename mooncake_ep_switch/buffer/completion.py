"""How a call's receive phase completes: here, in a hook the caller runs, or on a background thread.

DeepEP's modes: synchronous (the receive runs inside the call), `return_recv_hook=True` (the caller
runs the hook when it wants the data) and `async_finish=True` (a background thread receives; the
event waits for it). A hook, an event and a background receive refuse to run once the Buffer is
destroyed, and one that is waiting then is stopped by destroy() (buffer/lifetime.py).
"""
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional, Tuple

from mooncake_ep_switch.buffer.handle import EventOverlap
from mooncake_ep_switch.buffer.lifetime import guarded, Lifetime, once
from mooncake_ep_switch.errors import BufferDestroyed


class Completions:
    """Completes one Buffer's receive phases; owns its one background receive thread (made on first use)."""

    def __init__(self, life: Lifetime):
        self._life = life
        self._worker: Optional[ThreadPoolExecutor] = None

    def complete(self, receive: Callable[[], None], async_finish: bool, return_recv_hook: bool,
                 keep_alive) -> Tuple[EventOverlap, Optional[Callable[[], None]]]:
        """Turn a receive phase into (event, hook) according to the call's mode.

        Arguments:
            receive: the call's receive phase.
            async_finish: receive on the background thread; the event waits for it.
            return_recv_hook: return `receive` as the hook (the caller runs it).
            keep_alive: objects the event keeps alive (the call's tensors).

        Returns:
            event: an `EventOverlap`.
            hook: the receive hook, or None unless `return_recv_hook`.
        """
        if not (return_recv_hook or async_finish):
            receive()  # synchronous: runs exactly once, here (the caller holds the Buffer's lifetime)
            return EventOverlap(None, keep_alive), None
        life = self._life
        receive = once(guarded(life, receive))
        if return_recv_hook:
            return EventOverlap(receive, keep_alive), receive
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mep-recv")
        future = self._worker.submit(receive)

        def finish() -> None:
            while True:
                try:
                    return future.result(timeout=0.05)
                except FutureTimeout:
                    # destroy() stopped what it could (native waits); a collective the process group
                    # has not finished cannot be stopped, and its event must not block for it.
                    if life.destroyed and not future.done():
                        raise BufferDestroyed("aborted: the Buffer was destroyed while this call was in flight") \
                            from None

        return EventOverlap(finish, keep_alive), None

    def shutdown(self, deadline: float) -> None:
        """Stop the background thread by `deadline` (time.monotonic()).

        Queued receive phases refuse at once (the Buffer is destroyed), a running one was told to
        stop: the thread ends within the bound, and a later wait never blocks here.
        """
        worker, self._worker = self._worker, None
        if worker is None:
            return
        threads = list(getattr(worker, "_threads", ()))
        worker.shutdown(wait=False)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
