"""`mooncake-ep demo --model NAME` runs end to end; flags without a subcommand run the demo."""
import subprocess
import sys



def test_model_demo_command():
    import transformers  # noqa: F401  the `models` extra is part of the test install: missing, this fails
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "demo", "--model", "qwen3_moe", "--ranks", "2"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "PASS" in out and "DIFFERENT" not in out
    assert "decode EP" in out and "decode TP" in out and "tokens/s" in out
    assert "switch               before step 2: -> TP" in out and "EPLB committed" in out
    assert out.count("tokens same") == 12


def test_flags_without_subcommand_run_the_demo(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", "--ranks", "2", "--steps", "8",
                             "--transport", "collective", "--kill-step", "-1", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 CPU ranks" in result.stdout and "PASS" in result.stdout
    assert (tmp_path / "out" / "metrics.json").exists()
