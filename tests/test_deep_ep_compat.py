"""DeepEP V1's low-latency API (issue 27 item 5): `import mooncake_ep_switch.deep_ep as deep_ep` for `import deep_ep`.

Each case runs the call pattern of DeepEP V1's low-latency test on real rank processes (tests/harness.py)
over shm, the Transfer Engine (`allow_nvlink_for_low_latency_mode=False` reaches every peer through it)
and the collective fallback: the size hint, `Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
...)`, `clean_low_latency_buffer`, `low_latency_dispatch` in bf16 and FP8 (plain, `round_scale`,
`use_ue8m0`) with the receive statistics, through the event and through the hook, then
`low_latency_combine` plain and zero-copy; and shrink mode's mask calls. Every received row, scale,
count and combined value is compared with the independent references of tests/reference.py (the
power-of-two scales and UE8M0 packing with one written here, from DeepEP's documented contract).
"""
import time

import pytest
import torch

import mooncake_ep_switch.deep_ep as deep_ep
from mooncake_ep_switch import Buffer as OurBuffer, EventOverlap
from tests import harness
from tests.reference import dequantize, expected_combine, expected_routing, expert_scale, fp8_reference, \
    structured_inputs

T, HIDDEN, TOP_K = 16, 512, 3  # hidden a multiple of 512: UE8M0 packs four scales per int32
LONG_US = 30_000_000  # never reached by a healthy call
TRANSPORTS = ["shm", "mooncake", "collective"]
QUANT = [("bf16", False, False, False), ("fp8", True, False, False), ("fp8_round", True, True, False),
         ("fp8_ue8m0", True, True, True)]


def _experts(num_ranks):
    return 4 * num_ranks


def _inputs(rank, num_ranks, seed):
    """Uneven token counts and rows of very different magnitudes (so the scales differ), deterministic per
    (rank, seed): every rank rebuilds every rank's inputs without a collective."""
    n = T - 3 * rank
    inp = structured_inputs(rank, n, HIDDEN, _experts(num_ranks), TOP_K, seed, num_masked=4, random_values=True)
    magnitude = (2.0 ** (torch.arange(n) % 11 - 5).float() * 1.7).view(-1, 1)
    return inp._replace(x=(inp.x.float() * magnitude).to(torch.bfloat16))


def _make(ctx, transport, **kwargs):
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, ctx.num_ranks, _experts(ctx.num_ranks))
    return deep_ep.Buffer(ctx.group, num_rdma_bytes=hint, low_latency_mode=True,
                          num_qps_per_rank=_experts(ctx.num_ranks) // ctx.num_ranks,
                          allow_nvlink_for_low_latency_mode=transport != "mooncake", explicitly_destroy=True,
                          transport=transport, **kwargs)


# ---------------------------------------------------------------- references written from DeepEP's contract

def pow2_reference(rows):
    """round_scale: per 128 channels scale = 2^ceil(log2(max(amax, 1e-4) * float32(1/448))); the rows
    cast with it, saturating at +-448. Returns (data, float scales `[n, H/128]`, exponents)."""
    groups = rows.float().view(rows.size(0), -1, 128)
    ratio = groups.abs().amax(-1).clamp(min=1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2(ratio))
    scales = torch.ldexp(torch.ones_like(ratio), exponent)
    data = (groups / scales.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).view(rows.shape)
    return data, scales, exponent


def ue8m0_pack(exponent):
    """Exponents `[n, H/128]` -> int32 `[n, H/512]`: byte j (little-endian) of word p is group 4p+j, as e+127."""
    biased = (exponent.to(torch.int64) + 127).view(exponent.size(0), -1, 4)
    words = sum(biased[:, :, j] << (8 * j) for j in range(4))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def ue8m0_unpack(words):
    """int32 `[n, H/512]` -> float scales `[n, H/128]`, arithmetically (no reinterpreting views)."""
    value = words.to(torch.int64) % (2 ** 32)
    biased = torch.stack([(value >> (8 * j)) & 0xFF for j in range(4)], dim=-1).view(words.size(0), -1)
    return torch.ldexp(torch.ones(biased.shape), biased - 127)


