"""When to switch the MoE layers between the TP and the EP layout.

The policy is the one of the Moebius paper (section 7): asymmetric hysteresis.

- TP -> EP at once, on the first step whose in-flight request count reaches ``T_h``
  (a burst hurts TTFT immediately, so react fast);
- EP -> TP only when the mean count over the last ``W`` steps observed in EP falls below
  ``T_l = low_ratio * T_h`` (a momentary dip must not buy a costly switch);
- no switch during the ``C`` steps that follow a switch (cooldown);
- an optional capacity check (e.g. "does the target layout have KV room for these requests?")
  may refuse a switch; the refusal is reported and the policy stays where it is.

Rollout mode (RL rollouts, where the batch only shrinks) uses ``T_l = T_h`` and ``W = 1``: return
to TP the instant the batch drops below ``T_h``.

``calibrate()`` replaces the hand-tuned ``T_h`` with the crossover measured from EP and TP step
latencies at several batch sizes.

The policy only decides; the caller performs the switch. ``observe()`` assumes a returned switch
happens; if it fails, tell the policy with ``set_layout()``.
"""

import math
import numbers
from collections import deque
from typing import Callable, Iterable, NamedTuple, Optional, Sequence, Tuple

import numpy as np
from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.layouts import EP, LAYOUTS, TP  # noqa: F401  (layout names re-exported)


#: Threshold meaning "never enter EP" (what ``calibrate()`` returns when TP always wins).
NEVER = math.inf

#: Decision codes, in ``Decision.code``.
HOLD = "hold"
ENTER_EP = "enter_ep"
RETURN_TP = "return_tp"
COOLDOWN = "cooldown"
REFUSED = "refused"
WARMUP = "warmup"

CapacityCheck = Callable[[str, int], bool]


def _check_layout(name: str, value) -> str:
    if value not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {value!r}")
    return value


class PolicySettings(NamedTuple):
    """Settings of a `SwitchPolicy`.

    Arguments:
        threshold_high: ``T_h``, the request count at which TP -> EP happens (``NEVER`` = never).
        window: ``W``, the number of steps averaged before EP -> TP (ignored in rollout mode).
        low_ratio: ``T_l / T_h``, in (0, 1] (ignored in rollout mode, where it is 1).
        cooldown_steps: ``C``, steps after a switch during which no switch happens.
        rollout_mode: ``True`` for RL rollouts: ``T_l = T_h`` and ``W = 1``.
    """

    threshold_high: float
    window: int = 64
    low_ratio: float = 0.8
    cooldown_steps: int = 128
    rollout_mode: bool = False

    @property
    def threshold_low(self) -> float:
        """``T_l``: EP -> TP happens when the windowed mean falls below it.

        Returns:
            threshold: float, ``threshold_high`` in rollout mode, else ``low_ratio * threshold_high``
                (requests).
        """
        return self.threshold_high if self.rollout_mode else self.low_ratio * self.threshold_high

    @property
    def effective_window(self) -> int:
        """The window in use: ``window``, or 1 in rollout mode.

        Returns:
            window: int, steps averaged before EP -> TP.
        """
        return 1 if self.rollout_mode else self.window

    def validated(self) -> "PolicySettings":
        """Check every field.

        Returns:
            settings: ``self`` with integer fields normalised to ``int``.
        """
        t = self.threshold_high
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"threshold_high must be a number > 0, got {type(t).__name__} {t!r}")
        t = float(t)
        if not t > 0:  # also rejects NaN
            raise ValueError(f"threshold_high must be > 0 (math.inf allowed), got {t}")
        window = check_int("window", self.window, 1)
        r = self.low_ratio
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise TypeError(f"low_ratio must be a number in (0, 1], got {type(r).__name__} {r!r}")
        if not 0.0 < float(r) <= 1.0:
            raise ValueError(f"low_ratio must be in (0, 1], got {r}")
        cooldown = check_int("cooldown_steps", self.cooldown_steps, 0)
        if not isinstance(self.rollout_mode, bool):
            raise TypeError(f"rollout_mode must be a bool, got {type(self.rollout_mode).__name__} "
                            f"{self.rollout_mode!r}")
        return PolicySettings(t, window, float(r), cooldown, self.rollout_mode)


