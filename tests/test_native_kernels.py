"""Tests of the native core (csrc/, module mooncake_ep_switch._native) against independent torch
references: region layout, shared memory, signals, packing kernels, and a single-process
simulation of the one-sided dispatch/combine protocol of docs/protocol.md over R shm regions.
"""
import ctypes
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

try:
    from mooncake_ep_switch import _native as N
except ImportError:  # running from another directory without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mooncake_ep_switch import _native as N


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def create_segment(nbytes):
    """A zeroed memfd region of this process: (fd, base address)."""
    return N.region_create(nbytes)


def view(addr, nbytes, dtype=torch.uint8):
    """A torch tensor aliasing raw memory (no copy)."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=dtype)


def ref_quantize(x):
    """The torch reference FP8 quantization: (uint8 e4m3fn bits [n, H], float32 scales [n, G])."""
    n, hidden = x.shape
    xf = x.float().view(n, hidden // 128, 128)
    scale = xf.abs().amax(-1).clamp(min=1e-4) / 448
    q = (xf / scale[..., None]).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).view(n, hidden), scale


def ref_reduce(rows_per_k, weights, mask):
    """Sequential fp32 reference: acc = acc + w[:, k] * rows_k, skipping masked-out entries."""
    n, top_k = weights.shape
    acc = torch.zeros(n, rows_per_k[0].shape[1], dtype=torch.float32)
    for k in range(top_k):
        w = torch.where(mask[:, k], weights[:, k], torch.zeros(()))
        rows = torch.where(mask[:, k:k + 1], rows_per_k[k].float(), torch.zeros(()))
        acc = acc + w[:, None] * rows
    return acc.to(torch.bfloat16)


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


# ---------------------------------------------------------------------------------------------
# Region layout
# ---------------------------------------------------------------------------------------------

ORDER = ["dispatch_data", "dispatch_scales", "dispatch_src", "combine_data", "dispatch_signals",
         "combine_signals", "combine_send"]


@pytest.mark.parametrize("shape", [(1, 1, 128, 1), (2, 128, 7168, 32), (4, 16, 256, 8), (8, 3, 384, 24),
                                   (3, 7, 128, 9)])
def test_region_layout_invariants(shape):
    R, T, H, E = shape
    lay = N.region_layout(R, T, H, E)
    L, G = E // R, H // 128
    sizes = {
        "dispatch_data": L * R * T * 2 * H,
        "dispatch_scales": L * R * T * G * 4,
        "dispatch_src": L * R * T * 4,
        "combine_data": E * T * 2 * H,
        "dispatch_signals": R * L * 8,
        "combine_signals": E * 8,
        "combine_send": L * R * T * H * 2,
    }
    assert lay["control_bytes"] == 4096
    assert lay["row_bytes"] == 2 * H
    assert lay["num_local_experts"] == L
    assert lay["num_scale_groups"] == G
    assert lay["dispatch_data"] == 0
    end = 0
    for name in ORDER:
        off = lay[name]
        assert off % 64 == 0, name
        assert off >= end, f"{name} overlaps the previous array"
        assert off - end < 64, f"{name} leaves a gap larger than the alignment"
        end = off + sizes[name]
    assert lay["half_bytes"] % 4096 == 0
    assert end <= lay["half_bytes"] < end + 4096
    assert lay["total_bytes"] == 4096 + 2 * lay["half_bytes"]
    assert all(isinstance(v, int) for v in lay.values())


def test_region_layout_errors():
    with pytest.raises(ValueError, match="hidden"):
        N.region_layout(2, 16, 100, 8)
    with pytest.raises(ValueError, match="num_experts"):
        N.region_layout(3, 16, 128, 8)
    for i, name in enumerate(["num_ranks", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"]):
        args = [2, 16, 128, 8]
        args[i] = 0
        with pytest.raises(ValueError, match=name):
            N.region_layout(*args)
        args[i] = -4
        with pytest.raises(ValueError, match=name):
            N.region_layout(*args)
    with pytest.raises(ValueError, match="overflow"):
        N.region_layout(1 << 20, 1 << 20, 1 << 20, 1 << 20)


# ---------------------------------------------------------------------------------------------
# FP8 quantization and packing kernels
# ---------------------------------------------------------------------------------------------

def fp8_test_rows(hidden):
    """bf16 rows covering random data, zeros, tiny values, exact-448 and rounding ties."""
    torch.manual_seed(0)
    rows = [torch.randn(48, hidden) * torch.logspace(-6, 4, 48)[:, None]]
    rows.append(torch.zeros(2, hidden))                              # amax clamps to 1e-4
    rows.append(torch.full((1, hidden), 3e-5))                       # tiny: below the clamp
    rows.append(torch.randn(2, hidden) * 1e-30)                      # very tiny, float-subnormal scaled
    special = torch.zeros(4, hidden)
    # amax = 448 * 2^k makes the scale exactly 2^k, so the largest value lands exactly on 448 and
    # crafted values land exactly on e4m3fn rounding ties (normal and subnormal).
    ties = torch.tensor([448.0, -448.0, 1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, 5 * 2 ** -10,
                         2 ** -7 + 2 ** -11, 15 * 2 ** -10, 17 * 2 ** -10, 0.0, -0.0, 240.0, 232.0, 2 ** -9])
    for r, k in enumerate([0, -3, 5, -20]):
        row = torch.zeros(hidden)
        row[: ties.numel()] = ties * 2.0 ** k
        if hidden > 128:
            row[128:] = torch.randn(hidden - 128) * 2.0 ** k
            row[128] = 448.0 * 2.0 ** k
        special[r] = row
    rows.append(special)
    nonfinite = torch.randn(3, hidden)
    nonfinite[0, 5], nonfinite[1, 3], nonfinite[2, hidden - 2] = float("nan"), float("inf"), -float("inf")
    rows.append(nonfinite)
    return torch.cat(rows).to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [128, 512, 7168])
def test_quantize_fp8_rows_bit_exact(hidden):
    x = fp8_test_rows(hidden)
    n = x.shape[0]
    q = torch.empty(n, hidden, dtype=torch.uint8)
    scales = torch.empty(n, hidden // 128, dtype=torch.float32)
    N.quantize_fp8_rows(x.data_ptr(), x.stride(0) * 2, 0, n, hidden, q.data_ptr(), scales.data_ptr())
    rq, rs = ref_quantize(x)
    assert torch.equal(q, rq)
    assert torch.equal(bits(scales), bits(rs.contiguous()))
    # the crafted exact-448 entries really are 448 = 0x7e
    assert (q == 0x7E).any() and (q == 0xFE).any()


def test_quantize_fp8_rows_with_index_and_stride():
    hidden = 256
    base = fp8_test_rows(hidden)
    wide = torch.zeros(base.shape[0], hidden + 64, dtype=torch.bfloat16)
    wide[:, :hidden] = base
    index = torch.tensor([5, 0, 5, base.shape[0] - 1, 17], dtype=torch.int64)
    q = torch.empty(index.numel(), hidden, dtype=torch.uint8)
    scales = torch.empty(index.numel(), hidden // 128, dtype=torch.float32)
    N.quantize_fp8_rows(wide.data_ptr(), wide.stride(0) * 2, index.data_ptr(), index.numel(), hidden,
                        q.data_ptr(), scales.data_ptr())
    rq, rs = ref_quantize(base[index])
    assert torch.equal(q, rq)
    assert torch.equal(bits(scales), bits(rs.contiguous()))


def test_gather_and_scatter_rows():
    torch.manual_seed(1)
    src = torch.randint(0, 256, (20, 96), dtype=torch.uint8)
    index = torch.tensor([3, 3, 0, 19, 7, 11], dtype=torch.int64)
    dst = torch.zeros(6, 128, dtype=torch.uint8)  # wider rows: stride != row_bytes
    N.gather_rows(dst.data_ptr(), 128, src.data_ptr(), 96, 80, index.data_ptr(), index.numel())
    assert torch.equal(dst[:, :80], src[index, :80])
    assert not dst[:, 80:].any()

    perm = torch.randperm(20)[:9].to(torch.int64)
    out = torch.zeros(20, 96, dtype=torch.uint8)
    rows = torch.randint(0, 256, (9, 96), dtype=torch.uint8)
    N.scatter_rows(out.data_ptr(), 96, rows.data_ptr(), 96, 96, perm.data_ptr(), 9)
    ref = torch.zeros_like(out)
    ref[perm] = rows
    assert torch.equal(out, ref)

    bad = torch.tensor([1, -1], dtype=torch.int64)
    with pytest.raises(ValueError):
        N.gather_rows(dst.data_ptr(), 128, src.data_ptr(), 96, 80, bad.data_ptr(), 2)
    N.gather_rows(0, 0, 0, 0, 80, 0, 0)  # n = 0 touches nothing


def test_scatter_fp8_rows():
    torch.manual_seed(2)
    hidden, L, rows_per_expert, n = 256, 3, 10, 12
    G = hidden // 128
    data = torch.randint(0, 256, (n, hidden), dtype=torch.uint8)
    scales = torch.rand(n, G)
    pos = torch.randperm(L * rows_per_expert)[:n].to(torch.int64)
    recv_x = torch.zeros(L, rows_per_expert, hidden, dtype=torch.uint8)
    recv_scales = torch.zeros(L, G, rows_per_expert)
    N.scatter_fp8_rows(data.data_ptr(), scales.data_ptr(), n, hidden, pos.data_ptr(), recv_x.data_ptr(),
                       recv_scales.data_ptr(), rows_per_expert)
    ref_x = torch.zeros(L * rows_per_expert, hidden, dtype=torch.uint8)
    ref_x[pos] = data
    ref_s = torch.zeros(L * rows_per_expert, G)
    ref_s[pos] = scales
    assert torch.equal(recv_x.view(-1, hidden), ref_x)
    assert torch.equal(recv_scales.transpose(1, 2).reshape(-1, G), ref_s)


@pytest.mark.parametrize("hidden,top_k", [(128, 1), (1024, 8), (7168, 4)])
def test_combine_reduce_matches_sequential_fp32(hidden, top_k):
    torch.manual_seed(3)
    n, m = 33, 50
    rows = (torch.randn(m, hidden) * torch.logspace(-3, 3, m)[:, None]).to(torch.bfloat16)
    rows[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38])
    row_index = torch.randint(0, m, (n, top_k), dtype=torch.int64)
    row_index[torch.rand(n, top_k) < 0.25] = -1
    row_index[0] = -1  # a token with nothing selected is exactly zero
    weights = torch.randn(n, top_k, dtype=torch.float32)
    out = torch.empty(n, hidden, dtype=torch.bfloat16)
    N.combine_reduce(out.data_ptr(), n, hidden, top_k, row_index.data_ptr(), weights.data_ptr(), rows.data_ptr(),
                     hidden * 2)
    mask = row_index >= 0
    ref = ref_reduce([rows[row_index[:, k].clamp(min=0)] for k in range(top_k)], weights, mask)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(bits(out)[~nan], bits(ref)[~nan])
    assert not bits(out[0]).any()


# ---------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------

def test_signal_store_load():
    word = torch.zeros(4, dtype=torch.int64)
    addr = word.data_ptr() + 8
    N.signal_store(addr, (7 << 32) | 5)
    assert N.signal_load(addr) == (7 << 32) | 5
    assert word[1].item() == (7 << 32) | 5
    N.signal_store(addr, (1 << 64) - 1)
    assert N.signal_load(addr) == (1 << 64) - 1
    with pytest.raises(ValueError):
        N.signal_load(addr + 4)


# ---------------------------------------------------------------------------------------------
# Single-process simulation of R ranks over shm regions
# ---------------------------------------------------------------------------------------------

class Cluster:
    """R simulated ranks: one shm region each, mapped once (all ranks share this process)."""

    def __init__(self, R, T, H, E):
        self.R, self.T, self.H, self.E = R, T, H, E
        self.L, self.G = E // R, H // 128
        self.lay = N.region_layout(R, T, H, E)
        self.regions = []
        for _ in range(R):
            self.regions.append(create_segment(self.lay["total_bytes"]))
        self.active = [torch.ones(R, dtype=torch.int32) for _ in range(R)]

    def close(self):
        for fd, base in self.regions:
            N.region_unmap(base, self.lay["total_bytes"])
            N.region_close_fd(fd)

    def half(self, rank, tag):
        return self.regions[rank][1] + self.lay["control_bytes"] + (tag % 2) * self.lay["half_bytes"]

    def bases(self, tag):
        return [self.half(d, tag) for d in range(self.R)]

    def dispatch_send(self, rank, x, topk, tag, fp8, **kw):
        N.dispatch_send(x.data_ptr(), x.shape[0], self.H, topk.data_ptr(), topk.shape[1], self.E, self.R, rank,
                        self.T, self.active[rank].data_ptr(), self.bases(tag), tag, use_fp8=fp8, **kw)

    def dispatch_recv(self, rank, tag, fp8, timeout_us=2_000_000):
        R, T, H, L, G = self.R, self.T, self.H, self.L, self.G
        out = {
            "x": torch.full((L, R * T, H), -1, dtype=torch.uint8 if fp8 else torch.bfloat16),
            "scales": torch.full((L, G, R * T), -1.0, dtype=torch.float32),
            "src_info": torch.full((L, R * T), -7, dtype=torch.int32),
            "layout_range": torch.full((L, R), -7, dtype=torch.int64),
            "recv_count": torch.full((L,), -7, dtype=torch.int32),
        }
        failed = N.dispatch_recv(self.half(rank, tag), R, rank, T, H, self.E, tag, self.active[rank].data_ptr(),
                                 timeout_us, use_fp8=fp8, recv_x_ptr=out["x"].data_ptr(),
                                 recv_scales_ptr=out["scales"].data_ptr() if fp8 else 0,
                                 src_info_ptr=out["src_info"].data_ptr(),
                                 layout_range_ptr=out["layout_range"].data_ptr(),
                                 recv_count_ptr=out["recv_count"].data_ptr())
        out["failed"] = failed
        return out

    def combine_send(self, rank, expert_out, recv, tag, **kw):
        N.combine_send(expert_out.data_ptr(), self.H, self.E, self.R, rank, self.T, recv["src_info"].data_ptr(),
                       recv["layout_range"].data_ptr(), self.active[rank].data_ptr(), self.bases(tag), tag, **kw)

    def combine_recv(self, rank, topk, weights, tag, timeout_us=2_000_000):
        out = torch.full((topk.shape[0], self.H), float("nan"), dtype=torch.bfloat16)
        failed = N.combine_recv(self.half(rank, tag), self.R, rank, self.T, self.H, self.E, tag,
                                self.active[rank].data_ptr(), timeout_us, topk.data_ptr(), weights.data_ptr(),
                                topk.shape[0], topk.shape[1], out.data_ptr())
        return out, failed

    def signal_addr(self, rank, tag, kind, index):
        return self.half(rank, tag) + self.lay[kind] + 8 * index


@pytest.fixture
def make_cluster():
    clusters = []

    def make(R, T, H, E):
        c = Cluster(R, T, H, E)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.close()


def random_inputs(R, T, H, E, K, seed, full=False):
    """Per-rank bf16 tokens and top-k (distinct experts per row, some -1)."""
    g = torch.Generator().manual_seed(seed)
    xs, topks, weights = [], [], []
    for r in range(R):
        n = T if full else int(torch.randint(0, T + 1, (1,), generator=g))
        x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        x[:, -1] = r  # structured: misrouting shows up
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.empty(0, K)
        topk = topk.to(torch.int64)
        topk[torch.rand(n, K, generator=g) < 0.2] = -1
        xs.append(x)
        topks.append(topk.contiguous())
        weights.append(torch.rand(n, K, generator=g, dtype=torch.float32))
    return xs, topks, weights


def expected_dispatch(c, rank, xs, topks, live_sources, fp8):
    """Torch reference of the packed receive of `rank`."""
    L, R, T, G = c.L, c.R, c.T, c.G
    ref = {"rows": [], "src_info": [], "layout_range": torch.zeros(L, R, dtype=torch.int64), "recv_count": [],
           "scales": []}
    for l in range(L):
        e = rank * L + l
        begin, rows, src, scales = 0, [], [], []
        for s in range(R):
            if s not in live_sources:
                continue
            tokens = (topks[s] == e).any(dim=1).nonzero().flatten()
            ref["layout_range"][l, s] = (begin << 32) | tokens.numel()
            begin += tokens.numel()
            sel = xs[s][tokens]
            if fp8:
                q, sc = ref_quantize(sel)
                rows.append(q)
                scales.append(sc)
            else:
                rows.append(sel)
            src.append(tokens.to(torch.int32))
        ref["rows"].append(torch.cat(rows) if rows else None)
        ref["scales"].append(torch.cat(scales) if scales else None)
        ref["src_info"].append(torch.cat(src) if src else torch.empty(0, dtype=torch.int32))
        ref["recv_count"].append(begin)
    return ref


def check_dispatch(c, rank, got, ref, fp8):
    assert torch.equal(got["layout_range"], ref["layout_range"])
    assert got["recv_count"].tolist() == ref["recv_count"]
    for l in range(c.L):
        n = ref["recv_count"][l]
        assert torch.equal(got["src_info"][l, :n], ref["src_info"][l])
        if n == 0:
            continue
        assert torch.equal(bits(got["x"][l, :n]), bits(ref["rows"][l]))
        if fp8:
            # physical [L][G][R*T]: token axis contiguous; logical [L, R*T, G] is its transpose
            assert got["scales"].stride() == (c.G * c.R * c.T, c.R * c.T, 1)
            assert torch.equal(bits(got["scales"][l, :, :n].t().contiguous()), bits(ref["scales"][l].contiguous()))


def make_expert_outputs(c, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c.L, c.R * c.T, c.H, generator=g).to(torch.bfloat16) for _ in range(c.R)]


def expected_combine(c, owner_recvs, expert_outs, topks, weights, s, live_owners):
    """out[t] for token owner s from the owners' packed results, via an independent lookup."""
    n, K = topks[s].shape
    row_of = {}  # (expert, token) -> bf16 row returned for token owner s
    for d in live_owners:
        recv = owner_recvs[d]
        for l in range(c.L):
            v = int(recv["layout_range"][l, s])
            begin, count = v >> 32, v & 0xFFFFFFFF
            for i in range(count):
                t = int(recv["src_info"][l, begin + i])
                row_of[(d * c.L + l, t)] = expert_outs[d][l, begin + i]
    zero = torch.zeros(c.H, dtype=torch.bfloat16)
    mask = torch.zeros(n, K, dtype=torch.bool)
    per_k = []
    for k in range(K):
        rows = []
        for t in range(n):
            e = int(topks[s][t, k])
            ok = e >= 0 and e // c.L in live_owners
            mask[t, k] = ok
            rows.append(row_of[(e, t)] if ok else zero)
        per_k.append(torch.stack(rows) if rows else torch.empty(0, c.H, dtype=torch.bfloat16))
    return ref_reduce(per_k, weights[s], mask)


