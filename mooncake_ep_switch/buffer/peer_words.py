"""Waiting on control words that peers write into shared memory, with a deadline.

The switch protocol (switch/switcher.py) waits for every peer's word to reach a value; this is that
wait. (The online EPLB vote keeps its words in the store instead: buffer/ballot.py, as does the switch decision.)
"""
import time
from typing import Callable, List, Optional, Sequence

from mooncake_ep_switch import _native

POLL_US = 20_000  # one native wait slice; between slices the caller may look at other state


def wait_peer_words(peers: Sequence[int], addr_of: Callable[[int], int], word: int, mode: int, timeout_us: int,
                    on_slice: Optional[Callable[[List[int]], List[int]]] = None) -> List[int]:
    """Wait until the word of every peer in `peers` reaches `word`, or the deadline passes.

    Arguments:
        peers: ranks to wait for.
        addr_of: address of a peer's 8-byte word (mapped shared memory).
        word: the value to reach.
        mode: the native comparison (1: word >= `word`, 0: word == `word`; `_native.wait_words`).
        timeout_us: deadline in microseconds from now, -1 for none.
        on_slice: called with the peers still pending after every wait slice of at most `POLL_US`;
            returns the peers to keep waiting for (it may drop some, or raise).

    Returns:
        pending: the peers whose word did not reach `word` by the deadline (empty when all did).
    """
    deadline = None if timeout_us < 0 else time.monotonic() + timeout_us / 1e6
    pending = list(peers)
    while pending:
        left_us = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1e6))
        slice_us = POLL_US if left_us < 0 else min(POLL_US, left_us)
        missing = _native.wait_words([addr_of(p) for p in pending], [word] * len(pending), mode, slice_us)
        pending = [pending[i] for i in missing]
        if on_slice is not None:
            pending = on_slice(pending)
        if pending and deadline is not None and time.monotonic() >= deadline:
            return pending
    return []