def seen_by_expert(rows, mode):
    """What an expert computes on after the dispatch's cast: bf16 rows (FP8 dequantised to bf16)."""
    if mode == "bf16":
        return rows
    data, scales = fp8_reference(rows) if mode == "fp8" else pow2_reference(rows)[:2]
    return dequantize(data, scales).to(torch.bfloat16)


def check_dispatch(ctx, all_inputs, active, mode, recv, count, handle, stats, repeats):
    """recv_count, layout_range, src_info, the stats tensor and every row (and scale) against the references."""
    local = _experts(ctx.num_ranks) // ctx.num_ranks
    routing = expected_routing([inp.topk_idx for inp in all_inputs], active, ctx.rank, local)
    src_info, layout_range, tokens, hidden, experts = handle
    assert (tokens, hidden, experts) == (T, HIDDEN, _experts(ctx.num_ranks))
    assert count.tolist() == [len(p) for p in routing], (count.tolist(), mode)
    assert stats.tolist() == [repeats * len(p) for p in routing], "cumulative_local_expert_recv_stats"
    rows = ctx.num_ranks * T
    if mode == "bf16":
        assert recv.dtype == torch.bfloat16 and recv.shape == (local, rows, HIDDEN)
    else:
        data, scales = recv
        groups = HIDDEN // 512 if mode == "fp8_ue8m0" else HIDDEN // 128
        assert data.dtype == torch.float8_e4m3fn and data.shape == (local, rows, HIDDEN)
        assert scales.dtype == (torch.int32 if mode == "fp8_ue8m0" else torch.float32)
        assert scales.shape == (local, rows, groups) and scales.stride(1) == 1, "scales: token axis contiguous"
    for l_idx, pairs in enumerate(routing):
        for source in range(ctx.num_ranks):
            word = int(layout_range[l_idx, source])
            assert word & 0xFFFFFFFF == sum(1 for p in pairs if p[0] == source)
            if word & 0xFFFFFFFF:
                assert word >> 32 == sum(1 for p in pairs if p[0] < source)
        for row, (source, token) in enumerate(pairs):
            assert int(src_info[l_idx, row]) == token
            sent = all_inputs[source].x[token].view(1, -1)
            if mode == "bf16":
                assert torch.equal(recv[l_idx, row], sent[0]), (l_idx, row)
                continue
            if mode == "fp8":
                want_data, want_scales = fp8_reference(sent)
            else:
                want_data, want_scales, exponent = pow2_reference(sent)
                if mode == "fp8_ue8m0":
                    want_scales = ue8m0_pack(exponent)
            assert torch.equal(data[l_idx, row].view(torch.uint8), want_data[0].view(torch.uint8)), (mode, row)
            assert torch.equal(scales[l_idx, row], want_scales[0]), (mode, l_idx, row)


def simulated_expert(ctx, recv, count, mode):
    """The mock expert: dequantise (DeepEP's cast-back, UE8M0 unpacked), scale by a power of two per expert."""
    local = count.numel()
    out = torch.zeros((local, ctx.num_ranks * T, HIDDEN), dtype=torch.bfloat16)
    for l_idx in range(local):
        n = int(count[l_idx])
        if mode == "bf16":
            values = recv[l_idx, :n]
        else:
            data, scales = recv[0][l_idx, :n], recv[1][l_idx, :n]
            scales = ue8m0_unpack(scales) if mode == "fp8_ue8m0" else scales
            values = dequantize(data, scales).to(torch.bfloat16)
        out[l_idx, :n] = (values.float() * expert_scale(ctx.rank * local + l_idx)).to(torch.bfloat16)
    return out


def check_combine(ctx, mine, mode, owners, combined):
    local = _experts(ctx.num_ranks) // ctx.num_ranks
    expected = expected_combine(seen_by_expert(mine.x, mode), mine.topk_idx, mine.weights,
                                {r: bool(owners[r]) for r in range(ctx.num_ranks)}, local)
    assert torch.equal(combined, expected), f"combined differs from the reference ({mode})"


