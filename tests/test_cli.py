"""The command line a newcomer meets: every subcommand's help is complete and reachable, `--version` says what
the package mirrors."""
import subprocess
import sys

import pytest

import mooncake_ep_switch
from mooncake_ep_switch.apps import cli


def _help(*args) -> str:
    result = subprocess.run([sys.executable, "-m", "mooncake_ep_switch", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_version_names_the_mirrored_apis(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"mooncake_ep_switch {mooncake_ep_switch.__version__} ")
    assert all(name in line for name in ("Mooncake EP", "DeepEP V1", "DeepEP V2"))


def test_top_level_help_reaches_every_subcommand():
    text = _help("--help")
    assert all(name in text for name in ("demo", "bench", "simulate", "soak", "elastic", "memory", "hosts", "--version"))


def test_demo_help_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    options = [word for word in text.split() if word.startswith("--")]
    assert {"--ranks", "--transport", "--steps", "--device", "--out", "--kill-step", "--model"} <= set(options)
    # An option described has text after its metavar on its line or the next: argparse prints bare lines otherwise.
    lines = text.splitlines()
    for option in ("--ranks", "--transport"):
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(option))
        described = lines[index].strip()[len(option):].split("}", 1)[-1].split(maxsplit=1)[1:] or [lines[index + 1]]
        assert described[0].strip() and not described[0].strip().startswith("--"), (option, lines[index:index + 2])


@pytest.mark.parametrize("args", [["bench", "--help"], ["bench", "soak", "--help"], ["bench", "elastic", "--help"],
                                  ["bench", "memory", "--help"], ["simulate", "--help"]])
def test_bench_and_simulate_help(args, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(args)
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "--quick" in text or args[0] == "simulate"
    if args == ["bench", "--help"]:  # the real table benchmark's help, listing its subcommands (not just `rest`)
        assert all(name in text for name in ("soak", "elastic", "memory", "hosts", "--device cuda"))
    if args[:2] == ["bench", "soak"]:
        assert "--samples" in text and "--sample-every" not in text
        options = text[text.index("options:"):]
        quick = options[options.index("--quick"):options.index("--out")]
        assert quick.rstrip().endswith("run"), quick  # the help's sentence is whole


def test_dispatch_walk_script_help():
    result = subprocess.run([sys.executable, "scripts/dispatch_walk.py", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "shm" in result.stdout and "collective" in result.stdout, result.stderr
