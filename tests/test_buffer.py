"""Buffer dispatch/combine correctness, one test body over every transport and group size.

The checks follow DeepEP's test_low_latency.py and Mooncake's test_mooncake_ep.py in spirit:
structured tokens (value = rank - 128, last 128 columns = token index), random top-k with ten
slots set to -1, uneven token counts including a rank with none, a mock expert that scales by a
power of two (exact in bf16), and every completion mode.
"""
import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch import Buffer
from tests import harness
from tests.reference import (calc_diff, dequantize, expected_combine, expected_routing, expert_scale,
                             fp8_reference, structured_inputs, token_count)

TRANSPORTS = ["collective", "shm", "mooncake"]
SIZES = [1, 2, 4]
# The Transfer Engine route (disable_p2p=True) runs at R=2 and R=4; shm and collective also at 1 and 8.
GRID = [(t, r) for t in TRANSPORTS for r in SIZES if not (t == "mooncake" and r == 1)]
TIMEOUT_US = 30_000_000  # generous: a healthy run never reaches it


class Case:
    """Shape of one test round."""

    def __init__(self, hidden=256, tokens=40, experts=16, top_k=4):
        self.hidden, self.tokens, self.experts, self.top_k = hidden, tokens, experts, top_k


def _all_gather_topk(ctx, topk_idx):
    gathered = [None] * ctx.num_ranks
    dist.all_gather_object(gathered, topk_idx, group=ctx.group)
    return gathered


def _make_buffer(ctx, transport, case):
    size = Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    # "mooncake" with disable_p2p: every peer over the Transfer Engine, as between hosts.
    return Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)


def _complete(event, hook, mode):
    if mode == "hook":
        hook()
    # Safe on every event, synchronous ones included; completes async ones.
    event.current_stream_wait()


def _check_dispatch(ctx, case, inputs_by_rank, active, result, use_fp8, mode, structured=True):
    """Assert every output of a dispatch against the all-gathered routing.

    `structured`: the tokens carry their source and index (structured_inputs without random_values), which the
    bf16 rows are then also checked against; random rows are checked against the sent tokens only.
    """
    recv, recv_count, handle, event, hook = result
    _complete(event, hook, mode)
    local = case.experts // ctx.num_ranks
    src_info, layout_range, tokens, hidden, experts = handle
    assert (tokens, hidden, experts) == (case.tokens, case.hidden, case.experts)
    if not active[ctx.rank]:
        return handle  # every peer treats this rank as dead: what it receives is unspecified
    routing = expected_routing([inp.topk_idx for inp in inputs_by_rank], active, ctx.rank, local)
    counts = layout_range & 0xFFFFFFFF
    begins = layout_range >> 32
    assert recv_count.tolist() == [len(pairs) for pairs in routing]
    assert recv_count.tolist() == counts.sum(1).tolist()
    if use_fp8:
        data, scales = recv
        assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert scales.shape == (local, ctx.num_ranks * case.tokens, case.hidden // 128)
        assert scales.stride(1) == 1, "scales: the token axis must be contiguous"
    seen = []
    for l_idx, pairs in enumerate(routing):
        for source in range(ctx.num_ranks):
            source_pairs = [p for p in pairs if p[0] == source]
            assert int(counts[l_idx, source]) == len(source_pairs)
            begin = int(begins[l_idx, source])
            expected_begin = sum(1 for p in pairs if p[0] < source)
            if source_pairs:
                assert begin == expected_begin
        for row, (source, token) in enumerate(pairs):
            assert int(src_info[l_idx, row]) == token
            sent = inputs_by_rank[source].x[token]
            if use_fp8:
                ref_data, ref_scales = fp8_reference(sent.view(1, -1))
                assert torch.equal(data[l_idx, row].view(torch.uint8), ref_data[0].view(torch.uint8))
                assert torch.equal(scales[l_idx, row], ref_scales[0])
            else:
                got = recv[l_idx, row]
                assert torch.equal(got, sent), f"expert {l_idx} row {row}: wrong token"
                if structured:
                    assert float(got[0]) == source - 128 and float(got[-1]) == token
            seen.append((source, token))
    return handle


def _expert_outputs(ctx, case, recv, recv_count, use_fp8):
    """The mock expert: dequantise (FP8), scale by a power of two per global expert."""
    local = case.experts // ctx.num_ranks
    if use_fp8:
        data, scales = recv
        values = torch.zeros((local, data.size(1), case.hidden), dtype=torch.bfloat16)
        for l_idx in range(local):
            n = int(recv_count[l_idx])
            values[l_idx, :n] = dequantize(data[l_idx, :n], scales[l_idx, :n]).to(torch.bfloat16)
    else:
        values = recv
    y = torch.empty((local, values.size(1), case.hidden), dtype=torch.bfloat16)
    for l_idx in range(local):
        y[l_idx] = (values[l_idx].float() * expert_scale(ctx.rank * local + l_idx)).to(torch.bfloat16)
    return y


def _seen_values(inputs, use_fp8):
    if not use_fp8:
        return inputs.x
    data, scales = fp8_reference(inputs.x)
    return dequantize(data, scales).to(torch.bfloat16)


def gathered_inputs(ctx, case, seed, random_values=False, inactive=()):
    """This rank's structured inputs (uneven counts), every rank's (all-gathered), and the mask with
    `inactive` ranks at 0."""
    n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
    inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed, random_values=random_values)
    all_inputs = [None] * ctx.num_ranks
    dist.all_gather_object(all_inputs, inputs, group=ctx.group)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    active[list(inactive)] = 0
    return inputs, all_inputs, active


