"""A Buffer's counters (`Buffer.stats()`) and the log lines of the calls' faults (masks).

The hot path only adds to a few integers and compares the length of the transport's
`failed_sources` list with the number already seen; nothing is formatted or logged unless that
length moved. Then each newly masked rank is counted by its cause, as the transport sees it
(`contract.RuntimeQueries.mask_cause`: `"deadline"`, `"process_end"` or `"link"`), and logged on the
`mooncake_ep_switch.buffer` logger at WARNING (the first mask of a rank for a cause in an epoch;
repeats at DEBUG). A mask by a deadline that is implausibly short (below `SHORT_TIMEOUT_FLOOR_US` or
below this Buffer's mean call time) adds one WARNING per Buffer saying that `timeout_us` is in
microseconds: `timeout_us=10` meant as seconds masks a live peer after 10 us, silently otherwise.
"""
import logging
import threading
import time
from typing import Callable, Dict

from mooncake_ep_switch.buffer.events import REASONS, PeerMasked

__all__ = ["CallStats", "MASK_CAUSES", "SHORT_TIMEOUT_FLOOR_US"]

log = logging.getLogger("mooncake_ep_switch.buffer")

DEADLINE, PROCESS_END, LINK = "deadline", "process_end", "link"
MASK_CAUSES = (DEADLINE, PROCESS_END, LINK)
# A deadline below this (or below the Buffer's mean call time) that masks a peer gets the unit hint.
SHORT_TIMEOUT_FLOOR_US = 1000

_CAUSE_TEXT = {
    DEADLINE: "it did not signal within the call's deadline",
    PROCESS_END: "its process ended",
    LINK: "the link to it failed (a write or collective to it failed)",
}


class CallStats:
    """The counters of one Buffer, kept in its `BufferCore` (`core.stats`).

    Fields (plain attributes, added to by the Buffer's calls):
        dispatches, combines: calls that ran (a hook or async call counts when it was issued).
        dispatch_bytes: bytes of the bf16 token rows given to dispatch (num_tokens * hidden * 2).
        combine_bytes: bytes of the bf16 rows combine returned (num_tokens * hidden * 2).
        wait_s: seconds spent in the transport moving and waiting for rows (a synchronous call:
            send and receive; a hook or async call: its receive phase; not measured on `"cuda"`).
        masks: {cause: count} of ranks the calls masked in `active_ranks`.
        seen: how many entries of the transport's `failed_sources` were counted already.
    """

    __slots__ = ("dispatches", "combines", "dispatch_bytes", "combine_bytes", "wait_s", "masks", "seen",
                 "_lock", "_logged", "_hinted")

    def __init__(self):
        self.dispatches = self.combines = self.dispatch_bytes = self.combine_bytes = 0
        self.wait_s = 0.0
        self.masks: Dict[str, int] = dict.fromkeys(MASK_CAUSES, 0)
        self.seen = 0
        self._lock = threading.Lock()  # an async receive observes on its thread
        self._logged = set()  # (epoch, rank, cause) logged at WARNING
        self._hinted = False

    def resync(self, transport) -> None:
        """The transport's `failed_sources` was cleared or given entries that are no masks (membership
        evidence): count only what calls append from now on."""
        with self._lock:
            self.seen = len(transport.failed_sources)

    def observe(self, core, timeout_us: int, what: str, call: int) -> None:
        """Count and log the ranks masked since the last observation (the caller saw the length move).

        Arguments:
            core: the Buffer's `BufferCore` (its transport, rank and epoch).
            timeout_us: the deadline of the call that masked them.
            what: `"dispatch"` or `"combine"`.
            call: the call's number.
        """
        transport = core.transport
        with self._lock:
            failed = transport.failed_sources
            new = list(failed[self.seen:]) if len(failed) >= self.seen else list(failed)
            self.seen = len(failed)
            found = [(rank, transport.mask_cause(rank)) for rank in new]
            for _, cause in found:
                self.masks[cause] = self.masks.get(cause, 0) + 1
            calls = self.dispatches + self.combines
            mean_us = self.wait_s / calls * 1e6 if calls else 0.0
        for rank, cause in found:
            key = (core.epoch, rank, cause)
            if core.events.active and not any(k[:2] == key[:2] for k in self._logged):  # first mask of the rank
                dead = cause == "process_end" or rank in core.transport.dead_peers()
                core.events.emit(PeerMasked(rank, "dead" if dead else REASONS.get(cause, cause), core.epoch))
            level = logging.DEBUG if key in self._logged else logging.WARNING
            self._logged.add(key)
            if log.isEnabledFor(level):
                log.log(level, "rank %d masked rank %d in %s call %d (epoch %d, timeout_us=%d): %s [cause: %s]",
                        core.rank, rank, what, call, core.epoch, timeout_us, _CAUSE_TEXT.get(cause, cause), cause)
            if (cause == DEADLINE and not self._hinted and 0 <= timeout_us
                    and timeout_us < max(SHORT_TIMEOUT_FLOOR_US, mean_us)):
                self._hinted = True
                log.warning("rank %d masked live rank %d after timeout_us=%d, i.e. %g ms: timeout_us is in "
                            "MICROSECONDS (this Buffer's calls take %.0f us on average); a deadline in seconds "
                            "needs * 1_000_000 (e.g. timeout_us=10_000_000 for 10 s)",
                            core.rank, rank, timeout_us, timeout_us / 1e3, mean_us)

    def timed(self, receive: Callable[[], None], core, timeout_us: int, what: str,
              call: int) -> Callable[[], None]:
        """`receive` (a hook or async call's receive phase), counting its time and the masks it made."""

        def observed() -> None:
            start = time.perf_counter()
            try:
                receive()
            finally:
                self.wait_s += time.perf_counter() - start
                if len(core.transport.failed_sources) != self.seen:
                    self.observe(core, timeout_us, what, call)

        return observed

    def snapshot(self, core) -> dict:
        """The counters now, with the Buffer's view (see `Buffer.stats()`)."""
        with self._lock:
            masks = dict(self.masks)
        return {
            "rank": core.rank,
            "num_ranks": core.num_ranks,
            "transport": core.transport.name if core.transport is not None else None,
            "epoch": core.epoch,
            "members": len(core.members),
            "calls": self.dispatches + self.combines,
            "dispatches": self.dispatches,
            "combines": self.combines,
            "dispatch_bytes": self.dispatch_bytes,
            "combine_bytes": self.combine_bytes,
            "wait_s": self.wait_s,
            "masks": masks,
        }
