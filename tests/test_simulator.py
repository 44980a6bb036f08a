"""Serving simulator: the paper's qualitative results with `CostModel.from_paper()`, metric sanity."""

import dataclasses
import math

import numpy as np
import pytest

from mooncake_ep_switch.switch.planning.policy import EP, TP, PolicySettings, calibrate
from mooncake_ep_switch.switch.planning.simulator import (MODES, ORACLE, ORACLE_FREE, POLICY, STATIC_EP, STATIC_TP,
                                                 ComparisonRow, CostModel, Metrics, compare,
                                                 default_policy_settings, format_table, plot_timeline,
                                                 simulate)
from mooncake_ep_switch.switch.planning.traces import (PhaseSpec, Trace, bursty_trace, rollout_trace)

PAPER = CostModel.from_paper()


@pytest.fixture(scope="module", params=[0, 3], ids=lambda seed: f"seed{seed}")
def bursty(request):
    trace = bursty_trace(seed=request.param)
    return {r.mode: r.metrics for r in compare(trace, PAPER, modes=(STATIC_TP, STATIC_EP, POLICY))}


@pytest.fixture(scope="module")
def rollout_rows():
    return compare(rollout_trace(seed=0), PAPER)


# ---------------------------------------------------------------------------------------------
# cost model


def test_paper_cost_model_numbers():
    assert PAPER.decode_seconds(TP, 1) == pytest.approx(0.037)
    assert PAPER.decode_seconds(EP, 1) == pytest.approx(0.052)
    cal = PAPER.calibration()
    assert cal.outcome == "crossover" and 128 <= cal.threshold_high <= 256
    assert PAPER.switch_seconds(0) == pytest.approx(0.215)
    assert PAPER.switch_seconds(2048) == pytest.approx(0.434) == PAPER.switch_seconds(10 ** 6)
    assert PAPER.decode_seconds(TP, 0) == 0.0 and PAPER.prefill_seconds(EP, 0) == 0.0
    # Extrapolated past the last knot with the last slope.
    assert PAPER.decode_seconds(TP, 3072) == pytest.approx(0.300 + 0.140)


def test_from_calibration_round_trip():
    cal = calibrate(PAPER.decode_seconds, [1, 32, 128, 512, 2048])
    model = CostModel.from_calibration(cal, (0.2, 0.4), tp_max_running=512)
    for b in cal.batch_sizes:
        assert model.decode_seconds(TP, b) == PAPER.decode_seconds(TP, b)
        assert model.decode_seconds(EP, b) == PAPER.decode_seconds(EP, b)
    assert (model.switch_min_seconds, model.switch_max_seconds, model.tp_max_running) == (0.2, 0.4, 512)
    fixed = CostModel.from_calibration(cal, 0.3)
    assert fixed.switch_seconds(0) == fixed.switch_seconds(5000) == 0.3


@pytest.mark.parametrize("change, error, message", [
    (dict(batch_sizes=(4, 2)), ValueError, r"batch_sizes must hold >= 2 strictly ascending sizes, got \(4, 2\)"),
    (dict(batch_sizes=(1, 2), tp_decode_seconds=(0.1,), ep_decode_seconds=(0.1, 0.1)), ValueError,
     r"tp_decode_seconds must have one value per batch size \(2\), got 1"),
    (dict(batch_sizes=(1, 2), tp_decode_seconds=(0.1, -0.1), ep_decode_seconds=(0.1, 0.1)), ValueError,
     r"tp_decode_seconds\[i\] must be finite and > 0.0, got -0.1"),
    (dict(switch_min_seconds=1.0, switch_max_seconds=0.5), ValueError,
     r"switch_max_seconds must be >= switch_min_seconds \(1.0\), got 0.5"),
    (dict(tp_max_running=0), ValueError, "tp_max_running: expected an int >= 1, got 0"),
    (dict(max_prefill_tokens=1.5), TypeError, "max_prefill_tokens: expected an int >= 1, got float 1.5"),
])
def test_bad_cost_model_arguments(change, error, message):
    with pytest.raises(error, match=message):
        dataclasses.replace(PAPER, **change)


