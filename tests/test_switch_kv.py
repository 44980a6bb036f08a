"""Paged KV cache redistribution across TP<->EP switches.

Requests cover the edge cases of the Moebius review: a shared prefix (two children forked from one
parent, pages with reference count 3), partially filled last pages, a request mid-prefill (its
remaining prompt is written after the switch), a page-aligned request, and a rank owning nothing.
Decode attention before and after every switch must be bit-identical per (request, head), and equal
(to float tolerance) to a dense reference computed from the generated K/V without the cache.
"""
import math

import numpy as np

import pytest
import torch

from tests import harness

H_KV, G, D, PAGE, LAYERS = 4, 2, 16, 4, 2
E, H, I = 8, 128, 64


# ---------------------------------------------------------------------------------------------
# Requests: every token's K/V comes from a stream (key, layer) at its position
# ---------------------------------------------------------------------------------------------

def _stream(key, layer, length=64):
    generator = torch.Generator().manual_seed(key * 1000 + layer)
    k = torch.randn((length, H_KV, D), generator=generator).to(torch.bfloat16)
    v = torch.randn((length, H_KV, D), generator=generator).to(torch.bfloat16)
    return k, v


def _specs(rank, num_ranks):
    """Requests owned by `rank` in EP: (rid, parent or None, shared tokens, tokens, prompt_len)."""
    if num_ranks > 1 and rank == num_ranks - 1:
        return []  # a rank without requests
    base = 100 * (rank + 1)
    return [
        (base + 0, None, 0, 10, 10),        # partial last page (10 = 2 pages + 2)
        (base + 1, base + 0, 8, 11, 11),    # shares 2 full pages with base+0
        (base + 2, base + 0, 8, 13, 13),    # shares the same 2 pages: refcount 3
        (base + 3, None, 0, 6, 15 + rank),  # mid-prefill: 6 of 15+rank prompt tokens computed
        (base + 4, None, 0, 8 + 4 * rank, 8 + 4 * rank),  # page aligned
    ]


def _all_specs(num_ranks):
    return [spec for r in range(num_ranks) for spec in _specs(r, num_ranks)]


def _dense(spec, layer, upto):
    """Dense K/V `[upto, H_KV, D]` of a request, from its streams (independent of the cache)."""
    rid, parent, shared, _, _ = spec
    k, v = _stream(rid, layer)
    if parent is not None:
        pk, pv = _stream(parent, layer)
        k = torch.cat([pk[:shared], k[shared:]])
        v = torch.cat([pv[:shared], v[shared:]])
    return k[:upto], v[:upto]


def _query(rid, layer, step):
    generator = torch.Generator().manual_seed(rid * 31 + layer * 7 + step)
    return torch.randn((H_KV * G, D), generator=generator).to(torch.bfloat16)