class Decision(NamedTuple):
    """What the policy decided at one step.

    Arguments:
        target: the layout to switch to now (``"tp"`` or ``"ep"``), or ``None`` to stay.
        reason: a human-readable explanation, with the numbers that led to it.
        layout: the policy's layout after this decision.
        code: one of ``hold``, ``warmup``, ``enter_ep``, ``return_tp``, ``cooldown``, ``refused``.
    """

    target: Optional[str]
    reason: str
    layout: str
    code: str


class PolicyState(NamedTuple):
    """A snapshot of a policy's mutable state (for tests and logs).

    Arguments:
        layout: the current layout.
        last_step: the last observed step, or ``None``.
        last_switch_step: the step of the last switch, or ``None``.
        switch_count: switches decided so far.
        refusal_count: switches refused by the capacity check so far.
        window_counts: the counts observed in the current layout, at most ``W`` of them.
    """

    layout: str
    last_step: Optional[int]
    last_switch_step: Optional[int]
    switch_count: int
    refusal_count: int
    window_counts: Tuple[int, ...]


class SwitchPolicy:
    """Asymmetric-hysteresis TP <-> EP switch policy, fed one observation per engine step.

    Arguments:
        threshold_high: ``T_h``: enter EP when the request count reaches it (``NEVER`` = never).
        window: ``W``: EP -> TP needs ``W`` observations in EP whose mean is below ``T_l``.
        low_ratio: ``T_l = low_ratio * T_h``, in (0, 1].
        cooldown_steps: ``C``: after a switch at step ``s``, steps ``s+1 .. s+C`` never switch.
        capacity_check: ``f(target_layout, num_requests) -> bool``, ``False`` refuses the switch;
            ``None`` accepts every switch.
        rollout_mode: ``T_l = T_h`` and ``W = 1`` (``window`` and ``low_ratio`` are ignored).
        initial_layout: the layout the engine starts in.

    The window holds only counts observed since the last switch: counts seen in TP before a burst
    must not pull the EP mean down and send the engine back to TP while the burst goes on.
    """

    def __init__(self, threshold_high: float, window: int = 64, low_ratio: float = 0.8,
                 cooldown_steps: int = 128, capacity_check: Optional[CapacityCheck] = None,
                 rollout_mode: bool = False, initial_layout: str = TP):
        self._settings = PolicySettings(threshold_high, window, low_ratio, cooldown_steps,
                                        rollout_mode).validated()
        if capacity_check is not None and not callable(capacity_check):
            raise TypeError(f"capacity_check must be callable(target_layout, num_requests) -> bool or None, "
                            f"got {type(capacity_check).__name__}")
        self._capacity_check = capacity_check
        self._layout = _check_layout("initial_layout", initial_layout)
        self._window = deque(maxlen=self._settings.effective_window)
        self._last_step: Optional[int] = None
        self._last_switch_step: Optional[int] = None
        self._switch_count = 0
        self._refusal_count = 0

    @classmethod
    def from_settings(cls, settings: PolicySettings, capacity_check: Optional[CapacityCheck] = None,
                      initial_layout: str = TP) -> "SwitchPolicy":
        """Build a policy from a `PolicySettings`.

        Arguments:
            settings: the thresholds, window, cooldown and mode.
            capacity_check: see `SwitchPolicy`.
            initial_layout: the layout the engine starts in.

        Returns:
            policy: a fresh `SwitchPolicy`.
        """
        if not isinstance(settings, PolicySettings):
            raise TypeError(f"settings must be a PolicySettings, got {type(settings).__name__}")
        return cls(**settings._asdict(), capacity_check=capacity_check, initial_layout=initial_layout)

    @property
    def settings(self) -> PolicySettings:
        """The validated settings.

        Returns:
            settings: the `PolicySettings` this policy was built with (integer fields normalised).
        """
        return self._settings

    @property
    def layout(self) -> str:
        """The current layout, ``"tp"`` or ``"ep"``.

        Returns:
            layout: str, ``"tp"`` or ``"ep"``.
        """
        return self._layout

    def state(self) -> PolicyState:
        """Snapshot the mutable state.

        Returns:
            state: a `PolicyState`.
        """
        return PolicyState(self._layout, self._last_step, self._last_switch_step, self._switch_count,
                           self._refusal_count, tuple(self._window))

    def set_layout(self, layout: str, step: Optional[int] = None) -> None:
        """Tell the policy the engine's actual layout (e.g. after a failed or external switch).

        Arguments:
            layout: ``"tp"`` or ``"ep"``.
            step: if given, the step at which the layout changed: it starts a cooldown.
        """
        layout = _check_layout("layout", layout)
        if layout != self._layout:
            self._layout = layout
            self._window.clear()
        if step is not None:
            self._last_switch_step = check_int("step", step, 0)

    def observe(self, step: int, num_requests: int) -> Decision:
        """Record the in-flight request count of one step and decide whether to switch.

        Arguments:
            step: the engine step index, strictly increasing across calls (gaps allowed).
            num_requests: in-flight requests at this step (running and queued), ``>= 0``.

        Returns:
            decision: a `Decision`; when ``decision.target`` is not ``None`` the policy assumes
            the caller switches now (call ``set_layout()`` if the switch fails).
        """
        step = check_int("step", step, 0)
        count = check_int("num_requests", num_requests, 0)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step must be strictly increasing: got {step} after {self._last_step}")
        self._last_step = step
        self._window.append(count)
        s = self._settings

        if self._layout == TP:
            if not count >= s.threshold_high:
                return Decision(None, f"stay tp: {count} requests < T_h={s.threshold_high:g}", TP, HOLD)
            target, why = EP, f"{count} requests >= T_h={s.threshold_high:g}"
        else:
            w = s.effective_window
            if len(self._window) < w:
                return Decision(None, f"stay ep: {len(self._window)} of W={w} steps observed in ep",
                                EP, WARMUP)
            mean = sum(self._window) / len(self._window)
            if not mean < s.threshold_low:
                return Decision(None, f"stay ep: mean {mean:g} over {w} steps >= T_l={s.threshold_low:g}",
                                EP, HOLD)
            target, why = TP, f"mean {mean:g} over {w} steps < T_l={s.threshold_low:g}"

        if self._last_switch_step is not None and step - self._last_switch_step <= s.cooldown_steps:
            left = s.cooldown_steps - (step - self._last_switch_step) + 1
            return Decision(None, f"cooldown: would switch to {target} ({why}) but {left} cooldown "
                                  f"step(s) remain", self._layout, COOLDOWN)
        if self._capacity_check is not None:
            ok = self._capacity_check(target, count)
            if not isinstance(ok, (bool, np.bool_)):
                raise TypeError(f"capacity_check must return a bool, got {type(ok).__name__} {ok!r}")
            if not ok:
                self._refusal_count += 1
                return Decision(None, f"refused: capacity check refused {self._layout}->{target} at "
                                      f"{count} requests ({why})", self._layout, REFUSED)
        previous = self._layout
        self._layout = target
        self._last_switch_step = step
        self._switch_count += 1
        self._window.clear()
        return Decision(target, f"switch {previous}->{target}: {why}", target,
                        ENTER_EP if target == EP else RETURN_TP)