def test_bad_simulate_arguments():
    trace = rollout_trace(seed=0, num_sequences=4, max_output_tokens=8)
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'dynamic'"):
        simulate(trace, PAPER, "dynamic")
    with pytest.raises(TypeError, match="trace must be a traces.Trace, got list"):
        simulate([1, 2], PAPER, STATIC_TP)
    with pytest.raises(TypeError, match="cost_model must be a CostModel, got dict"):
        simulate(trace, {}, STATIC_TP)
    with pytest.raises(TypeError, match="policy_settings must be a PolicySettings or None, got dict"):
        simulate(trace, PAPER, POLICY, {})
    with pytest.raises(ValueError, match=r"modes must be drawn from .*got 'best'"):
        compare(trace, PAPER, modes=("best",))
    with pytest.raises(ValueError, match="layout must be one of"):
        PAPER.decode_seconds("dp", 1)
    with pytest.raises(ValueError, match=r"switch_seconds must be seconds or \(min, max\), got \(1, 2, 3\)"):
        CostModel.from_calibration(PAPER.calibration(), (1, 2, 3))


# ---------------------------------------------------------------------------------------------
# the paper's qualitative results


def test_bursty_policy_tracks_the_better_static_layout_in_each_phase(bursty):
    tp, ep, policy = bursty[STATIC_TP], bursty[STATIC_EP], bursty[POLICY]
    phases = list(zip(tp.phases, ep.phases, policy.phases))
    assert [p[0].name for p in phases] == ["quiet", "burst", "quiet", "burst", "quiet"]
    # Low load: TP's decode TPOT (~41 ms at ~40 requests, vs EP's ~57 ms), nothing worse.
    first_tp, first_ep, first_policy = phases[0]
    assert first_policy.decode_interval_mean == pytest.approx(first_tp.decode_interval_mean)
    assert first_tp.decode_interval_mean < 0.8 * first_ep.decode_interval_mean
    for t, e, p in phases:
        if t.name == "quiet":
            assert p.decode_interval_mean <= 1.02 * min(t.decode_interval_mean, e.decode_interval_mean)
        else:
            # Bursts: EP's TPOT; EP's TTFT plus at most ~one switch pause (0.24 s) and the few
            # TP steps before the count reaches T_h; far from TP's.
            assert p.tpot_mean <= 1.02 * e.tpot_mean < t.tpot_mean
            assert p.ttft_p99 <= e.ttft_p99 + 0.5 and 1.5 * p.ttft_p99 < t.ttft_p99
            assert abs(p.ttft_mean - e.ttft_mean) < abs(p.ttft_mean - t.ttft_mean)
            assert p.ep_seconds > 2 * p.tp_seconds
    # One entry and one return per burst: the paper's "4 switches total".
    assert policy.switch_count == 4
    assert [(s.source, s.target) for s in policy.switches] == [(TP, EP), (EP, TP)] * 2


def test_rollout_policy_beats_best_static(rollout_rows):
    rows = {r.mode: r for r in rollout_rows}
    best_static = min(rows[STATIC_TP].makespan, rows[STATIC_EP].makespan)
    policy = rows[POLICY]
    # Paper: 1.16-1.25x over the better static layout on RL rollouts.
    assert policy.makespan < best_static and 1.10 < policy.speedup_vs_best_static < 1.35
    assert policy.switch_count == 2  # EP for the head, TP for the straggler tail
    # The oracle charges switches and is the exact optimum on a rollout: a lower bound.
    assert rows[ORACLE].makespan <= policy.makespan + 1e-9
    assert rows[ORACLE_FREE].makespan <= rows[ORACLE].makespan + 1e-9
    assert policy.makespan < 1.01 * rows[ORACLE].makespan
    assert rows[STATIC_TP].speedup_vs_best_static < 1.0 == pytest.approx(rows[STATIC_EP].speedup_vs_best_static)


def test_rollout_policy_switches_when_batch_drops_below_threshold(rollout_rows):
    policy = {r.mode: r for r in rollout_rows}[POLICY].metrics
    threshold = default_policy_settings(rollout_trace(seed=0), PAPER).threshold_high
    enter, leave = policy.switches
    assert enter.step == 0 and enter.target == EP
    assert leave.target == TP and leave.num_requests < threshold
    tl = policy.timeline
    assert tl.num_requests[leave.step - 1] >= threshold


# ---------------------------------------------------------------------------------------------
# metric sanity and determinism


def small_bursty(seed):
    phases = (PhaseSpec("quiet", 10.0, 5.0), PhaseSpec("burst", 4.0, 100.0), PhaseSpec("quiet", 10.0, 5.0))
    return bursty_trace(seed=seed, phases=phases)


