"""The main job runs end to end (shortened) and its correctness check holds."""
import json
import subprocess
import sys


def test_demo_short_run(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "demo", "--steps", "5", "--kill-step", "2",
                             "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["correct"] and len(metrics["steps"]) == 5
    # Rank 2 was SIGKILLed at step 2: survivors served it without rank 2, a replacement joined, and
    # every later step was whole again.
    recovery = metrics["recovery"]
    assert recovery["killed_at_step"] == 2 and recovery["survivors_saw_dead"] == [2]
    assert recovery["view"] == [0, 1, 2, 3] and recovery["first_full_step"] == 3
    assert 0 < recovery["interruption_seconds"] < 60
    assert [s["ranks_serving"] for s in metrics["steps"]] == [4, 4, 3, 4, 4]
    assert metrics["transport"] == "shm"  # one host, a region: auto picks shared memory
    assert metrics["max_calc_diff"] < 1e-4


def test_demo_collective_transport(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "demo", "--steps", "2", "--transport",
                             "collective", "--ranks", "2", "--kill-step", "-1", "--out", str(out)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((out / "metrics.json").read_text())["transport"] == "collective"
