"""The step-latency cost model the simulator and the switch policy run on: what a step costs in each layout.

`CostModel` holds per-layout decode seconds by batch size, prefill seconds per token, running
caps and the switch time (a function of the load); `calibrate` fits it from measurements
(`policy.calibrate`), `simulate_cli.cpu_calibration` measures one on this machine.
"""
import math
import numbers
from bisect import bisect_right
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from mooncake_ep_switch.switch.planning.policy import LAYOUTS, TP, Calibration, calibrate
from mooncake_ep_switch.checks import check_int


def _real(name: str, value, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = value > minimum if strict else value >= minimum
    if not (ok and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and {'>' if strict else '>='} {minimum}, got {value}")
    return value


def _layout(name: str, value) -> str:
    if value not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {value!r}")
    return value


@dataclass(frozen=True)
class CostModel:
    """Step-latency model of one serving instance in the TP and the EP layout.

    Decode step latency is piecewise linear in the decode batch through the knots
    (``batch_sizes``, ``*_decode_seconds``), flat below the first knot and extended with the last
    segment's slope above the last one. Prefill costs ``prefill_overhead_seconds`` plus a
    per-token cost per layout. A switch costs ``switch_min_seconds`` at no load, rising linearly
    with the in-flight count to ``switch_max_seconds`` at ``switch_full_load_requests`` (the KV
    part of a switch scales with cache occupancy).

    Arguments:
        batch_sizes: ascending distinct knots, >= 1.
        tp_decode_seconds, ep_decode_seconds: decode step latency at each knot, > 0.
        tp_prefill_seconds_per_token, ep_prefill_seconds_per_token: prefill cost per prompt token.
        prefill_overhead_seconds: fixed cost of a step that prefills anything.
        switch_min_seconds, switch_max_seconds: switch time range, ``min <= max``.
        switch_full_load_requests: in-flight count at which a switch costs ``switch_max_seconds``.
        tp_max_running, ep_max_running: running-request cap of each layout (KV capacity).
        max_prefill_tokens: prefill token budget per step (a longer prompt still goes alone).
    """

    batch_sizes: Tuple[int, ...]
    tp_decode_seconds: Tuple[float, ...]
    ep_decode_seconds: Tuple[float, ...]
    tp_prefill_seconds_per_token: float = 18e-6
    ep_prefill_seconds_per_token: float = 14e-6
    prefill_overhead_seconds: float = 0.005
    switch_min_seconds: float = 0.215
    switch_max_seconds: float = 0.434
    switch_full_load_requests: int = 2048
    tp_max_running: int = 2048
    ep_max_running: int = 2048
    max_prefill_tokens: int = 8192

    def __post_init__(self):
        sizes = tuple(check_int("batch_sizes[i]", b, 1) for b in self.batch_sizes)
        if len(sizes) < 2 or any(b >= c for b, c in zip(sizes, sizes[1:])):
            raise ValueError(f"batch_sizes must hold >= 2 strictly ascending sizes, got {sizes}")
        for name in ("tp_decode_seconds", "ep_decode_seconds"):
            values = tuple(_real(f"{name}[i]", v, 0.0, strict=True) for v in getattr(self, name))
            if len(values) != len(sizes):
                raise ValueError(f"{name} must have one value per batch size ({len(sizes)}), got {len(values)}")
            object.__setattr__(self, name, values)
        object.__setattr__(self, "batch_sizes", sizes)
        for name in ("tp_prefill_seconds_per_token", "ep_prefill_seconds_per_token",
                     "prefill_overhead_seconds", "switch_min_seconds", "switch_max_seconds"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
        if self.switch_max_seconds < self.switch_min_seconds:
            raise ValueError(f"switch_max_seconds must be >= switch_min_seconds ({self.switch_min_seconds}), "
                             f"got {self.switch_max_seconds}")
        for name in ("switch_full_load_requests", "tp_max_running", "ep_max_running", "max_prefill_tokens"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))

    @classmethod
    def from_paper(cls) -> "CostModel":
        """Qwen3-235B-A22B on 8xH200, after the Moebius paper.

        From the paper: low-load TPOT ~37 ms in TP vs ~52 ms in EP, crossover in 128-256
        requests (here 224), switches of 215 ms (low KV load) to 434 ms (high), a 2,048-request
        cap. Ours (the paper gives no numbers): the decode latencies above 256 requests (EP about
        2.6x TP's throughput at 2,048); prefill at 18 us/token in TP and 14 us/token in EP (a
        roofline guess: 22B active parameters at ~50% of 8xH200 BF16 peak, plus TP's all-reduce
        volume growing with tokens); 8,192 prefill tokens per step; equal running caps (TP's
        halved KV capacity under 4 KV heads over 8 ranks is left out).

        Returns:
            model: a `CostModel`.
        """
        return cls(batch_sizes=(1, 64, 256, 1024, 2048),
                   tp_decode_seconds=(0.037, 0.038, 0.060, 0.160, 0.300),
                   ep_decode_seconds=(0.052, 0.053, 0.057, 0.080, 0.115))

    @classmethod
    def from_calibration(cls, calibration: Calibration,
                         switch_seconds: Union[float, Tuple[float, float]], **overrides) -> "CostModel":
        """A model whose decode latencies are a calibration's measured tables.

        Arguments:
            calibration: the `Calibration` returned by `calibrate()`.
            switch_seconds: one switch time, or ``(min, max)`` from no load to full load.
            overrides: any other `CostModel` field (prefill costs, caps, ...).

        Returns:
            model: a `CostModel`.
        """
        if not isinstance(calibration, Calibration):
            raise TypeError(f"calibration must be a Calibration, got {type(calibration).__name__}")
        if isinstance(switch_seconds, tuple):
            if len(switch_seconds) != 2:
                raise ValueError(f"switch_seconds must be seconds or (min, max), got {switch_seconds!r}")
            low, high = switch_seconds
        else:
            low = high = switch_seconds
        return cls(batch_sizes=calibration.batch_sizes, tp_decode_seconds=calibration.tp_seconds,
                   ep_decode_seconds=calibration.ep_seconds, switch_min_seconds=low,
                   switch_max_seconds=high, **overrides)

    def decode_seconds(self, layout: str, batch: int) -> float:
        """Latency of one decode step.

        Arguments:
            layout: ``"tp"`` or ``"ep"``.
            batch: decode batch size, >= 0 (0 costs nothing).

        Returns:
            seconds: the step latency.
        """
        values = self.tp_decode_seconds if _layout("layout", layout) == TP else self.ep_decode_seconds
        batch = _real("batch", batch)
        if batch == 0:
            return 0.0
        sizes = self.batch_sizes
        if batch <= sizes[0]:
            return values[0]
        i = min(bisect_right(sizes, batch), len(sizes) - 1)
        b0, b1, v0, v1 = sizes[i - 1], sizes[i], values[i - 1], values[i]
        return v0 + (v1 - v0) * (batch - b0) / (b1 - b0)

    def decode_table(self, layout: str, max_batch: int) -> np.ndarray:
        """Decode latency for every batch size ``0 .. max_batch`` (fast lookups).

        Arguments:
            layout: ``"tp"`` or ``"ep"``.
            max_batch: the largest batch size, >= 0.

        Returns:
            seconds: float64 array of length ``max_batch + 1``.
        """
        return np.array([self.decode_seconds(layout, b) for b in range(check_int("max_batch", max_batch, 0) + 1)])

    def prefill_seconds(self, layout: str, tokens: int) -> float:
        """Latency of prefilling ``tokens`` prompt tokens in one step.

        Arguments:
            layout: ``"tp"`` or ``"ep"``.
            tokens: prompt tokens, >= 0 (0 costs nothing).

        Returns:
            seconds: the prefill latency.
        """
        per_token = (self.tp_prefill_seconds_per_token if _layout("layout", layout) == TP
                     else self.ep_prefill_seconds_per_token)
        tokens = _real("tokens", tokens)
        return 0.0 if tokens == 0 else self.prefill_overhead_seconds + per_token * tokens

    def switch_seconds(self, num_requests: int) -> float:
        """Time one TP <-> EP switch takes with ``num_requests`` in flight.

        Arguments:
            num_requests: in-flight requests, >= 0.

        Returns:
            seconds: the switch time, in ``[switch_min_seconds, switch_max_seconds]``.
        """
        load = min(1.0, _real("num_requests", num_requests) / self.switch_full_load_requests)
        return self.switch_min_seconds + (self.switch_max_seconds - self.switch_min_seconds) * load

    def max_running(self, layout: str) -> int:
        """Running-request cap of a layout.

        Arguments:
            layout: ``"tp"`` or ``"ep"``.

        Returns:
            cap: the cap.
        """
        return self.tp_max_running if _layout("layout", layout) == TP else self.ep_max_running

    def calibration(self, batch_sizes: Optional[Sequence[int]] = None) -> Calibration:
        """Run `calibrate()` against this model's decode latency.

        Arguments:
            batch_sizes: sizes to measure; default the knots (exact for piecewise-linear curves).

        Returns:
            calibration: the `Calibration`.
        """
        return calibrate(self.decode_seconds, self.batch_sizes if batch_sizes is None else batch_sizes)