def low_latency_round(ctx, buffer, seed, mode, active, return_recv_hook=False, repeats=1, combine_active=None,
                      dispatch_only=False):
    """One dispatch (repeated `repeats` times into one stats tensor), the mock experts, a plain and a
    zero-copy combine into `out`; everything checked. `active`: the view of who takes part (in combine:
    `combine_active`, if given)."""
    all_inputs = [_inputs(r, ctx.num_ranks, seed) for r in range(ctx.num_ranks)]
    mine = all_inputs[ctx.rank]
    use_fp8, round_scale, use_ue8m0 = next(q[1:] for q in QUANT if q[0] == mode)
    local = _experts(ctx.num_ranks) // ctx.num_ranks
    stats = torch.zeros(local, dtype=torch.int32)
    for _ in range(repeats):
        recv, count, handle, event, hook = buffer.low_latency_dispatch(
            mine.x, mine.topk_idx, T, _experts(ctx.num_ranks), cumulative_local_expert_recv_stats=stats,
            use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not return_recv_hook,
            return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else event.current_stream_wait()
    check_dispatch(ctx, all_inputs, active, mode, recv, count, handle, stats, repeats)
    if dispatch_only:
        return
    y = simulated_expert(ctx, recv, count, mode)
    for zero_copy in (False, True):
        if zero_copy:
            buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
        out = torch.empty((mine.x.size(0), HIDDEN), dtype=torch.bfloat16)
        combined, event, hook = buffer.low_latency_combine(y, mine.topk_idx, mine.weights, handle,
                                                           async_finish=not return_recv_hook, zero_copy=zero_copy,
                                                           return_recv_hook=return_recv_hook, out=out)
        hook() if return_recv_hook else event.current_stream_wait()
        assert combined.data_ptr() == out.data_ptr()
        check_combine(ctx, mine, mode, combine_active or active, combined)


# ---------------------------------------------------------------- the call pattern

def rank_call_pattern(ctx, transport):
    buffer = _make(ctx, transport, timeout_us=LONG_US)
    assert buffer.transport == transport and buffer.group_size == ctx.num_ranks and buffer.rank == ctx.rank
    buffer.clean_low_latency_buffer(T, HIDDEN, _experts(ctx.num_ranks))
    everyone = [1] * ctx.num_ranks
    seed = 0
    for return_recv_hook in (False, True):
        for mode, *_ in QUANT:
            seed += 1
            low_latency_round(ctx, buffer, seed, mode, everyone, return_recv_hook, repeats=1 + seed % 2)
    # An async_finish dispatch whose event is never waited: the next call completes it (DeepEP: stream order),
    # its casts and statistics included.
    all_inputs = [_inputs(r, ctx.num_ranks, 50) for r in range(ctx.num_ranks)]
    stats = torch.zeros(_experts(ctx.num_ranks) // ctx.num_ranks, dtype=torch.int32)
    recv, count, handle, event, _ = buffer.low_latency_dispatch(
        all_inputs[ctx.rank].x, all_inputs[ctx.rank].topk_idx, T, _experts(ctx.num_ranks),
        cumulative_local_expert_recv_stats=stats, round_scale=True, use_ue8m0=True, async_finish=True)
    buffer.clean_low_latency_buffer(T, HIDDEN, _experts(ctx.num_ranks))
    assert event.is_complete()
    check_dispatch(ctx, all_inputs, everyone, "fp8_ue8m0", recv, count, handle, stats, 1)
    low_latency_round(ctx, buffer, 99, "fp8_ue8m0", everyone)
    buffer.destroy()
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deep_ep_low_latency_call_pattern(transport):
    """DeepEP V1's low-latency test loop (hooks and events, bf16, FP8, round_scale, UE8M0, stats, zero copy)."""
    assert harness.run(2, rank_call_pattern, transport, timeout_s=120) == [True, True]


# ---------------------------------------------------------------- shrink mode: mask calls

def rank_partition_and_heal(ctx, transport):
    """Ranks 0-1 mask rank 2 and rank 2 masks them: both sides run exact rounds of their own without waiting;
    then the masks are cleared (one side by unmasking, the other by cleaning) and everyone runs a round."""
    buffer = _make(ctx, transport, enable_shrink=True, timeout_us=LONG_US)
    status = torch.full((ctx.num_ranks,), 7, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 0]
    others = [r for r in range(3) if r != ctx.rank]
    to_mask = [2] if ctx.rank < 2 else [0, 1]
    for rank in to_mask:
        buffer.low_latency_update_mask_buffer(rank, mask=True)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r in to_mask else 0 for r in range(3)]
    view = [0 if r in to_mask else 1 for r in range(3)]
    started = time.monotonic()
    low_latency_round(ctx, buffer, 5, "bf16", view)
    buffer.clean_low_latency_buffer(T, HIDDEN, _experts(3))
    low_latency_round(ctx, buffer, 6, "fp8_ue8m0", view, return_recv_hook=True)
    elapsed = time.monotonic() - started
    assert elapsed < LONG_US / 1e6 / 2, f"masked ranks were waited for ({elapsed:.1f} s)"
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 if r in to_mask else 0 for r in range(3)], "no timeout may change the mask"
    if ctx.rank < 2:
        buffer.low_latency_update_mask_buffer(2, mask=False)
    else:
        buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 0], others
    buffer.clean_low_latency_buffer(T, HIDDEN, _experts(3))
    low_latency_round(ctx, buffer, 7, "fp8", [1, 1, 1])
    buffer.destroy()
    return elapsed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_mask_calls_partition_and_heal(transport):
    harness.run(3, rank_partition_and_heal, transport, timeout_s=120)