class Calibration(NamedTuple):
    """Measured EP and TP step latencies and the threshold derived from them.

    Arguments:
        batch_sizes: the measured batch sizes, ascending.
        tp_seconds: TP step latency at each batch size (median over repeats).
        ep_seconds: EP step latency at each batch size (median over repeats).
        threshold_high: ``T_h``: the interpolated crossover, ``NEVER`` or the smallest size.
        outcome: ``"crossover"``, ``"tp_always"`` (``T_h = NEVER``) or ``"ep_always"``
            (``T_h`` = smallest measured size).
    """

    batch_sizes: Tuple[int, ...]
    tp_seconds: Tuple[float, ...]
    ep_seconds: Tuple[float, ...]
    threshold_high: float
    outcome: str

    def settings(self, window: int = 64, low_ratio: float = 0.8, cooldown_steps: int = 128,
                 rollout_mode: bool = False) -> PolicySettings:
        """Policy settings using the calibrated ``T_h``.

        Arguments:
            window, low_ratio, cooldown_steps, rollout_mode: as in `PolicySettings`.

        Returns:
            settings: validated `PolicySettings`.
        """
        return PolicySettings(self.threshold_high, window, low_ratio, cooldown_steps, rollout_mode).validated()


def _measure(measure: Callable[[str, int], float], layout: str, batch: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        value = measure(layout, batch)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"measure_step_latency({layout!r}, {batch}) must return seconds as a number, "
                            f"got {type(value).__name__} {value!r}")
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"measure_step_latency({layout!r}, {batch}) must return finite seconds > 0, "
                             f"got {value}")
        samples.append(value)
    samples.sort()
    mid = len(samples) // 2
    return samples[mid] if len(samples) % 2 else 0.5 * (samples[mid - 1] + samples[mid])


