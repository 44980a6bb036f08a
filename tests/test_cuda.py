"""The "cuda" transport on a GPU: the Buffer test body, bit-identical to shm, faults, CUDA graphs.

Every rank is a process on the one GPU (CUDA IPC between processes on one device is the code path
NVLink uses between GPUs). Each test runs the same inputs through a "shm" Buffer (CPU tensors) and a
"cuda" Buffer (CUDA tensors) in the same rank processes and requires the outputs to be identical
bit for bit, and checks the CUDA outputs against the independent references of tests/reference.py.
Without a CUDA device every test here is skipped with the reason "no CUDA device".
"""
import contextlib
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch import Buffer, EventOverlap
from mooncake_ep_switch.launcher.launch import check_outcomes
from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason, current_raw_stream
from tests import harness
from tests.reference import expected_combine, expert_scale, structured_inputs, token_count
from tests.test_buffer import Case, _check_dispatch, _expert_outputs, _seen_values, gathered_inputs

pytestmark = pytest.mark.skipif(bool(cuda_unavailable_reason()), reason="no CUDA device")

TIMEOUT_US = 30_000_000
# Ranks share one GPU: without MPS their kernels are time-sliced, so a live peer can be late by
# several time slices; the fault tests' deadline leaves room for that.
FAULT_TIMEOUT_US = 3_000_000
FAULT_SLACK_S = 2.0
DEAD = 1


def test_the_raw_stream_is_torchs_current_stream():
    """The launchers' stream handle (torch's C getter) is `torch.cuda.current_stream().cuda_stream`: the default
    stream, a side stream made current, and again the default one after it."""
    torch.cuda.set_device(0)
    assert current_raw_stream(0) == torch.cuda.current_stream(0).cuda_stream
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side):
        assert current_raw_stream(0) == side.cuda_stream != 0
    assert current_raw_stream(0) == torch.cuda.current_stream(0).cuda_stream


def _use_device() -> None:
    """Rank processes use GPU 0 (where there is one: tests/test_cuda_emulated.py runs these bodies on an
    emulated device, whose tensors live on the host)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)


def _settle() -> None:
    """Wait for the device (a no-op on the emulated one, whose launches complete at once)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _buffers(ctx, case):
    _use_device()
    size = Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    return Buffer(ctx.group, size, transport="shm"), Buffer(ctx.group, size, transport="cuda")


def _to_cpu(value):
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _round(buffer, inputs, active, case, use_fp8, mode, device, zero_copy=False, use_out=False, rank=0, ranks=1):
    """One dispatch + mock expert + combine on `buffer` (inputs moved to `device`); CPU copies of all outputs."""
    flags = dict(async_finish=mode == "async", return_recv_hook=mode == "hook")
    x, topk, weights = (inputs.x.to(device), inputs.topk_idx.to(device), inputs.weights.to(device))
    active = active.to(device)
    recv, count, handle, event, hook = buffer.dispatch(x, topk, active, case.tokens, case.experts, TIMEOUT_US,
                                                       use_fp8=use_fp8, **flags)
    if mode == "hook":
        hook()
    event.current_stream_wait()
    cpu_recv, cpu_count = _to_cpu(recv), count.cpu()
    y = _expert_outputs(_Ctx(rank, ranks), case, cpu_recv, cpu_count, use_fp8).to(device)
    if zero_copy:
        target = buffer.get_next_combine_buffer(handle)
        target.copy_(y)
        y = target
    out = torch.full((x.size(0), case.hidden), 7.0, dtype=torch.bfloat16, device=device) if use_out else None
    combined, event, hook = buffer.combine(y, topk, weights, active, TIMEOUT_US, handle, zero_copy=zero_copy, out=out,
                                           **flags)
    if mode == "hook":
        hook()
    event.current_stream_wait()
    if use_out:
        assert combined.data_ptr() == out.data_ptr()
    _settle()
    return dict(recv=cpu_recv, count=cpu_count, src_info=handle[0].cpu(), layout_range=handle[1].cpu(),
                combined=combined.cpu(), active=active.cpu(), handle=_to_cpu(tuple(handle)))