SILENT = 1


def rank_silent_peer(ctx, transport, timeout_us, stage):
    """DeepEP's shrink test: rank SILENT stops calling at its first dispatch (or after it, before combine);
    the others' dispatch (combine) masks it at the deadline, results are exact without it (its rows received
    before it went silent count), and later calls (clean included) never wait for it again."""
    buffer = _make(ctx, transport, enable_shrink=True, timeout_us=timeout_us)
    harness.RANK_STATE["buffer"] = buffer  # destroyed by rank_teardown, after every rank is done
    everyone = [1] * ctx.num_ranks
    without = [0 if r == SILENT else 1 for r in range(ctx.num_ranks)]
    dispatch_view = without if stage == "dispatch" else everyone
    if ctx.rank == SILENT:
        if stage == "combine":
            low_latency_round(ctx, buffer, 11, "fp8", everyone, return_recv_hook=True, dispatch_only=True)
        return None
    status = torch.zeros(ctx.num_ranks, dtype=torch.int32)
    started = time.monotonic()
    low_latency_round(ctx, buffer, 11, "fp8", dispatch_view, return_recv_hook=True, combine_active=without)
    first = time.monotonic() - started
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 - a for a in without]
    started = time.monotonic()
    buffer.clean_low_latency_buffer(T, HIDDEN, _experts(ctx.num_ranks))
    low_latency_round(ctx, buffer, 12, "bf16", without)
    later = time.monotonic() - started
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [1 - a for a in without]
    assert first >= timeout_us / 1e6 * 0.9 and later < timeout_us / 1e6 * 0.9, (first, later)
    return first, later


@pytest.mark.parametrize("stage", ["dispatch", "combine"])
@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_shrink_a_silent_rank_is_masked_at_the_deadline(transport, stage):
    """shm and the Transfer Engine (the collective fallback notices a silent peer only at gloo's timeout)."""
    timeout_us = harness.FAULT_TIMEOUT_US_TE if transport == "mooncake" else harness.FAULT_TIMEOUT_US
    try:
        harness.run(3, rank_silent_peer, transport, timeout_us, stage, timeout_s=120)
    finally:
        harness.run(3, harness.rank_teardown, timeout_s=60)