def run_round(c, tag, fp8, seed, K=3, full=False):
    R = c.R
    xs, topks, weights = random_inputs(R, c.T, c.H, c.E, K, seed, full)
    for r in range(R):
        c.dispatch_send(r, xs[r], topks[r], tag, fp8)
    recvs = [c.dispatch_recv(r, tag, fp8) for r in range(R)]
    for r in range(R):
        assert recvs[r]["failed"] == []
        check_dispatch(c, r, recvs[r], expected_dispatch(c, r, xs, topks, set(range(R)), fp8), fp8)
    outs = make_expert_outputs(c, seed + 1000)
    for r in range(R):
        c.combine_send(r, outs[r], recvs[r], tag)
    for s in range(R):
        got, failed = c.combine_recv(s, topks[s], weights[s], tag)
        assert failed == []
        ref = expected_combine(c, recvs, outs, topks, weights, s, set(range(R)))
        assert torch.equal(bits(got), bits(ref))


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_simulated_dispatch_combine(make_cluster, R, fp8):
    c = make_cluster(R, 12, 256, 4 * R)
    # Tags 1..4 alternate halves; tags 3 and 4 reuse halves with stale data from 1 and 2.
    for tag in range(1, 5):
        run_round(c, tag, fp8, seed=10 * R + tag, full=(tag == 2))
    assert all(a.tolist() == [1] * R for a in c.active)