class _Ctx:
    def __init__(self, rank, num_ranks):
        self.rank, self.num_ranks = rank, num_ranks


def _assert_identical(ctx, case, cpu, gpu, use_fp8):
    """Every output the protocol defines is the same bits on both transports."""
    assert torch.equal(gpu["count"], cpu["count"]), "recv_count"
    assert torch.equal(gpu["layout_range"], cpu["layout_range"]), "layout_range"
    assert torch.equal(gpu["src_info"], cpu["src_info"]), "src_info (valid rows and the zeroed tail)"
    local = case.experts // ctx.num_ranks
    for l_idx in range(local):
        n = int(cpu["count"][l_idx])
        if use_fp8:
            assert torch.equal(gpu["recv"][0][l_idx, :n].view(torch.uint8), cpu["recv"][0][l_idx, :n].view(torch.uint8))
            assert torch.equal(gpu["recv"][1][l_idx, :n], cpu["recv"][1][l_idx, :n]), "FP8 scales"
        else:
            assert torch.equal(gpu["recv"][l_idx, :n], cpu["recv"][l_idx, :n]), f"rows of local expert {l_idx}"
    assert torch.equal(gpu["combined"].view(torch.int16), cpu["combined"].view(torch.int16)), "combined"
    assert torch.equal(gpu["active"], cpu["active"])


def rank_matches_shm(ctx, use_fp8, mode, seed, inactive=(), zero_copy=False, use_out=False, random_values=False):
    """The Buffer test body on both transports with the same inputs: identical, and right."""
    case = Case()
    shm, gpu = _buffers(ctx, case)
    try:
        inputs, all_inputs, active = gathered_inputs(ctx, case, seed, random_values, inactive)
        if ctx.rank in inactive:
            return True  # every peer treats it as dead: it takes no part
        cpu = _round(shm, inputs, active, case, use_fp8, mode, "cpu", zero_copy, use_out, ctx.rank, ctx.num_ranks)
        dev = _round(gpu, inputs, active, case, use_fp8, mode, gpu.device, zero_copy, use_out, ctx.rank, ctx.num_ranks)
        _assert_identical(ctx, case, cpu, dev, use_fp8)
        # And right, against the independent references (the shm path is checked the same way in test_buffer).
        result = (dev["recv"], dev["count"], dev["handle"], EventOverlap(None), None)
        _check_dispatch(ctx, case, all_inputs, active.tolist(), result, use_fp8, "sync", structured=not random_values)
        expected = expected_combine(_seen_values(inputs, use_fp8), inputs.topk_idx, inputs.weights,
                                    {r: bool(active[r]) for r in range(ctx.num_ranks)}, case.experts // ctx.num_ranks)
        if not random_values:
            assert torch.equal(dev["combined"], expected), "structured tokens must combine exactly"
        return True
    finally:
        gpu.destroy()
        shm.destroy()


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["sync", "hook", "async"])
def test_cuda_matches_shm(num_ranks, use_fp8, mode):
    harness.run(num_ranks, rank_matches_shm, use_fp8, mode, seed=num_ranks)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_random_values_match_shm(use_fp8):
    harness.run(4, rank_matches_shm, use_fp8, "sync", seed=9, random_values=True)


@pytest.mark.parametrize("zero_copy,use_out", [(True, False), (False, True), (True, True)])
def test_cuda_zero_copy_and_out(zero_copy, use_out):
    harness.run(4, rank_matches_shm, False, "sync", seed=3, zero_copy=zero_copy, use_out=use_out)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_cuda_inactive_rank(num_ranks):
    harness.run(num_ranks, rank_matches_shm, False, "sync", seed=5, inactive=(1,))


# Each mode's (async_finish, return_recv_hook, on a side stream) for the two dispatches and their combines:
# "mixed" launches an async_finish call on the communication stream and then a synchronous one on the current
# stream before waiting for the first; "side" makes the first dispatch and its combine while a side stream is
# current and the second on the current stream (the transport orders its launches across streams,
# `CudaTransport._launch_stream`; GPU only: the emulated device has one stream).
_MODES = {"sync": ((False, False, False), (False, False, False)), "hook": ((False, True, False), (False, True, False)),
          "async": ((True, False, False), (True, False, False)), "mixed": ((True, False, False), (False, False, False)),
          "side": ((False, False, True), (False, False, False))}


