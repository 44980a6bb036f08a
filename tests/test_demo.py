"""The main job runs end to end (shortened) and its correctness check holds."""
import json
import subprocess
import sys


def test_demo_short_run(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "demo", "--steps", "3", "--out", str(out)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["correct"] and len(metrics["steps"]) == 3
    assert metrics["transport"] == "shm"  # one host, a region: auto picks shared memory
    assert metrics["max_calc_diff"] < 1e-4


def test_demo_collective_transport(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "demo", "--steps", "2", "--transport",
                             "collective", "--ranks", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((out / "metrics.json").read_text())["transport"] == "collective"