def test_simulated_zero_copy_combine_buffer(make_cluster):
    """Expert outputs placed in the region's own combine_send array (the zero-copy path)."""
    c = make_cluster(2, 8, 128, 4)
    tag = 7
    xs, topks, weights = random_inputs(2, 8, 128, 4, 2, seed=5)
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], tag, False)
    recvs = [c.dispatch_recv(r, tag, False) for r in range(2)]
    outs = []
    for r in range(2):
        buf = view(c.half(r, tag) + c.lay["combine_send"], c.L * 2 * 8 * 128 * 2, torch.bfloat16)
        buf = buf.view(c.L, 16, 128)
        buf.copy_(recvs[r]["x"] * 2)
        outs.append(buf)
        N.combine_send(buf.data_ptr(), 128, 4, 2, r, 8, recvs[r]["src_info"].data_ptr(),
                       recvs[r]["layout_range"].data_ptr(), c.active[r].data_ptr(), c.bases(tag), tag)
    for s in range(2):
        got, failed = c.combine_recv(s, topks[s], weights[s], tag)
        assert failed == []
        assert torch.equal(bits(got), bits(expected_combine(c, recvs, outs, topks, weights, s, {0, 1})))


def test_dispatch_send_per_destination_and_deferred_signals(make_cluster):
    """dest= selects one destination; write_signals=False writes data only (signals posted later)."""
    c = make_cluster(2, 8, 128, 4)
    tag = 3
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=9, full=True)
    c.dispatch_send(0, xs[0], topks[0], tag, False, dest=1, write_signals=False)
    # nothing signalled yet, and nothing went to rank 0
    for l in range(c.L):
        assert N.signal_load(c.signal_addr(1, tag, "dispatch_signals", 0 * c.L + l)) == 0
        assert N.signal_load(c.signal_addr(0, tag, "dispatch_signals", 0 * c.L + l)) == 0
    c.dispatch_send(0, xs[0], topks[0], tag, False, dest=1)  # now with signals
    c.dispatch_send(0, xs[0], topks[0], tag, False, dest=0)
    c.dispatch_send(1, xs[1], topks[1], tag, False)
    for r in range(2):
        got = c.dispatch_recv(r, tag, False)
        assert got["failed"] == []
        check_dispatch(c, r, got, expected_dispatch(c, r, xs, topks, {0, 1}, False), False)


