"""The ElasticBuffer's rows on host tensors (native `elastic_pack_rows` / `elastic_unpack_rows`) against
the torch path used on devices and against a per-token reference of the inner routing: the same bytes,
the same routing, the same local ids and counts; bad ids refused. One process, no ranks."""
import itertools

import pytest
import torch

from mooncake_ep_switch.elastic_buffer import layout as lay
from mooncake_ep_switch.elastic_buffer import rows as codec

SHAPES = [(2, 32, 8), (4, 32, 8), (8, 16, 2), (3, 9, 9), (16, 64, 4), (1, 4, 3)]  # (R, E, K)


def reference_routing(topk, num_experts, num_ranks, rank, num_bias):
    """Per token: the bias slots, then each rank's data slot in the order of its last top-k entry, -1 after."""
    local, width = num_experts // num_ranks, min(topk.shape[1], num_ranks)
    out = []
    for row in topk.tolist():
        last = {}
        for k, expert in enumerate(row):
            if expert >= 0:
                last[expert // local] = k
        groups = [3 * owner for owner, _ in sorted(last.items(), key=lambda item: item[1])]
        out.append([3 * rank + 1, 3 * rank + 2][:num_bias] + (groups + [-1] * width)[:width])
    return torch.tensor(out, dtype=torch.int64).view(topk.shape[0], num_bias + width)


def random_topk(generator, n, num_experts, num_topk):
    if n == 0:
        return torch.empty((0, num_topk), dtype=torch.int64)
    topk = torch.stack([torch.randperm(num_experts, generator=generator)[:num_topk] for _ in range(n)])
    topk[torch.rand(topk.shape, generator=generator) < 0.2] = -1
    return topk


@pytest.mark.parametrize("num_ranks,num_experts,num_topk", SHAPES)
def test_native_rows_equal_the_torch_path_and_the_reference(num_ranks, num_experts, num_topk):
    generator = torch.Generator().manual_seed(num_ranks * 100 + num_topk)
    hidden = 256 if num_ranks % 2 else 200  # FP8 scale groups of 2 and of 2 (one partial)
    width = codec.inner_hidden(hidden, num_topk)
    for n, use_fp8, with_weights in itertools.product((0, 1, 37), (False, True), (False, True)):
        topk = random_topk(generator, n, num_experts, num_topk)
        x = torch.randn((n, hidden), generator=generator).to(torch.bfloat16)
        scales = None
        if use_fp8:
            x = x.to(torch.float8_e4m3fn)
            scales = torch.rand((n, codec.num_scale_groups(hidden)), generator=generator)
        weights = torch.rand((n, num_topk), generator=generator) if with_weights else None
        for rank, num_bias in itertools.product(sorted({0, num_ranks // 2, num_ranks - 1}), (0, 1, 2)):
            rows, inner_topk = codec.pack_host(x, scales, topk, weights, width, num_experts, num_ranks, rank, num_bias)
            expected_routing = reference_routing(topk, num_experts, num_ranks, rank, num_bias)
            assert torch.equal(inner_topk, expected_routing)
            assert torch.equal(codec.inner_routing(topk, num_experts, num_ranks, rank, num_bias), expected_routing)
            expected_rows = codec.pack_dispatch_rows(x, scales, topk, weights, width)
            assert torch.equal(rows.view(torch.uint8), expected_rows.view(torch.uint8))
        # The receiving side, on rows laid out with a gap between them (a stride wider than a row).
        received = torch.zeros((n, width + 128), dtype=torch.bfloat16)[:, :width]
        received.copy_(codec.pack_dispatch_rows(x, scales, topk, weights, width))
        num_local = num_experts // num_ranks
        for rank in sorted({0, num_ranks - 1}):
            got_x, got_scales, local, got_weights, counts = codec.unpack_host(received, hidden, num_topk, use_fp8,
                                                                              rank, num_local)
            want_x, want_scales, want_topk, want_weights = codec.unpack_dispatch_rows(received, hidden, num_topk,
                                                                                      use_fp8)
            assert torch.equal(got_x.view(torch.uint8), want_x.view(torch.uint8))
            assert (got_scales is None) == (want_scales is None)
            if want_scales is not None:
                assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))
            assert torch.equal(got_weights.view(torch.int32), want_weights.view(torch.int32))
            want_local = lay.local_topk(want_topk, rank, num_local)
            assert torch.equal(local, want_local)
            assert torch.equal(lay.local_ids(want_topk, rank, num_local, num_experts), want_local)
            assert torch.equal(counts, lay.expert_counts(want_local, num_local))
            assert counts.tolist() == [int((want_topk == rank * num_local + j).sum()) for j in range(num_local)]


def test_native_packing_refuses_bad_ids():
    topk = torch.tensor([[0, 1], [2, 2]], dtype=torch.int64)
    x = torch.zeros((2, 128), dtype=torch.bfloat16)
    assert codec.pack_host(x, None, topk, None, 256, 4, 2, 0, 0) == (None, None)  # expert 2 twice
    assert codec.pack_host(x, None, torch.tensor([[0, 1], [3, 4]]), None, 256, 4, 2, 0, 0) == (None, None)
    assert codec.pack_host(x, None, torch.tensor([[0, 1], [-2, 3]]), None, 256, 4, 2, 0, 0) == (None, None)
    rows, _ = codec.pack_host(x, None, torch.tensor([[-1, -1], [3, -1]]), None, 256, 4, 2, 0, 0)  # -1 repeats
    assert rows is not None


def _route(local):
    """A route holding only what `write_partials` reads: the received tokens in order, their local ids."""
    n = local.size(0)
    src_global = torch.arange(n, dtype=torch.int64)
    route = lay.Route(None, n, local.size(1), 0, False, src_global, local, None, 0, None, 0, None, 0, 0)
    route.inner_rows = (route.inner_handle, slice(0, n), src_global)
    return route


@pytest.mark.parametrize("num_topk,with_weights", [(1, True), (8, True), (8, False), (31, True)])
def test_native_combine_rows_equal_the_torch_path(num_topk, with_weights):
    """`write_partials` (native `elastic_write_partials` on host tensors) writes the same row bytes as its
    torch form (partial, then each weight byte as a bf16 number, other ranks' entries zero), on a combine
    buffer view narrower than its rows; `read_combined` (native `elastic_read_combined`) gives back the
    same tokens and float32 weights bit for bit as the torch decode."""
    from mooncake_ep_switch.elastic_buffer import inner_rows

    generator = torch.Generator().manual_seed(num_topk)
    n, hidden = 37, 200
    local = torch.randint(-1, 4, (n, num_topk), generator=generator)
    weights = torch.randn((n, num_topk), generator=generator) if with_weights else None
    partial = torch.randn((n, hidden + 56), generator=generator).to(torch.bfloat16)[:, :hidden]  # a row stride
    columns = hidden + 4 * num_topk
    native = torch.full((3, 48, columns + 100), 3.0, dtype=torch.bfloat16)
    reference = native.clone()
    inner_rows.write_partials(native[:, :, :columns], _route(local), partial, weights, None, 16)
    reference[0, :n, :hidden] = partial
    masked = torch.zeros((n, num_topk)) if weights is None else weights.masked_fill(local < 0, 0.0)
    reference[0, :n, hidden:columns] = codec.encode_weight_bytes(masked)
    assert torch.equal(native.view(torch.int16), reference.view(torch.int16))  # nothing else written

    out = native[0, :n]  # the inner combine's result has this shape: [x | weight numbers | the rest]
    got_x, got_weights = inner_rows.read_combined(out, hidden, num_topk, with_weights)
    assert torch.equal(got_x.view(torch.int16), partial.contiguous().view(torch.int16))
    if with_weights:
        want = codec.decode_weight_bytes(out[:, hidden:columns], num_topk)
        assert torch.equal(got_weights.view(torch.int32), want.view(torch.int32))
        assert torch.equal(got_weights.view(torch.int32), masked.view(torch.int32))
    else:
        assert got_weights is None
