"""Unit tests of the TP <-> EP switch policy and its calibration (no engine, synthetic counts)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_ep_switch.switch.planning.policy import (COOLDOWN, ENTER_EP, EP, NEVER, REFUSED, RETURN_TP, TP,
                                              WARMUP, Calibration, Decision, PolicySettings, SwitchPolicy,
                                              calibrate)


def run(policy, counts, first_step=0):
    """Feed counts step by step; return the decisions and the (step, target) switch list."""
    decisions = [policy.observe(first_step + i, c) for i, c in enumerate(counts)]
    switches = [(first_step + i, d.target) for i, d in enumerate(decisions) if d.target is not None]
    return decisions, switches


# ---------------------------------------------------------------------------------------------
# switch points


def test_bursty_exact_switch_points():
    # T_h = 256 -> T_l = 204.8; W = 5 counts observed in EP; no cooldown in the way.
    policy = SwitchPolicy(256, window=5, cooldown_steps=3)
    counts = [50] * 10 + [300] * 20 + [100] * 30 + [260] * 5
    decisions, switches = run(policy, counts)
    # Enter at the first count >= T_h. Back once the EP window mean < T_l: the window after step 29
    # holds 300s; [300, 300, 100, 100, 100] (steps 28..32) has mean 180 < 204.8 first at step 32.
    assert switches == [(10, EP), (32, TP), (60, EP)]
    assert decisions[10].code == ENTER_EP and decisions[32].code == RETURN_TP
    assert "300 requests >= T_h=256" in decisions[10].reason
    assert "180" in decisions[32].reason and "204.8" in decisions[32].reason
    assert all(d.layout == EP for d in decisions[10:32]) and all(d.layout == TP for d in decisions[32:60])


def test_entry_is_immediate_and_at_threshold_exactly():
    policy = SwitchPolicy(256, window=4, cooldown_steps=0)
    _, switches = run(policy, [255, 255, 256])
    assert switches == [(2, EP)]


def test_return_needs_a_full_window_of_ep_observations():
    # Counts seen in TP before the switch must not pull the EP mean down.
    policy = SwitchPolicy(256, window=4, cooldown_steps=0)
    decisions, switches = run(policy, [0] * 20 + [300, 300, 300, 300, 300])
    assert switches == [(20, EP)]
    assert [d.code for d in decisions[21:24]] == [WARMUP] * 3
    assert policy.state().window_counts == (300, 300, 300, 300)


def test_rollout_trace_switch_points_vs_serving_mode():
    # A rollout: 2048 sequences decaying to 0, one step per finished sequence batch.
    counts = list(range(2048, 0, -8))
    rollout = SwitchPolicy(256, cooldown_steps=0, rollout_mode=True)
    _, switches = run(rollout, counts)
    below = next(i for i, c in enumerate(counts) if c < 256)
    assert switches == [(0, EP), (below, TP)]
    # Serving mode with the same T_h waits for the mean over W to fall below 0.8 T_h.
    serving = SwitchPolicy(256, window=8, cooldown_steps=0)
    _, serving_switches = run(serving, counts)
    back = serving_switches[1][0]
    assert serving_switches[0] == (0, EP) and back > below
    assert np.mean(counts[back - 7:back + 1]) < 0.8 * 256 <= np.mean(counts[back - 8:back])


def test_rollout_mode_semantics():
    policy = SwitchPolicy(300, window=50, low_ratio=0.5, cooldown_steps=0, rollout_mode=True)
    s = policy.settings
    assert s.threshold_low == 300 and s.effective_window == 1
    assert s.window == 50 and s.low_ratio == 0.5  # kept as given, ignored in rollout mode
    _, switches = run(policy, [400, 299, 300, 301, 299])
    # Back the instant the count drops below T_h; enter again at T_h.
    assert switches == [(0, EP), (1, TP), (2, EP), (4, TP)]


# ---------------------------------------------------------------------------------------------
# cooldown and hysteresis


def test_cooldown_blocks_the_next_c_steps():
    policy = SwitchPolicy(256, window=1, cooldown_steps=10)
    decisions, switches = run(policy, [300] + [0] * 15 + [300] * 15)
    # Switch at 0; steps 1..10 are cooldown; back to TP at 11; enter again 12 steps later at 22.
    assert switches == [(0, EP), (11, TP), (22, EP)]
    assert all(d.code == COOLDOWN for d in decisions[1:11])
    assert "cooldown" in decisions[5].reason and "6 cooldown step(s) remain" in decisions[5].reason
    assert all(d.code == COOLDOWN for d in decisions[16:22])


def test_cooldown_counts_step_numbers_not_calls():
    policy = SwitchPolicy(256, window=1, cooldown_steps=10)
    assert policy.observe(100, 300).target == EP
    assert policy.observe(105, 0).code == COOLDOWN
    assert policy.observe(111, 0).target == TP  # gap in step numbers: 111 - 100 > 10


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 600), min_size=1, max_size=300),
       threshold=st.integers(1, 500), window=st.integers(1, 12), cooldown=st.integers(0, 20),
       rollout=st.booleans())
def test_switch_invariants_on_random_traces(counts, threshold, window, cooldown, rollout):
    policy = SwitchPolicy(threshold, window=window, cooldown_steps=cooldown, rollout_mode=rollout)
    w = policy.settings.effective_window
    in_layout = []
    layout, last = TP, None
    for step, count in enumerate(counts):
        in_layout.append(count)
        d = policy.observe(step, count)
        if d.target is None:
            assert d.layout == layout
            continue
        assert last is None or step - last > cooldown
        if d.target == EP:
            assert layout == TP and count >= threshold
        else:
            assert layout == EP and len(in_layout) >= w
            assert np.mean(in_layout[-w:]) < policy.settings.threshold_low
        layout, last, in_layout = d.target, step, []
    assert policy.layout == layout


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(data=st.data(), threshold=st.integers(10, 1000), window=st.integers(1, 16),
       start=st.sampled_from([TP, EP]))
def test_no_oscillation_inside_the_hysteresis_band(data, threshold, window, start):
    low = math.ceil(0.8 * threshold)
    if low >= threshold:
        return
    counts = data.draw(st.lists(st.integers(low, threshold - 1), min_size=1, max_size=200))
    policy = SwitchPolicy(threshold, window=window, cooldown_steps=0, initial_layout=start)
    _, switches = run(policy, counts)
    assert switches == [] and policy.layout == start


def test_paper_hovering_example_does_not_alternate():
    rng = np.random.default_rng(0)
    policy = SwitchPolicy(256, window=16, cooldown_steps=0)
    counts = [300] * 5 + list(rng.integers(210, 256, size=500))  # enter EP, then hover at ~230
    _, switches = run(policy, counts)
    assert switches == [(0, EP)]


def test_momentary_dip_does_not_return_to_tp():
    policy = SwitchPolicy(256, window=8, cooldown_steps=0)
    _, switches = run(policy, [300] * 10 + [0, 0] + [300] * 10)
    assert switches == [(0, EP)]


# ---------------------------------------------------------------------------------------------
# capacity check


def test_capacity_refusal_keeps_state_and_records_reason():
    calls = []
    allow = {EP: False, TP: True}

    def capacity(target, num_requests):
        calls.append((target, num_requests))
        return allow[target]

    policy = SwitchPolicy(256, window=2, cooldown_steps=5, capacity_check=capacity)
    run(policy, [10, 20])
    assert calls == []  # only asked when a switch is due
    before = policy.state()
    d = policy.observe(2, 400)
    assert d == Decision(None, d.reason, TP, REFUSED)
    assert "capacity" in d.reason and "tp->ep" in d.reason and "400" in d.reason
    after = policy.state()
    assert (after.layout, after.last_switch_step, after.switch_count) == \
           (before.layout, before.last_switch_step, before.switch_count)
    assert after.refusal_count == 1 and calls == [(EP, 400)]
    # Refused again while capacity is short, then switches as soon as it is available.
    assert policy.observe(3, 400).code == REFUSED
    allow[EP] = True
    assert policy.observe(4, 400).target == EP
    assert policy.state().switch_count == 1 and policy.state().last_switch_step == 4


def test_capacity_check_not_called_during_cooldown():
    calls = []
    policy = SwitchPolicy(256, window=1, cooldown_steps=3,
                          capacity_check=lambda t, n: calls.append((t, n)) or True)
    run(policy, [300, 0, 0, 0, 0])
    assert calls == [(EP, 300), (TP, 0)]


def test_capacity_refusal_of_return_to_tp():
    policy = SwitchPolicy(256, window=1, cooldown_steps=0, capacity_check=lambda t, n: t == EP or n < 50)
    decisions, switches = run(policy, [300, 100, 60, 40])
    assert switches == [(0, EP), (3, TP)]
    assert [d.code for d in decisions[1:3]] == [REFUSED, REFUSED]
    assert "ep->tp" in decisions[1].reason


def test_capacity_check_must_return_bool():
    policy = SwitchPolicy(256, capacity_check=lambda t, n: "yes")
    with pytest.raises(TypeError, match="capacity_check must return a bool, got str 'yes'"):
        policy.observe(0, 300)
    assert SwitchPolicy(256, capacity_check=lambda t, n: np.bool_(True)).observe(0, 300).target == EP


def test_set_layout_after_failed_switch():
    policy = SwitchPolicy(256, window=1, cooldown_steps=2)
    assert policy.observe(0, 300).target == EP
    policy.set_layout(TP, step=1)  # the switch failed; the engine is still in TP
    assert policy.layout == TP and policy.state().last_switch_step == 1
    assert policy.observe(2, 300).code == COOLDOWN
    assert policy.observe(4, 300).target == EP


# ---------------------------------------------------------------------------------------------
# settings and arguments


def test_from_settings_matches_constructor():
    s = PolicySettings(200, window=7, low_ratio=0.7, cooldown_steps=4)
    a, b = SwitchPolicy.from_settings(s), SwitchPolicy(200, window=7, low_ratio=0.7, cooldown_steps=4)
    assert a.settings == b.settings == s.validated()
    assert s.threshold_low == pytest.approx(140)
    counts = [0, 250, 250, 100, 100, 100, 100, 100, 100, 100, 100, 300]
    assert run(a, counts)[1] == run(b, counts)[1]
    with pytest.raises(TypeError, match="settings must be a PolicySettings, got dict"):
        SwitchPolicy.from_settings({"threshold_high": 1})


def test_never_threshold_never_enters_ep():
    policy = SwitchPolicy(NEVER, window=1, cooldown_steps=0)
    assert run(policy, [10 ** 9] * 3)[1] == []


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(threshold_high=0), ValueError, "threshold_high must be > 0 .*got 0.0"),
    (dict(threshold_high=float("nan")), ValueError, "threshold_high must be > 0 .*got nan"),
    (dict(threshold_high=True), TypeError, "threshold_high must be a number > 0, got bool True"),
    (dict(threshold_high="256"), TypeError, "threshold_high must be a number > 0, got str '256'"),
    (dict(threshold_high=256, window=0), ValueError, "window: expected an int >= 1, got 0"),
    (dict(threshold_high=256, window=2.5), TypeError, "window: expected an int >= 1, got float 2.5"),
    (dict(threshold_high=256, low_ratio=0.0), ValueError, r"low_ratio must be in \(0, 1\], got 0.0"),
    (dict(threshold_high=256, low_ratio=1.5), ValueError, r"low_ratio must be in \(0, 1\], got 1.5"),
    (dict(threshold_high=256, cooldown_steps=-1), ValueError, "cooldown_steps: expected an int >= 0, got -1"),
    (dict(threshold_high=256, rollout_mode=1), TypeError, "rollout_mode must be a bool, got int 1"),
    (dict(threshold_high=256, capacity_check=3), TypeError, "capacity_check must be callable.*got int"),
    (dict(threshold_high=256, initial_layout="dp"), ValueError, r"initial_layout must be one of \('tp', 'ep'\), got 'dp'"),
])
def test_bad_policy_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        SwitchPolicy(**kwargs)


def test_bad_observe_arguments():
    policy = SwitchPolicy(256)
    policy.observe(5, 10)
    with pytest.raises(ValueError, match="step must be strictly increasing: got 5 after 5"):
        policy.observe(5, 10)
    with pytest.raises(ValueError, match="num_requests: expected an int >= 0, got -1"):
        policy.observe(6, -1)
    with pytest.raises(TypeError, match="num_requests: expected an int >= 0, got float 3.0"):
        policy.observe(6, 3.0)
    with pytest.raises(ValueError, match="step: expected an int >= 0, got -2"):
        SwitchPolicy(256).observe(-2, 1)
    with pytest.raises(ValueError, match="layout must be one of"):
        policy.set_layout("both")
    policy.observe(np.int64(7), np.int32(3))  # numpy integers are fine


# ---------------------------------------------------------------------------------------------
# calibration


def linear(a_tp, b_tp, a_ep, b_ep):
    def measure(layout, batch):
        return a_tp + b_tp * batch if layout == TP else a_ep + b_ep * batch
    return measure


def test_calibrate_finds_known_linear_crossover():
    measure = linear(0.030, 1.2e-4, 0.050, 0.3e-4)  # b* = 0.02 / 0.9e-4 = 222.2
    cal = calibrate(measure, [1, 16, 64, 128, 256, 512, 1024])
    assert isinstance(cal, Calibration) and cal.outcome == "crossover"
    assert cal.threshold_high == pytest.approx(0.02 / 0.9e-4, rel=1e-9)
    assert cal.batch_sizes == (1, 16, 64, 128, 256, 512, 1024)
    assert cal.tp_seconds[0] == pytest.approx(0.03012) and cal.ep_seconds[-1] == pytest.approx(0.08072)
    s = cal.settings(window=10, cooldown_steps=3)
    assert s == PolicySettings(cal.threshold_high, 10, 0.8, 3, False)


@settings(max_examples=50, deadline=None, database=None, derandomize=True)
@given(crossover=st.floats(2.0, 1000.0), gap=st.floats(1e-3, 0.05), slope_tp=st.floats(2e-5, 5e-4),
       slope_ratio=st.floats(0.0, 0.9))
def test_calibrate_linear_crossover_property(crossover, gap, slope_tp, slope_ratio):
    # EP starts `gap` slower and gains with a smaller slope: they meet at `crossover` exactly.
    slope_ep = slope_ratio * slope_tp
    a_tp = 0.03
    a_ep = a_tp + (slope_tp - slope_ep) * crossover
    cal = calibrate(linear(a_tp, slope_tp, a_ep, slope_ep), [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    assert cal.outcome == "crossover"
    assert cal.threshold_high == pytest.approx(crossover, rel=1e-6, abs=1e-6)


def test_calibrate_nonlinear_within_interpolation_error():
    # TP grows quadratically, EP linearly: exact crossover solves 0.03 + 1e-6 b^2 = 0.05 + 2e-5 b.
    measure = lambda layout, b: 0.03 + 1e-6 * b * b if layout == TP else 0.05 + 2e-5 * b  # noqa: E731
    exact = (2e-5 + math.sqrt(4e-10 + 4 * 1e-6 * 0.02)) / (2 * 1e-6)
    sizes = [1, 32, 64, 128, 192, 256, 512]
    cal = calibrate(measure, sizes)
    assert 128 <= exact <= 192 and 128 <= cal.threshold_high <= 192  # inside the bracket
    assert abs(cal.threshold_high - exact) < 0.05 * exact


def test_calibrate_without_crossover():
    tp_always = calibrate(linear(0.03, 1e-5, 0.05, 1e-5), [1, 64, 4096])
    assert tp_always.outcome == "tp_always" and tp_always.threshold_high == NEVER == math.inf
    ep_always = calibrate(linear(0.05, 1e-4, 0.03, 1e-5), [8, 64, 512])
    assert ep_always.outcome == "ep_always" and ep_always.threshold_high == 8
    # A measured tie counts on the EP side: EP is not worse there.
    table = {TP: {4: 1.0, 10: 1.0, 20: 2.0}, EP: {4: 2.0, 10: 1.0, 20: 1.0}}
    tie = calibrate(lambda layout, b: table[layout][b], [4, 10, 20])
    assert tie.outcome == "crossover" and tie.threshold_high == 10


def test_calibrate_uses_last_tp_to_ep_change():
    # Noise makes EP win at 16 once; the threshold goes where EP keeps winning.
    table = {TP: {1: 1.0, 16: 2.0, 64: 1.0, 256: 3.0}, EP: {1: 2.0, 16: 1.0, 64: 2.0, 256: 1.0}}
    cal = calibrate(lambda layout, b: table[layout][b], [256, 1, 64, 16])  # any order in
    assert cal.batch_sizes == (1, 16, 64, 256)
    assert 64 < cal.threshold_high < 256 and cal.threshold_high == pytest.approx(64 + 1 / 3 * 192)


def test_calibrate_repeats_use_median():
    calls = []
    noise = iter([5.0, 1.0, 1.1] * 100)

    def measure(layout, batch):
        calls.append((layout, batch))
        return next(noise) * (1.0 if layout == TP else 2.0 - batch / 100)

    cal = calibrate(measure, [10, 90], repeats=3)
    assert len(calls) == 12 and cal.tp_seconds == (1.1, 1.1)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((42, [1, 2]), {}, TypeError, "measure_step_latency must be callable"),
    ((lambda l, b: 1.0, [8]), {}, ValueError, r"batch_sizes needs at least 2 sizes .*got \[8\]"),
    ((lambda l, b: 1.0, [8, 8]), {}, ValueError, r"batch_sizes must be distinct, got \[8, 8\]"),
    ((lambda l, b: 1.0, [0, 8]), {}, ValueError, r"batch_sizes\[i\]: expected an int >= 1, got 0"),
    ((lambda l, b: 1.0, 8), {}, TypeError, "batch_sizes must be an iterable of positive integers, got int"),
    ((lambda l, b: 1.0, [1, 2]), {"repeats": 0}, ValueError, "repeats: expected an int >= 1, got 0"),
    ((lambda l, b: -1.0, [1, 2]), {}, ValueError, r"measure_step_latency\('tp', 1\) must return finite seconds > 0, got -1.0"),
    ((lambda l, b: float("nan"), [1, 2]), {}, ValueError, "must return finite seconds > 0, got nan"),
    ((lambda l, b: "fast", [1, 2]), {}, TypeError, "must return seconds as a number, got str 'fast'"),
])
def test_bad_calibrate_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        calibrate(*args, **kwargs)