def test_inactive_destination_is_not_written(make_cluster):
    c = make_cluster(2, 8, 128, 4)
    tag = 5
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=11, full=True)
    c.active[0][1] = 0
    c.dispatch_send(0, xs[0], topks[0], tag, False)
    half1 = view(c.half(1, tag), c.lay["half_bytes"])
    assert not half1.any()  # neither data nor signals
    # an unreachable (base 0) destination is skipped as well
    c.active[0][1] = 1
    bases = c.bases(tag)
    bases[1] = 0
    N.dispatch_send(xs[0].data_ptr(), 8, 128, topks[0].data_ptr(), 2, 4, 2, 0, 8, c.active[0].data_ptr(), bases, tag,
                    use_fp8=False)
    assert not half1.any()


def test_dispatch_recv_timeout_marks_source_inactive(make_cluster):
    c = make_cluster(3, 8, 128, 6)
    tag = 1
    xs, topks, weights = random_inputs(3, 8, 128, 6, 2, seed=12, full=True)
    c.dispatch_send(0, xs[0], topks[0], tag, True)
    c.dispatch_send(1, xs[1], topks[1], tag, True)  # rank 2 never sends
    timeout_us = 100_000
    t0 = time.monotonic()
    got = c.dispatch_recv(0, tag, True, timeout_us=timeout_us)
    elapsed = time.monotonic() - t0
    assert got["failed"] == [2]
    assert c.active[0].tolist() == [1, 1, 0]
    assert timeout_us / 1e6 <= elapsed < timeout_us / 1e6 + 0.5
    check_dispatch(c, 0, got, expected_dispatch(c, 0, xs, topks, {0, 1}, True), True)
    assert got["layout_range"][:, 2].eq(0).all()
    # already inactive: not waited for again
    t0 = time.monotonic()
    again = c.dispatch_recv(0, tag, True, timeout_us=10_000_000)
    assert again["failed"] == [] and time.monotonic() - t0 < 1.0


