"""Step-level serving simulator for TP / EP / switching layouts, driven by a step-latency model.

One engine step, as in SGLang with chunked prefill: (1) observe the in-flight request count
(running + queued) and pick the layout, paying the switch time if it changes; (2) admit queued
requests FIFO while the layout's running cap and the step's prefill token budget allow and
prefill them (their first token appears when the prefill ends); (3) decode one token for every
request that was already running. A request of ``L`` output tokens admitted at step ``k`` finishes
at the end of step ``k + L - 1``.

Modes:

- ``static_tp`` / ``static_ep``: one layout all along, never a switch;
- ``policy``: a `SwitchPolicy` observes every step; starts in TP, every switch is charged;
- ``oracle``: the cheapest layout schedule for the step trajectory, switch cost charged, found by
  dynamic programming over the per-step (TP cost, EP cost, switch cost) of the trajectory; starts
  in TP like the policy. On a rollout trace (everything arrives at 0, equal running caps) the
  trajectory does not depend on the layout, so this is the exact optimum: a lower bound on the
  makespan any switching policy can reach. On a serving trace the plan is made on the trajectory
  of ``oracle_free`` and replayed by step index, so it is a reference, not a bound;
- ``oracle_free``: per step the faster layout with switches free (counted, not charged): an
  unreachable bound.

Note the paper's "oracle" is different: one static layout per rollout step chosen with
foreknowledge, which on a single rollout step equals the better static layout.
"""

import math
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from mooncake_ep_switch.switch.planning.policy import EP, LAYOUTS, TP, PolicySettings, SwitchPolicy
from mooncake_ep_switch.switch.planning.cost_model import CostModel
from mooncake_ep_switch.switch.planning.traces import ROLLOUT, Trace

STATIC_TP = "static_tp"
STATIC_EP = "static_ep"
POLICY = "policy"
ORACLE = "oracle"
ORACLE_FREE = "oracle_free"
MODES = (STATIC_TP, STATIC_EP, POLICY, ORACLE, ORACLE_FREE)

_LAYOUT_CODE = {TP: 0, EP: 1}


class Timeline(NamedTuple):
    """Per-step record of a run (for plots); arrays of one entry per step.

    Arguments:
        time: step start time in seconds (after any switch at that step).
        num_requests: in-flight requests (running + queued) observed at the step.
        batch: decode batch of the step.
        layout: 0 for TP, 1 for EP.
        step_seconds: prefill + decode latency of the step (switch time excluded).
        pause_seconds: switch time paid just before the step (0 for most steps).
    """

    time: np.ndarray
    num_requests: np.ndarray
    batch: np.ndarray
    layout: np.ndarray
    step_seconds: np.ndarray
    pause_seconds: np.ndarray

    def decode_interval_mean(self, mask: Optional[np.ndarray] = None) -> float:
        """Token-weighted mean time between two tokens of a running request (decode TPOT).

        Each step weighs by its decode batch; its interval is its latency plus any switch pause
        before it (a switch stalls every running request).

        Arguments:
            mask: optional boolean mask of the steps to include.

        Returns:
            seconds: the mean interval, NaN if no decode happened.
        """
        weight = self.batch if mask is None else self.batch[mask]
        interval = self.step_seconds + self.pause_seconds
        if mask is not None:
            interval = interval[mask]
        total = weight.sum()
        return float((weight * interval).sum() / total) if total else float("nan")


class SwitchEvent(NamedTuple):
    """One layout switch.

    Arguments:
        time: when it started.
        step: the step it preceded.
        source, target: layouts.
        seconds: time charged (0 in ``oracle_free``).
        num_requests: in-flight requests at the switch.
    """

    time: float
    step: int
    source: str
    target: str
    seconds: float
    num_requests: int


class PhaseMetrics(NamedTuple):
    """Metrics of one trace phase (requests by arrival time, steps by start time).

    Arguments:
        name, start, end: the phase.
        requests: requests that arrived in it.
        ttft_mean, ttft_p99: time to first token of those requests, seconds.
        tpot_mean: mean per-request time per output token (requests of >= 2 tokens), seconds;
            a request that arrives late in a phase is also slowed by the next one.
        decode_interval_mean: token-weighted decode interval of the steps that start in the phase
            (what tokens generated during the phase experienced), seconds.
        tp_seconds, ep_seconds: engine busy time in each layout during the phase.
        switch_seconds: time spent switching during the phase.
    """

    name: str
    start: float
    end: float
    requests: int
    ttft_mean: float
    ttft_p99: float
    tpot_mean: float
    decode_interval_mean: float
    tp_seconds: float
    ep_seconds: float
    switch_seconds: float


