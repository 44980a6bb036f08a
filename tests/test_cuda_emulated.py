"""The "cuda" transport's Python layer on every machine: the bodies of tests/test_cuda.py on the
emulated device of tests/emulated_device.py (the real kernels on the host block/warp emulator, device
memory as shared regions between the rank processes, streams and events as host stand-ins).

Real: the Buffer, validation, the device call path (sync, hook, async, zero-copy, out=, fresh outputs,
the launches' streams), CudaTransport (endpoints in the store, opening peers' regions, the peer table, the control
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


def test_a_launch_on_another_stream_waits_for_the_previous_launch():
    """`launch_order.LaunchOrder`: the first launch and launches on the same stream wait for nothing (stream
    order); a launch on another stream makes that stream wait for the previous launch's, also a receive hook's
    launch on its call's stream (`on`); a capture waits for nothing and changes nothing."""
    from mooncake_ep_switch.buffer.transport.launch_order import LaunchOrder

    class Stream:
        def __init__(self, raw):
            self.raw, self.waited = raw, []

        def wait_stream(self, other):
            self.waited.append(other.raw)

    streams, current, capturing = {}, [7], [False]

    def stream_of(raw):
        return streams.setdefault(raw, Stream(raw))

    order = LaunchOrder(lambda: current[0], lambda: stream_of(current[0]), lambda: capturing[0])

    def launch(raw, capture=False):
        current[0], capturing[0] = raw, capture
        assert order.current() == (raw, stream_of(raw), capture)

    launch(7)
    launch(7)
    assert streams[7].waited == []
    launch(9)  # e.g. a synchronous call after an async_finish one on the communication stream
    launch(9)
    assert streams[9].waited == [7]
    launch(7)
    assert streams[7].waited == [9]
    assert order.on(9, stream_of(9), False) == 9  # a hook of a call made on 9, run while 7 is current
    assert streams[9].waited == [7, 7]
    launch(11, capture=True)  # a capture cannot wait for work outside it, and leaves the order as it was
    assert streams[11].waited == []
    assert order.on(11, stream_of(11), True) == 11  # that call's hook, run after the capture ended: no wait either
    assert streams[11].waited == []
    launch(7)  # after the capture: waits for the last launch before it
    assert streams[7].waited == [9, 9]
    launch(7, capture=True)  # a capture on the last launch's stream is reported as one
    assert order.last == (7, stream_of(7))


def rank_hooks_launch_on_their_calls_stream(ctx) -> bool:
    """A dispatch's and a combine's receive hooks launch on the stream that was current at the call, whichever is
    current when they run (DeepEP's and Mooncake EP's rule); every launch's stream as the launchers got it. A
    combine on another stream than its dispatch records its stream on the handle's tensors it reads (the allocator
    keeps them until it is done); on the same stream it records nothing."""
    import torch

    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.buffer.transport import cuda as cuda_transport
    from tests.emulated_device import install
    from tests.reference import structured_inputs, token_count
    from tests.test_buffer import TIMEOUT_US, Case

    fake = install()
    recorded = []
    torch.Tensor.record_stream = lambda tensor, stream: recorded.append(tensor.data_ptr())
    current = [5]
    cuda_transport.current_raw_stream = lambda device_index: current[0]
    launches = []
    for name, stream_at in (("dispatch_send", 7), ("dispatch_recv", 9), ("combine_send", 5), ("combine_recv", 7)):
        def record(*args, _name=name, _at=stream_at, _inner=getattr(fake, name), **kwargs):
            launches.append((_name, args[_at]))
            return _inner(*args, **kwargs)

        setattr(fake, name, record)
    case = Case(tokens=8)
    n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
    inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, 3)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    with Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts),
                transport="cuda") as buffer:
        recv, count, handle, _, hook = buffer.dispatch(inputs.x, inputs.topk_idx, active, case.tokens, case.experts,
                                                       TIMEOUT_US, use_fp8=False, return_recv_hook=True)
        current[0] = 6
        hook()
        current[0] = 8
        _, _, hook = buffer.combine(recv, inputs.topk_idx, inputs.weights, active, TIMEOUT_US, handle,
                                    return_recv_hook=True)
        current[0] = 5
        hook()
    assert launches == [("dispatch_send", 5), ("dispatch_recv", 5), ("combine_send", 8), ("combine_recv", 8)], \
        launches
    # The combine ran on another stream than its dispatch: what it reads of the dispatch is recorded on its stream
    assert {handle[0].data_ptr(), handle[1].data_ptr()} <= set(recorded), recorded
    with Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts),
                transport="cuda") as buffer:
        recorded.clear()
        recv, count, handle, _, _ = buffer.dispatch(inputs.x, inputs.topk_idx, active, case.tokens, case.experts,
                                                    TIMEOUT_US, use_fp8=False)
        buffer.combine(recv, inputs.topk_idx, inputs.weights, active, TIMEOUT_US, handle)
        assert recorded == [], recorded  # on the dispatch's stream: stream order, nothing to record
    return True


def test_receive_hooks_launch_on_their_calls_stream():
    with harness.fresh_cluster(2) as cluster:
        assert all(check_outcomes(cluster.run(rank_hooks_launch_on_their_calls_stream, timeout_s=120)))