def test_combine_recv_timeout_marks_owner_inactive(make_cluster):
    c = make_cluster(2, 8, 128, 4)
    tag = 2
    xs, topks, weights = random_inputs(2, 8, 128, 4, 3, seed=13, full=True)
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], tag, False)
    recvs = [c.dispatch_recv(r, tag, False) for r in range(2)]
    outs = make_expert_outputs(c, 99)
    c.combine_send(0, outs[0], recvs[0], tag)  # rank 1 (owner of experts 2, 3) never combines
    t0 = time.monotonic()
    got, failed = c.combine_recv(0, topks[0], weights[0], tag, timeout_us=50_000)
    elapsed = time.monotonic() - t0
    assert failed == [1]
    assert c.active[0].tolist() == [1, 0]
    assert 0.05 <= elapsed < 0.55
    ref = expected_combine(c, recvs, outs, topks, weights, 0, {0})
    assert torch.equal(bits(got), bits(ref))


def test_stale_tag_is_not_accepted(make_cluster):
    c = make_cluster(2, 8, 128, 4)
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=14, full=True)
    # Round n-2 = 1 completes normally on half 1.
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], 1, False)
    for r in range(2):
        assert c.dispatch_recv(r, 1, False)["failed"] == []
    # Round n = 3 uses the same half; rank 1 does not send, its tag-1 signals are still there.
    c.dispatch_send(0, xs[0], topks[0], 3, False)
    got = c.dispatch_recv(0, 3, False, timeout_us=30_000)
    assert got["failed"] == [1]
    assert got["layout_range"][:, 1].eq(0).all()
    check_dispatch(c, 0, got, expected_dispatch(c, 0, xs, topks, {0}, False), False)


