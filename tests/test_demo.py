"""The main job runs end to end (shortened) and its correctness check holds."""
import json
import subprocess
import sys


def _run(out, *args):
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "demo", "--out", str(out), *args],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    return json.loads((out / "metrics.json").read_text()), result.stdout


def test_demo_short_run(tmp_path):
    out = tmp_path / "demo"
    metrics, stdout = _run(out, "--steps", "24")
    assert metrics["correct"] and metrics["max_calc_diff"] < 1e-4 and len(metrics["steps"]) == 24
    assert metrics["transport"] == "shm"  # one host, a region: auto picks shared memory
    layouts = [s["layout"] for s in metrics["steps"]]
    requests = [s["requests"] for s in metrics["steps"]]
    # The policy follows the burst: TP at low load, EP during the burst, TP again after it.
    assert layouts[0] == "tp" and layouts[-1] == "tp" and "ep" in layouts
    assert [s["target"] for s in metrics["switches"]] == ["ep", "tp"]
    assert all(requests[s["step"]] >= 64 for s in metrics["steps"] if s["layout"] == "ep" and s["step"] <= 15)
    # EPLB rebalanced online during the burst (every chunk committed, weights moved) without a failed check.
    committed = [r for r in metrics["rebalances"] if r["outcome"] == "committed"]
    assert committed and all(r["moved_bytes"] > 0 for r in committed)
    # Rank 2 was SIGKILLed in the burst: survivors served that step without it, a replacement joined,
    # and the next step was whole again.
    recovery = metrics["recovery"]
    kill = recovery["killed_at_step"]
    assert layouts[kill] == "ep" and recovery["survivors_saw_dead"] == [2]
    assert recovery["view"] == [0, 1, 2, 3] and recovery["first_full_step"] == kill + 1
    assert 0 < recovery["interruption_seconds"] < 60
    assert [s["ranks_serving"] for s in metrics["steps"]][kill - 1:kill + 2] == [4, 3, 4]
    kinds = {e["kind"] for e in metrics["events"]}
    assert kinds == {"switch", "rebalance", "kill", "rejoin"}
    assert (out / "timeline.png").stat().st_size > 10_000


def test_demo_collective_transport(tmp_path):
    out = tmp_path / "demo"
    metrics, _ = _run(out, "--steps", "8", "--transport", "collective", "--ranks", "2", "--kill-step", "-1")
    assert metrics["transport"] == "collective" and metrics["correct"]
    assert {s["layout"] for s in metrics["steps"]} == {"tp", "ep"}
