"""Single-process checks of the switch's plans: the reshard's copy blocks (all P ranks simulated in
one process), the KV redistribution plans (algorithms 3 and 4) and the metadata encoding."""
import types

import numpy as np
import pytest
import torch

from mooncake_ep_switch.switch import reshard
from mooncake_ep_switch.switch.kv_alloc import unit_order
from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, KVRequest, PagedKVCache, RankMeta
from mooncake_ep_switch.reference.moe_block import random_weights, shard_ep, shard_tp
from mooncake_ep_switch.switch.unified_weights import WeightShape


def _fake_unified(shape, ranks):
    return types.SimpleNamespace(shape=shape, num_ranks=ranks,
                                 gate_up_bytes=lambda: shape.num_experts // ranks * 2 * shape.intermediate
                                 * shape.hidden * 2)


def _slot(gate_up, down):
    return torch.cat([gate_up.reshape(-1).view(torch.uint8), down.reshape(-1).view(torch.uint8)]).clone()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_reshard_blocks_move_every_byte_to_its_target(ranks):
    shape = WeightShape(8, 128, 64)
    full = random_weights(*shape, seed=3)
    unified = _fake_unified(shape, ranks)
    ep = [_slot(*shard_ep(full.gate_up, full.down, r, ranks)) for r in range(ranks)]
    tp = [torch.zeros_like(ep[0]) for _ in range(ranks)]
    for way, sources, targets in (("ep->tp", ep, tp), ("tp->ep", tp, [torch.zeros_like(s) for s in ep])):
        for s in range(ranks):
            for d in range(ranks):
                blocks = reshard.slot_chunk_blocks(unified, way, s, d, sources[s].data_ptr(), targets[d].data_ptr())
                moved = reshard.copy(blocks, (targets[d].data_ptr(), targets[d].data_ptr() + targets[d].numel()),
                                     (sources[s].data_ptr(), sources[s].data_ptr() + sources[s].numel()))
                assert moved == sources[s].numel() // ranks
        for r in range(ranks):
            shard = shard_tp if way == "ep->tp" else shard_ep
            assert torch.equal(targets[r], _slot(*shard(full.gate_up, full.down, r, ranks))), (way, r)


def test_copy_blocks_refuses_out_of_region_writes():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    blocks = np.array([[dst.data_ptr(), src.data_ptr(), 1, 32, 32, 32],
                       [dst.data_ptr() + 40, src.data_ptr(), 1, 32, 32, 32]], dtype=np.int64)
    with pytest.raises(ValueError, match="outside its region"):
        reshard.copy(blocks, (dst.data_ptr(), dst.data_ptr() + 64), (src.data_ptr(), src.data_ptr() + 64))
    assert not dst.any(), "nothing may be written when any block is out of range"


def _cache(ranks, rank=0, units=64):
    buffer = types.SimpleNamespace(group=None, rank=rank, num_ranks=ranks, transport="collective")
    return PagedKVCache(buffer, KVCacheConfig(1, 4, 8, 4, units))


def test_ep_to_tp_plan_moves_each_page_once_per_head_group():
    ranks = 2
    owner0 = _cache(ranks, 0)
    owner0.add_request(1, 10)
    owner0.reserve(1, 10)                     # 3 pages, last holds 2 tokens
    owner0.fork(1, 2, 8, 12)                  # shares 2 pages
    owner0.reserve(2, 4)                      # one own page, full
    owner1 = _cache(ranks, 1)
    metas = [owner0.snapshot(), owner1.snapshot()]
    plan = owner1.plan(metas, "tp")
    assert not plan.refused
    # 4 distinct pages of rank 0, each sends head group 1 to rank 1 once; nothing from rank 1
    assert plan.moves.shape == (4, 5)
    assert sorted(plan.moves[:, 4].tolist()) == [2, 4, 4, 4]
    assert set(plan.moves[:, 0].tolist()) == {0} and set(plan.moves[:, 2].tolist()) == {1}
    # rank 1's TP tables: the shared pages are the same units for both requests
    assert plan.new_requests[1].pages[:2] == plan.new_requests[2].pages[:2]
    assert plan.new_requests[1].num_tokens == 10 and plan.new_requests[2].num_tokens == 12


def test_tp_to_ep_plan_longest_first_families_and_capacity():
    ranks = 2
    caches = [_cache(ranks, r, units=40) for r in range(ranks)]
    lengths = {10: 20, 11: 4, 12: 12, 13: 8}  # tokens; 13 forks 12's first 8 tokens
    for cache in caches:
        cache.layout = "tp"
        for rid in (10, 11, 12):
            cache.add_request(rid, lengths[rid])
            cache.reserve(rid, lengths[rid])
        cache.fork(12, 13, 8, 9)
        cache.reserve(13, 1)
    metas = [c.snapshot() for c in caches]
    plan = caches[0].plan(metas, "ep")
    assert not plan.refused
    # families by distinct pages: {10}: 5, {12, 13}: 3 + 1, {11}: 1 -> 10 to rank 0, {12,13} and 11 to rank 1
    assert plan.owner == {10: 0, 12: 1, 13: 1, 11: 1}
    # every distinct page moves once per head group: 5 + 4 + 1 pages, 2 groups
    assert plan.moves.shape[0] == (5 + 4 + 1) * ranks
    plan1 = caches[1].plan(metas, "ep")
    assert plan1.new_requests[12].pages[:2] == plan1.new_requests[13].pages[:2]
    # too little room: each rank has 3 free EP pages, request 10 needs 5
    tight = [RankMeta(m.layout, m.requests, np.r_[np.ones(6, bool), np.zeros(34, bool)]) for m in metas]
    refused = caches[0].plan(tight, "ep")
    assert "capacity" in refused.refused and refused.moves.size == 0


def test_metadata_round_trip_and_unit_order():
    cache = _cache(4, 1)
    cache.add_request(7, 30)
    cache.reserve(7, 9)
    data = cache.encode_meta()
    meta = cache.decode_meta(data)
    assert meta.requests == {7: KVRequest(9, 30, cache.requests[7].pages)}
    assert (meta.free == cache.free).all() and meta.layout == "ep"
    free = np.array([1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0], dtype=bool)
    assert unit_order(free, 4).tolist() == [10, 5, 6, 7, 0, 1, 2, 3]
