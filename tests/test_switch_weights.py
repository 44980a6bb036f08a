"""TP<->EP weight switching: bit-exact reshard round trips, TP vs EP forwards, fixed views, one-slot
overhead, the TP all-reduce, and the collective fallback.

References are independent of the reshard code: the expected shard of every layer is sliced from the
full weights with plain torch indexing, and the forward reference is the single-process
`reference_forward` on the full weights.
"""
import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.reference import calc_diff

E, H, I, TOP_K, T = 8, 128, 64, 2, 8


def _expected_shard(full, layout, rank, ranks):
    """Slice one layer's shard with plain indexing (no runtime code)."""
    if layout == "ep":
        local = E // ranks
        return full.gate_up[rank * local:(rank + 1) * local], full.down[rank * local:(rank + 1) * local]
    part = I // ranks
    lo, hi = rank * part, (rank + 1) * part
    gate_up = torch.cat([full.gate_up[:, lo:hi], full.gate_up[:, I + lo:I + hi]], dim=1)
    return gate_up, full.down[:, :, lo:hi]


def _tokens(rank, seed):
    generator = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randn((T - rank, H), generator=generator).to(torch.bfloat16)


def _setup(ctx, transport, num_layers, layout="ep"):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.tp_collective import TPAllReduce
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(T, H, ctx.num_ranks, E), transport=transport)
    full = [random_weights(E, H, I, seed=20 + layer) for layer in range(num_layers)]
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), num_layers, layout=layout)
    unified.load_full(full)
    all_reduce = TPAllReduce(buffer, T * ctx.num_ranks, H)
    return buffer, full, unified, all_reduce


def _forward(ctx, buffer, unified, all_reduce, full, seed):
    """Run every layer's MoE block in the current layout on this rank's tokens; returns output per layer."""
    from mooncake_ep_switch.reference.moe_block import ep_forward_local, tp_forward

    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    outs = []
    for layer, weights in enumerate(full):
        gate_up, down = unified.view(layer)
        if unified.layout == "ep":
            out = ep_forward_local(buffer, _tokens(ctx.rank, seed + layer), weights.router, gate_up, down, TOP_K, T,
                                   active)
        else:  # TP: every rank runs every rank's tokens; keep the rows of our own
            everyone = [_tokens(r, seed + layer) for r in range(ctx.num_ranks)]
            out_all = tp_forward(all_reduce, torch.cat(everyone), weights.router, gate_up, down, TOP_K, active)
            begin = sum(x.size(0) for x in everyone[:ctx.rank])
            out = out_all[begin:begin + everyone[ctx.rank].size(0)]
        outs.append(out)
    assert active.tolist() == [1] * ctx.num_ranks
    return outs


def _check_views(ctx, unified, full):
    for layer, weights in enumerate(full):
        gate_up, down = unified.view(layer)
        want_gate_up, want_down = _expected_shard(weights, unified.layout, ctx.rank, ctx.num_ranks)
        assert torch.equal(gate_up, want_gate_up), f"layer {layer} gate_up differs in {unified.layout}"
        assert torch.equal(down, want_down), f"layer {layer} down differs in {unified.layout}"


def rank_switch_sequence(ctx, transport, sequence, num_layers):
    """Switch through `sequence`; after every switch check the views and both forwards."""
    from mooncake_ep_switch.reference.moe_block import reference_forward
    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, full, unified, all_reduce = _setup(ctx, transport, num_layers)
    diffs, layouts = [], []
    try:
        for step, target in enumerate(["ep"] + list(sequence)):
            if step:
                report = switch_layout(buffer, target, weights=unified, timeout_us=20_000_000)
                assert report.outcome == "completed" and report.layout == target, report
                assert report.weight_bytes == unified.layer_bytes * num_layers * (ctx.num_ranks - 1) // ctx.num_ranks
                assert report.weight_local_bytes == unified.layer_bytes * num_layers // ctx.num_ranks
            assert unified.layout == target
            _check_views(ctx, unified, full)
            outs = _forward(ctx, buffer, unified, all_reduce, full, seed=7)
            for layer, out in enumerate(outs):
                reference = reference_forward(_tokens(ctx.rank, 7 + layer), full[layer], TOP_K)
                diffs.append(calc_diff(out, reference))
            layouts.append((target, [o.clone() for o in outs]))
    finally:
        all_reduce.destroy()
        unified.destroy()
        buffer.destroy()
    # the same layout gives bit-identical outputs whatever switches happened in between
    for name in ("ep", "tp"):
        runs = [outs for layout, outs in layouts if layout == name]
        for outs in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs, runs[0])), f"{name} output changed across switches"
    cross = [calc_diff(a, b) for (la, oa), (lb, ob) in zip(layouts, layouts[1:]) for a, b in zip(oa, ob)]
    return {"max_ref_diff": max(diffs), "max_cross_diff": max(cross) if cross else 0.0}


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_reshard_round_trips_and_forwards_agree(num_ranks):
    results = harness.run(num_ranks, rank_switch_sequence, "shm", ["tp", "ep", "tp", "ep"], 3)
    for result in results:
        assert result["max_ref_diff"] < 1e-4, result
        assert result["max_cross_diff"] < 1e-4, result


