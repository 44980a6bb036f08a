"""Synthetic request traces for the switch simulator.

Two shapes after the Moebius paper's evaluation (section 9):

- ``bursty_trace``: online serving, Poisson arrivals whose rate changes by phase (quiet phases
  around bursts), chat-like prompt and output lengths (log-normal);
- ``rollout_trace``: one RL rollout step, every sequence starts at time 0, output lengths
  heavy-tailed and capped, so the batch decays from thousands to a few stragglers.

Traces are plain arrays plus phase boundaries; they are deterministic given ``seed``.
"""

import math
from typing import NamedTuple, Sequence, Tuple

import numpy as np

from mooncake_ep_switch.checks import check_int

SERVING = "serving"
ROLLOUT = "rollout"


class PhaseSpec(NamedTuple):
    """One phase of a bursty trace, as requested.

    Arguments:
        name: a label (``"quiet"``, ``"burst"``, ...), used in per-phase metrics.
        duration_seconds: how long arrivals follow this rate, > 0.
        rate_per_second: mean Poisson arrival rate, >= 0.
    """

    name: str
    duration_seconds: float
    rate_per_second: float


class Phase(NamedTuple):
    """One phase of a generated trace, on the trace's clock.

    Arguments:
        name: the label.
        start: start time in seconds (inclusive).
        end: end time in seconds (exclusive; ``math.inf`` for the last phase of a rollout).
    """

    name: str
    start: float
    end: float


class Trace(NamedTuple):
    """Requests to replay, sorted by arrival time; arrays are read-only.

    Arguments:
        kind: ``"serving"`` or ``"rollout"``.
        arrival_seconds: float64 arrival times, ascending.
        prompt_tokens: int64 prompt lengths, >= 1.
        output_tokens: int64 output lengths, >= 1.
        phases: the phases, contiguous and ascending; requests belong to the phase of their arrival.
        seed: the seed it was generated with.
    """

    kind: str
    arrival_seconds: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    phases: Tuple[Phase, ...]
    seed: int

    @property
    def num_requests(self) -> int:
        """Number of requests.

        Returns:
            count: int, the length of ``arrival_seconds``.
        """
        return int(self.arrival_seconds.shape[0])

    def phase_index(self) -> np.ndarray:
        """Index into ``phases`` of each request, by arrival time.

        Returns:
            index: int64 array, one entry per request.
        """
        starts = np.array([p.start for p in self.phases])
        return np.searchsorted(starts, self.arrival_seconds, side="right") - 1


#: The paper's bursty workload shape (about 3,100 requests: ~5 req/s quiet, bursts of 80 and 120
#: req/s; the paper has 3,107 ChatBot Arena requests over 375 s). Burst lengths are ours.
PAPER_BURSTY_PHASES = (
    PhaseSpec("quiet", 60.0, 5.0),
    PhaseSpec("burst", 8.0, 80.0),
    PhaseSpec("quiet", 120.0, 5.0),
    PhaseSpec("burst", 8.0, 120.0),
    PhaseSpec("quiet", 120.0, 5.0),
)


def _check_positive(name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float,
                       maximum: int) -> np.ndarray:
    values = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(values), 1, maximum).astype(np.int64)


def _readonly(*arrays: np.ndarray):
    for a in arrays:
        a.setflags(write=False)


def bursty_trace(seed: int = 0, phases: Sequence[PhaseSpec] = PAPER_BURSTY_PHASES,
                 prompt_median: float = 384.0, prompt_sigma: float = 0.8,
                 output_median: float = 200.0, output_sigma: float = 0.8,
                 max_prompt_tokens: int = 4096, max_output_tokens: int = 2048) -> Trace:
    """Online-serving trace: Poisson arrivals with a per-phase rate, log-normal lengths.

    Arguments:
        seed: RNG seed; the same seed gives the same trace.
        phases: ``PhaseSpec`` list, played back to back.
        prompt_median, prompt_sigma: log-normal prompt lengths (median, sigma of the log).
        output_median, output_sigma: log-normal output lengths.
        max_prompt_tokens, max_output_tokens: caps.

    Returns:
        trace: a ``"serving"`` `Trace`.
    """
    phases = tuple(phases)
    if not phases:
        raise ValueError("phases must hold at least one PhaseSpec, got an empty sequence")
    for i, p in enumerate(phases):
        if not isinstance(p, PhaseSpec):
            raise TypeError(f"phases[{i}] must be a PhaseSpec, got {type(p).__name__}")
        _check_positive(f"phases[{i}].duration_seconds", p.duration_seconds)
        _check_positive(f"phases[{i}].rate_per_second", p.rate_per_second, allow_zero=True)
    for name, v in (("prompt_median", prompt_median), ("prompt_sigma", prompt_sigma),
                    ("output_median", output_median), ("output_sigma", output_sigma)):
        _check_positive(name, v, allow_zero=name.endswith("sigma"))
    rng = np.random.default_rng(seed)
    arrivals, out_phases, t = [], [], 0.0
    for p in phases:
        n = rng.poisson(p.rate_per_second * p.duration_seconds)
        arrivals.append(np.sort(rng.uniform(t, t + p.duration_seconds, size=n)))
        out_phases.append(Phase(p.name, t, t + p.duration_seconds))
        t += p.duration_seconds
    arrival = np.concatenate(arrivals)
    n = arrival.shape[0]
    prompt = _lognormal_lengths(rng, n, prompt_median, prompt_sigma, int(max_prompt_tokens))
    output = _lognormal_lengths(rng, n, output_median, output_sigma, int(max_output_tokens))
    _readonly(arrival, prompt, output)
    return Trace(SERVING, arrival, prompt, output, tuple(out_phases), int(seed))


def rollout_trace(seed: int = 0, num_sequences: int = 2048, prompt_median: float = 256.0,
                  prompt_sigma: float = 0.5, output_median: float = 3000.0, output_sigma: float = 1.0,
                  max_output_tokens: int = 32768, max_prompt_tokens: int = 4096) -> Trace:
    """One RL rollout step: all sequences start at time 0, heavy-tailed capped output lengths.

    The defaults follow the paper's DeepMath rollouts (2,048 prompts, 32,768-token cap); the
    length distribution (log-normal, median 3,000, sigma 1.0) is our assumption.

    Arguments:
        seed: RNG seed; the same seed gives the same trace.
        num_sequences: sequences in the rollout, >= 1.
        prompt_median, prompt_sigma: log-normal prompt lengths.
        output_median, output_sigma: log-normal output lengths before the cap.
        max_output_tokens, max_prompt_tokens: caps.

    Returns:
        trace: a ``"rollout"`` `Trace` with one phase ``"rollout"``.
    """
    num_sequences = check_int("num_sequences", num_sequences, 1)
    for name, v in (("prompt_median", prompt_median), ("prompt_sigma", prompt_sigma),
                    ("output_median", output_median), ("output_sigma", output_sigma)):
        _check_positive(name, v, allow_zero=name.endswith("sigma"))
    rng = np.random.default_rng(seed)
    n = int(num_sequences)
    arrival = np.zeros(n)
    prompt = _lognormal_lengths(rng, n, prompt_median, prompt_sigma, int(max_prompt_tokens))
    output = _lognormal_lengths(rng, n, output_median, output_sigma, int(max_output_tokens))
    _readonly(arrival, prompt, output)
    return Trace(ROLLOUT, arrival, prompt, output, (Phase("rollout", 0.0, math.inf),), int(seed))
