"""A combine that starts each token's sum from a bias (issue 42 item 4): `Buffer.combine(..., bias=...)` reads
the bias rows where they are, and an `ElasticBuffer` uses it, so a bias costs no dispatched copy of the tokens.

Checked on real rank processes (R=2) over every host transport: the Buffer's result bit for bit against an
independent float32 reduction, the ElasticBuffer's against V2's reference (tests/elastic_reference.py), and
the ElasticBuffer's inner dispatch carries no bias rows. The same on the 'cuda' transport (its combine kernel
reads the bias rows in device memory), against shm's result too: on the emulated device of
tests/emulated_device.py everywhere, and on a GPU where there is one (scripts/gpu_check.sh runs it).
"""
import pytest
import torch

from mooncake_ep_switch import Buffer, ElasticBuffer
from mooncake_ep_switch.buffer.transport.cuda import cuda_unavailable_reason
from tests import harness
from tests.elastic_reference import expected_combine, expected_dispatch, expert_output, make_inputs, ordered_sum

TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE


def reference(y, topk_idx, weights, biases, hidden):
    """`bf16(bias0 + bias1 + sum_k w[t,k] * y[t,k])` in float32, bias first, top-k order, -1 skipped; a bias
    narrower than `hidden` covers its first channels only."""
    n, num_topk = topk_idx.shape
    out = torch.empty(n, hidden, dtype=torch.bfloat16)
    for t in range(n):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for bias in biases:
            acc[:bias.size(1)] = acc[:bias.size(1)] + bias[t].float()
        for k in range(num_topk):
            if int(topk_idx[t, k]) >= 0:
                acc = acc + weights[t, k] * y[t, k].float()
        out[t] = acc.to(torch.bfloat16)
    return out


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def _inputs(seed, n, H, K, E):
    """n tokens (the first with one top-k entry of -1), their top-k ids and weights, and two biases."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    topk[0, 1] = -1
    weights = torch.rand(n, K, generator=g)
    biases = [torch.randn(n, H, generator=g).to(torch.bfloat16) for _ in range(2)]
    return n, x, topk, weights, biases


def rank_buffer_bias(ctx, transport):
    """The legacy Buffer's combine with one, two and narrow biases, exact; bad biases refused by name first."""
    R, rank, T, H, K, E = ctx.num_ranks, ctx.rank, 6, 256, 3, 4 * ctx.num_ranks
    L = E // R
    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(T, H, R, E), transport=transport,
                    disable_p2p=transport == "mooncake")
    n, x, topk, weights, biases = _inputs(40 + rank, T - rank, H, K, E)
    active = torch.ones(R, dtype=torch.int32)
    refused = 0
    for case, bias in enumerate([biases[0], tuple(biases), (None, biases[1]), biases[0][:, :H // 2].contiguous()]):
        recv_x, recv_count, handle, _, _ = buffer.dispatch(x, topk, active, T, E, TIMEOUT_US, use_fp8=False)
        # The expert output of each received row: its token scaled by a per-expert factor (exact in bf16).
        y_local = torch.zeros_like(recv_x)
        for local in range(L):
            rows = int(recv_count[local])
            y_local[local, :rows] = recv_x[local, :rows] * (1 + rank * L + local)
        if case == 0:  # bad biases, refused before anything moves (every rank makes the same calls)
            for name, bad in (("bias", biases[0][:-1]), ("bias", biases[0].float()),
                              ("bias\\[1\\]", (biases[0], biases[1][:, :H // 2].contiguous())),
                              ("bias", torch.zeros(n, H + 128, dtype=torch.bfloat16)), ("bias", [biases[0]])):
                with pytest.raises((TypeError, ValueError), match=name):
                    buffer.combine(y_local, topk, weights, active, TIMEOUT_US, handle, bias=bad)
                refused += 1
        out, _, _ = buffer.combine(y_local, topk, weights, active, TIMEOUT_US, handle, bias=bias)
        y = torch.where((topk >= 0).unsqueeze(2), x.unsqueeze(1) * (1 + topk.clamp(min=0)).unsqueeze(2).to(x.dtype),
                        torch.zeros(1, dtype=x.dtype))
        given = [bias] if isinstance(bias, torch.Tensor) else [b for b in bias if b is not None]
        assert _bits_equal(out, reference(y, topk, weights, given, H)), f"{transport}: case {case} differs"
    used = buffer.transport
    buffer.destroy()
    return refused, used


def rank_elastic_bias(ctx, transport):
    """An ElasticBuffer with two bias slots allowed: its inner dispatch routes no bias rows, and combines with
    one and two biases are V2's reference bit for bit."""
    R, rank, T, H, K, E = ctx.num_ranks, ctx.rank, 8, 256, 4, 4 * ctx.num_ranks
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport=transport,
                           disable_p2p=transport == "mooncake", max_num_bias=2)
    device = buffer.runtime.device or torch.device("cpu")  # a GPU's on the 'cuda' transport on a GPU
    everyone = list(range(R))
    all_inputs = [make_inputs(r, R, T, H, K, E, 21) for r in range(R)]
    mine = all_inputs[rank]
    _, _, recv_w, handle, _ = buffer.dispatch(mine.x.to(device), topk_idx=mine.topk_idx.to(device),
                                              topk_weights=mine.topk_weights.to(device), num_experts=E)
    route = handle.route
    inner_counts = route.inner_handle[1].cpu() & 0xFFFFFFFF  # [3, R]: rows per inner local expert and source
    copies = {"routing columns": route.inner_topk.size(1), "bias rows received": int(inner_counts[1:].sum())}
    want = expected_dispatch(all_inputs, rank, R, T, E, everyone)
    y_recv = expert_output(want["src_global"], K, H, 21)
    x = ordered_sum(torch.where((want["local"] >= 0).unsqueeze(2), y_recv, torch.zeros_like(y_recv)))
    y_own = expert_output(rank * T + torch.arange(mine.x.size(0)), K, H, 21)
    for biases in ([mine.bias[0]], list(mine.bias)):
        bias = biases[0].to(device) if len(biases) == 1 else tuple(b.to(device) for b in biases)
        combined, _, _ = buffer.combine(x.to(device), handle, topk_weights=recv_w, bias=bias)
        assert _bits_equal(combined.cpu(), expected_combine(y_own, mine.topk_idx, E, R, biases, everyone)), len(biases)
    copies["transport"] = buffer.runtime.transport
    buffer.destroy()
    return copies


@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_a_bias_starts_the_sum_and_costs_no_copy(transport):
    """Buffer.combine's bias (one, two, (None, b), narrower than hidden) is exact and bad ones are refused by
    name; an ElasticBuffer's biases are exact and its inner dispatch has no bias columns or rows."""
    assert harness.run(2, rank_buffer_bias, transport, timeout_s=180) == [(5, transport)] * 2
    for copies in harness.run(2, rank_elastic_bias, transport, timeout_s=180):
        # min(K, R) data columns only, and no row of the bias slots
        assert copies == {"routing columns": 2, "bias rows received": 0, "transport": transport}


def rank_cuda_bias_matches_host(ctx):
    """The 'cuda' transport's combine with biases (a GPU's, or the emulated device's of
    tests/emulated_device.py): bit for bit the shm transport's with the same inputs, and `reference`, with
    two biases, bias 1 alone over 129 of 256 channels, and one bias, in sync, hook and async modes; bad
    biases refused by name first. Then an ElasticBuffer on 'cuda' (`rank_elastic_bias`)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # rank processes on GPU 0 (the emulated device has none)
    R, rank, T, H, K, E = ctx.num_ranks, ctx.rank, 6, 256, 3, 4 * ctx.num_ranks
    L = E // R
    size = Buffer.get_ep_buffer_size_hint(T, H, R, E)
    host, cuda = Buffer(ctx.group, size, transport="shm"), Buffer(ctx.group, size, transport="cuda")
    n, x, topk, weights, biases = _inputs(60 + rank, T - rank, H, K, E)
    biases[0][:, ::5] = -0.0  # the sum starts from 0.0f + 1.0f * bias: +0.0 on the CPU, on the device too
    active = torch.ones(R, dtype=torch.int32)
    y = torch.where((topk >= 0).unsqueeze(2), x.unsqueeze(1) * (1 + topk.clamp(min=0)).unsqueeze(2).to(x.dtype),
                    torch.zeros(1, dtype=x.dtype))
    cases = [(tuple(biases), "sync"), ((None, biases[1][:, :129].contiguous()), "hook"), (biases[0], "async")]
    refused = 0
    for case, (bias, mode) in enumerate(cases):
        flags = dict(async_finish=mode == "async", return_recv_hook=mode == "hook")
        outs = []
        for buffer, device in ((host, torch.device("cpu")), (cuda, cuda.device)):
            on = (lambda t: None if t is None else t.to(device))
            recv_x, recv_count, handle, event, hook = buffer.dispatch(on(x), on(topk), on(active), T, E, TIMEOUT_US,
                                                                      use_fp8=False, **flags)
            if hook is not None:
                hook()
            event.current_stream_wait()
            counts = recv_count.cpu()
            y_local = torch.zeros_like(recv_x)
            for local in range(L):
                y_local[local, :int(counts[local])] = recv_x[local, :int(counts[local])] * (1 + rank * L + local)
            given = on(bias) if isinstance(bias, torch.Tensor) else tuple(on(b) for b in bias)
            if case == 0 and buffer is cuda:  # refused by name before anything moves (every rank alike)
                bad = [("bias", on(biases[0][:-1])), ("bias", on(biases[0].float())),
                       ("bias\\[1\\]", (on(biases[0]), on(torch.zeros(n, H + 128, dtype=torch.bfloat16))))]
                if device.type == "cuda":
                    bad.append(("bias", biases[0]))  # a host tensor for a combine on the GPU
                for name, wrong in bad:
                    with pytest.raises((TypeError, ValueError), match=name):
                        buffer.combine(y_local, on(topk), on(weights), on(active), TIMEOUT_US, handle, bias=wrong)
                    refused += 1
            out, event, hook = buffer.combine(y_local, on(topk), on(weights), on(active), TIMEOUT_US, handle,
                                              bias=given, **flags)
            if hook is not None:
                hook()
            event.current_stream_wait()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            outs.append(out.cpu())
        parts = [bias] if isinstance(bias, torch.Tensor) else [b for b in bias if b is not None]
        assert _bits_equal(outs[1], outs[0]), f"case {case} ({mode}): the cuda transport differs from shm"
        assert _bits_equal(outs[1], reference(y, topk, weights, parts, H)), f"case {case} ({mode})"
    host.destroy()
    cuda.destroy()
    return refused, rank_elastic_bias(ctx, "cuda")


def test_a_bias_on_the_emulated_cuda_device():
    """Buffer.combine(bias=) on the 'cuda' transport (the device kernels on the host emulator, fresh rank
    processes: the emulation is not undone) equals shm's bit for bit; an ElasticBuffer on it routes no bias
    slots and its biased combines are V2's reference."""
    from mooncake_ep_switch.launcher.launch import check_outcomes
    from tests.emulated_device import run_emulated

    with harness.fresh_cluster(2) as cluster:
        values = check_outcomes(cluster.run(run_emulated, __name__, "rank_cuda_bias_matches_host", timeout_s=180))
    for refused, copies in values:
        assert refused == 3
        assert copies == {"routing columns": 2, "bias rows received": 0, "transport": "cuda"}


@pytest.mark.skipif(bool(cuda_unavailable_reason()), reason="no CUDA device")
def test_a_bias_on_the_gpu():
    """The same on a GPU (rank processes on GPU 0, CUDA tensors in and out); a host bias refused too."""
    from mooncake_ep_switch.launcher.launch import check_outcomes

    with harness.fresh_cluster(2) as cluster:
        values = check_outcomes(cluster.run(rank_cuda_bias_matches_host, timeout_s=180))
    for refused, copies in values:
        assert refused == 4
        assert copies == {"routing columns": 2, "bias rows received": 0, "transport": "cuda"}