def rank_without_shrink(ctx, transport):
    """Without enable_shrink the mask calls raise, and a peer missing the deadline makes the call raise (DeepEP
    traps) naming it."""
    buffer = _make(ctx, transport, timeout_us=400_000)
    harness.RANK_STATE["buffer"] = buffer
    for call, args in (("low_latency_update_mask_buffer", (1, True)), ("low_latency_clean_mask_buffer", ()),
                       ("low_latency_query_mask_buffer", (torch.zeros(2, dtype=torch.int32),))):
        with pytest.raises(RuntimeError, match="enable_shrink"):
            getattr(buffer, call)(*args)
    if ctx.rank == SILENT:
        return True
    mine = _inputs(ctx.rank, 2, 3)
    with pytest.raises(RuntimeError, match=r"low_latency_dispatch: ranks \[1\] missed the deadline"):
        buffer.low_latency_dispatch(mine.x, mine.topk_idx, T, _experts(2), use_fp8=False)
    return True


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_without_shrink_a_missed_deadline_raises(transport):
    try:
        harness.run(2, rank_without_shrink, transport, timeout_s=60)
    finally:
        harness.run(2, harness.rank_teardown, timeout_s=60)


# ---------------------------------------------------------------- names and bad arguments

def test_module_exports_deep_ep_names():
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.EventOverlap is EventOverlap
    for shape in ((128, 7168, 8, 288), (16, 512, 2, 8)):
        assert deep_ep.Buffer.get_low_latency_rdma_size_hint(*shape) == OurBuffer.get_ep_buffer_size_hint(*shape)
    event = deep_ep.Buffer.capture()
    assert event.is_complete()
    event.current_stream_wait()


def test_round_scale_reference_matches_deep_ep_examples():
    """The test's own references on hand-computed values: amax 448 -> scale 1; amax 480 -> 2; amax 1e-9 ->
    the margin 1e-4 -> 2^-22 (1e-4/448 = 2.2e-7, in (2^-23, 2^-22]); UE8M0 bytes of word 0 little-endian."""
    rows = torch.zeros((1, 512), dtype=torch.bfloat16)
    rows[0, 0], rows[0, 128], rows[0, 256], rows[0, 384] = 448, 480, 1e-9, -3.5
    data, scales, exponent = pow2_reference(rows)
    assert exponent.tolist() == [[0, 1, -22, -7]] and scales[0, 0] == 1 and scales[0, 1] == 2
    assert float(data[0, 0].float()) == 448 and float(data[0, 384].float()) == -448
    assert ue8m0_pack(exponent).tolist() == [[127 | (128 << 8) | (105 << 16) | (120 << 24)]]
    assert torch.equal(ue8m0_unpack(ue8m0_pack(exponent)), scales)