def test_collective_fallback_round_trip():
    results = harness.run(2, rank_switch_sequence, "collective", ["tp", "ep"], 2)
    for result in results:
        assert result["max_ref_diff"] < 1e-4 and result["max_cross_diff"] < 1e-4, result


def rank_fixed_views(ctx, switches):
    """Addresses of every (layer, layout) view before and after `switches` switches, and the overhead."""
    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, full, unified, all_reduce = _setup(ctx, "shm", 3)
    try:
        def addresses():
            return {(layer, layout): tuple(t.data_ptr() for t in unified.view(layer, layout))
                    for layer in range(3) for layout in ("ep", "tp")}

        before = addresses()
        for index in range(switches):
            switch_layout(buffer, "tp" if index % 2 == 0 else "ep", weights=unified)
            assert addresses() == before, f"a view moved after switch {index + 1}"
        _check_views(ctx, unified, full)
        memory = unified.memory_report()
        return {"layout": unified.layout, "memory": memory._asdict(), "free_slot": unified.free_slot()}
    finally:
        all_reduce.destroy()
        unified.destroy()
        buffer.destroy()


def test_view_addresses_fixed_and_overhead_one_slot():
    results = harness.run(2, rank_fixed_views, 10)
    for result in results:
        memory = result["memory"]
        assert result["layout"] == "ep"
        assert memory["overhead_bytes"] == memory["slot_bytes"] == memory["layer_bytes"]
        assert memory["region_bytes"] == 4 * memory["layer_bytes"]  # L + 1 slots, L = 3
        assert result["free_slot"] == 0


def rank_all_reduce(ctx, skip_rank):
    """Deterministic sums; then `skip_rank` skips a call and the others mark it inactive."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.tp_collective import TPAllReduce

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(4, 128, ctx.num_ranks, 8), transport="shm")
    reduce = TPAllReduce(buffer, 16, 128)
    try:
        parts = [torch.randn((5, 128), generator=torch.Generator().manual_seed(r)) for r in range(ctx.num_ranks)]
        expected = torch.zeros(5, 128)
        for part in parts:
            expected += part
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        results = []
        for _ in range(3):  # three calls reuse both halves
            out = reduce.all_reduce(parts[ctx.rank], active, 5_000_000)
            assert torch.equal(out, expected.to(torch.bfloat16))
            results.append(out)
        if ctx.rank != skip_rank:
            out = reduce.all_reduce(parts[ctx.rank], active, 300_000)
            assert active.tolist() == [0 if r == skip_rank else 1 for r in range(ctx.num_ranks)]
            partial = torch.zeros(5, 128)
            for r, part in enumerate(parts):
                if r != skip_rank:
                    partial += part
            assert torch.equal(out, partial.to(torch.bfloat16))
        return active.tolist()
    finally:
        torch.distributed.barrier(group=ctx.group)
        reduce.destroy()
        buffer.destroy()


def test_tp_all_reduce_deterministic_and_fault_aware():
    harness.run(4, rank_all_reduce, 3)


UNCHANGED_TIMEOUT_US = 10_000_000


def rank_one_rank_already_in_target(ctx):
    """Rank 1 reloads the EP layout (as after a failed switch) while rank 0 stays in TP; both ask
    for "ep". Rank 1 is "unchanged", rank 0 must refuse (at once: rank 1 refuses in its words), and
    once rank 0 reloads EP too the next switch completes: the switch sequence stayed in step."""
    import time

    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, full, unified, all_reduce = _setup(ctx, "shm", 2)
    try:
        first = switch_layout(buffer, "tp", weights=unified, timeout_us=UNCHANGED_TIMEOUT_US)
        assert first.outcome == "completed", first
        if ctx.rank == 1:
            unified.layout = "ep"
            unified.load_full(full)
        dist.barrier(group=ctx.group)
        started = time.perf_counter()
        mixed = switch_layout(buffer, "ep", weights=unified, timeout_us=UNCHANGED_TIMEOUT_US)
        mixed_s = time.perf_counter() - started
        dist.barrier(group=ctx.group)
        if ctx.rank == 0:  # reload EP: now every rank is in EP
            unified.layout = "ep"
            unified.load_full(full)
        last = switch_layout(buffer, "tp", weights=unified, timeout_us=UNCHANGED_TIMEOUT_US)
        if last.outcome == "completed":
            _check_views(ctx, unified, full)
        return {"mixed": (mixed.outcome, mixed.layout, mixed.reason), "mixed_s": mixed_s,
                "last": (last.outcome, last.layout, last.reason), "seq": unified.seq}
    finally:
        all_reduce.destroy()
        unified.destroy()
        buffer.destroy()


def test_a_rank_already_in_the_target_keeps_the_switch_sequence_in_step():
    results = harness.run(2, rank_one_rank_already_in_target)
    assert results[1]["mixed"][:2] == ("unchanged", "ep"), results[1]
    outcome, layout, reason = results[0]["mixed"]
    assert (outcome, layout) == ("refused", "tp") and "other arguments" in reason, results[0]
    assert results[0]["mixed_s"] < UNCHANGED_TIMEOUT_US / 1e6 / 2, results[0]["mixed_s"]  # not at its deadline
    for result in results:
        assert result["last"] == ("completed", "tp", ""), result
    assert results[0]["seq"] == results[1]["seq"] == 3