def rank_two_dispatches(ctx, mode):
    """Two dispatches alive at once (both region halves), then both combines, each against shm."""
    case = Case(tokens=24)
    shm, gpu = _buffers(ctx, case)
    try:
        n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
        results = {}
        for name, buffer, device in (("cpu", shm, "cpu"), ("gpu", gpu, gpu.device)):
            rounds = []
            for seed, (async_finish, hooked, on_side) in zip((21, 22), _MODES[mode]):
                flags = dict(async_finish=async_finish, return_recv_hook=hooked)
                side = torch.cuda.Stream(gpu.device) if on_side and name == "gpu" else None
                inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed)
                active = torch.ones(ctx.num_ranks, dtype=torch.int32, device=device)
                x, topk, weights = inputs.x.to(device), inputs.topk_idx.to(device), inputs.weights.to(device)
                with _on(side):
                    result = buffer.dispatch(x, topk, active, case.tokens, case.experts, TIMEOUT_US, use_fp8=False,
                                             **flags)
                rounds.append((x, topk, weights, active, flags, side, result))
            outs = []
            for x, topk, weights, active, flags, side, (recv, count, handle, event, hook) in rounds:
                _receive(hook, event, side)
                y = _expert_outputs(ctx, case, recv.cpu(), count.cpu(), False).to(device)
                with _on(side):
                    combined, event, hook = buffer.combine(y, topk, weights, active, TIMEOUT_US, handle, **flags)
                _receive(hook, event, side)
                outs.append((recv.cpu(), count.cpu(), combined.cpu()))
            results[name] = outs
        for (c_recv, c_count, c_out), (g_recv, g_count, g_out) in zip(results["cpu"], results["gpu"]):
            assert torch.equal(c_count, g_count)
            for l_idx in range(c_count.numel()):
                assert torch.equal(c_recv[l_idx, :int(c_count[l_idx])], g_recv[l_idx, :int(c_count[l_idx])])
            assert torch.equal(c_out, g_out)
        # Device outputs come from torch's allocator, never the Buffer's pool (output_pool.fresh_dispatch_outputs):
        # the pool's reference counts cannot see a stream still writing a dropped result, or a caller's record_stream.
        assert gpu.output_pool_bytes() == 0 < shm.output_pool_bytes(), (gpu.output_pool_bytes(), mode)
        return True
    finally:
        gpu.destroy()
        shm.destroy()


@contextlib.contextmanager
def _on(side):
    """Make a call with `side` current (after it waited for the current stream, whose tensors it reads)."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield


def _receive(hook, event, side) -> None:
    """Run a call's receive hook and wait for the call (on `side` when it was made there)."""
    if hook is not None:
        hook()
    event.current_stream_wait()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize("mode", list(_MODES))
def test_cuda_two_dispatches_in_a_row(mode):
    harness.run(4, rank_two_dispatches, mode)


def rank_deep_ep_hook_run_under_a_side_stream(ctx):
    """DeepEP V1's low_latency_dispatch with round_scale (the wrapper casts the rows after the receive): its hook run
    while a side stream is current, after the call's stream was held back by a sleep, gives the same FP8 rows,
    scales and counts as the hook run on the call's stream (the receive and the casts both run there)."""
    from mooncake_ep_switch import deep_ep

    _use_device()
    tokens, hidden, experts, top_k = 16, 512, 4 * ctx.num_ranks, 3
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ctx.num_ranks, experts)
    buffer = deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True,
                            num_qps_per_rank=experts // ctx.num_ranks, explicitly_destroy=True, transport="cuda")
    try:
        inputs = structured_inputs(ctx.rank, tokens - ctx.rank, hidden, experts, top_k, 5, random_values=True)
        x, topk = inputs.x.cuda(), inputs.topk_idx.cuda()
        side = torch.cuda.Stream()
        results = []
        for on_side in (False, True):
            (data, scales), count, _, _, hook = buffer.low_latency_dispatch(
                x, topk, tokens, experts, round_scale=True, use_ue8m0=False, return_recv_hook=True)
            torch.cuda._sleep(50_000_000)  # the call's stream busy for tens of ms: its receive lands late
            if on_side:  # the side stream is idle: work the hook put there would run before the receive
                with torch.cuda.stream(side):
                    hook()
            else:
                hook()
            torch.cuda.synchronize()
            valid = count.cpu().tolist()
            results.append(([data[e, :n].view(torch.uint8).cpu() for e, n in enumerate(valid)],
                            [scales[e, :n].cpu() for e, n in enumerate(valid)], valid))
        (rows0, scales0, count0), (rows1, scales1, count1) = results
        assert count0 == count1 and sum(count0) > 0
        assert all(torch.equal(a, b) for a, b in zip(rows0, rows1)), "FP8 rows"
        assert all(torch.equal(a, b) for a, b in zip(scales0, scales1)), "scales"
        return True
    finally:
        buffer.destroy()


