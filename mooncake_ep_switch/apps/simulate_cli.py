"""`mooncake-ep simulate`: replay a bursty serving trace and an RL-rollout trace through the switch policy.

Both traces (``switch/planning/traces.py``) run under the step-latency cost model (``switch/planning/simulator.py``)
in every mode: static TP, static EP, the switch policy and the oracle (plus ``oracle_free``, the
switches-are-free bound). The cost model is either the Moebius paper's (``CostModel.from_paper()``:
Qwen3-235B-A22B on 8xH200) or, with ``--calibrate``, measured on this machine: a single-process CPU
timing of one MoE layer in the TP and the EP layout at several batch sizes (`cpu_calibration()`),
fed to ``policy.calibrate()`` for the crossover.

The run checks the paper's qualitative result and says whether it holds (exit code 1 if not):

- bursty trace: in every phase the policy matches the better static layout of that phase (quiet:
  decode TPOT; bursts: TTFT mean and p99, TPOT), within 5 % plus, for TTFT, the policy's reaction
  time and switch pauses (`check_bursty()`);
- rollout trace: the policy's makespan beats the better static layout's (the paper's step-level
  oracle equals the better static layout on one rollout step).
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, TextIO, Tuple

import numpy as np

from mooncake_ep_switch.bench.cpu_calibration import (CPU_BATCH_SIZES, CPU_LAYER,  # noqa: F401  (re-exported)
                                                     QUICK_CPU_BATCH_SIZES, CpuCalibration, cpu_calibration)
from mooncake_ep_switch.switch.planning.policy import EP, NEVER, TP, PolicySettings
from mooncake_ep_switch.switch.planning.simulator import (ORACLE, POLICY, STATIC_EP, STATIC_TP,
                                                 ComparisonRow, CostModel, compare,
                                                 default_policy_settings, format_table, plot_timeline)
from mooncake_ep_switch.switch.planning.traces import PAPER_BURSTY_PHASES, PhaseSpec, Trace, bursty_trace, rollout_trace

#: The Moebius paper's results (seed 000, section 9), for the side-by-side table. ``None``: not given.
PAPER_RESULTS = {
    "bursty_ttft_mean_burst_s": {STATIC_TP: 9.9, STATIC_EP: None, POLICY: 3.1},
    "bursty_ttft_p99_burst_s": {STATIC_TP: 90.0, STATIC_EP: None, POLICY: 6.0},
    "bursty_tpot_quiet_ms": {STATIC_TP: 37.0, STATIC_EP: 52.0, POLICY: 37.0},
    "bursty_switches": {STATIC_TP: 0, STATIC_EP: 0, POLICY: 4},
    "rollout_speedup_vs_better_static": "1.16-1.25x (mean 1.22x)",
    "rollout_speedup_vs_worse_static": "up to 1.31x",
}

#: `--quick` bursty trace: the paper's shape (quiet, 80/s burst, quiet, 120/s burst, quiet), shorter.
QUICK_BURSTY_PHASES = (
    PhaseSpec("quiet", 20.0, 5.0),
    PhaseSpec("burst", 5.0, 80.0),
    PhaseSpec("quiet", 40.0, 5.0),
    PhaseSpec("burst", 5.0, 120.0),
    PhaseSpec("quiet", 40.0, 5.0),
)
QUICK_ROLLOUT_SEQUENCES = 1024
QUICK_ROLLOUT_MAX_OUTPUT = 16384

#: The paper's cooldown (5 s) and its shortest switch (215 ms), see `policy_settings()`.
PAPER_COOLDOWN_SECONDS = 5.0
PAPER_SWITCH_MIN_SECONDS = 0.215

#: Relative tolerance of the qualitative checks.
RELATIVE_TOLERANCE = 0.05

#: Modes drawn in the PNGs (``oracle_free`` switches every few steps and hides the rest).
PLOTTED_MODES = (STATIC_TP, STATIC_EP, POLICY, ORACLE)

# ---------------------------------------------------------------------------------------------
# running and checking


class Check(NamedTuple):
    """One qualitative check.

    Arguments:
        name: what is checked.
        holds: whether it holds.
        detail: the numbers behind the verdict.
    """

    name: str
    holds: bool
    detail: str


def build_traces(seed: int = 0, quick: bool = False) -> Tuple[Trace, Trace]:
    """The bursty serving trace and the rollout trace of a run.

    Arguments:
        seed: trace seed.
        quick: shorter traces (`QUICK_BURSTY_PHASES`, 1,024 rollout sequences capped at 16,384 tokens).

    Returns:
        bursty, rollout: two `Trace` values.
    """
    if quick:
        return (bursty_trace(seed=seed, phases=QUICK_BURSTY_PHASES),
                rollout_trace(seed=seed, num_sequences=QUICK_ROLLOUT_SEQUENCES,
                              max_output_tokens=QUICK_ROLLOUT_MAX_OUTPUT))
    return bursty_trace(seed=seed, phases=PAPER_BURSTY_PHASES), rollout_trace(seed=seed)


def policy_settings(trace: Trace, model: CostModel) -> PolicySettings:
    """The policy's settings for a trace: `default_policy_settings()` with a cooldown scaled to the model.

    The paper's cooldown is 5 s, about 23 switch times of 215 ms; here it stays 23 switch times
    (``5 s * switch_min / 0.215 s``), counted in low-load TP steps. Under the paper's model this
    is exactly ``default_policy_settings()`` (136 steps); under a CPU model whose steps and
    switches are a hundred times shorter it keeps the cooldown from spanning minutes of loaded
    steps, which would pin the policy in one layout through a whole burst.

    Arguments:
        trace: the trace.
        model: the cost model.

    Returns:
        settings: validated `PolicySettings`.
    """
    settings = default_policy_settings(trace, model)
    if settings.rollout_mode:
        return settings
    seconds = PAPER_COOLDOWN_SECONDS * model.switch_min_seconds / PAPER_SWITCH_MIN_SECONDS
    return settings._replace(cooldown_steps=int(math.ceil(seconds / model.decode_seconds(TP, 1)))).validated()


def _fine(x: float) -> bool:
    return x is not None and math.isfinite(x)


def _within(policy: float, better: float, slack: float = 0.0) -> bool:
    if not (_fine(policy) and _fine(better)):
        return True  # nothing measured in the phase (no request or no decode step)
    return policy <= better * (1.0 + RELATIVE_TOLERANCE) + slack + 1e-12


def _reaction_seconds(metrics, layout: str, start: float, end: float) -> Optional[float]:
    """Seconds from ``start`` until the run is in ``layout`` (0 if it already is), None if not before ``end``."""
    current = TP  # every switching mode starts in TP
    for event in metrics.switches:
        if event.time >= start:
            break
        current = event.target
    if current == layout:
        return 0.0
    for event in metrics.switches:
        if start <= event.time < end and event.target == layout:
            return event.time - start
    return None


def check_bursty(rows: Dict[str, ComparisonRow], model: CostModel) -> Tuple[Check, List[Check]]:
    """Does the policy match the better static layout in every phase of the bursty trace?

    Quiet phases compare the decode TPOT of the steps in the phase (token-weighted), tolerance 5 %.
    Bursts compare the mean and p99 TTFT of the requests arriving in the phase and their mean
    TPOT. The better static layout of a phase is the one with the lower quiet TPOT or the lower
    burst mean TTFT. In a burst the policy must reach the better layout; TPOT gets 5 %, TTFT 5 %
    plus the policy's reaction: the time from the burst's start until it is in the better layout
    (the in-flight count must first reach ``T_h``) and the switch pauses it paid in the phase.

    Arguments:
        rows: `compare()` rows by mode; needs ``static_tp``, ``static_ep`` and ``policy``.
        model: the cost model.

    Returns:
        overall, per_phase: the overall `Check` and one per phase.
    """
    tp, ep, policy = (rows[m].metrics.phases for m in (STATIC_TP, STATIC_EP, POLICY))
    checks = []
    for i, (t, e, p) in enumerate(zip(tp, ep, policy)):
        span = f"{p.name} {i + 1} [{p.start:.0f}-{p.end:.0f} s, {p.requests} req]"
        if p.name == "burst":
            better, label = (t, TP) if t.ttft_mean <= e.ttft_mean else (e, EP)
            reaction = _reaction_seconds(rows[POLICY].metrics, label, p.start, p.end)
            if reaction is None:
                holds, slack, when = False, 0.0, f"never in {label.upper()} during the burst"
            else:
                slack = reaction + p.switch_seconds
                holds = (_within(p.ttft_mean, better.ttft_mean, slack) and _within(p.ttft_p99, better.ttft_p99, slack)
                         and _within(p.tpot_mean, better.tpot_mean))
                when = f"in {label.upper()} after {reaction:.2f} s"
            detail = (f"better: static {label.upper()}: TTFT mean {better.ttft_mean:.2f} s, p99 "
                      f"{better.ttft_p99:.2f} s, TPOT {1e3 * better.tpot_mean:.1f} ms; policy ({when}, paused "
                      f"{p.switch_seconds:.2f} s): {p.ttft_mean:.2f} s, {p.ttft_p99:.2f} s, {1e3 * p.tpot_mean:.1f} ms")
        else:
            better, label = ((t, "TP") if not (e.decode_interval_mean < t.decode_interval_mean) else (e, "EP"))
            holds = _within(p.decode_interval_mean, better.decode_interval_mean)
            detail = (f"better: static {label}: decode TPOT {1e3 * better.decode_interval_mean:.1f} ms; "
                      f"policy {1e3 * p.decode_interval_mean:.1f} ms")
        checks.append(Check(span, holds, detail))
    good = sum(c.holds for c in checks)
    overall = Check("bursty: the policy matches the better static layout in every phase", good == len(checks),
                    f"{good}/{len(checks)} phases; {rows[POLICY].switch_count} switches")
    return overall, checks


def check_rollout(rows: Dict[str, ComparisonRow]) -> Check:
    """Does the policy's rollout makespan beat the better static layout's (by at least 0.1 %)?

    Arguments:
        rows: `compare()` rows by mode; needs ``static_tp``, ``static_ep`` and ``policy``.

    Returns:
        check: a `Check`.
    """
    tp, ep, policy = rows[STATIC_TP], rows[STATIC_EP], rows[POLICY]
    best = tp if tp.makespan <= ep.makespan else ep
    holds = policy.makespan < 0.999 * best.makespan
    return Check("rollout: the policy's makespan beats the better static layout", holds,
                 f"policy {policy.makespan:.1f} s vs {best.mode} {best.makespan:.1f} s: "
                 f"{best.makespan / policy.makespan:.3f}x; {policy.switch_count} switches")


def _phase_summary(trace: Trace) -> str:
    index = trace.phase_index()
    parts = []
    for i, p in enumerate(trace.phases):
        n = int((index == i).sum())
        parts.append(f"{p.name} {p.end - p.start:.0f} s ({n / (p.end - p.start):.0f}/s)")
    return ", ".join(parts)


def paper_comparison(bursty: Dict[str, ComparisonRow],
                     rollout: Dict[str, ComparisonRow]) -> List[Tuple[str, str, str, str, str, str, str]]:
    """Rows ``(metric, paper TP, paper EP, paper Moebius, ours TP, ours EP, ours policy)``.

    Arguments:
        bursty, rollout: `compare()` rows by mode.

    Returns:
        rows: text cells.
    """
    def bursts(row: ComparisonRow, field: str, scale: float = 1.0, fmt: str = "{:.2f}", name: str = "burst") -> str:
        values = [getattr(p, field) * scale for p in row.metrics.phases if p.name == name]
        return " / ".join(fmt.format(v) for v in values)

    def paper(key: str, mode: str, unit: str) -> str:
        v = PAPER_RESULTS[key][mode]
        return "-" if v is None else f"{v:g}{unit}"

    modes = (STATIC_TP, STATIC_EP, POLICY)
    tp, ep = rollout[STATIC_TP].makespan, rollout[STATIC_EP].makespan
    pol = rollout[POLICY].makespan
    return [
        ("bursty: mean TTFT in bursts (s; ours: burst 1 / 2)",
         *(paper("bursty_ttft_mean_burst_s", m, " s") for m in modes),
         *(bursts(bursty[m], "ttft_mean") for m in modes)),
        ("bursty: p99 TTFT in bursts (s; ours: burst 1 / 2)",
         *(paper("bursty_ttft_p99_burst_s", m, " s") for m in modes),
         *(bursts(bursty[m], "ttft_p99") for m in modes)),
        ("bursty: decode TPOT in quiet phases (ms; ours: quiet 1 / 2 / 3)",
         "~37 ms", "52 ms", "~37 ms (tracks TP)",
         *(bursts(bursty[m], "decode_interval_mean", 1e3, "{:.1f}", "quiet") for m in modes)),
        ("bursty: layout switches",
         *(f"{PAPER_RESULTS['bursty_switches'][m]}" for m in modes),
         *(str(bursty[m].switch_count) for m in modes)),
        ("rollout: makespan speed-up vs better static",
         "-", "-", PAPER_RESULTS["rollout_speedup_vs_better_static"],
         f"{min(tp, ep) / tp:.3f}x", f"{min(tp, ep) / ep:.3f}x", f"{min(tp, ep) / pol:.3f}x"),
        ("rollout: makespan speed-up vs worse static",
         "-", "-", PAPER_RESULTS["rollout_speedup_vs_worse_static"],
         f"{max(tp, ep) / tp:.3f}x", f"{max(tp, ep) / ep:.3f}x", f"{max(tp, ep) / pol:.3f}x"),
    ]


def _format_grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _phase_table(rows: Dict[str, ComparisonRow]) -> str:
    header = ("phase", "mode", "req", "TTFT mean s", "TTFT p99 s", "TPOT ms", "decode TPOT ms", "EP busy %")
    out = []
    for i, phase in enumerate(rows[STATIC_TP].metrics.phases):
        for mode in (STATIC_TP, STATIC_EP, POLICY, ORACLE):
            if mode not in rows:
                continue
            p = rows[mode].metrics.phases[i]
            busy = p.tp_seconds + p.ep_seconds
            out.append((f"{phase.name} {i + 1}" if mode == STATIC_TP else "", mode, str(p.requests),
                        f"{p.ttft_mean:.2f}", f"{p.ttft_p99:.2f}", f"{1e3 * p.tpot_mean:.1f}",
                        f"{1e3 * p.decode_interval_mean:.1f}", f"{100 * p.ep_seconds / busy:.0f}" if busy else "-"))
    return _format_grid(header, out)


def _row_json(row: ComparisonRow) -> dict:
    m = row.metrics
    return {"mode": row.mode, "ttft_mean_s": row.ttft_mean, "ttft_p99_s": row.ttft_p99, "tpot_mean_s": row.tpot_mean,
            "decode_interval_mean_s": m.decode_interval_mean, "makespan_s": row.makespan,
            "switch_count": row.switch_count, "switch_seconds": m.switch_seconds,
            "speedup_vs_best_static": row.speedup_vs_best_static, "steps": m.steps,
            "phases": [dict(p._asdict()) for p in m.phases]}


def _model_json(model: CostModel) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in model.__dict__.items()}


def _nan_to_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def run_simulation(seed: int = 0, quick: bool = False, calibrate_here: bool = False, out_dir: Optional[str] = None,
                   stream: Optional[TextIO] = None, plot: bool = True) -> dict:
    """Run both traces in every mode, print the tables and the checks, write PNGs and JSON.

    Arguments:
        seed: trace seed.
        quick: shorter traces (and a shorter calibration).
        calibrate_here: measure the cost model on this CPU (`cpu_calibration()`) instead of the paper's.
        out_dir: directory for ``bursty_timeline.png``, ``rollout_timeline.png`` and
            ``simulate.json``; ``None`` writes nothing.
        stream: where the report goes (default ``sys.stdout``).
        plot: write the PNGs (needs matplotlib, the ``plot`` extra).

    Returns:
        result: a JSON-able dict: ``model``, ``policy``, ``bursty``, ``rollout`` (rows per mode),
        ``paper_comparison``, ``checks`` (name, holds, detail), ``holds`` (all checks), ``files``.
    """
    stream = sys.stdout if stream is None else stream
    say = lambda *a: print(*a, file=stream)  # noqa: E731
    result: dict = {"seed": seed, "quick": quick}
    if calibrate_here:
        cpu = cpu_calibration(QUICK_CPU_BATCH_SIZES if quick else CPU_BATCH_SIZES, trials=2 if quick else 5,
                              seed=seed)
        model = cpu.cost_model()
        cal = cpu.calibration
        layer = cpu.layer
        say(f"cost model: CPU CALIBRATION measured on this machine in {cpu.wall_seconds:.1f} s (not a GPU: no "
            f"NVLink, no network; one engine step = one MoE layer, E={layer['num_experts']}, "
            f"H={layer['hidden']}, I={layer['intermediate']}, top-{layer['top_k']}, {layer['num_ranks']} ranks "
            f"emulated in one process, one thread)")
        say(_format_grid(("batch", "TP ms", "EP ms", "EP/TP"),
                         [(str(b), f"{1e3 * t:.2f}", f"{1e3 * e:.2f}", f"{e / t:.2f}")
                          for b, t, e in zip(cal.batch_sizes, cal.tp_seconds, cal.ep_seconds)]))
        say(f"crossover: {cal.outcome}, T_h = {cal.threshold_high:.0f}; switch {1e3 * cpu.switch_seconds[0]:.1f}-"
            f"{1e3 * cpu.switch_seconds[1]:.1f} ms (min: one rank's weight reshard copy, measured; max: min x "
            f"434/215, the paper's KV-load factor, not measured); prefill {1e6 * cpu.tp_prefill_seconds_per_token:.1f}"
            f" us/token TP, {1e6 * cpu.ep_prefill_seconds_per_token:.1f} us/token EP")
        result["model"] = {"source": "cpu_calibration", "layer": layer, "wall_seconds": cpu.wall_seconds,
                           "calibration": cal._asdict(), "parameters": _model_json(model)}
        if cal.outcome != "crossover":
            say(f"note: no TP/EP crossover measured here ({cal.outcome}): the policy has nothing to switch for, "
                "so the paper's qualitative result cannot be reproduced with this model")
    else:
        model = CostModel.from_paper()
        cal = model.calibration()
        say("cost model: the Moebius paper's (Qwen3-235B-A22B on 8xH200): decode TPOT 37 ms TP / 52 ms EP at low "
            f"load, crossover {cal.threshold_high:.0f} requests (paper: 128-256), switches "
            f"{1e3 * model.switch_min_seconds:.0f}-{1e3 * model.switch_max_seconds:.0f} ms, 2,048-request cap "
            "(decode above 256 requests and prefill costs are our assumptions, see CostModel.from_paper)")
        result["model"] = {"source": "paper", "calibration": cal._asdict(), "parameters": _model_json(model)}

    bursty, rollout = build_traces(seed, quick)
    started = time.perf_counter()
    serving_settings = policy_settings(bursty, model)
    rollout_settings = policy_settings(rollout, model)
    bursty_rows = {r.mode: r for r in compare(bursty, model, serving_settings)}
    rollout_rows = {r.mode: r for r in compare(rollout, model, rollout_settings)}
    say(f"policy: T_h = {serving_settings.threshold_high:.0f} (calibrated crossover), T_l = "
        f"{serving_settings.threshold_low:.0f}, W = {serving_settings.window} steps, cooldown "
        f"{serving_settings.cooldown_steps} steps (the paper's 5 s as 23 switch times); rollout mode: return to TP as soon as the batch < T_h")
    result["policy"] = {"serving": serving_settings._asdict(), "rollout": rollout_settings._asdict()}

    say("")
    say(f"== bursty serving trace (seed {seed}{', quick' if quick else ''}): {bursty.num_requests} requests; "
        f"{_phase_summary(bursty)}")
    say(format_table(list(bursty_rows.values())))
    say("")
    say("per phase (requests by arrival; decode TPOT: token-weighted step interval of the phase):")
    say(_phase_table(bursty_rows))
    say("")
    say(f"== RL rollout trace (seed {seed}{', quick' if quick else ''}): {rollout.num_requests} sequences at t=0, "
        f"output {int(np.median(rollout.output_tokens))} tokens median, {int(rollout.output_tokens.max())} max")
    say(format_table(list(rollout_rows.values())))
    say("(oracle: cheapest layout schedule with switches charged, exact on a rollout; oracle_free: switches free, "
        "counted not charged)")
    elapsed = time.perf_counter() - started

    comparison = paper_comparison(bursty_rows, rollout_rows)
    say("")
    say("== side by side with the paper (seed 000, section 9; 3,107 ChatBot Arena requests / DeepMath rollouts "
        "on 8xH200; ours: synthetic traces under the " + ("CPU-calibrated" if calibrate_here else "paper") +
        " cost model)")
    say(_format_grid(("metric", "paper TP", "paper EP", "paper Moebius", "ours TP", "ours EP", "ours policy"),
                     comparison))

    overall, phases = check_bursty(bursty_rows, model)
    rollout_check = check_rollout(rollout_rows)
    checks = [overall, rollout_check]
    say("")
    say("== qualitative checks")
    for c in phases:
        say(f"  [{'ok' if c.holds else 'FAIL'}] {c.name}: {c.detail}")
    for c in checks:
        say(f"  [{'HOLDS' if c.holds else 'FAILS'}] {c.name}: {c.detail}")
    holds = all(c.holds for c in checks)

    files: List[str] = []
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        if plot:
            if importlib.util.find_spec("matplotlib") is None:
                say("PNGs skipped: matplotlib is not installed (pip install -e '.[plot]')")
            else:
                for name, rows, threshold in (("bursty", bursty_rows, serving_settings.threshold_high),
                                              ("rollout", rollout_rows, rollout_settings.threshold_high)):
                    path = os.path.join(out_dir, f"{name}_timeline.png")
                    plot_timeline([rows[m] for m in PLOTTED_MODES],
                                  path, threshold if threshold != NEVER else None)
                    files.append(path)
    result.update({
        "bursty": {"requests": bursty.num_requests, "phases": [p._asdict() for p in bursty.phases],
                   "rows": {m: _row_json(r) for m, r in bursty_rows.items()}},
        "rollout": {"sequences": rollout.num_requests, "rows": {m: _row_json(r) for m, r in rollout_rows.items()}},
        "paper_comparison": [list(r) for r in comparison],
        "checks": [c._asdict() for c in phases + checks], "holds": holds,
        "simulation_seconds": elapsed,
    })
    if out_dir is not None:
        path = os.path.join(out_dir, "simulate.json")
        files.append(path)
        result["files"] = files
        with open(path, "w") as f:
            json.dump(_nan_to_none(result), f, indent=1, default=float)
    result["files"] = files
    if files:
        say("wrote " + ", ".join(files))
    say(f"verdict: the paper's qualitative result {'HOLDS' if holds else 'DOES NOT HOLD'} "
        f"({'CPU-calibrated' if calibrate_here else 'paper'} cost model)")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `simulate` options to a parser.

    Arguments:
        parser: the ``simulate`` sub-parser.
    """
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help="shorter traces (bursts of 5 s, 1,024 rollout sequences) and calibration")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the cost model on this CPU (a few seconds) instead of the paper's")
    parser.add_argument("--out", default="mep_simulate_out",
                        help="directory for the PNGs and simulate.json (default mep_simulate_out)")
    parser.add_argument("--no-plot", action="store_true", help="do not write PNGs")


def run_from_args(args: argparse.Namespace) -> int:
    """Run `simulate` from parsed arguments.

    Arguments:
        args: from a parser set up by `add_arguments()`.

    Returns:
        exit_code: 0 if the qualitative result holds, 1 if not.
    """
    result = run_simulation(seed=args.seed, quick=args.quick, calibrate_here=args.calibrate, out_dir=args.out,
                            plot=not args.no_plot)
    return 0 if result["holds"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m mooncake_ep_switch.apps.simulate_cli`: same as `mooncake-ep simulate`.

    Arguments:
        argv: the options (default ``sys.argv[1:]``).

    Returns:
        exit_code: 0 if the qualitative result holds, 1 if not.
    """
    parser = argparse.ArgumentParser(prog="mooncake-ep simulate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