def calibrate(measure_step_latency: Callable[[str, int], float], batch_sizes: Iterable[int],
              repeats: int = 1) -> Calibration:
    """Measure EP and TP step latency at several batch sizes and put ``T_h`` at the crossover.

    With ``d(b) = EP(b) - TP(b)`` (positive where TP is faster), ``T_h`` is the point where the
    last sign change from ``d > 0`` to ``d <= 0`` happens, linearly interpolated between the two
    batch sizes bracketing it, so EP is at least as fast at every measured size above ``T_h``.
    Without a crossover: TP faster at the largest size -> ``T_h = NEVER`` (``"tp_always"``); EP
    at least as fast everywhere -> ``T_h`` = smallest size (``"ep_always"``).

    Arguments:
        measure_step_latency: ``f(layout, batch_size) -> seconds`` of one decode step (a real
            engine run or a model); called ``repeats`` times per layout and size.
        batch_sizes: at least two distinct positive sizes (sorted here).
        repeats: measurements per point; their median is used.

    Returns:
        calibration: a `Calibration` with the tables and the threshold.
    """
    if not callable(measure_step_latency):
        raise TypeError(f"measure_step_latency must be callable(layout, batch_size) -> seconds, "
                        f"got {type(measure_step_latency).__name__}")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
        raise TypeError(f"batch_sizes must be an iterable of positive integers, got {type(batch_sizes).__name__}")
    sizes = [check_int("batch_sizes[i]", b, 1) for b in batch_sizes]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct, got {sizes}")
    if len(sizes) < 2:
        raise ValueError(f"batch_sizes needs at least 2 sizes to find a crossover, got {sizes}")
    repeats = check_int("repeats", repeats, 1)
    sizes.sort()
    tp = [_measure(measure_step_latency, TP, b, repeats) for b in sizes]
    ep = [_measure(measure_step_latency, EP, b, repeats) for b in sizes]
    threshold, outcome = _crossover(sizes, tp, ep)
    return Calibration(tuple(sizes), tuple(tp), tuple(ep), threshold, outcome)


def _crossover(sizes: Sequence[int], tp: Sequence[float], ep: Sequence[float]) -> Tuple[float, str]:
    diff = [e - t for t, e in zip(tp, ep)]
    tp_wins = [i for i, d in enumerate(diff) if d > 0]
    if not tp_wins:
        return float(sizes[0]), "ep_always"
    i = tp_wins[-1]
    if i == len(sizes) - 1:
        return NEVER, "tp_always"
    d0, d1 = diff[i], diff[i + 1]  # d0 > 0 >= d1
    b0, b1 = sizes[i], sizes[i + 1]
    return b0 + d0 / (d0 - d1) * (b1 - b0), "crossover"