def rank_bad_arguments(ctx):
    """Rank 0 makes every mistake (rank 1 none); the round after it is exact on both, so no refused call moved
    anything or advanced a counter."""
    group = ctx.group
    refused = []
    if ctx.rank == 0:
        for kwargs, error, text in (
                (dict(low_latency_mode=False), NotImplementedError, "low_latency_mode: expected True"),
                (dict(low_latency_mode=True, num_qps_per_rank=0), ValueError, "num_qps_per_rank"),
                (dict(low_latency_mode=True, enable_shrink=2), ValueError, "enable_shrink: expected a bool"),
                (dict(low_latency_mode=True, timeout_us=-1), ValueError, "timeout_us: expected an int >= 1"),
                (dict(low_latency_mode=True, transport="nvshmem"), ValueError, "transport")):
            with pytest.raises(error, match=text):
                deep_ep.Buffer(group, 0, 1 << 20, **kwargs)
            refused.append(text)
        with pytest.raises(NotImplementedError, match="comm"):
            deep_ep.Buffer(None, 0, 1 << 20, low_latency_mode=True, comm=object())
    buffer = _make(ctx, "shm", timeout_us=LONG_US)
    harness.RANK_STATE["buffer"] = buffer
    mine = _inputs(ctx.rank, 2, 21)
    stats = torch.zeros(_experts(2) // 2, dtype=torch.int32)
    if ctx.rank == 0:
        x, k, e = mine.x, mine.topk_idx, _experts(2)
        cases = [
            (dict(cumulative_local_expert_recv_stats=stats.long()), "cumulative_local_expert_recv_stats"),
            (dict(cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32)),
             "cumulative_local_expert_recv_stats"),
            (dict(dispatch_wait_recv_cost_stats=torch.zeros(2, 2, dtype=torch.int64)), "dispatch_wait_recv_cost"),
            (dict(use_ue8m0=True), "use_ue8m0"),
            (dict(round_scale=1.0), "round_scale: expected a bool"),
            (dict(async_finish=True, return_recv_hook=True), "async_finish, return_recv_hook"),
        ]
        for kwargs, text in cases:
            kwargs.setdefault("cumulative_local_expert_recv_stats", stats)
            with pytest.raises((ValueError, TypeError), match=text):
                buffer.low_latency_dispatch(x, k, T, e, **kwargs)
        with pytest.raises(ValueError, match="x: expected a hidden size that is a multiple of 512"):
            buffer.low_latency_dispatch(x[:, :384].contiguous(), k, T, e, round_scale=True, use_ue8m0=True)
        with pytest.raises(ValueError, match="topk_idx"):
            buffer.low_latency_dispatch(x, k.int(), T, e, cumulative_local_expert_recv_stats=stats)
        with pytest.raises(ValueError, match="num_experts: expected a multiple of num_ranks"):
            buffer.low_latency_dispatch(x, k, T, 7)
        with pytest.raises(ValueError, match="hidden"):
            buffer.clean_low_latency_buffer(T, 100, e)
        assert stats.tolist() == [0] * stats.numel(), "a refused dispatch added to the stats"
        with pytest.raises(RuntimeError, match="enable_shrink"):
            buffer.low_latency_update_mask_buffer(1, True)
        for name in ("dispatch", "combine", "get_dispatch_layout", "internode_dispatch", "internode_combine"):
            with pytest.raises(NotImplementedError, match="normal-mode"):
                getattr(buffer, name)(x)
        with pytest.raises(ValueError, match="timeout_us"):
            buffer.timeout_us = 0
        refused.append("dispatch")
    low_latency_round(ctx, buffer, 21, "bf16", [1, 1])
    mine = _inputs(ctx.rank, 2, 22)
    recv, count, handle, _, _ = buffer.low_latency_dispatch(mine.x, mine.topk_idx, T, _experts(2), use_fp8=False)
    y = simulated_expert(ctx, recv, count, "bf16")
    if ctx.rank == 0:
        for kwargs, text in ((dict(use_logfmt=True, zero_copy=True), "use_logfmt, zero_copy"),
                             (dict(combine_wait_recv_cost_stats=torch.zeros(2)), "combine_wait_recv_cost_stats"),
                             (dict(use_logfmt="yes"), "use_logfmt: expected a bool")):
            with pytest.raises((ValueError, TypeError), match=text):
                buffer.low_latency_combine(y, mine.topk_idx, mine.weights, handle, **kwargs)
    combined, _, _ = buffer.low_latency_combine(y, mine.topk_idx, mine.weights, handle, use_logfmt=True,
                                                combine_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64))
    check_combine(ctx, mine, "bf16", [1, 1], combined)
    return refused


def test_bad_arguments_raise_clear_errors_and_change_nothing():
    try:
        refused = harness.run(2, rank_bad_arguments, timeout_s=90)
    finally:
        harness.run(2, harness.rank_teardown, timeout_s=60)
    assert len(refused[0]) == 6 and refused[1] == []


def rank_destroy_needs_the_flag(ctx):
    buffer = deep_ep.Buffer(ctx.group, num_rdma_bytes=0, low_latency_mode=True, transport="collective")
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buffer.destroy()
    buffer.buffer.destroy()
    return True


def test_destroy_requires_explicitly_destroy():
    assert harness.run(2, rank_destroy_needs_the_flag, timeout_s=60) == [True, True]