def rank_round_trip(ctx, transport, use_fp8, mode, seed=0, inactive=(), random_values=False, case=None,
                    zero_copy=False, use_out=False):
    """One dispatch + mock experts + combine, checked against the references."""
    case = case or Case()
    buffer = _make_buffer(ctx, transport, case)
    try:
        inputs, all_inputs, active = gathered_inputs(ctx, case, seed, random_values, inactive)
        n = inputs.x.size(0)
        if ctx.rank in inactive and buffer.transport != "collective":
            return 0.0  # dead to every peer: on one-sided transports it simply takes no part
        flags = dict(async_finish=mode == "async", return_recv_hook=mode == "hook")
        result = buffer.dispatch(inputs.x, inputs.topk_idx, active, case.tokens, case.experts, TIMEOUT_US,
                                 use_fp8=use_fp8, **flags)
        handle = _check_dispatch(ctx, case, all_inputs, active.tolist(), result, use_fp8, mode,
                                 structured=not random_values)
        recv, recv_count = result[0], result[1]
        y = _expert_outputs(ctx, case, recv, recv_count, use_fp8)
        if zero_copy:
            target = buffer.get_next_combine_buffer(handle)
            target.copy_(y)
            y = target
        out = torch.full((n, case.hidden), 7.0, dtype=torch.bfloat16) if use_out else None
        combined, event, hook = buffer.combine(y, inputs.topk_idx, inputs.weights, active, TIMEOUT_US, handle,
                                               zero_copy=zero_copy, out=out, **flags)
        _complete(event, hook, mode)
        if use_out:
            assert combined.data_ptr() == out.data_ptr()
        local = case.experts // ctx.num_ranks
        owner_active = {r: bool(active[r]) for r in range(ctx.num_ranks)}
        expected = expected_combine(_seen_values(inputs, use_fp8), inputs.topk_idx, inputs.weights, owner_active,
                                    local)
        assert active.tolist() == [0 if r in inactive else 1 for r in range(ctx.num_ranks)]
        if ctx.rank in inactive:
            return 0.0  # dead to every peer: it must not hang, its output is unspecified
        diff = calc_diff(combined, expected) if n else 0.0
        assert diff < 1e-5, f"combine differs from the reference: calc_diff={diff}"
        if not random_values:
            assert torch.equal(combined, expected), "structured tokens must combine exactly"
        return diff
    finally:
        buffer.destroy()


@pytest.mark.parametrize("transport,num_ranks", GRID)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["sync", "hook", "async"])
def test_round_trip(transport, num_ranks, use_fp8, mode):
    harness.run(num_ranks, rank_round_trip, transport, use_fp8, mode, seed=num_ranks)


@pytest.mark.parametrize("transport", ["collective", "shm"])
def test_round_trip_eight_ranks(transport):
    harness.run(8, rank_round_trip, transport, False, "sync", seed=8, case=Case(tokens=24, experts=16))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_combine_random_values_precision(transport, use_fp8):
    """Random activations: bf16 combine within 1e-5, FP8 within 9e-4 of the bf16 reference."""
    diffs = harness.run(4, rank_random_precision, transport, use_fp8)
    limit = 9e-4 if use_fp8 else 1e-5
    assert max(diffs) < limit, diffs


