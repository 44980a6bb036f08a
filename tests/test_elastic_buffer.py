"""ElasticBuffer (issue 26): DeepEP V2's dispatch/combine layouts, bit for bit against an independent
reference (tests/elastic_reference.py), on real rank processes over every host transport.

Each rank runs V2's own test pattern for every case of the grid expert_alignment {1, 128} x FP8 x
bias {0, 1, 2} x async: a dispatch, an expanded dispatch, a cached dispatch, a cached expanded dispatch
with zero padding, then a combine of the first handle and of the expanded one. Ranks hold `T - rank`
tokens (V2's test) with ~1 in 8 top-k entries -1; one grid has a rank with no tokens at all.
"""
import pytest
import torch

from mooncake_ep_switch import ElasticBuffer, EPHandle
from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason
from tests import harness
from tests.elastic_reference import (expected_combine, expected_combine_entries, expected_dispatch, expected_weights,
                                     expert_output, make_inputs, ordered_sum)

TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()  # outputs of a "cuda" buffer on a GPU; the references live on the CPU
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    assert torch.equal(_bits(got), _bits(want)), f"{name}: bits differ"


def _align(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def check_dispatch(recv_x, recv_topk, recv_w, handle, want, fp8: bool, alignment: int, L: int, R: int, T: int,
                   with_weights: bool) -> None:
    """The not-expanded outputs and handle against the reference rows."""
    n = want["src_global"].numel()
    assert handle.num_recv_tokens == n
    _same("recv_src_metadata[:, 0]", handle.recv_src_metadata[:, 0].to(torch.int64), want["src_global"])
    if fp8:
        _same("recv_x[0]", recv_x[0], want["fp8"])
        _same("recv_x[1]", recv_x[1].contiguous(), want["sf"])
    else:
        _same("recv_x", recv_x, want["x"])
    _same("recv_topk_idx", recv_topk, want["local"])
    if with_weights:
        _same("recv_topk_weights", recv_w, want["weights"])
    else:
        assert recv_w is None
    per_source = torch.bincount(torch.div(want["src_global"], T, rounding_mode="floor"), minlength=R)
    _same("psum per scale-up rank", handle.psum_num_recv_tokens_per_scaleup_rank,
          torch.cumsum(per_source, 0).to(torch.int32))
    counts = [int((want["local"] == j).sum()) for j in range(L)]
    assert handle.num_recv_tokens_per_expert_list == [_align(c, alignment) for c in counts]
    if not handle.do_expand:
        _same("psum per expert", handle.psum_num_recv_tokens_per_expert,
              torch.cumsum(torch.tensor([_align(c, alignment) for c in counts]), 0).to(torch.int32))


def check_expanded(e_x, e_topk, e_w, e_handle, want, fp8: bool, alignment: int, L: int, zero_padding: bool) -> None:
    """Expanded: row `slot[i, k]` holds token i (and weight k), expert blocks aligned, in received order."""
    assert e_topk is None and e_handle.do_expand
    slots = e_handle.recv_src_metadata[:, 2:].to(torch.int64).cpu()
    local = want["local"]
    _same("expanded slots cover the local entries", slots >= 0, local >= 0)
    counts = [int((local == j).sum()) for j in range(L)]
    start = 0
    for j, count in enumerate(counts):
        token, entry = torch.nonzero(local == j, as_tuple=True)
        assert torch.equal(slots[token, entry], torch.arange(start, start + count)), f"expert {j}'s rows"
        assert int(e_handle.psum_num_recv_tokens_per_expert[j]) == start + count
        assert int(e_handle.num_unaligned_recv_tokens_per_expert[j]) == count
        if zero_padding:
            pad = slice(start + count, _align(start + count, alignment))
            data = e_x[0] if fp8 else e_x
            assert not bool(data[pad].view(torch.uint8).any()), f"expert {j}'s padding is not zero"
            assert not bool(e_w[pad].any())
        start = _align(start + count, alignment)
    assert e_handle.num_expanded_tokens == start
    token, entry = torch.nonzero(local >= 0, as_tuple=True)
    rows = slots[token, entry]
    if fp8:
        _same("expanded recv_x[0]", e_x[0][rows], want["fp8"][token])
        _same("expanded recv_x[1]", e_x[1][rows].contiguous(), want["sf"][token])
    else:
        _same("expanded recv_x", e_x[rows], want["x"][token])
    if e_w is not None:
        _same("expanded weights", e_w[rows], want["weights"][token, entry])


def rank_v2_grid(ctx, transport: str, T: int, H: int, K: int, E: int, seed: int, empty_rank=None, max_num_bias=2,
                 v2=None):
    """V2's tests/elastic/test_ep.py pattern over the grid; every output checked bit for bit.

    `v2`: the flags of one scenario of V2's program as its argparse gives them (ints: deterministic,
    allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, do_cpu_sync); with
    allow_multiple_reduction 0 the expanded combine takes no weights (as V2's program) and its
    reference has no reduction before the owner's. Without `v2`: V2's defaults, as bools."""
    v2 = dict(v2 or {})
    do_cpu_sync = v2.pop("do_cpu_sync", True)
    multiple = v2.get("allow_multiple_reduction", True)
    R, rank, L = ctx.num_ranks, ctx.rank, E // ctx.num_ranks
    if transport == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(0)  # rank processes on GPU 0 (the emulated device has none)
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True,
                           transport=transport, disable_p2p=transport == "mooncake", num_cpu_timeout_secs=30,
                           max_num_bias=max_num_bias, **v2)
    everyone = list(range(R))
    all_inputs = [make_inputs(r, R, T, H, K, E, seed, empty_rank) for r in range(R)]
    device = buffer.runtime.device or torch.device("cpu")  # a GPU's for "cuda" on a GPU, else the host's
    mine = type(all_inputs[rank])(*(None if t is None else [b.to(device) for b in t] if isinstance(t, list)
                                    else t.to(device) for t in all_inputs[rank]))
    want = expected_dispatch(all_inputs, rank, R, T, E, everyone)
    y_recv = expert_output(want["src_global"], K, H, seed)  # [n, K, H]: the expert side's outputs
    y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, seed)
    cases = 0
    for alignment in (1, 128):
        for fp8 in (False, True):
            for num_bias in range(max_num_bias + 1):
                for run_async in (False, True):
                    x = (mine.fp8, mine.sf) if fp8 else mine.x
                    bias = None if num_bias == 0 else mine.bias[0] if num_bias == 1 else tuple(mine.bias)
                    common = dict(num_experts=E, num_max_tokens_per_rank=T, expert_alignment=alignment,
                                  async_with_compute_stream=run_async, do_cpu_sync=do_cpu_sync,
                                  do_handle_copy=int(cases % 2 == 0) if v2 else True)
                    recv_x, recv_topk, recv_w, handle, event = buffer.dispatch(
                        x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, **common)
                    event.current_stream_wait() if run_async else None
                    check_dispatch(recv_x, recv_topk, recv_w, handle, want, fp8, alignment, L, R, T, True)
                    e_x, e_topk, e_w, e_handle, _ = buffer.dispatch(
                        x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, do_expand=True,
                        use_tma_aligned_col_major_sf=True, **common)
                    check_expanded(e_x, e_topk, e_w, e_handle, want, fp8, alignment, L, False)
                    c_x, c_topk, c_w, c_handle, _ = buffer.dispatch(x, handle=handle,
                                                                    async_with_compute_stream=run_async)
                    assert c_handle is handle and c_w is None
                    check_dispatch(c_x, c_topk, c_w, handle, want, fp8, alignment, L, R, T, False)
                    ce_x, _, ce_w, _, _ = buffer.dispatch(x, topk_weights=mine.topk_weights, handle=e_handle,
                                                          do_expand=True, do_zero_padding=True)
                    check_expanded(ce_x, None, ce_w, e_handle, want, fp8, alignment, L, True)

                    # Combine: each rank's partial of a received token is its entries' outputs summed in
                    # top-k order (not expanded: by the caller; expanded: by combine from the slot rows).
                    partial = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv,
                                                      torch.zeros_like(y_recv))).to(device)
                    host = all_inputs[rank]
                    host_biases = [] if bias is None else [host.bias[0]] if num_bias == 1 else list(host.bias)
                    reference = expected_combine(y_own, host.topk_idx, E, R, host_biases, everyone)
                    weights = expected_weights(host.topk_idx, host.topk_weights, E, R, everyone)
                    combined, combined_w, event = buffer.combine(partial, handle, topk_weights=recv_w, bias=bias,
                                                                 async_with_compute_stream=run_async)
                    event.current_stream_wait()
                    _same("combined_x", combined, reference)
                    _same("combined_topk_weights", combined_w, weights)
                    slots = e_handle.recv_src_metadata[:, 2:].to(torch.int64).cpu()
                    expanded_y = torch.randn(e_handle.num_expanded_tokens, H).to(torch.bfloat16)  # padding: junk
                    token, entry = torch.nonzero(slots >= 0, as_tuple=True)
                    expanded_y[slots[token, entry]] = y_recv[token, entry]
                    expanded_y = expanded_y.to(device)
                    if multiple:
                        combined2, combined_w2, _ = buffer.combine(expanded_y, e_handle, topk_weights=e_w, bias=bias)
                        _same("expanded combined_x", combined2, reference)
                        _same("expanded combined_topk_weights", combined_w2, weights)
                    else:  # one reduction, on the owner (V2's program passes no weights here)
                        combined2, combined_w2, _ = buffer.combine(expanded_y, e_handle, bias=bias)
                        assert combined_w2 is None
                        _same("expanded combined_x (one reduction)", combined2,
                              expected_combine_entries(y_own, host.topk_idx, E, R, host_biases, everyone))
                    if v2.get("deterministic"):  # V2's program: the same dispatch again gives the same bits
                        again_x, again_topk, again_w, again, _ = buffer.dispatch(
                            x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, **common)
                        check_dispatch(again_x, again_topk, again_w, again, want, fp8, alignment, L, R, T, True)
                    cases += 1
    used = buffer.runtime.transport, sorted(set(buffer.runtime.peer_routes()) - {"self"})
    buffer.destroy()
    return {"cases": cases, "received": want["src_global"].numel(), "transport": used[0], "routes": used[1]}


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_v2_layouts_and_combine_are_exact(transport, num_ranks):
    """Every output of V2's test pattern equals the reference bit for bit, over the whole grid."""
    E = 8 * num_ranks // 2
    # K=6 > num_ranks: a token reaches every rank, and its inner routing (one column per rank plus the two
    # bias slots) is still within the inner Buffer's top-k bound.
    values = harness.run(num_ranks, rank_v2_grid, transport, 12, 256, 6, E, 5, timeout_s=300)
    assert all(value["cases"] == 24 for value in values)
    assert all(value["received"] > 0 for value in values)
    routes = {"shm": ["shm"], "mooncake": ["te"], "collective": ["collective"]}[transport]
    assert all(value["transport"] == transport and value["routes"] == routes for value in values), values