def test_corrupted_count_marks_source_inactive(make_cluster):
    c = make_cluster(2, 8, 128, 4)
    tag = 4
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=15, full=True)
    c.dispatch_send(0, xs[0], topks[0], tag, False)
    # A corrupted peer 1 claims T + 1 rows for local expert 1 of rank 0 (and 0 for expert 0).
    N.signal_store(c.signal_addr(0, tag, "dispatch_signals", 1 * c.L + 0), (tag << 32) | 0)
    N.signal_store(c.signal_addr(0, tag, "dispatch_signals", 1 * c.L + 1), (tag << 32) | (c.T + 1))
    t0 = time.monotonic()
    got = c.dispatch_recv(0, tag, False, timeout_us=5_000_000)
    assert time.monotonic() - t0 < 1.0  # a protocol error fails the source at once
    assert got["failed"] == [1] and c.active[0].tolist() == [1, 0]
    assert got["recv_count"].tolist() == [int((topks[0] == l).any(1).sum()) for l in range(c.L)]
    check_dispatch(c, 0, got, expected_dispatch(c, 0, xs, topks, {0}, False), False)


def test_corrupted_token_index_marks_source_inactive(make_cluster):
    c = make_cluster(2, 8, 128, 4)
    tag = 6
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=16, full=True)
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], tag, False)
    # Overwrite one token index written by rank 1 into rank 0's dispatch_src[l=0][s=1][0].
    count = N.signal_load(c.signal_addr(0, tag, "dispatch_signals", 1 * c.L + 0)) & 0xFFFFFFFF
    assert count > 0
    src = view(c.half(0, tag) + c.lay["dispatch_src"], c.L * 2 * 8 * 4, torch.int32).view(c.L, 2, 8)
    src[0, 1, 0] = 8  # == T: out of range
    got = c.dispatch_recv(0, tag, False, timeout_us=5_000_000)
    assert got["failed"] == [1]
    check_dispatch(c, 0, got, expected_dispatch(c, 0, xs, topks, {0}, False), False)


def test_combine_send_rejects_bad_ranges(make_cluster):
    c = make_cluster(2, 8, 128, 4)
    tag = 1
    x = torch.zeros(c.L, 16, 128, dtype=torch.bfloat16)
    src_info = torch.zeros(c.L, 16, dtype=torch.int32)
    layout_range = torch.zeros(c.L, 2, dtype=torch.int64)
    layout_range[1, 1] = (10 << 32) | 7  # 17 > R*T
    with pytest.raises(ValueError, match="layout_range"):
        N.combine_send(x.data_ptr(), 128, 4, 2, 0, 8, src_info.data_ptr(), layout_range.data_ptr(),
                       c.active[0].data_ptr(), c.bases(tag), tag)
    layout_range[1, 1] = (0 << 32) | 2
    src_info[1, 1] = 8
    with pytest.raises(ValueError, match="src_info"):
        N.combine_send(x.data_ptr(), 128, 4, 2, 0, 8, src_info.data_ptr(), layout_range.data_ptr(),
                       c.active[0].data_ptr(), c.bases(tag), tag)
    # validation happens before any write
    assert not view(c.half(0, tag), c.lay["half_bytes"]).any()
    assert not view(c.half(1, tag), c.lay["half_bytes"]).any()


def test_dispatch_send_rejects_bad_arguments(make_cluster):
    c = make_cluster(2, 4, 128, 4)
    x = torch.zeros(6, 128, dtype=torch.bfloat16)
    topk = torch.zeros(6, 1, dtype=torch.int64)  # 6 tokens to expert 0 > T = 4
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        c.dispatch_send(0, x, topk, 1, False)
    topk[:] = 4  # == E
    with pytest.raises(ValueError, match="topk"):
        c.dispatch_send(0, x[:2], topk[:2], 1, False)
    with pytest.raises(ValueError, match="tag"):
        c.dispatch_send(0, x[:2], topk[:2] * 0, 0, False)
    with pytest.raises(ValueError, match="peer_half_bases"):
        N.dispatch_send(x.data_ptr(), 2, 128, topk.data_ptr(), 1, 4, 2, 0, 4, c.active[0].data_ptr(), [0], 1,
                        use_fp8=False)
    assert not view(c.half(0, 1), c.lay["half_bytes"]).any()
    assert not view(c.half(1, 1), c.lay["half_bytes"]).any()


def test_waits_release_the_gil(make_cluster):
    """A receiver blocked in a thread does not stop another thread from sending."""
    c = make_cluster(2, 8, 128, 4)
    tag = 9
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=17, full=True)
    c.dispatch_send(0, xs[0], topks[0], tag, False)
    result = {}
    th = threading.Thread(target=lambda: result.update(c.dispatch_recv(0, tag, False, timeout_us=-1)))
    th.start()
    time.sleep(0.05)
    assert th.is_alive()
    c.dispatch_send(1, xs[1], topks[1], tag, False)
    th.join(timeout=5)
    assert not th.is_alive()
    assert result["failed"] == []
    check_dispatch(c, 0, result, expected_dispatch(c, 0, xs, topks, {0, 1}, False), False)


# ---------------------------------------------------------------------------------------------
# Compact combine (the Transfer Engine layout: only routed rows, one range per token owner)
# ---------------------------------------------------------------------------------------------

def _with_duplicates(topks):
    """Repeat entry 0 in entry 1 of every third row (a token selects that expert once)."""
    out = []
    for topk in topks:
        topk = topk.clone()
        topk[::3, 1] = topk[::3, 0]
        out.append(topk.contiguous())
    return out