def rank_random_precision(ctx, transport, use_fp8):
    """Dispatch random tokens; compare the combine with a bf16 reference that never quantised."""
    case = Case(hidden=512, tokens=32, experts=8, top_k=3)
    buffer = _make_buffer(ctx, transport, case)
    try:
        n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
        inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed=11, random_values=True)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        recv, recv_count, handle, event, _ = buffer.dispatch(inputs.x, inputs.topk_idx, active, case.tokens,
                                                             case.experts, TIMEOUT_US, use_fp8=use_fp8)
        y = _expert_outputs(ctx, case, recv, recv_count, use_fp8)
        combined, _, _ = buffer.combine(y, inputs.topk_idx, inputs.weights, active, TIMEOUT_US, handle)
        owner_active = {r: True for r in range(ctx.num_ranks)}
        expected = expected_combine(inputs.x, inputs.topk_idx, inputs.weights, owner_active,
                                    case.experts // ctx.num_ranks)
        return calc_diff(combined, expected) if n else 0.0
    finally:
        buffer.destroy()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("zero_copy,use_out", [(True, False), (False, True), (True, True)])
def test_zero_copy_and_out(transport, zero_copy, use_out):
    harness.run(4, rank_round_trip, transport, False, "sync", seed=3, zero_copy=zero_copy, use_out=use_out)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_inactive_rank_is_neither_sent_to_nor_expected(transport, num_ranks):
    """A rank marked inactive by every caller: its tokens and its experts drop out exactly."""
    harness.run(num_ranks, rank_round_trip, transport, False, "sync", seed=5, inactive=(1,))


def rank_two_dispatches(ctx, transport, mode):
    """Two dispatches alive at once (double buffering), then both combines, each checked."""
    case = Case(tokens=24)
    buffer = _make_buffer(ctx, transport, case)
    try:
        flags = dict(async_finish=mode == "async", return_recv_hook=mode == "hook")
        n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
        rounds = []
        for seed in (21, 22):
            inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed)
            all_inputs = [None] * ctx.num_ranks
            dist.all_gather_object(all_inputs, inputs, group=ctx.group)
            active = torch.ones(ctx.num_ranks, dtype=torch.int32)
            result = buffer.dispatch(inputs.x, inputs.topk_idx, active, case.tokens, case.experts, TIMEOUT_US,
                                     use_fp8=False, **flags)
            rounds.append((inputs, all_inputs, active, result))
        for inputs, all_inputs, active, result in rounds:
            handle = _check_dispatch(ctx, case, all_inputs, active.tolist(), result, False, mode)
            y = _expert_outputs(ctx, case, result[0], result[1], False)
            combined, event, hook = buffer.combine(y, inputs.topk_idx, inputs.weights, active, TIMEOUT_US, handle,
                                                   **flags)
            _complete(event, hook, mode)
            expected = expected_combine(inputs.x, inputs.topk_idx, inputs.weights,
                                        {r: True for r in range(ctx.num_ranks)}, case.experts // ctx.num_ranks)
            assert torch.equal(combined, expected)
        return True
    finally:
        buffer.destroy()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["sync", "hook", "async"])
def test_two_dispatches_in_a_row(transport, mode):
    harness.run(4, rank_two_dispatches, transport, mode)


def rank_many_rounds(ctx, transport, rounds):
    """Many consecutive rounds with changing routing: no state leaks between calls."""
    for seed in range(rounds):
        rank_round_trip(ctx, transport, seed % 2 == 1, ["sync", "hook", "async"][seed % 3], seed=100 + seed)
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_rounds(transport):
    harness.run(2, rank_many_rounds, transport, 6)


def rank_mixed_routes(ctx, hosts):
    """Ranks split over `hosts` pretend hosts (MEP_HOST_ID): shm inside a host, TE across."""
    import os

    os.environ["MEP_HOST_ID"] = f"pretend-host-{ctx.rank * hosts // ctx.num_ranks}"
    try:
        case = Case()
        size = Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
        with Buffer(ctx.group, size) as buffer:  # auto: ranks span hosts -> "mooncake"
            routes = list(buffer._transport.routes)
            assert buffer.transport == "mooncake", buffer.transport
        results = [rank_round_trip(ctx, "auto", use_fp8, mode, seed=60 + i)
                   for i, (use_fp8, mode) in enumerate([(False, "sync"), (True, "hook")])]
        return routes, results
    finally:
        os.environ.pop("MEP_HOST_ID", None)


def test_mixed_routes_shm_inside_a_host_te_across():
    values = harness.run(4, rank_mixed_routes, 2)
    routes = [v[0] for v in values]
    assert routes[0] == ["self", "shm", "te", "te"]
    assert routes[3] == ["te", "te", "shm", "self"]