def test_deep_ep_hook_run_under_a_side_stream():
    assert harness.run(2, rank_deep_ep_hook_run_under_a_side_stream) == [True, True]


def rank_validation(ctx):
    """Every argument error on CUDA tensors is a clear exception naming the argument; nothing is
    corrupted: a correct round trip afterwards still matches shm."""
    case = Case()
    shm, gpu = _buffers(ctx, case)
    dev = gpu.device
    try:
        n = max(1, token_count(ctx.rank, ctx.num_ranks, case.tokens))
        inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed=31)
        x, topk, weights = inputs.x.to(dev), inputs.topk_idx.to(dev), inputs.weights.to(dev)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32, device=dev)
        T, E = case.tokens, case.experts
        bad_topk = topk.clone()
        bad_topk[0, 0] = E
        repeated = topk.clone()
        repeated[0, 1] = repeated[0, 0] = 1
        two = active.clone()
        two[0] = 2
        misaligned = torch.empty(x.numel() + 8, dtype=torch.bfloat16, device=dev)[1:1 + x.numel()].view_as(x)
        misaligned.copy_(x)
        # Tensors on the wrong device (only where the Buffer's device is a real GPU).
        device_errors = [
            (dict(x=inputs.x), ValueError, "x: expected a tensor on cuda"),
            (dict(active_ranks=active.cpu()), ValueError, "active_ranks: expected a tensor on cuda"),
            (dict(topk_idx=topk.cpu()), ValueError, "topk_idx: expected a tensor on cuda"),
        ] if dev.type == "cuda" else []
        dispatch_errors = device_errors + [
            (dict(x=x.float()), ValueError, "x: expected dtype"),
            (dict(x=torch.zeros((n, 100), dtype=torch.bfloat16, device=dev)), ValueError, "x: expected a hidden size"),
            (dict(topk_idx=bad_topk), ValueError, "topk_idx: expected expert ids in"),
            (dict(topk_idx=repeated), ValueError, "topk_idx: expected no expert twice"),
            (dict(active_ranks=two), ValueError, "active_ranks: expected values 0 or 1"),
            (dict(num_experts=E + 1), ValueError, "num_experts"),
            (dict(num_max_dispatch_tokens_per_rank=0), ValueError, "num_max_dispatch_tokens_per_rank"),
            (dict(x=misaligned), ValueError, "x: expected a tensor whose data starts at a 16-byte aligned"),
        ]
        good = dict(x=x, topk_idx=topk, active_ranks=active, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                    timeout_us=TIMEOUT_US, use_fp8=False)
        for change, error, message in dispatch_errors:
            args = dict(good, **change)
            if "x" in change and change["x"].size(0) != args["topk_idx"].size(0):
                args["topk_idx"] = topk[:change["x"].size(0)].contiguous()
            with pytest.raises(error, match=message):
                gpu.dispatch(**args)
        assert torch.equal(active, torch.ones_like(active)), "a refused call must not touch the mask"
        recv, count, handle, _, _ = gpu.dispatch(**good)
        y = _expert_outputs(ctx, case, recv.cpu(), count.cpu(), False).to(dev)
        other_topk = topk.clone()
        other_topk[0, 0] = (int(topk[0, 0]) + 1) % E if int(topk[0, 0]) >= 0 else 0
        if int((other_topk[0] == other_topk[0, 0]).sum()) > 1:
            other_topk[0, 0] = -1 if int(topk[0, 0]) >= 0 else int(topk[0, 0])
        combine_errors = ([
            (dict(x=y.cpu()), ValueError, "x: expected a tensor on cuda"),
            (dict(topk_weights=weights.cpu()), ValueError, "topk_weights: expected a tensor on cuda"),
            (dict(active_ranks=active.cpu()), ValueError, "active_ranks"),
        ] if dev.type == "cuda" else []) + [
            (dict(out=torch.empty((n + 1, case.hidden), dtype=torch.bfloat16, device=dev)), ValueError, "out:"),
            (dict(x=y[:, :-1]), ValueError, "x: expected shape"),
            (dict(handle=(1, 2, 3)), TypeError, "handle"),
        ]
        if not torch.equal(other_topk, topk):
            combine_errors.append((dict(topk_idx=other_topk), ValueError, "topk_idx: expected the topk_idx given"))
        cgood = dict(x=y, topk_idx=topk, topk_weights=weights, active_ranks=active, timeout_us=TIMEOUT_US,
                     handle=handle)
        for change, error, message in combine_errors:
            with pytest.raises(error, match=message):
                gpu.combine(**dict(cgood, **change))
        gpu.combine(**cgood)
        with pytest.raises(ValueError, match="combined already"):
            gpu.combine(**cgood)
        _settle()
        # The Buffer is still usable and still right.
        active_cpu = torch.ones(ctx.num_ranks, dtype=torch.int32)
        a = _round(shm, inputs, active_cpu, case, False, "sync", "cpu", rank=ctx.rank, ranks=ctx.num_ranks)
        b = _round(gpu, inputs, active_cpu, case, False, "sync", gpu.device, rank=ctx.rank, ranks=ctx.num_ranks)
        _assert_identical(ctx, case, a, b, False)
        return True
    finally:
        gpu.destroy()
        shm.destroy()


