"""`mooncake-ep simulate`: the CLI runs, checks the paper's qualitative result, writes PNGs and JSON.

The simulator's own numbers are tested in test_simulator.py; here: the command, its checks (and
that they can fail), its output files and the CPU calibration's plumbing.
"""
import json
import re
import subprocess
import sys

import pytest

from mooncake_ep_switch.apps import cli, simulate_cli
from mooncake_ep_switch.switch.planning.policy import EP, TP, calibrate
from mooncake_ep_switch.switch.planning.simulator import POLICY, STATIC_EP, STATIC_TP, CostModel, compare

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One in-process `simulate --quick` run (paper cost model), shared by the tests below."""
    out = tmp_path_factory.mktemp("simulate")
    code = cli.main(["simulate", "--quick", "--seed", "1", "--out", str(out)])
    return code, out


def test_quick_run_holds_and_writes_pngs(quick_run, capsys):
    code, out = quick_run
    assert code == 0
    for name in ("bursty_timeline.png", "rollout_timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 20_000
    result = json.loads((out / "simulate.json").read_text())
    assert result["holds"] is True and result["model"]["source"] == "paper"
    checks = {c["name"]: c["holds"] for c in result["checks"]}
    assert checks["bursty: the policy matches the better static layout in every phase"]
    assert checks["rollout: the policy's makespan beats the better static layout"]
    assert sum(re.match(r"(quiet|burst) \d ", name) is not None for name in checks) == 5  # one per phase
    bursty, rollout = result["bursty"]["rows"], result["rollout"]["rows"]
    assert set(bursty) == set(rollout) == {"static_tp", "static_ep", "policy", "oracle", "oracle_free"}
    assert bursty["policy"]["switch_count"] == 4 and bursty["static_tp"]["switch_count"] == 0
    assert rollout["policy"]["makespan_s"] < min(rollout["static_tp"]["makespan_s"], rollout["static_ep"]["makespan_s"])
    for row in bursty.values():
        assert row["ttft_mean_s"] > 0 and row["ttft_p99_s"] >= row["ttft_mean_s"] and row["tpot_mean_s"] > 0
    # The side-by-side table carries the paper's figures.
    assert any("1.16-1.25x" in " ".join(row) for row in result["paper_comparison"])


def test_report_text(tmp_path, capsys):
    assert cli.main(["simulate", "--quick", "--no-plot", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for needle in ("TTFT mean s", "TTFT p99 s", "TPOT ms", "makespan s", "switches", "static_tp", "static_ep",
                   "policy", "oracle", "side by side with the paper", "9.9 s", "HOLDS", "verdict"):
        assert needle in text, needle
    assert not list(tmp_path.glob("*.png"))  # --no-plot


def test_checks_fail_for_a_policy_that_never_switches():
    """The checks are not vacuous: static TP posing as the policy fails both."""
    model = CostModel.from_paper()
    bursty, rollout = simulate_cli.build_traces(seed=0, quick=True)
    rows = {r.mode: r for r in compare(bursty, model, modes=(STATIC_TP, STATIC_EP))}
    overall, phases = simulate_cli.check_bursty({**rows, POLICY: rows[STATIC_TP]}, model)
    assert not overall.holds
    assert [p.holds for p in phases] == [True, False, False, False, False]
    rows = {r.mode: r for r in compare(rollout, model, modes=(STATIC_TP, STATIC_EP))}
    assert not simulate_cli.check_rollout({**rows, POLICY: rows[STATIC_EP]}).holds


def test_failed_check_gives_exit_code_1(tmp_path, monkeypatch):
    failing = simulate_cli.Check("rollout: forced", False, "forced by the test")
    monkeypatch.setattr(simulate_cli, "check_rollout", lambda rows: failing)
    assert cli.main(["simulate", "--quick", "--no-plot", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "simulate.json").read_text())["holds"] is False


def test_cpu_calibration_plumbing():
    """A tiny CPU calibration: both layouts measured, a usable cost model (numbers vary by machine)."""
    layer = {"num_experts": 8, "hidden": 256, "intermediate": 128, "top_k": 2, "num_ranks": 4}
    cpu = simulate_cli.cpu_calibration((1, 16, 64), trials=1, layer=layer)
    cal = cpu.calibration
    assert cal.batch_sizes == (1, 16, 64) and cal.outcome in ("crossover", "tp_always", "ep_always")
    assert all(t > 0 for t in cal.tp_seconds + cal.ep_seconds)
    low, high = cpu.switch_seconds
    assert 0 < low < high and cpu.wall_seconds < 30
    model = cpu.cost_model()
    assert model.decode_seconds(TP, 16) == cal.tp_seconds[1] and model.decode_seconds(EP, 64) == cal.ep_seconds[2]
    with pytest.raises(ValueError, match=r"num_ranks \(3\) must divide num_experts \(8\)"):
        simulate_cli.cpu_calibration((1, 2), trials=1, layer={**layer, "num_ranks": 3})


def test_calibrate_flag_says_cpu(tmp_path, monkeypatch, capsys):
    """`--calibrate` says the model is a CPU calibration, prints its table and uses it.

    The measurement is stubbed (a CPU calibration's outcome depends on the machine and its load;
    `cpu_calibration()` itself is exercised above): here the "measured" curves are the paper's,
    so the run must reproduce the qualitative result.
    """
    paper = CostModel.from_paper()
    scaled = calibrate(paper.decode_seconds, paper.batch_sizes)
    stub = simulate_cli.CpuCalibration(scaled, (0.215, 0.434), 18e-6, 14e-6, dict(simulate_cli.CPU_LAYER), 1, 0.1)
    calls = []
    monkeypatch.setattr(simulate_cli, "cpu_calibration", lambda *a, **k: calls.append((a, k)) or stub)
    code = cli.main(["simulate", "--quick", "--calibrate", "--no-plot", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert calls and calls[0][0][0] == simulate_cli.QUICK_CPU_BATCH_SIZES
    assert "CPU CALIBRATION" in text and "not a GPU" in text and "EP/TP" in text
    assert "HOLDS (CPU-calibrated cost model)" in text and code == 0
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert result["model"]["source"] == "cpu_calibration"
    assert result["model"]["parameters"]["switch_max_seconds"] == 0.434
    assert result["policy"]["serving"]["threshold_high"] == pytest.approx(scaled.threshold_high)


def test_module_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "simulate", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for option in ("--seed", "--quick", "--calibrate", "--out", "--no-plot"):
        assert option in result.stdout