class Metrics(NamedTuple):
    """Result of one simulated run.

    Arguments:
        mode: the mode.
        ttft_mean, ttft_p99: time to first token, seconds.
        tpot_mean: mean per-request time per output token, seconds.
        decode_interval_mean: token-weighted decode interval over the run (`Timeline`), seconds.
        makespan: last finish minus first arrival, seconds (the rollout time on a rollout trace).
        switch_count: layout changes.
        switch_seconds: total time charged for switches.
        tp_seconds, ep_seconds: engine busy time in each layout.
        steps: engine steps.
        phases: one `PhaseMetrics` per trace phase.
        switches: the `SwitchEvent` list.
        timeline: the per-step `Timeline`.
    """

    mode: str
    ttft_mean: float
    ttft_p99: float
    tpot_mean: float
    decode_interval_mean: float
    makespan: float
    switch_count: int
    switch_seconds: float
    tp_seconds: float
    ep_seconds: float
    steps: int
    phases: Tuple[PhaseMetrics, ...]
    switches: Tuple[SwitchEvent, ...]
    timeline: Timeline


def default_policy_settings(trace: Trace, cost_model: CostModel) -> PolicySettings:
    """Policy settings for a trace: ``T_h`` calibrated on the cost model, paper-like hysteresis.

    Rollout traces get rollout mode (no cooldown needed: the batch only shrinks). Serving traces
    get ``W = 64`` steps and a cooldown of 5 s (the paper's) in low-load TP steps.

    Arguments:
        trace: the trace to simulate.
        cost_model: the model whose crossover gives ``T_h``.

    Returns:
        settings: validated `PolicySettings`.
    """
    calibration = cost_model.calibration()
    if trace.kind == ROLLOUT:
        return calibration.settings(window=1, cooldown_steps=0, rollout_mode=True)
    cooldown = int(math.ceil(5.0 / cost_model.decode_seconds(TP, 1)))
    return calibration.settings(window=64, low_ratio=0.8, cooldown_steps=cooldown)


# A chooser gets (step, in-flight count, running, cost of this step in each layout as a callable)
# and returns (layout, charge_switch).
_Chooser = Callable[[int, int, int, Callable[[str], float]], Tuple[str, bool]]


class _Run(NamedTuple):
    first_token: np.ndarray
    finish: np.ndarray
    timeline: Timeline
    switches: Tuple[SwitchEvent, ...]
    prefill_tokens: np.ndarray


def _check_trace(trace: Trace) -> None:
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a traces.Trace, got {type(trace).__name__}")
    if trace.num_requests == 0:
        raise ValueError("trace must hold at least one request, got 0")
    if np.any(np.diff(trace.arrival_seconds) < 0):
        raise ValueError("trace.arrival_seconds must be ascending")


