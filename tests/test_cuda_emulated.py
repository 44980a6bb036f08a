"""The "cuda" transport's Python layer on every machine: the bodies of tests/test_cuda.py on the
emulated device of tests/emulated_device.py (the real kernels on the host block/warp emulator, device
memory as shared regions between the rank processes, streams and events as host stand-ins).

Real: the Buffer, validation, the device call path (sync, hook, async, zero-copy, out=, the output
pool), CudaTransport (endpoints in the store, opening peers' regions, the peer table, the control
block, the peer watcher's dead words, failed sources, destroy), faults and re-admission. Left to a
GPU (tests/test_cuda.py): device-mismatch errors, CUDA graphs, the GPU's memory model and speed.
Each test uses fresh rank processes (the emulation is not undone).
"""
import pytest

from mooncake_ep_switch.launcher.launch import check_outcomes
from tests import harness
from tests import test_cuda
from tests.emulated_device import run_emulated

# (use_fp8, mode, extra) rounds, each against shm with the same inputs, bit for bit
ROUNDS = [(False, "sync", {}), (True, "sync", {}), (False, "hook", {}), (True, "hook", {}), (False, "async", {}),
          (True, "async", {}), (False, "sync", dict(zero_copy=True)), (False, "sync", dict(use_out=True)),
          (False, "hook", dict(zero_copy=True, use_out=True)), (False, "sync", dict(inactive=(1,))),
          (True, "sync", dict(random_values=True)), (False, "sync", dict(random_values=True))]


def rank_rounds(ctx, rounds) -> int:
    """Every round of `rounds` in these rank processes (one Buffer pair per round, as on the GPU)."""
    for index, (use_fp8, mode, extra) in enumerate(rounds):
        test_cuda.rank_matches_shm(ctx, use_fp8, mode, seed=40 + index, **extra)
    return len(rounds)


def rank_two_dispatches_every_mode(ctx) -> bool:
    for mode in ("sync", "hook", "async", "mixed"):  # "side" needs real streams (tests/test_cuda.py on a GPU)
        test_cuda.rank_two_dispatches(ctx, mode)
    return True


# The split launches and the fused ones (MEP_CUDA_FUSED_KERNELS, the same outputs bit for bit)
LAUNCHES = [pytest.param(None, id="split"), pytest.param({"MEP_CUDA_FUSED_KERNELS": "1"}, id="fused")]


def _emulated(num_ranks: int, function, *args, timeout_s: float = 180, env=None):
    with harness.fresh_cluster(num_ranks, env=env) as cluster:
        return check_outcomes(cluster.run(run_emulated, function.__module__, function.__name__, *args,
                                          timeout_s=timeout_s))


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_emulated_buffer_body_matches_shm(num_ranks, launches):
    assert _emulated(num_ranks, rank_rounds, ROUNDS, env=launches) == [len(ROUNDS)] * num_ranks


def test_emulated_two_dispatches_in_a_row():
    assert all(_emulated(4, rank_two_dispatches_every_mode))


def test_emulated_validation_errors_leave_the_buffer_usable():
    assert all(_emulated(2, test_cuda.rank_validation))


def test_emulated_hot_path():
    assert all(_emulated(2, test_cuda.rank_hot_path))


def test_emulated_misuse_two_buffers_and_after_destroy():
    assert all(_emulated(2, test_cuda.rank_misuse))


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("kill_point", ["before_dispatch", "between"])
def test_emulated_rank_killed(kill_point, launches):
    test_cuda.killed_case(kill_point, emulated=True, env=launches)


def test_emulated_rank_replaced_with_update_ep_member():
    test_cuda.replaced_case(emulated=True)


def test_the_host_profile_script_runs_on_the_emulated_device():
    """scripts/cuda_host_profile.py (the host's share of an eager round trip; gpu_check.sh's hostprof stage) on the
    emulated device with no-op launchers: a figure per rank and rank 0's profile of the Buffer's call path."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # --top past the number of functions called: every one listed (a top-8 cut by own time is a matter of chance)
    run = subprocess.run([sys.executable, "scripts/cuda_host_profile.py", "--emulated", "--rounds", "20", "--top",
                          "100000", "--fused"], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for line in ("HOST rank 0: ", "HOST rank 1: ", "fused launches; emulated device", "device_calls.py"):
        assert line in run.stdout, (line, run.stdout[-3000:])


def test_a_launch_on_another_stream_waits_for_the_previous_launch(monkeypatch):
    """`CudaTransport._launch_stream`: the first launch and launches on the same stream wait for nothing (stream
    order); a launch on another stream makes that stream wait for the previous launch's, except in a capture."""
    from types import SimpleNamespace

    import torch

    from mooncake_ep_switch.buffer.transport import cuda as cuda_transport

    class Stream:
        def __init__(self, raw):
            self.raw, self.waited = raw, []

        def wait_stream(self, other):
            self.waited.append(other.raw)

    streams, current, capturing = {}, [7], [False]
    monkeypatch.setattr(cuda_transport, "current_raw_stream", lambda index: current[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.setdefault(current[0],
                                                                                             Stream(current[0])))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    transport = SimpleNamespace(device=torch.device("cuda", 0), _last_raw=None, _last_stream=None)

    def launch(stream, capture=False):
        current[0], capturing[0] = stream, capture
        assert cuda_transport.CudaTransport._launch_stream(transport) == stream

    launch(7)
    launch(7)
    assert streams[7].waited == []
    launch(9)  # e.g. a synchronous call after an async_finish one on the communication stream
    launch(9)
    assert streams[9].waited == [7]
    launch(7)
    assert streams[7].waited == [9]
    launch(11, capture=True)  # a capture cannot wait for work outside it
    assert streams[11].waited == []
    launch(7)
    assert streams[7].waited == [9, 11]
