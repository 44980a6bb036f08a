"""The order of the "cuda" transport's launches across streams: each runs after the one before it.

A call's kernels share per-shape scratch (`CudaTransport._scratch_for`: the send's slots and counts, the
receive's counts and offsets) with every other call of its shape and half. Launches on one stream run in
order; launches on two streams (an `async_finish` call on the communication stream and a synchronous one
on the current stream before its event was waited for, a caller alternating streams) would run at once and
overwrite each other's scratch. DeepEP runs every call on its one communication stream; here a synchronous
call runs on the current stream (no stream switch, capturable), and a launch on another stream than the
previous launch's makes its stream wait for that one on the device (no host wait).

Not while a CUDA graph is captured: a capture may not wait for work outside it, and the capture changes
nothing (the launch after it still waits for the stream before it). A graph's replays run where and when the
caller launches them, ordered by the caller, as DeepEP's. The order is the one the host launches in: two
threads launching at the same moment are not ordered.
"""
from typing import Callable, Optional, Tuple


class LaunchOrder:
    """The stream of the transport's latest launch, and the waits that order the next one after it.

    Arguments:
        current_raw: the current stream's `cudaStream_t` as an int (cheap: called at every launch).
        current_stream: the current stream's torch.cuda.Stream (called only when the stream changed).
        capturing: whether the current stream is capturing a CUDA graph.
    """

    __slots__ = ("_current_raw", "_current_stream", "_capturing", "last")

    def __init__(self, current_raw: Callable[[], int], current_stream: Callable[[], object],
                 capturing: Callable[[], bool]):
        self._current_raw, self._current_stream, self._capturing = current_raw, current_stream, capturing
        self.last: Tuple[Optional[int], object] = (None, None)  # (raw, stream) of the latest launch: one store

    def current(self) -> Tuple[int, object, bool]:
        """The current stream for a launch, ordered after the previous launch (`on`).

        Returns:
            raw: int, its `cudaStream_t`.
            stream: its torch.cuda.Stream (for `on` later, e.g. a receive hook, and `record_stream`).
            captured: whether it is capturing a CUDA graph now (pass it to `on` for a later launch there).
        """
        raw = self._current_raw()
        last = self.last
        if raw == last[0]:  # it may be capturing since (a caller's torch.cuda.graph(stream=...)): asked anyway
            return raw, last[1], self._capturing()
        stream, captured = self._current_stream(), self._capturing()
        self.on(raw, stream, captured)
        return raw, stream, captured

    def on(self, raw: int, stream, captured: bool) -> int:
        """Order a launch on `stream` (not necessarily the current one: a receive hook launches on its call's)
        after the previous launch: when that was on another stream, `stream` waits for it on the device.

        Arguments:
            raw: the stream's `cudaStream_t` as an int.
            stream: its torch.cuda.Stream.
            captured: whether `stream` is capturing a CUDA graph (as `current` said when the call was made).

        Returns:
            raw: `raw`.
        """
        last_raw, last_stream = self.last
        if raw != last_raw and not captured:
            if last_stream is not None:
                stream.wait_stream(last_stream)
            self.last = (raw, stream)
        return raw