def _run(trace: Trace, cost: CostModel, initial_layout: str, choose: _Chooser) -> _Run:
    """The engine loop described in the module docstring; ``choose`` picks each step's layout."""
    arrival, prompt, output = trace.arrival_seconds, trace.prompt_tokens, trace.output_tokens
    n = trace.num_requests
    prompt_cum = np.concatenate(([0], np.cumsum(prompt)))
    cap_max = max(cost.tp_max_running, cost.ep_max_running)
    decode = {TP: cost.decode_table(TP, cap_max), EP: cost.decode_table(EP, cap_max)}
    budget = cost.max_prefill_tokens
    first_token = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    buckets: Dict[int, List[np.ndarray]] = {}
    tl_time, tl_count, tl_batch, tl_layout, tl_seconds, tl_pause, tl_tokens = [], [], [], [], [], [], []
    switches: List[SwitchEvent] = []
    t = float(arrival[0])
    arrived = admitted = running = done = step = 0
    layout = initial_layout

    def admission(lay: str) -> int:
        room = cost.max_running(lay) - running
        end = min(arrived, admitted + max(room, 0))
        if end <= admitted:
            return admitted
        # FIFO: as many as the budget allows, at least one.
        k = int(np.searchsorted(prompt_cum, prompt_cum[admitted] + budget, side="right")) - 1
        return min(end, max(k, admitted + 1))

    def step_cost(lay: str) -> float:
        k = admission(lay)
        tokens = int(prompt_cum[k] - prompt_cum[admitted])
        return cost.prefill_seconds(lay, tokens) + decode[lay][running]

    while done < n:
        arrived = int(np.searchsorted(arrival, t, side="right"))
        if running == 0 and arrived == admitted:
            t = float(arrival[arrived])  # idle until the next arrival
            continue
        count = running + arrived - admitted
        target, charge = choose(step, count, running, step_cost)
        pause = 0.0
        if target != layout:
            seconds = cost.switch_seconds(count) if charge else 0.0
            switches.append(SwitchEvent(t, step, layout, target, seconds, count))
            t += seconds
            pause = seconds
            layout = target
        k = admission(layout)
        tokens = int(prompt_cum[k] - prompt_cum[admitted])
        prefill = cost.prefill_seconds(layout, tokens)
        seconds = prefill + decode[layout][running]
        batch = running
        if k > admitted:
            first_token[admitted:k] = t + prefill
            ids = np.arange(admitted, k)
            lengths = output[admitted:k]
            single = ids[lengths == 1]
            finish[single] = t + prefill
            done += single.shape[0]
            multi = lengths > 1
            for end_step, group in _group_by(step + lengths[multi] - 1, ids[multi]):
                buckets.setdefault(end_step, []).append(group)
            running += int(multi.sum())
            admitted = k
        t_end = t + seconds
        for group in buckets.pop(step, ()):
            finish[group] = t_end
            running -= group.shape[0]
            done += group.shape[0]
        tl_time.append(t)
        tl_count.append(count)
        tl_batch.append(batch)
        tl_layout.append(_LAYOUT_CODE[layout])
        tl_seconds.append(seconds)
        tl_pause.append(pause)
        tl_tokens.append(tokens)
        t = t_end
        step += 1

    timeline = Timeline(np.array(tl_time), np.array(tl_count, dtype=np.int64), np.array(tl_batch, dtype=np.int64),
                        np.array(tl_layout, dtype=np.int8), np.array(tl_seconds), np.array(tl_pause))
    return _Run(first_token, finish, timeline, tuple(switches), np.array(tl_tokens, dtype=np.int64))


def _group_by(keys: np.ndarray, ids: np.ndarray):
    if keys.shape[0] == 0:
        return
    order = np.argsort(keys, kind="stable")
    keys, ids = keys[order], ids[order]
    cuts = np.flatnonzero(np.diff(keys)) + 1
    for chunk_keys, chunk_ids in zip(np.split(keys, cuts), np.split(ids, cuts)):
        yield int(chunk_keys[0]), chunk_ids


def _oracle_plan(run: _Run, cost: CostModel, initial_layout: str) -> np.ndarray:
    """Cheapest layout per step for a recorded trajectory, switches charged (dynamic programming)."""
    tl = run.timeline
    steps = tl.batch.shape[0]
    cap_max = max(cost.tp_max_running, cost.ep_max_running)
    per_token = np.array([cost.tp_prefill_seconds_per_token, cost.ep_prefill_seconds_per_token])
    tokens = run.prefill_tokens
    step_cost = np.empty((steps, 2))
    for code, lay in enumerate(LAYOUTS):
        prefill = np.where(tokens > 0, cost.prefill_overhead_seconds + per_token[code] * tokens, 0.0)
        step_cost[:, code] = prefill + cost.decode_table(lay, cap_max)[tl.batch]
    switch = np.array([cost.switch_seconds(c) for c in tl.num_requests])
    total = np.empty((steps, 2))
    came_from_switch = np.zeros((steps, 2), dtype=bool)
    start = _LAYOUT_CODE[initial_layout]
    total[0, start] = step_cost[0, start]
    total[0, 1 - start] = switch[0] + step_cost[0, 1 - start]
    came_from_switch[0, 1 - start] = True
    for k in range(1, steps):
        for code in (0, 1):
            stay = total[k - 1, code]
            move = total[k - 1, 1 - code] + switch[k]
            came_from_switch[k, code] = move < stay
            total[k, code] = min(stay, move) + step_cost[k, code]
    plan = np.empty(steps, dtype=np.int8)
    code = int(np.argmin(total[-1]))
    for k in range(steps - 1, -1, -1):
        plan[k] = code
        if came_from_switch[k, code]:
            code = 1 - code
    return plan


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.shape[0] else float("nan")


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.shape[0] else float("nan")