@pytest.mark.parametrize("R,compact_senders", [(2, {0, 1}), (2, {1}), (4, {0, 2, 3})])
def test_compact_combine_matches_reference(make_cluster, R, compact_senders):
    """Senders in `compact_senders` write compactly (as a TE peer's rows arrive), the others
    directly: every owner's combine equals the reference, duplicates in a top-k row included, and a
    compact sender writes exactly its routed rows, behind each other, and nothing beyond."""
    c = make_cluster(R, 12, 128, 4 * R)
    tag = 5
    xs, topks, weights = random_inputs(R, c.T, c.H, c.E, 3, seed=40 + R, full=True)
    topks = _with_duplicates(topks)
    for r in range(R):
        c.dispatch_send(r, xs[r], topks[r], tag, False)
    recvs = [c.dispatch_recv(r, tag, False) for r in range(R)]
    outs = make_expert_outputs(c, 77 + R)
    row_bytes = c.H * 2
    for s in range(R):  # poison every combine_data row: a row read but never written shows up
        view(c.half(s, tag) + c.lay["combine_data"], c.E * c.T * row_bytes).fill_(0x7F)
    for r in range(R):
        c.combine_send(r, outs[r], recvs[r], tag, compact=r in compact_senders)
    for r in compact_senders:
        for s in range(R):
            counts = (recvs[r]["layout_range"][:, s] & 0xFFFFFFFF).tolist()
            block = view(c.half(s, tag) + c.lay["combine_data"] + r * c.L * c.T * row_bytes,
                         c.L * c.T * row_bytes, torch.bfloat16).view(c.L * c.T, c.H)
            packed = []
            for l, count in enumerate(counts):
                begin = int(recvs[r]["layout_range"][l, s]) >> 32
                packed.append(outs[r][l, begin:begin + count])
            rows = sum(counts)
            assert torch.equal(bits(block[:rows]), bits(torch.cat(packed)))
            assert (block[rows:].view(torch.uint8) == 0x7F).all(), "a compact sender wrote past its rows"
    for s in range(R):
        got, failed = c.combine_recv(s, topks[s], weights[s], tag)
        assert failed == []
        assert torch.equal(bits(got), bits(expected_combine(c, recvs, outs, topks, weights, s, set(range(R)))))


def test_compact_combine_count_mismatch_fails_that_owner(make_cluster):
    """An owner whose compact counts differ from what the token owner dispatched (here the token
    owner combines with another top-k than it dispatched) is failed, never read at the wrong rows;
    the other owner's rows still combine exactly."""
    c = make_cluster(2, 8, 128, 4)
    tag = 6
    xs, topks, weights = random_inputs(2, 8, 128, 4, 2, seed=21, full=True)
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], tag, False)
    recvs = [c.dispatch_recv(r, tag, False) for r in range(2)]
    outs = make_expert_outputs(c, 31)
    for r in range(2):
        c.combine_send(r, outs[r], recvs[r], tag, compact=True)
    changed = topks[0].clone()
    row = int((changed[:, 0] == 2).nonzero()[0]) if (changed[:, 0] == 2).any() else 0
    changed[row] = torch.tensor([2, -1]) if int(changed[row, 0]) != 2 else torch.tensor([3, -1])
    assert not torch.equal(changed, topks[0])
    before = time.monotonic()
    got, failed = c.combine_recv(0, changed, weights[0], tag, timeout_us=5_000_000)
    assert time.monotonic() - before < 1.0
    assert failed == [1] and c.active[0].tolist() == [1, 0]
    assert torch.equal(bits(got), bits(expected_combine(c, recvs, outs, [changed], [weights[0]], 0, {0})))


def test_mixed_compact_flags_fail_the_owner(make_cluster):
    """One owner's signals that disagree on the compact flag are a protocol error: failed at once."""
    c = make_cluster(2, 8, 128, 4)
    tag = 8
    xs, topks, weights = random_inputs(2, 8, 128, 4, 2, seed=22, full=True)
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], tag, False)
    recvs = [c.dispatch_recv(r, tag, False) for r in range(2)]
    outs = make_expert_outputs(c, 32)
    for r in range(2):
        c.combine_send(r, outs[r], recvs[r], tag, compact=True)
    word = c.signal_addr(0, tag, "combine_signals", 1 * c.L + 1)
    N.signal_store(word, N.signal_load(word) & ~0x80000000)
    got, failed = c.combine_recv(0, topks[0], weights[0], tag, timeout_us=5_000_000)
    assert failed == [1] and c.active[0].tolist() == [1, 0]
    assert torch.equal(bits(got), bits(expected_combine(c, recvs, outs, topks, weights, 0, {0})))