def _reference_attention(q, k, v):
    """Plain per-head softmax attention in float64 (GQA: query head h uses KV head h // G)."""
    out = torch.empty((H_KV * G, D), dtype=torch.float64)
    for h in range(H_KV * G):
        kh, vh = k[:, h // G].double(), v[:, h // G].double()
        p = torch.softmax(q[h].double() @ kh.t() / math.sqrt(D), dim=-1)
        out[h] = p @ vh
    return out


def _heads(kv):
    """Query-head indices stored here (G per KV head of the local head groups)."""
    hg = H_KV // kv.num_ranks
    return [h for g in kv.head_groups() for h in range(g * hg * G, (g + 1) * hg * G)]


def _populate(kv, rank, num_ranks, layout):
    """Create the requests in `layout` (EP: owner writes all heads; TP: every rank its head group)."""
    specs = _specs(rank, num_ranks) if layout == "ep" else _all_specs(num_ranks)
    hg = H_KV // num_ranks
    heads = slice(None) if layout == "ep" else slice(rank * hg, (rank + 1) * hg)
    for spec in specs:
        rid, parent, shared, tokens, prompt = spec
        if parent is None:
            kv.add_request(rid, prompt)
        else:
            kv.fork(parent, rid, shared, prompt)
        start = kv.reserve(rid, tokens - kv.requests[rid].num_tokens)
        for layer in range(LAYERS):
            k, v = _dense(spec, layer, tokens)
            kv.write(rid, layer, start, k[start:, heads].contiguous(), v[start:, heads].contiguous())


def _attention_here(kv, step):
    """{(rid, layer): {query head: output row}} for every request here."""
    from mooncake_ep_switch.reference.attention import decode_attention

    rids = sorted(kv.requests)
    heads = _heads(kv)
    result = {}
    for layer in range(LAYERS):
        q = torch.stack([_query(rid, layer, step)[heads] for rid in rids]) if rids else torch.zeros(0, len(heads), D)
        out = decode_attention(kv, layer, rids, q)
        for index, rid in enumerate(rids):
            result[(rid, layer)] = {h: out[index, j].clone() for j, h in enumerate(heads)}
    return result


def _check_reference(kv, attention, num_ranks, step):
    specs = {spec[0]: spec for spec in _all_specs(num_ranks)}
    worst = 0.0
    for (rid, layer), rows in attention.items():
        spec = specs[rid]
        k, v = _dense(spec, layer, kv.requests[rid].num_tokens)
        expected = _reference_attention(_query(rid, layer, step), k, v)
        for h, row in rows.items():
            worst = max(worst, float((row.double() - expected[h]).abs().max()))
    assert worst < 1e-4, f"attention differs from the dense reference by {worst}"


def _check_sharing(kv):
    """Shared prefix pages stay shared (same ids, refcount = users) and nothing leaks."""
    for rid, req in kv.requests.items():
        for page in req.pages:
            users = sum(page in other.pages for other in kv.requests.values())
            assert kv.refcount[page] == users, (rid, page)
    per_page = kv.num_ranks if kv.layout == "ep" else 1
    assert kv.used_units() == len(kv.refcount) * per_page


def _setup(ctx, transport, num_units):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E), transport=transport)
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), 2)
    unified.load_full([random_weights(E, H, I, seed=layer) for layer in range(2)])
    kv = PagedKVCache(buffer, KVCacheConfig(LAYERS, H_KV, D, PAGE, num_units))
    return buffer, unified, kv


def rank_kv_switches(ctx, transport, sequence):
    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, unified, kv = _setup(ctx, transport, 96)
    try:
        _populate(kv, ctx.rank, ctx.num_ranks, "ep")
        phases, kv_bytes = [], []
        for step, target in enumerate(["ep"] + list(sequence)):
            if step:
                report = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=20_000_000)
                assert report.outcome == "completed" and kv.layout == target, report
                kv_bytes.append(report.kv_bytes)
            _check_sharing(kv)
            attention = _attention_here(kv, step=0)
            _check_reference(kv, attention, ctx.num_ranks, step=0)
            phases.append((kv.layout, attention))
        # After the last switch: finish the mid-prefill requests and decode one token everywhere.
        specs = {spec[0]: spec for spec in _all_specs(ctx.num_ranks)}
        hg = H_KV // ctx.num_ranks
        heads = slice(None) if kv.layout == "ep" else slice(ctx.rank * hg, (ctx.rank + 1) * hg)
        for rid in sorted(kv.requests):
            req = kv.requests[rid]
            target_tokens = max(req.prompt_len, req.num_tokens) + 1
            start = kv.reserve(rid, target_tokens - req.num_tokens)
            for layer in range(LAYERS):
                k, v = _dense(specs[rid], layer, target_tokens)
                kv.write(rid, layer, start, k[start:, heads].contiguous(), v[start:, heads].contiguous())
        _check_sharing(kv)
        final = _attention_here(kv, step=1)
        _check_reference(kv, final, ctx.num_ranks, step=1)
        return {"phases": phases, "final_layout": kv.layout, "kv_bytes": kv_bytes}
    finally:
        kv.destroy()
        unified.destroy()
        buffer.destroy()