def _metrics(mode: str, trace: Trace, run: _Run) -> Metrics:
    ttft = run.first_token - trace.arrival_seconds
    multi = trace.output_tokens > 1
    tpot = np.full(trace.num_requests, np.nan)
    tpot[multi] = (run.finish[multi] - run.first_token[multi]) / (trace.output_tokens[multi] - 1)
    tl = run.timeline
    busy_tp = float(tl.step_seconds[tl.layout == 0].sum())
    busy_ep = float(tl.step_seconds[tl.layout == 1].sum())
    phase_of_request = trace.phase_index()
    starts = np.array([p.start for p in trace.phases])
    phase_of_step = np.searchsorted(starts, tl.time, side="right") - 1
    switch_phase = np.searchsorted(starts, np.array([s.time for s in run.switches]), side="right") - 1
    switch_secs = np.array([s.seconds for s in run.switches])
    phases = []
    for i, p in enumerate(trace.phases):
        mask = phase_of_request == i
        steps = phase_of_step == i
        phases.append(PhaseMetrics(
            p.name, p.start, p.end, int(mask.sum()), _mean(ttft[mask]), _percentile(ttft[mask], 99),
            _mean(tpot[mask & multi]), tl.decode_interval_mean(steps),
            float(tl.step_seconds[steps & (tl.layout == 0)].sum()),
            float(tl.step_seconds[steps & (tl.layout == 1)].sum()),
            float(switch_secs[switch_phase == i].sum()) if switch_secs.shape[0] else 0.0))
    return Metrics(mode, _mean(ttft), _percentile(ttft, 99), _mean(tpot[multi]), tl.decode_interval_mean(),
                   float(np.nanmax(run.finish) - trace.arrival_seconds[0]), len(run.switches),
                   float(switch_secs.sum()) if switch_secs.shape[0] else 0.0, busy_tp, busy_ep,
                   int(tl.batch.shape[0]), tuple(phases), run.switches, tl)


def simulate(trace: Trace, cost_model: CostModel, mode: str,
             policy_settings: Optional[PolicySettings] = None) -> Metrics:
    """Replay a trace through the step-level engine model in one mode.

    Arguments:
        trace: a `Trace` from ``traces``.
        cost_model: the `CostModel`.
        mode: one of ``MODES`` (see the module docstring for what each means).
        policy_settings: for ``"policy"``; default `default_policy_settings(trace, cost_model)`.
            Its capacity check refuses a switch when the running requests exceed the target
            layout's cap.

    Returns:
        metrics: the run's `Metrics`.
    """
    _check_trace(trace)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if policy_settings is not None and not isinstance(policy_settings, PolicySettings):
        raise TypeError(f"policy_settings must be a PolicySettings or None, got {type(policy_settings).__name__}")

    if mode in (STATIC_TP, STATIC_EP):
        fixed = TP if mode == STATIC_TP else EP
        return _metrics(mode, trace, _run(trace, cost_model, fixed, lambda *_: (fixed, True)))

    if mode == POLICY:
        settings = policy_settings if policy_settings is not None else default_policy_settings(trace, cost_model)
        running_now = [0]

        def capacity(target: str, _count: int) -> bool:
            return running_now[0] <= cost_model.max_running(target)

        policy = SwitchPolicy.from_settings(settings, capacity_check=capacity, initial_layout=TP)

        def choose_policy(step, count, running, _cost):
            running_now[0] = running
            policy.observe(step, count)
            return policy.layout, True

        return _metrics(mode, trace, _run(trace, cost_model, TP, choose_policy))

    def choose_free(step, count, running, step_cost):
        return (TP if step_cost(TP) <= step_cost(EP) else EP), False

    free = _run(trace, cost_model, TP, choose_free)
    if mode == ORACLE_FREE:
        return _metrics(mode, trace, free)

    plan = _oracle_plan(free, cost_model, TP)

    def choose_plan(step, count, running, _cost):
        return LAYOUTS[plan[min(step, plan.shape[0] - 1)]], True

    return _metrics(mode, trace, _run(trace, cost_model, TP, choose_plan))


