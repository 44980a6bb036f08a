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
from typing import Callable, Optional


class LaunchOrder:
    """The stream of the transport's latest launch, and the waits that order the next one after it.

    Arguments:
        current_raw: the current stream's `cudaStream_t` as an int (cheap: called at every launch).
        current_stream: the current stream's torch.cuda.Stream (called only when the stream changed).
        capturing: whether the current stream is capturing a CUDA graph.
    """

    __slots__ = ("_current_raw", "_current_stream", "_capturing", "last_raw", "last_stream")

    def __init__(self, current_raw: Callable[[], int], current_stream: Callable[[], object],
                 capturing: Callable[[], bool]):
        self._current_raw, self._current_stream, self._capturing = current_raw, current_stream, capturing
        self.last_raw: Optional[int] = None
        self.last_stream = None

    def current(self) -> tuple:
        """The current stream for a launch, ordered after the previous launch (`on`).

        Returns:
            raw: int, its `cudaStream_t`.
            stream: its torch.cuda.Stream (for `on` later, e.g. a receive hook, and `record_stream`).
        """
        raw = self._current_raw()
        if raw == self.last_raw:
            return raw, self.last_stream
        stream = self._current_stream()
        self.on(raw, stream)
        return raw, stream

    def on(self, raw: int, stream) -> int:
        """Order a launch on `stream` (not necessarily the current one: a receive hook launches on its call's)
        after the previous launch: when that was on another stream, `stream` waits for it on the device.

        Arguments:
            raw: the stream's `cudaStream_t` as an int.
            stream: its torch.cuda.Stream.

        Returns:
            raw: `raw`.
        """
        if raw != self.last_raw and not self._capturing():
            if self.last_stream is not None:
                stream.wait_stream(self.last_stream)
            self.last_raw, self.last_stream = raw, stream
        return raw