# ---------------------------------------------------------------------------------------------
# Compact dispatch (the Transfer Engine layout: each token once per destination)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("R,compact_senders", [(2, {0, 1}), (4, {1, 3})])
def test_compact_dispatch_matches_reference(make_cluster, R, compact_senders, fp8):
    """Senders in `compact_senders` dispatch compactly, the others directly; every receiver's packed
    rows, scales, src_info and ranges equal the reference (duplicates in a top-k row included), a
    compact sender wrote each token once per destination, and the compact combine back is exact."""
    c = make_cluster(R, 12, 256, 4 * R)
    tag = 3
    xs, topks, weights = random_inputs(R, c.T, c.H, c.E, 3, seed=50 + R, full=True)
    topks = _with_duplicates(topks)
    for r in range(R):
        c.dispatch_send(r, xs[r], topks[r], tag, fp8, compact=r in compact_senders)
    for r in compact_senders:
        for d in range(R):
            owners = torch.div(topks[r], c.L, rounding_mode="floor")
            tokens = (owners == d).any(1).nonzero().flatten()
            start = c.half(d, tag) + c.lay["dispatch_data"] + r * c.T * c.H * 2
            if fp8:  # dense at H bytes (only those cross the wire), each token once, ascending
                rows = view(start, tokens.numel() * c.H, torch.uint8).view(tokens.numel(), c.H)
                assert torch.equal(rows, ref_quantize(xs[r][tokens])[0]), "compact FP8 rows: dense, each token once"
            else:
                rows = view(start, tokens.numel() * c.H * 2, torch.uint8).view(tokens.numel(), c.H * 2)
                assert torch.equal(rows.view(torch.bfloat16), xs[r][tokens]), "compact rows: each token once, ascending"
    recvs = [c.dispatch_recv(r, tag, fp8) for r in range(R)]
    for r in range(R):
        assert recvs[r]["failed"] == []
        check_dispatch(c, r, recvs[r], expected_dispatch(c, r, xs, topks, set(range(R)), fp8), fp8)
    if fp8:
        return
    outs = make_expert_outputs(c, 90 + R)
    for r in range(R):
        c.combine_send(r, outs[r], recvs[r], tag, compact=r in compact_senders)
    for s in range(R):
        got, failed = c.combine_recv(s, topks[s], weights[s], tag)
        assert failed == []
        assert torch.equal(bits(got), bits(expected_combine(c, recvs, outs, topks, weights, s, set(range(R)))))


@pytest.mark.parametrize("compact", [False, True])
def test_dispatch_send_takes_rows_quantized_once(make_cluster, compact):
    """FP8 rows quantized by the caller (quantize_fp8_rows, once for several sends) give every
    receiver exactly what dispatch_send's own quantization gives; rows without scales are refused."""
    c = make_cluster(2, 12, 256, 8)
    xs, topks, _ = random_inputs(2, c.T, c.H, c.E, 3, seed=71, full=True)
    sent = {}
    for tag, given in ((3, False), (4, True)):
        for r in range(2):
            extra = {}
            if given:
                q = torch.full((c.T, c.H), 0x55, dtype=torch.uint8)
                sc = torch.full((c.T, c.H // 128), -1.0, dtype=torch.float32)
                N.quantize_fp8_rows(xs[r].data_ptr(), c.H * 2, 0, c.T, c.H, q.data_ptr(), sc.data_ptr())
                extra = {"fp8_rows_ptr": q.data_ptr(), "fp8_scales_ptr": sc.data_ptr()}
                sent[r] = (q, sc)  # alive until the sends are done
            c.dispatch_send(r, xs[r], topks[r], tag, True, compact=compact, **extra)
        sent[tag] = [c.dispatch_recv(r, tag, True) for r in range(2)]
    for r in range(2):
        assert sent[3][r]["failed"] == [] and sent[4][r]["failed"] == []
        check_dispatch(c, r, sent[4][r], expected_dispatch(c, r, xs, topks, {0, 1}, True), True)
        for key in ("x", "scales", "src_info", "layout_range", "recv_count"):
            assert torch.equal(bits(sent[3][r][key]), bits(sent[4][r][key])), key
    q = torch.zeros((c.T, c.H), dtype=torch.uint8)
    with pytest.raises(ValueError, match="fp8_rows_ptr and fp8_scales_ptr: expected both or neither"):
        c.dispatch_send(0, xs[0], topks[0], 5, True, fp8_rows_ptr=q.data_ptr())


def test_compact_dispatch_bad_token_list_fails_that_source(make_cluster):
    """A compact source whose token list is not strictly ascending (corrupted) is failed at once;
    the other source's rows are still exact."""
    c = make_cluster(2, 8, 128, 4)
    tag = 5
    xs, topks, _ = random_inputs(2, 8, 128, 4, 2, seed=23, full=True)
    for r in range(2):
        c.dispatch_send(r, xs[r], topks[r], tag, False, compact=True)
    meta = view(c.half(0, tag) + c.lay["dispatch_data"] + (1 * 2 + 1) * c.T * c.H * 2, 8, torch.int32)
    counts = [int(N.signal_load(c.signal_addr(0, tag, "dispatch_signals", 1 * c.L + l))) & 0x7FFFFFFF
              for l in range(c.L)]
    assert counts[0] >= 2
    meta[1] = meta[0]  # a repeated token in local expert 0's list: not strictly ascending
    before = time.monotonic()
    got = c.dispatch_recv(0, tag, False, timeout_us=5_000_000)
    assert time.monotonic() - before < 1.0
    assert got["failed"] == [1] and c.active[0].tolist() == [1, 0]
    check_dispatch(c, 0, got, expected_dispatch(c, 0, xs, topks, {0}, False), False)


def test_compact_dispatch_needs_two_local_experts(make_cluster):
    c = make_cluster(2, 8, 128, 2)  # L = 1
    xs, topks, _ = random_inputs(2, 8, 128, 2, 1, seed=24, full=True)
    with pytest.raises(ValueError, match="compact"):
        c.dispatch_send(0, xs[0], topks[0], 1, False, compact=True)