def test_cuda_validation_errors_leave_the_buffer_usable():
    harness.run(2, rank_validation)


def rank_hot_path(ctx):
    """Calls of a shape validated before take the hot path (CallSpecs.match_*, on the Buffer's device): one full
    dispatch validation for three dispatches, none for a combine given its handle; a plain 5-tuple handle takes
    the full combine validation. Every round's outputs equal the first's, bit for bit."""
    from mooncake_ep_switch.buffer import validation

    case = Case()
    shm, gpu = _buffers(ctx, case)
    specs, full_combine = gpu._core.specs, validation.check_combine
    counts = {"dispatch": 0, "combine": 0}
    full_dispatch = specs.validate_dispatch

    def counted_dispatch(*args, **kwargs):
        counts["dispatch"] += 1
        return full_dispatch(*args, **kwargs)

    def counted_combine(*args, **kwargs):
        counts["combine"] += 1
        return full_combine(*args, **kwargs)

    specs.validate_dispatch, validation.check_combine = counted_dispatch, counted_combine
    try:
        dev = gpu.device
        n = max(1, token_count(ctx.rank, ctx.num_ranks, case.tokens))
        inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed=17)
        x, topk, weights = inputs.x.to(dev), inputs.topk_idx.to(dev), inputs.weights.to(dev)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32, device=dev)
        results = []
        for plain in (False, False, False, True):
            recv, count, handle, _, _ = gpu.dispatch(x, topk, active, case.tokens, case.experts, TIMEOUT_US,
                                                     use_fp8=False)
            combined, _, _ = gpu.combine(recv.clone(), topk, weights, active, TIMEOUT_US,
                                         tuple(handle) if plain else handle)
            _settle()
            results.append((count.cpu(), combined.cpu()))
        assert counts == {"dispatch": 1, "combine": 1}, f"full validations: {counts}"
        for got in results[1:]:
            assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])
        return True
    finally:
        specs.validate_dispatch, validation.check_combine = full_dispatch, full_combine
        gpu.destroy()
        shm.destroy()