def _assemble(results, layout_index):
    """{(rid, layer): {head: row}} merged over ranks for one phase."""
    merged = {}
    for result in results:
        layout, attention = result["phases"][layout_index]
        for key, rows in attention.items():
            merged.setdefault(key, {}).update(rows)
    return merged


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_kv_attention_unchanged_across_switches(num_ranks):
    sequence = ["tp", "ep", "tp"]
    results = harness.run(num_ranks, rank_kv_switches, "shm", sequence)
    assert all(sum(r["kv_bytes"][i] for r in results) > 0 for i in range(len(sequence)))
    first = _assemble(results, 0)
    rids = {spec[0] for spec in _all_specs(num_ranks)}
    assert {rid for rid, _ in first} == rids
    for index in range(1, len(sequence) + 1):
        merged = _assemble(results, index)
        assert merged.keys() == first.keys()
        for key, rows in first.items():
            assert sorted(merged[key]) == list(range(H_KV * G)), key
            for h, row in rows.items():
                assert torch.equal(merged[key][h], row), f"attention of {key} head {h} changed after switch {index}"


def test_kv_collective_fallback():
    results = harness.run(2, rank_kv_switches, "collective", ["tp", "ep"])
    first = _assemble(results, 0)
    for index in (1, 2):
        merged = _assemble(results, index)
        for key, rows in first.items():
            for h, row in rows.items():
                assert torch.equal(merged[key][h], row)


def rank_capacity_refusal(ctx):
    """A KV pool too small for the TP layout: the switch is refused and nothing changes."""
    from mooncake_ep_switch.switch.switcher import switch_layout

    # rank 2 holds 12 EP pages (48 units); the TP layout would need 21 more units there, 16 are free
    buffer, unified, kv = _setup(ctx, "shm", 64)
    try:
        _populate(kv, ctx.rank, ctx.num_ranks, "ep")
        weights_before = [tuple(t.clone() for t in unified.view(layer)) for layer in range(2)]
        pool_before = kv.pool.clone()
        state_before = (dict(kv.requests), dict(kv.refcount), kv.free.copy())
        report = switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=20_000_000)
        assert report.outcome == "refused" and "capacity" in report.reason, report
        assert unified.layout == "ep" and kv.layout == "ep" and report.layout == "ep"
        assert all(torch.equal(a, b) for layer, saved in enumerate(weights_before)
                   for a, b in zip(saved, unified.view(layer)))
        assert torch.equal(pool_before, kv.pool)
        assert (dict(kv.requests), dict(kv.refcount)) == state_before[:2] and (kv.free == state_before[2]).all()
        # the next switch with room works (after freeing requests)
        for rid in sorted(kv.requests, reverse=True):
            kv.free_request(rid)
        report = switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=20_000_000)
        assert report.outcome == "completed", report
        return report.reason
    finally:
        kv.destroy()
        unified.destroy()
        buffer.destroy()


def test_capacity_check_refuses_without_touching_anything():
    harness.run(4, rank_capacity_refusal)


# ---------------------------------------------------------------------------------------------
# Corrupt peer metadata: every bad count/length/offset is refused fast, before any loop over it
# ---------------------------------------------------------------------------------------------

def _meta_cache(layout="ep"):
    import types

    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache

    buffer = types.SimpleNamespace(group=None, rank=0, num_ranks=2, transport="collective")
    cache = PagedKVCache(buffer, KVCacheConfig(1, 4, 8, 4, 64), layout)
    cache.add_request(7, 30)
    cache.reserve(7, 9)      # 3 pages
    cache.add_request(9, 4)  # no pages
    return cache