@pytest.mark.parametrize("max_num_bias", [0, 1])
def test_fewer_bias_slots(max_num_bias):
    """max_num_bias 0 or 1 (fewer copies at dispatch): the grid's cases with that many biases, exact; more
    biases than that are refused by name (rank_misuse)."""
    values = harness.run(2, rank_v2_grid, "shm", 12, 256, 6, 8, 13, None, max_num_bias, timeout_s=300)
    assert all(value["cases"] == 8 * (max_num_bias + 1) for value in values)


def test_a_rank_with_no_tokens():
    """A rank that dispatches nothing still receives, combines others' tokens, and gets an empty result."""
    values = harness.run(4, rank_v2_grid, "shm", 12, 128, 3, 8, 11, 2, timeout_s=300)
    assert all(value["cases"] == 24 for value in values)


def rank_misuse(ctx):
    """Every bad argument is refused with an error naming it, before anything moves; the buffer then
    serves a valid round exactly (every rank makes the same bad calls, as an SPMD caller would)."""
    from mooncake_ep_switch import BufferDestroyed

    R, rank, T, H, K, E = ctx.num_ranks, ctx.rank, 8, 128, 3, 8
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport="shm")
    everyone = list(range(R))
    all_inputs = [make_inputs(r, R, T, H, K, E, 3) for r in range(R)]
    mine = all_inputs[rank]
    good = dict(topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, num_experts=E)
    # Mooncake's ElasticBuffer.dispatch keywords (num_sms=None, do_cpu_sync=None) are accepted too.
    _, _, recv_w, handle, _ = buffer.dispatch(mine.x, num_sms=None, do_cpu_sync=None, **good)
    duplicate = mine.topk_idx.clone()
    duplicate[0, 1] = duplicate[0, 0] = 1
    bad_dispatch = [
        ("x", dict(x=mine.x.float())), ("x", dict(x=mine.x[0])), ("x", dict(x=(mine.fp8, mine.sf, mine.sf))),
        ("x\\[1\\]", dict(x=(mine.fp8, mine.sf[:, :0]))),
        ("topk_idx", dict(topk_idx=mine.topk_idx.int())), ("topk_idx", dict(topk_idx=mine.topk_idx + E)),
        ("topk_idx", dict(topk_idx=duplicate)), ("topk_idx", dict(topk_idx=mine.topk_idx[:, :0])),
        ("topk_idx", dict(topk_idx=torch.zeros(mine.x.size(0), 32, dtype=torch.int64))),
        ("topk_weights", dict(topk_weights=mine.topk_weights[:, :1])),
        ("num_experts", dict(num_experts=None)), ("num_experts", dict(num_experts=E + 1)),
        ("num_max_tokens_per_rank", dict(num_max_tokens_per_rank=1)),
        ("expert_alignment", dict(expert_alignment=0)), ("do_zero_padding", dict(do_zero_padding=True)),
        ("do_expand", dict(do_expand=2)),
        ("cumulative_local_expert_recv_stats", dict(cumulative_local_expert_recv_stats=torch.zeros(E // R))),
        ("active_ranks", dict(active_ranks=torch.ones(R + 1, dtype=torch.int32))),
        ("timeout_us", dict(timeout_us=2 ** 63)),
        ("handle", dict(handle=object(), topk_idx=None)), ("topk_idx", dict(handle=handle)),
        ("do_cpu_sync", dict(handle=handle, topk_idx=None, do_cpu_sync=True)), ("do_cpu_sync", dict(do_cpu_sync="no")),
        ("do_expand", dict(handle=handle, topk_idx=None, do_expand=True)),
    ]
    refused = 0
    for name, change in bad_dispatch:
        call = dict(x=mine.x, **good)
        call.update(change)
        with pytest.raises((TypeError, ValueError), match=name):
            buffer.dispatch(**call)
        refused += 1
    n = handle.num_recv_tokens
    partial = torch.zeros(n, H, dtype=torch.bfloat16)
    bad_combine = [
        ("x", dict(x=partial[:max(n - 1, 0)] if n else torch.zeros(1, H, dtype=torch.bfloat16))),
        ("x", dict(x=partial.float())), ("handle", dict(handle=(1, 2))),
        ("topk_weights", dict(topk_weights=torch.zeros(n, K + 1))),
        ("bias", dict(bias=torch.zeros(mine.x.size(0) + 1, H, dtype=torch.bfloat16))),
        ("bias", dict(bias=(mine.bias[0],) * 3)), ("bias", dict(bias=[mine.bias[0]])), ("bias", dict(bias=())),
        ("bias", dict(bias=(mine.bias[0],))), ("bias", dict(bias=(None, mine.bias[0]))),
        ("active_ranks", dict(active_ranks=torch.ones(R, dtype=torch.int64))),
    ]
    lean = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport="shm", max_num_bias=1)
    _, _, lean_w, lean_handle, _ = lean.dispatch(mine.x, **good)
    with pytest.raises(ValueError, match="bias"):
        lean.combine(torch.zeros(lean_handle.num_recv_tokens, H, dtype=torch.bfloat16), lean_handle,
                     topk_weights=lean_w, bias=tuple(mine.bias))
    lean.combine(torch.zeros(lean_handle.num_recv_tokens, H, dtype=torch.bfloat16), lean_handle, topk_weights=lean_w,
                 bias=mine.bias[0])
    with pytest.raises(ValueError, match="handle: expected an EPHandle returned by this ElasticBuffer"):
        buffer.combine(torch.zeros(lean_handle.num_recv_tokens, H, dtype=torch.bfloat16), lean_handle)
    with pytest.raises(ValueError, match="handle: expected an EPHandle returned by this ElasticBuffer"):
        buffer.dispatch(mine.x, handle=lean_handle)
    lean.destroy()
    for name, change in bad_combine:
        call = dict(x=partial, handle=handle, topk_weights=recv_w)
        call.update(change)
        with pytest.raises((TypeError, ValueError), match=name):
            buffer.combine(**call)
        refused += 1
    # Still serving: the same handle combines exactly (its layout was never touched).
    want = expected_dispatch(all_inputs, rank, R, T, E, everyone)
    y_recv = expert_output(want["src_global"], K, H, 3)
    y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, 3)
    partial = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
    combined, weights, _ = buffer.combine(partial, handle, topk_weights=recv_w, bias=mine.bias[1])
    _same("combined_x after misuse", combined, expected_combine(y_own, mine.topk_idx, E, R, [mine.bias[1]], everyone))
    _same("weights after misuse", weights, expected_weights(mine.topk_idx, mine.topk_weights, E, R, everyone))
    buffer.destroy()
    buffer.destroy()  # idempotent
    with pytest.raises(BufferDestroyed):
        buffer.dispatch(mine.x, **good)
    constructor = [("num_cpu_bytes", dict(num_cpu_bytes=2 << 20)), ("num_topk", dict(num_topk=40)),
                   ("num_bytes", dict(num_max_tokens_per_rank=0)), ("explicitly_destroy", dict(explicitly_destroy="1")),
                   ("max_num_bias", dict(max_num_bias=3)),
                   ("transport", dict(transport="rdma"))]
    for name, change in constructor:
        settings = dict(num_max_tokens_per_rank=T, hidden=H, num_topk=K)
        settings.update(change)
        with pytest.raises((TypeError, ValueError), match=name):
            ElasticBuffer(ctx.group, **settings)
        refused += 1
    return refused


def test_misuse_is_refused_by_name_and_the_buffer_keeps_serving():
    refused = harness.run(2, rank_misuse, timeout_s=120)
    assert refused[0] == refused[1] == 41


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_v2_layouts_on_the_emulated_cuda_device(num_ranks):
    """The same grid on the cuda transport (device kernels, CUDA IPC regions) on the emulated device of
    tests/emulated_device.py: the real kernels on the host block/warp emulator."""
    from mooncake_ep_switch.launcher.launch import check_outcomes
    from tests.emulated_device import run_emulated

    E = 8 * num_ranks // 2
    with harness.fresh_cluster(num_ranks) as cluster:
        values = check_outcomes(cluster.run(run_emulated, __name__, "rank_v2_grid", "cuda", 12, 256, 4, E, 9,
                                            timeout_s=600))
    assert all(value["cases"] == 24 and value["received"] > 0 for value in values)
    assert all(value["transport"] == "cuda" and value["routes"] == ["cuda"] for value in values), values


@pytest.mark.skipif(bool(cuda_unavailable_reason()), reason="no CUDA device")
def test_v2_layouts_on_the_gpu():
    """The same grid on a GPU (rank processes on GPU 0, CUDA tensors in and out), every output exact."""
    from mooncake_ep_switch.launcher.launch import check_outcomes

    with harness.fresh_cluster(2) as cluster:
        values = check_outcomes(cluster.run(rank_v2_grid, "cuda", 12, 256, 4, 8, 9, timeout_s=300))
    assert all(value["cases"] == 24 and value["received"] > 0 for value in values)
    assert all(value["transport"] == "cuda" and value["routes"] == ["cuda"] for value in values), values


def test_the_benchmark_round_runs():
    """`python -m mooncake_ep_switch.bench elastic` measures this round against the Buffer's (timing lives in
    the benchmark; here it must run and count one rank's (token, destination) pairs)."""
    from mooncake_ep_switch.bench import elastic_bench
    from mooncake_ep_switch.bench import transport as tb

    shape = tb.TransportShape(2, 8, 128, 8, 3)
    values = harness.run(2, elastic_bench.rank_elastic_round, "shm", shape, 2, 1, timeout_s=120)
    for rank, value in enumerate(values):
        x, topk, _ = tb.rank_inputs(rank, shape)
        owner = torch.div(topk, 4, rounding_mode="floor")
        assert value["rank_pairs"] == int((owner == 0).any(1).sum() + (owner == 1).any(1).sum())
        assert value["seconds"] > 0 and value["transport"] == "shm"
        assert len(value["batch_seconds"]) == len(value["legacy_batch_seconds"]) == 5  # measure's per-batch ratios


def rank_out_of_order(ctx, transport):
    """Three dispatches, then their combines in reverse order, each twice: the first two handles' inner
    region halves were reused by later dispatches, so their combines lay the routing out again first;
    every result exact."""
    R, rank, T, H, K, E = ctx.num_ranks, ctx.rank, 10, 128, 4, 4 * ctx.num_ranks
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport=transport,
                           disable_p2p=transport == "mooncake")
    everyone = list(range(R))
    calls = []
    for seed in (31, 32, 33):
        all_inputs = [make_inputs(r, R, T, H, K, E, seed) for r in range(R)]
        mine = all_inputs[rank]
        expand = seed == 32
        recv_x, _, recv_w, handle, _ = buffer.dispatch(mine.x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights,
                                                       num_experts=E, do_expand=expand)
        calls.append((seed, all_inputs, handle, recv_w, expand))
    before = buffer._inner_dispatches
    for seed, all_inputs, handle, recv_w, expand in reversed(calls):
        mine = all_inputs[rank]
        want = expected_dispatch(all_inputs, rank, R, T, E, everyone)
        y_recv = expert_output(want["src_global"], K, H, seed)
        if expand:
            slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
            x = torch.zeros(handle.num_expanded_tokens, H, dtype=torch.bfloat16)
            token, entry = torch.nonzero(slots >= 0, as_tuple=True)
            x[slots[token, entry]] = y_recv[token, entry]
        else:
            x = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
        y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, seed)
        for _ in range(2):
            combined, weights, _ = buffer.combine(x, handle, topk_weights=recv_w, bias=mine.bias[0])
            _same("combined_x", combined, expected_combine(y_own, mine.topk_idx, E, R, [mine.bias[0]], everyone))
            _same("weights", weights, expected_weights(mine.topk_idx, mine.topk_weights, E, R, everyone))
    redispatched = buffer._inner_dispatches - before
    buffer.destroy()
    return redispatched


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_handles_combined_out_of_order_and_twice(transport):
    redispatched = harness.run(2, rank_out_of_order, transport, timeout_s=120)
    # The last handle combines in place twice (its second combine takes a call number, reusing the second
    # handle's region half); the second and the first then need their routing laid out again, once each.
    assert redispatched == [2, 2], redispatched