class ComparisonRow(NamedTuple):
    """One row of `compare()`.

    Arguments:
        mode: the mode.
        ttft_mean, ttft_p99, tpot_mean, makespan: from its `Metrics` (seconds).
        switch_count: layout changes.
        speedup_vs_best_static: best static makespan / this makespan.
        metrics: the full `Metrics`.
    """

    mode: str
    ttft_mean: float
    ttft_p99: float
    tpot_mean: float
    makespan: float
    switch_count: int
    speedup_vs_best_static: float
    metrics: Metrics


def compare(trace: Trace, cost_model: CostModel, policy_settings: Optional[PolicySettings] = None,
            modes: Sequence[str] = MODES) -> Tuple[ComparisonRow, ...]:
    """Simulate a trace in several modes and tabulate them.

    Arguments:
        trace: the `Trace`.
        cost_model: the `CostModel`.
        policy_settings: for the ``"policy"`` mode (see `simulate()`).
        modes: modes to run; the static ones always run (they are the speed-up reference).

    Returns:
        rows: one `ComparisonRow` per mode, in ``modes`` order.
    """
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes must be drawn from {MODES}, got {m!r}")
    to_run = dict.fromkeys((STATIC_TP, STATIC_EP, *modes))  # ordered, no duplicates
    results = {m: simulate(trace, cost_model, m, policy_settings) for m in to_run}
    best_static = min(results[STATIC_TP].makespan, results[STATIC_EP].makespan)
    return tuple(ComparisonRow(m, r.ttft_mean, r.ttft_p99, r.tpot_mean, r.makespan, r.switch_count,
                               best_static / r.makespan, r)
                 for m, r in ((m, results[m]) for m in modes))


def format_table(rows: Sequence[ComparisonRow]) -> str:
    """Render `compare()` rows as a fixed-width text table (times in ms / s as labelled).

    Arguments:
        rows: `ComparisonRow` values.

    Returns:
        text: the table.
    """
    lines = [f"{'mode':<12} {'TTFT mean s':>11} {'TTFT p99 s':>10} {'TPOT ms':>8} {'makespan s':>10} "
             f"{'switches':>8} {'vs best static':>14}"]
    for r in rows:
        lines.append(f"{r.mode:<12} {r.ttft_mean:>11.2f} {r.ttft_p99:>10.2f} {1e3 * r.tpot_mean:>8.1f} "
                     f"{r.makespan:>10.1f} {r.switch_count:>8d} {r.speedup_vs_best_static:>13.3f}x")
    return "\n".join(lines)


def plot_timeline(results: Union[Sequence[Metrics], Sequence[ComparisonRow], Mapping[str, Metrics]], path: str,
                  threshold_high: Optional[float] = None) -> str:
    """Plot in-flight requests and the layout over time for each run, to a PNG.

    Arguments:
        results: `Metrics` or `ComparisonRow` values, or a mapping mode -> `Metrics`.
        path: output file path (PNG).
        threshold_high: if given, drawn as a horizontal line on the request plot.

    Returns:
        path: the written path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    items = list(results.values()) if isinstance(results, Mapping) else list(results)
    runs = [r.metrics if isinstance(r, ComparisonRow) else r for r in items]
    if not runs or not all(isinstance(r, Metrics) for r in runs):
        raise TypeError("results must be a non-empty sequence of Metrics or ComparisonRow, or a mapping to Metrics")
    fig = Figure(figsize=(11, 6), constrained_layout=True)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": (3, 1.4)})
    for i, r in enumerate(runs):
        tl = r.timeline
        top.plot(tl.time, tl.num_requests, lw=0.9, label=r.mode)
        bottom.step(tl.time, tl.layout + 1.3 * i, where="post", lw=1.0, label=r.mode)
    if threshold_high is not None and math.isfinite(threshold_high):
        top.axhline(threshold_high, color="k", ls="--", lw=0.8, label=f"T_h = {threshold_high:.0f}")
    top.set_ylabel("in-flight requests")
    top.legend(loc="upper right", fontsize=8)
    bottom.set_yticks([1.3 * i + 0.5 for i in range(len(runs))], [r.mode for r in runs], fontsize=8)
    bottom.set_ylabel("layout (low TP, high EP)")
    bottom.set_xlabel("time (s)")
    fig.savefig(path, dpi=110)
    return path