def test_determinism_with_seed():
    a, b, c = small_bursty(7), small_bursty(7), small_bursty(8)
    for field in ("arrival_seconds", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert a.num_requests != c.num_requests or not np.array_equal(a.output_tokens, c.output_tokens)
    m1, m2 = simulate(a, PAPER, POLICY), simulate(b, PAPER, POLICY)
    assert m1[:10] == m2[:10] and m1.switches == m2.switches
    for x, y in zip(m1.timeline, m2.timeline):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("mode", MODES)
def test_metric_sanity(mode):
    trace = small_bursty(3)
    m = simulate(trace, PAPER, mode)
    assert isinstance(m, Metrics) and m.mode == mode
    assert m.steps == m.timeline.time.shape[0] > 0
    assert np.all(np.diff(m.timeline.time) > 0)
    assert m.ttft_mean > 0 and m.ttft_p99 >= m.ttft_mean and m.tpot_mean > 0
    assert m.makespan >= trace.arrival_seconds[-1] - trace.arrival_seconds[0]
    assert m.tp_seconds + m.ep_seconds == pytest.approx(m.timeline.step_seconds.sum())
    assert m.switch_seconds == pytest.approx(m.timeline.pause_seconds.sum())
    assert sum(p.requests for p in m.phases) == trace.num_requests
    assert sum(p.tp_seconds + p.ep_seconds for p in m.phases) == pytest.approx(m.tp_seconds + m.ep_seconds)
    start = 1 if mode == STATIC_EP else 0  # every other mode starts in TP
    changes = np.count_nonzero(np.diff(m.timeline.layout)) + int(m.timeline.layout[0] != start)
    assert m.switch_count == len(m.switches) == changes
    if mode in (STATIC_TP, STATIC_EP):
        assert m.switch_count == 0 and m.switch_seconds == 0
        assert (m.ep_seconds if mode == STATIC_TP else m.tp_seconds) == 0
    elif mode == ORACLE_FREE:
        assert all(s.seconds == 0 for s in m.switches)
    else:
        assert all(0.215 <= s.seconds <= 0.434 for s in m.switches)


def test_capacity_check_refuses_return_to_small_tp():
    # TP can only hold 64 running requests: the return to TP waits until the batch fits.
    model = dataclasses.replace(PAPER, tp_max_running=64)
    trace = rollout_trace(seed=1, num_sequences=512, output_median=300, max_output_tokens=2000)
    settings = PolicySettings(PAPER.calibration().threshold_high, window=1, cooldown_steps=0, rollout_mode=True)
    m = simulate(trace, model, POLICY, settings)
    leave = [s for s in m.switches if s.target == TP]
    assert len(leave) == 1
    assert m.timeline.batch[leave[0].step] <= 64 < settings.threshold_high
    unrestricted = simulate(trace, PAPER, POLICY, settings)
    assert [s for s in unrestricted.switches if s.target == TP][0].step < leave[0].step


def test_compare_rows_and_table_and_plot(tmp_path):
    trace = small_bursty(5)
    rows = compare(trace, PAPER, modes=(POLICY, STATIC_EP))
    assert [r.mode for r in rows] == [POLICY, STATIC_EP]
    assert all(isinstance(r, ComparisonRow) for r in rows)
    text = format_table(rows)
    assert "policy" in text and "static_ep" in text and text.count("\n") == 2
    path = plot_timeline(rows, str(tmp_path / "timeline.png"), threshold_high=224)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="results must be a non-empty sequence"):
        plot_timeline([], str(tmp_path / "empty.png"))


def test_traces_shape():
    serving = bursty_trace(seed=0)
    assert isinstance(serving, Trace) and serving.kind == "serving"
    assert [p.end for p in serving.phases[:-1]] == [p.start for p in serving.phases[1:]]
    per_phase = np.bincount(serving.phase_index(), minlength=len(serving.phases))
    rates = per_phase / np.array([p.end - p.start for p in serving.phases])
    assert rates[1] > 10 * rates[0] and rates[3] > 10 * rates[2]
    assert not serving.arrival_seconds.flags.writeable
    roll = rollout_trace(seed=0)
    assert roll.kind == "rollout" and np.all(roll.arrival_seconds == 0) and roll.num_requests == 2048
    assert roll.output_tokens.max() == 32768 and np.median(roll.output_tokens) < 5000  # heavy tail, capped
    with pytest.raises(ValueError, match=r"phases\[0\].duration_seconds must be a finite number > 0, got 0.0"):
        bursty_trace(phases=(PhaseSpec("x", 0, 1.0),))
    with pytest.raises(ValueError, match="num_sequences: expected an int >= 1, got 0"):
        rollout_trace(num_sequences=0)
    assert math.isinf(roll.phases[0].end)