def _corrupt(kind, data):
    """`data` (a valid encoding: header, request 7 with 3 pages, request 9 with none, bitmap) corrupted."""
    data = data.copy()
    if kind == "count_2_40":
        data[3] = 1 << 40
    elif kind == "count_2_40_negative_lengths":  # each record steps back: an endless walk before
        data[3] = 1 << 40
        data[7] = -4
    elif kind == "negative_count":
        data[3] = -1
    elif kind == "negative_length":
        data[7] = -3
    elif kind == "length_past_end":
        data[7] = 1 << 40
    elif kind == "page_past_units":
        data[8] = 1 << 34
    elif kind == "negative_page":
        data[8] = -1
    elif kind == "pages_not_matching_tokens":
        data[5] = 100
    elif kind == "negative_tokens":
        data[5] = -9
    elif kind == "duplicate_rid":
        data[11] = 7
    elif kind == "bad_layout":
        data[1] = 99
    elif kind == "truncated":
        data = data[:9]
    elif kind == "truncated_bitmap":
        data = data[:-1]
    elif kind == "trailing_words":
        data = np.concatenate([data, np.zeros(3, dtype=np.int64)])
    elif kind == "count_too_small":
        data[3] = 1
    elif kind == "duplicate_page":  # request 7's three pages all name its first one
        data[9] = data[10] = data[8]
    elif kind == "used_page_marked_free":
        data[-1] = -1  # every unit free
    return data


_CORRUPTIONS = ["duplicate_page", "count_2_40", "count_2_40_negative_lengths", "negative_count", "negative_length", "length_past_end",
                "page_past_units", "negative_page", "pages_not_matching_tokens", "negative_tokens", "duplicate_rid",
                "bad_layout", "truncated", "truncated_bitmap", "trailing_words", "count_too_small",
                "used_page_marked_free"]


@pytest.mark.parametrize("kind", _CORRUPTIONS)
def test_corrupt_kv_metadata_is_refused_fast(kind):
    import time

    cache = _meta_cache()
    data = cache.encode_meta()
    assert cache.decode_meta(data).requests == cache.requests  # the valid encoding decodes
    bad = _corrupt(kind, data)
    started = time.monotonic()
    with pytest.raises(ValueError, match="metadata"):
        cache.decode_meta(bad)
    assert time.monotonic() - started < 1.0, f"{kind}: decoding took {time.monotonic() - started:.1f} s"
    assert cache.decode_meta(cache.encode_meta()).requests == cache.requests  # still usable


def rank_corrupt_metadata(ctx, transport, corrupt_rank):
    """Rank `corrupt_rank` publishes KV metadata whose request count is 2^40 and whose records step
    backwards: every rank refuses the switch quickly, nothing changes, and the next switch works."""
    import time

    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, unified, kv = _setup(ctx, transport, 96)
    try:
        _populate(kv, ctx.rank, ctx.num_ranks, "ep")
        pool_before = kv.pool.clone()
        state_before = (dict(kv.requests), dict(kv.refcount), kv.free.copy())
        if ctx.rank == corrupt_rank:
            good = kv.encode_meta
            kv.encode_meta = lambda: _corrupt("count_2_40_negative_lengths", good())
        started = time.monotonic()
        report = switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=20_000_000)
        elapsed = time.monotonic() - started
        assert report.outcome == "refused" and report.layout == "ep", report
        assert "metadata" in report.reason or "refused" in report.reason, report.reason
        assert unified.layout == "ep" and kv.layout == "ep" and torch.equal(pool_before, kv.pool)
        assert (dict(kv.requests), dict(kv.refcount)) == state_before[:2] and (kv.free == state_before[2]).all()
        if ctx.rank == corrupt_rank:
            del kv.encode_meta
        report = switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=20_000_000)
        assert report.outcome == "completed" and kv.layout == "tp", report
        _check_sharing(kv)
        _check_reference(kv, _attention_here(kv, step=0), ctx.num_ranks, step=0)
        return elapsed
    finally:
        kv.destroy()
        unified.destroy()
        buffer.destroy()


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_corrupt_peer_metadata_aborts_the_switch_everywhere(transport):
    elapsed = harness.run(4 if transport == "shm" else 2, rank_corrupt_metadata, transport, 0)
    assert max(elapsed) < 10.0, elapsed