def test_cuda_hot_path():
    harness.run(2, rank_hot_path)


def rank_misuse(ctx):
    """Misuse a hostile caller tries: two "cuda" Buffers of one group in one process (each its own
    region and counters, interleaved calls), then calls, hooks and events after destroy() (clear
    RuntimeErrors, never a crash), and destroy() twice."""
    case = Case()
    shm, first = _buffers(ctx, case)
    second = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts),
                    transport="cuda")
    dev = first.device
    try:
        inputs, _, active = gathered_inputs(ctx, case, seed=61)
        reference = _round(shm, inputs, active, case, False, "sync", "cpu", rank=ctx.rank, ranks=ctx.num_ranks)
        for buffer in (first, second, first):  # interleaved: neither Buffer sees the other's signals
            got = _round(buffer, inputs, active, case, False, "sync", dev, rank=ctx.rank, ranks=ctx.num_ranks)
            _assert_identical(ctx, case, reference, got, False)
        x, topk = inputs.x.to(dev), inputs.topk_idx.to(dev)
        mask = active.to(dev)
        recv, count, handle, event, hook = second.dispatch(x, topk, mask, case.tokens, case.experts, TIMEOUT_US,
                                                           use_fp8=False, return_recv_hook=True)
        hook()
        _settle()
        second.destroy()
        second.destroy()  # idempotent
        with pytest.raises(RuntimeError, match="destroyed"):
            second.dispatch(x, topk, mask, case.tokens, case.experts, TIMEOUT_US, use_fp8=False)
        with pytest.raises(RuntimeError, match="destroyed"):
            second.get_next_combine_buffer(handle)
        with pytest.raises(RuntimeError, match="destroyed"):
            second.combine(recv, topk, inputs.weights.to(dev), mask, TIMEOUT_US, handle)
        event.current_stream_wait()  # the hook ran before destroy(): its event stays complete
        return True
    finally:
        second.destroy()
        first.destroy()
        shm.destroy()


def test_cuda_misuse_two_buffers_and_after_destroy():
    harness.run(2, rank_misuse)


def rank_graph(ctx, replays):
    """dispatch + mock expert + combine captured in one CUDA graph, replayed with new inputs copied
    into its static tensors: every replay equals the eager result on the same inputs."""
    case = Case(tokens=32)
    torch.cuda.set_device(0)
    size = Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    gpu = Buffer(ctx.group, size, transport="cuda")
    eager = Buffer(ctx.group, size, transport="cuda")
    dev = gpu.device
    try:
        n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
        local = case.experts // ctx.num_ranks
        scales = torch.tensor([expert_scale(ctx.rank * local + l) for l in range(local)], device=dev).view(-1, 1, 1)

        def step(buffer, x, topk, weights, active):
            recv, _, handle, _, _ = buffer.dispatch(x, topk, active, case.tokens, case.experts, TIMEOUT_US,
                                                    use_fp8=False)
            y = (recv.float() * scales).to(torch.bfloat16)
            return buffer.combine(y, topk, weights, active, TIMEOUT_US, handle)[0]

        def inputs_of(seed):
            inp = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed)
            return inp.x.to(dev), inp.topk_idx.to(dev), inp.weights.to(dev)

        def reference(seed):
            inp = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed)
            return expected_combine(inp.x, inp.topk_idx, inp.weights, {r: True for r in range(ctx.num_ranks)}, local)

        x, topk, weights = inputs_of(70)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before capture (lazy module loading, pools)
            step(gpu, x, topk, weights, active)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(gpu, x, topk, weights, active)
        for replay in range(replays):
            new_x, new_topk, new_weights = inputs_of(71 + replay)
            x.copy_(new_x)
            topk.copy_(new_topk)
            weights.copy_(new_weights)
            graph.replay()
            expected = step(eager, new_x, new_topk, new_weights, torch.ones_like(active))
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"replay {replay}"
            assert torch.equal(out.cpu(), reference(71 + replay)), f"replay {replay}: against the reference"
            assert active.tolist() == [1] * ctx.num_ranks
        return True
    finally:
        torch.cuda.synchronize()
        eager.destroy()
        gpu.destroy()


