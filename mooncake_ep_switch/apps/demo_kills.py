"""The demo's deaths: which steps kill a rank, which rank, how long the survivors serve without it, stalls.

A run kills up to two ranks, each replaced before the next death (`DemoConfig`):

* the *covered* kill (`covered_kill_step`): a rank all of whose experts have a live copy on
  another rank (fault-aware routing loses nothing from the next step on), replaced after one step;
* the main kill (`kill_step`): `kill_rank` when it holds the only copy of some expert, else the
  lowest rank that does (`kill_covered`: a covered rank instead); the survivors serve
  `replace_after` steps without it, from 2 on with a coverage epoch restoring its experts.

A rank the survivors masked although it was alive (its process ran: a stall past the step's
deadline, as on a loaded machine) is a *stall*, not a death: `stalled_ranks` names them.
"""
from typing import List, Optional

import numpy as np

from mooncake_ep_switch.apps.demo_ranks import DemoConfig, uncovered_without

__all__ = ["Kill", "plan_kills", "covered_kill_rank", "only_copy_rank", "step_timeout_us", "stalled_ranks",
           "judged_diffs", "STALL_FACTOR", "MAX_TIMEOUT_US"]

STALL_FACTOR = 20  # a step's deadline: this many times the slowest of the recent steps (never under the floor)
MAX_TIMEOUT_US = 60_000_000  # the deadline's cap
RECENT_STEPS = 5


class Kill:
    """One death of the run: its step, how its rank is chosen, the steps served without it, what it measured.

    Attributes:
        index: 1-based order in the run.
        step: the decode step at which the rank SIGKILLs itself.
        covered: the rank is one all of whose experts have a live copy elsewhere.
        replace_after: steps the survivors serve without it before its replacement starts.
        rank: the rank killed (set at `step`; None before, or when no rank fits and the kill is skipped).
        coverage_step: the commit step of its coverage epoch, or None.
        coverage_at: wall clock of that commit, or None.
        recovery: the demo's recovery record (None until the replacement started).
    """

    def __init__(self, index: int, step: int, covered: bool, replace_after: int):
        self.index, self.step, self.covered, self.replace_after = index, step, covered, replace_after
        self.rank: Optional[int] = None
        self.skipped = False
        self.coverage_step = self.coverage_at = None
        self.recovery: Optional[dict] = None

    def window(self, step: int) -> bool:
        """Whether the survivors serve `step` without the rank (after the kill step, before the replacement)."""
        return not self.skipped and self.step < step <= self.step + self.replace_after


def plan_kills(config: DemoConfig, trace: List[int]) -> List[Kill]:
    """The run's kills in step order, checked against the trace.

    Arguments:
        config: the `DemoConfig`.
        trace: requests per step (`request_trace`).

    Returns:
        kills: list of `Kill` (empty: `kill_step` -1).

    Raises:
        ValueError: a kill step outside the burst, or a covered kill not before the main kill's step with its
            replacement admitted in between (named argument, the steps).
    """
    kills = []
    if config.kill_step < 0:
        return kills
    for name, step in (("covered_kill_step", config.covered_kill_step), ("kill_step", config.kill_step)):
        if step >= 0 and (step >= len(trace) or trace[step] < config.switch_threshold):
            raise ValueError(f"{name}: expected a step inside the burst (EP layout), got {step}")
    if config.covered_kill_step >= 0:
        if config.covered_kill_step + 1 >= config.kill_step:
            raise ValueError(f"covered_kill_step: expected a step before kill_step - 1 = {config.kill_step - 1} "
                             f"(replaced after one step, before the next death), got {config.covered_kill_step}")
        kills.append(Kill(1, config.covered_kill_step, True, 1))
    kills.append(Kill(len(kills) + 1, config.kill_step, config.kill_covered, config.replace_after))
    return kills


def covered_kill_rank(phy2log: np.ndarray, config: DemoConfig, avoid: int) -> Optional[int]:
    """The highest rank other than 0 and `avoid` all of whose experts have a copy on another rank; else any such
    rank; None when there is none."""
    covered = [r for r in range(config.num_ranks) if not uncovered_without(phy2log, config, r)]
    preferred = [r for r in covered if r not in (0, avoid)]
    return max(preferred) if preferred else (max(covered) if covered else None)


def only_copy_rank(phy2log: np.ndarray, config: DemoConfig) -> int:
    """`config.kill_rank` when it holds the only copy of some expert; else the lowest rank that does; else
    `config.kill_rank`."""
    if uncovered_without(phy2log, config, config.kill_rank):
        return config.kill_rank
    return next((r for r in range(config.num_ranks) if uncovered_without(phy2log, config, r)), config.kill_rank)


def step_timeout_us(config: DemoConfig, seconds: List[float]) -> int:
    """The deadline of a step's dispatch/combine/all-reduce: `STALL_FACTOR` x the slowest of the last
    `RECENT_STEPS` steps, at least `config.timeout_us`, at most `MAX_TIMEOUT_US`.

    A dead rank is found by the peer watcher within milliseconds whatever the deadline (its process
    ends); the deadline only decides when a live but late rank is masked, which on a loaded machine
    must not happen to a rank that is merely slow.
    """
    recent = max(seconds[-RECENT_STEPS:], default=0.0)
    return int(min(MAX_TIMEOUT_US, max(config.timeout_us, STALL_FACTOR * recent * 1e6)))


def stalled_ranks(dead: List[int], kills: List[Kill], step: int) -> List[int]:
    """The ranks in `dead` that no kill explains at `step` (masked while their process ran)."""
    killed = {k.rank for k in kills if k.rank is not None and (k.step == step or k.window(step))}
    return [r for r in dead if r not in killed]


def judged_diffs(steps: List[dict]):
    """The largest calc_diff of the steps the check judges (no rank masked while alive) and of the others.

    Arguments:
        steps: the demo's per-step records ("max_calc_diff", "stalled_ranks").

    Returns:
        (judged, stalled): floats; `judged` 0.0 when every step stalled, `stalled` None when none did.
    """
    judged = [s["max_calc_diff"] for s in steps if not s["stalled_ranks"]]
    stalled = [s["max_calc_diff"] for s in steps if s["stalled_ranks"]]
    return max(judged, default=0.0), max(stalled, default=None)