def test_cuda_graph_replays_match_eager():
    harness.run(2, rank_graph, 10)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def rank_killed(ctx, kill_point):
    """Round 1 whole; in round 2 rank DEAD is SIGKILLed at `kill_point`; survivors return within the
    deadline with DEAD cleared in active_ranks and every other row exact."""
    case = Case(tokens=32)
    _use_device()
    size = Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    gpu = Buffer(ctx.group, size, transport="cuda")
    dev = gpu.device
    n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
    rounds = []
    for index in range(2):
        gathered = [None] * ctx.num_ranks
        dist.all_gather_object(gathered, structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k,
                                                           seed=50 + index), group=ctx.group)
        rounds.append(gathered)
    local = case.experts // ctx.num_ranks
    without_dead = [0 if r == DEAD else 1 for r in range(ctx.num_ranks)]
    timings = {}
    for index, all_inputs in enumerate(rounds):
        mine = all_inputs[ctx.rank]
        x, topk, weights = mine.x.to(dev), mine.topk_idx.to(dev), mine.weights.to(dev)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32, device=dev)
        fault = index == 1
        if fault and ctx.rank == DEAD and kill_point == "before_dispatch":
            _die()
        start = time.monotonic()
        recv, count, handle, _, _ = gpu.dispatch(x, topk, active, case.tokens, case.experts, FAULT_TIMEOUT_US,
                                                 use_fp8=False)
        _settle()
        dispatch_s = time.monotonic() - start
        if fault and ctx.rank == DEAD and kill_point == "between":
            _die()
        after_dispatch = active.tolist()
        y = _expert_outputs(ctx, case, recv.cpu(), count.cpu(), False).to(dev)
        start = time.monotonic()
        combined, _, _ = gpu.combine(y, topk, weights, active, FAULT_TIMEOUT_US, handle)
        _settle()
        combine_s = time.monotonic() - start
        combine_active = active.tolist()
        dispatch_active = after_dispatch
        if fault:
            assert combine_active == without_dead, combine_active
            assert after_dispatch == (without_dead if kill_point == "before_dispatch" else [1] * ctx.num_ranks)
            timings = {"dispatch": dispatch_s, "combine": combine_s}
        from tests.reference import expected_routing

        routing = expected_routing([inp.topk_idx for inp in all_inputs], dispatch_active, ctx.rank, local)
        assert count.cpu().tolist() == [len(pairs) for pairs in routing]
        recv_cpu, src = recv.cpu(), handle[0].cpu()
        for l_idx, pairs in enumerate(routing):
            for row, (source, token) in enumerate(pairs):
                assert int(src[l_idx, row]) == token
                assert torch.equal(recv_cpu[l_idx, row], all_inputs[source].x[token])
        expected = expected_combine(mine.x, mine.topk_idx, mine.weights,
                                    {r: bool(combine_active[r]) for r in range(ctx.num_ranks)}, local)
        assert torch.equal(combined.cpu(), expected)
    gpu.destroy()
    return timings


def on_device(function, emulated: bool) -> tuple:
    """The rank function (and its leading arguments) that runs `function` on the GPU, or on the
    emulated device of tests/emulated_device.py (installed first in the rank process)."""
    if emulated:
        from tests.emulated_device import run_emulated

        return (run_emulated, function.__module__, function.__name__)
    return (function,)


@pytest.mark.parametrize("kill_point", ["before_dispatch", "between"])
def test_cuda_rank_killed(kill_point):
    killed_case(kill_point)


def killed_case(kill_point: str, emulated: bool = False, env=None) -> None:
    """4 ranks, rank DEAD SIGKILLed at `kill_point` in round 2: survivors within the deadline, exact. `env`: the
    ranks' extra environment (MEP_CUDA_FUSED_KERNELS)."""
    with harness.fresh_cluster(4, env=env) as cluster:
        outcomes = cluster.run(*on_device(rank_killed, emulated), kill_point, timeout_s=90, failure_grace_s=30)
    assert not outcomes[DEAD].ok and outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    for outcome in outcomes:
        if outcome.rank == DEAD:
            continue
        assert outcome.ok, outcome.error
        budget = FAULT_TIMEOUT_US / 1e6 + FAULT_SLACK_S
        assert outcome.value["dispatch"] + outcome.value["combine"] < budget, outcome.value


# ---------------------------------------------------------------------------------------------
# Elastic: a SIGKILLed rank is replaced; update_ep_member() maps the replacement's IPC handle and
# every address an engine holds stays the same.
# ---------------------------------------------------------------------------------------------
_STATE = {}
ELASTIC_RANKS, ELASTIC_DEAD = 4, 2


def _elastic_size():
    from tests.test_faults import Shape

    return Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, ELASTIC_RANKS, Shape.experts)


def _addresses(buffer):
    from tests.test_faults import Shape

    shape = (Shape.experts // ELASTIC_RANKS, ELASTIC_RANKS * Shape.tokens, Shape.hidden)
    halves = [buffer._transport.combine_buffer(call, shape, None).data_ptr() for call in (0, 1)]
    return [buffer._transport.base, buffer._transport.peer_table.data_ptr()] + halves


def _elastic_round(ctx, buffer, round_index, expect_dead=(), dispatch_dead=None):
    """test_elastic's round on this Buffer's device, with the view's mask."""
    from tests.test_elastic import _round

    return _round(ctx, buffer, round_index, buffer.active_mask(), expect_dead, dispatch_dead)


def rank_elastic_fail(ctx):
    _use_device()
    buffer = Buffer(ctx.group, _elastic_size(), transport="cuda")
    _STATE["buffer"] = buffer
    before = _addresses(buffer)
    _elastic_round(ctx, buffer, 0)
    if ctx.rank == ELASTIC_DEAD:
        _die()
    seconds = _elastic_round(ctx, buffer, 1, expect_dead=(ELASTIC_DEAD,), dispatch_dead=(ELASTIC_DEAD,))
    return {"seconds": seconds, "addresses": before}


def rank_elastic_recover(ctx):
    from mooncake_ep_switch.elastic import join

    if ctx.group is None:  # the replacement process
        _use_device()
        buffer = Buffer(join(ctx.store, ctx.rank, ctx.num_ranks), _elastic_size(), transport="cuda")
        _STATE["buffer"] = buffer
    else:
        buffer = _STATE["buffer"]
        deadline = time.monotonic() + 30
        while ELASTIC_DEAD not in buffer.pending_joiners():
            assert time.monotonic() < deadline, "the replacement never showed up"
            time.sleep(0.01)
    view = buffer.update_ep_member(timeout_s=30)
    for round_index in range(10, 13):
        _elastic_round(ctx, buffer, round_index)
    addresses = _addresses(buffer)
    buffer.destroy()
    return {"view": list(view.ranks), "addresses": addresses}


def test_cuda_rank_replaced_with_update_ep_member():
    replaced_case()


def replaced_case(emulated: bool = False) -> None:
    """Rank ELASTIC_DEAD SIGKILLed, survivors serve without it, its replacement is admitted; exact
    rounds after, and no address an engine holds moved."""
    with harness.fresh_cluster(ELASTIC_RANKS) as cluster:
        outcomes = cluster.run(*on_device(rank_elastic_fail, emulated), timeout_s=90, failure_grace_s=30)
        before = {}
        for outcome in outcomes:
            if outcome.rank == ELASTIC_DEAD:
                assert not outcome.ok and outcome.exitcode == -signal.SIGKILL, outcome
                continue
            assert outcome.ok, outcome.error
            assert outcome.value["seconds"] < FAULT_TIMEOUT_US / 1e6 + FAULT_SLACK_S, outcome.value
            before[outcome.rank] = outcome.value["addresses"]
        cluster.respawn(ELASTIC_DEAD)
        after = check_outcomes(cluster.run(*on_device(rank_elastic_recover, emulated), timeout_s=120))
    assert all(v["view"] == list(range(ELASTIC_RANKS)) for v in after)
    for rank, addresses in before.items():
        assert after[rank]["addresses"] == addresses, "an address an engine holds moved across recovery"
