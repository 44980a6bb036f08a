"""KV moves' copy blocks (`kv_cache.move_blocks`, `packed_blocks`): one block a head of a move, with a row per (layer,
K/V) plane, copy exactly the bytes the first version's blocks did (one per move and plane,
tests/kv_plan_reference.py), through the native bounds-checked `copy_blocks`; and far fewer of them."""
import zlib

import numpy as np
import pytest
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, move_blocks, packed_blocks, peer_blocks
from tests.kv_plan_reference import reference_move_blocks, reference_packed_blocks


class _Cache:
    """A cache's shape: what the block builders and the reference read (no Buffer, no memory)."""

    def __init__(self, layers: int, heads_per_unit: int, head_dim: int, page_size: int, units: int):
        self.num_ranks = 2
        self.config = KVCacheConfig(layers, heads_per_unit * self.num_ranks, head_dim, page_size, units)
        self.heads_per_unit = heads_per_unit
        self.unit_bytes = heads_per_unit * page_size * head_dim * 2

    def move_blocks(self, moves, src_base, dst_base):
        return move_blocks(self.config, self.num_ranks, moves, src_base, dst_base)

    def packed_blocks(self, moves, pool_base, packed_base, pack):
        return packed_blocks(self.config, self.num_ranks, moves, pool_base, packed_base, pack)


def _moves(rng, cache, count: int, full_share: float) -> np.ndarray:
    """`count` moves between distinct random units; a share of full pages, the rest 0..page_size - 1 tokens."""
    units = cache.config.num_units
    page = cache.config.page_size
    moves = np.zeros((count, 5), dtype=np.int64)
    moves[:, 1] = rng.choice(units, count, replace=False)
    moves[:, 3] = rng.choice(units, count, replace=False)
    full = rng.random(count) < full_share
    moves[:, 4] = np.where(full, page, rng.integers(0, page, count))
    return moves


def _copy(blocks: np.ndarray, dst: torch.Tensor, src: torch.Tensor) -> int:
    blocks = np.ascontiguousarray(blocks, dtype=np.int64)
    lo_d, lo_s = dst.data_ptr(), src.data_ptr()
    _native.copy_blocks(blocks.ctypes.data, blocks.shape[0], lo_d, lo_d + dst.numel(), lo_s, lo_s + src.numel())
    return int((blocks[:, 2] * blocks[:, 3]).sum()) if blocks.size else 0


SHAPES = [  # layers, heads per unit, head_dim, page_size, units
    (1, 1, 8, 1, 8), (2, 1, 8, 4, 16), (3, 2, 16, 4, 16), (2, 4, 8, 16, 32), (5, 3, 8, 2, 24), (4, 2, 64, 16, 12)]


@pytest.mark.parametrize("full_share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}h{}D{}p{}u{}".format(*s))
def test_move_blocks_copy_what_the_first_version_did(shape, full_share):
    rng = np.random.default_rng(zlib.crc32(repr((shape, full_share)).encode()))
    cache = _Cache(*shape)
    pool = cache.config.num_layers * 2 * cache.config.num_units * cache.unit_bytes
    src = torch.from_numpy(rng.integers(0, 256, pool, dtype=np.uint8))
    want, got = torch.zeros(pool, dtype=torch.uint8), torch.zeros(pool, dtype=torch.uint8)
    moves = _moves(rng, cache, cache.config.num_units // 2, full_share)
    old = reference_move_blocks(cache, moves, src.data_ptr(), want.data_ptr())
    new = cache.move_blocks(moves, src.data_ptr(), got.data_ptr())
    assert _copy(new, got, src) == _copy(old, want, src)
    assert torch.equal(got, want)
    assert new.shape[0] == moves.shape[0] * cache.heads_per_unit  # vs moves x L x 2 before


@pytest.mark.parametrize("full_share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}h{}D{}p{}u{}".format(*s))
def test_packed_blocks_pack_and_unpack_what_the_first_version_did(shape, full_share):
    rng = np.random.default_rng(zlib.crc32(repr((shape, full_share, "packed")).encode()))
    cache = _Cache(*shape)
    pool_bytes = cache.config.num_layers * 2 * cache.config.num_units * cache.unit_bytes
    pool = torch.from_numpy(rng.integers(0, 256, pool_bytes, dtype=np.uint8))
    moves = _moves(rng, cache, cache.config.num_units // 2, full_share)
    want, got = torch.zeros(pool_bytes, dtype=torch.uint8), torch.zeros(pool_bytes, dtype=torch.uint8)
    old, old_size = reference_packed_blocks(cache, moves, pool.data_ptr(), want.data_ptr(), True)
    new, new_size = cache.packed_blocks(moves, pool.data_ptr(), got.data_ptr(), True)
    assert new_size == old_size and _copy(new, got, pool) == _copy(old, want, pool) == old_size
    assert torch.equal(got, want)
    # Unpack that packed buffer into two zeroed pools.
    unpacked_want, unpacked_got = torch.zeros_like(pool), torch.zeros_like(pool)
    old, _ = reference_packed_blocks(cache, moves, unpacked_want.data_ptr(), want.data_ptr(), False)
    new, _ = cache.packed_blocks(moves, unpacked_got.data_ptr(), want.data_ptr(), False)
    assert _copy(new, unpacked_got, want) == _copy(old, unpacked_want, want)
    assert torch.equal(unpacked_got, unpacked_want)


def test_a_deep_model_gets_a_block_a_head():
    """61 layers, 2 heads a unit: a move is 2 blocks of 122 rows (was 122 blocks of 2 rows)."""
    cache = _Cache(61, 2, 8, 4, 8)
    moves = np.array([[0, 1, 1, 5, 4], [0, 2, 1, 6, 3]], dtype=np.int64)
    blocks = cache.move_blocks(moves, 0, 0)
    assert blocks.shape[0] == 2 * 2 and (blocks[:, 2] == 122).all()
    assert reference_move_blocks(cache, moves, 0, 0).shape[0] == 2 * 122


@pytest.mark.parametrize("column,value", [(1, -1), (1, 8), (3, 8), (4, -1), (4, 5)],
                         ids=["src_unit_low", "src_unit_high", "dst_unit_high", "tokens_low", "tokens_high"])
def test_moves_outside_the_cache_are_refused(column, value):
    """A block is a whole plane's rows: a move's fill past its page (or a unit past the pool) would write into other
    units, still inside the region's bounds the native copy checks. The builders refuse it first."""
    cache = _Cache(2, 2, 8, 4, 8)
    moves = np.array([[0, 1, 1, 5, 4], [0, 2, 1, 6, 3]], dtype=np.int64)
    moves[1, column] = value
    with pytest.raises(ValueError, match="moves: expected units in"):
        cache.move_blocks(moves, 0, 0)
    with pytest.raises(ValueError, match="moves: expected units in"):
        cache.packed_blocks(moves, 0, 0, True)


def test_int32_moves_give_the_same_blocks():
    cache = _Cache(3, 2, 8, 4, 8)
    moves = np.array([[0, 1, 1, 5, 4], [0, 2, 1, 6, 3]], dtype=np.int64)
    want = cache.move_blocks(moves, 1 << 40, 1 << 41)
    assert np.array_equal(cache.move_blocks(moves.astype(np.int32), 1 << 40, 1 << 41), want)


# ------------------------------------------------------------------------------------------------
# peer_blocks: every peer's blocks of a plan in one native pass
# ------------------------------------------------------------------------------------------------

def _plan_moves(rng, num_ranks: int, units: int, page: int, count: int) -> np.ndarray:
    """`count` moves between random ranks and units (a plan's rows, unsorted), random fills 0..page."""
    moves = np.zeros((count, 5), dtype=np.int64)
    moves[:, 0], moves[:, 2] = rng.integers(0, num_ranks, count), rng.integers(0, num_ranks, count)
    moves[:, 1], moves[:, 3] = rng.integers(0, units, count), rng.integers(0, units, count)
    moves[:, 4] = rng.integers(0, page + 1, count)
    return moves


@pytest.mark.parametrize("sending", [True, False], ids=["sends", "receives"])
@pytest.mark.parametrize("num_ranks,heads_per_unit", [(1, 2), (2, 1), (3, 2), (4, 1), (8, 2)])
def test_peer_blocks_are_each_peers_move_blocks_in_order(num_ranks, heads_per_unit, sending):
    """`peer_blocks` equals, peer after peer in the order given, `move_blocks` of the rows a filter on (rank, peer)
    selects, in plan order, with each side's pool base; peers left out (a dead rank) get nothing."""
    rng = np.random.default_rng(num_ranks * 10 + heads_per_unit + 100 * sending)
    config = KVCacheConfig(3, heads_per_unit * num_ranks, 16, 4, 32)
    moves = _plan_moves(rng, num_ranks, config.num_units, config.page_size, 300)
    bases = [(r + 1) << 40 for r in range(num_ranks)]
    mine, other = (0, 2) if sending else (2, 0)
    for rank in range(num_ranks):
        order = [(rank + step) % num_ranks for step in range(num_ranks)]
        for peers in (order, order[::-1][:max(1, num_ranks - 2)], []):
            blocks, bounds = peer_blocks(config, num_ranks, moves, rank, peers, bases, sending)
            assert len(bounds) == len(peers) + 1 and bounds[0] == 0 and bounds[-1] == blocks.shape[0]
            for i, peer in enumerate(peers):
                rows = moves[(moves[:, mine] == rank) & (moves[:, other] == peer)]
                src, dst = (rank, peer) if sending else (peer, rank)
                want = move_blocks(config, num_ranks, rows, bases[src], bases[dst])
                assert np.array_equal(blocks[bounds[i]:bounds[i + 1]], want), (rank, peers, peer)


def test_peer_blocks_copy_what_move_blocks_do():
    """Through the native copy: the blocks of rank 0's sends to itself and to rank 1 move the same bytes as the
    per-peer `move_blocks` into a second pair of pools."""
    rng = np.random.default_rng(5)
    config = KVCacheConfig(2, 4, 8, 4, 16)
    units = rng.permutation(16)
    moves = np.array([[0, units[i], i % 2, units[15 - i], int(rng.integers(0, 5))] for i in range(8)], dtype=np.int64)
    unit = (config.num_kv_heads // 2) * config.page_size * config.head_dim * 2
    pool = config.num_layers * 2 * config.num_units * unit
    src = torch.from_numpy(rng.integers(0, 256, pool, dtype=np.uint8))
    got = [torch.zeros(pool, dtype=torch.uint8) for _ in range(2)]
    want = [torch.zeros(pool, dtype=torch.uint8) for _ in range(2)]
    blocks, bounds = peer_blocks(config, 2, moves, 0, [0, 1], [src.data_ptr(), got[1].data_ptr()], True)
    # rank 0's own moves copy within its pool: aim them at got[0] instead (same offsets)
    own = blocks[bounds[0]:bounds[1]].copy()
    own[:, 0] += got[0].data_ptr() - src.data_ptr()
    assert _copy(own, got[0], src) + _copy(blocks[bounds[1]:bounds[2]], got[1], src) == int(
        (blocks[:, 2] * blocks[:, 3]).sum())
    for peer in (0, 1):
        rows = moves[moves[:, 2] == peer]
        _copy(move_blocks(config, 2, rows, src.data_ptr(), want[peer].data_ptr()), want[peer], src)
        assert torch.equal(got[peer], want[peer])


@pytest.mark.parametrize("column,value,match", [
    (1, -1, "moves: expected units in"), (3, 16, "moves: expected units in"), (4, 5, "moves: expected units in"),
    (4, -1, "moves: expected units in"), (2, 2, "names rank 2, outside"), (2, -1, "names rank -1, outside")])
def test_peer_blocks_refuse_a_bad_move(column, value, match):
    """A move `rank` sends with a unit outside the pool, a fill past its page or a peer outside the group is refused
    (ValueError), as by `move_blocks`; a bad move of another rank's is not read."""
    config = KVCacheConfig(2, 4, 8, 4, 16)
    moves = np.array([[0, 1, 1, 5, 4], [0, 2, 1, 6, 3], [1, 3, 0, 7, 2]], dtype=np.int64)
    bad = moves.copy()
    bad[1, column] = value
    with pytest.raises(ValueError, match=match):
        peer_blocks(config, 2, bad, 0, [0, 1], [1 << 40, 1 << 41], True)
    if column != 2:  # the other rank's moves are never read
        other = moves.copy()
        other[2, column] = value
        blocks, _ = peer_blocks(config, 2, other, 0, [0, 1], [1 << 40, 1 << 41], True)
        assert blocks.shape[0] == 2 * 2


@pytest.mark.parametrize("peers,rank,match", [([0, 0], 0, "peers must be distinct"), ([0, 2], 0, "peers must be"),
                                              ([-1], 0, "peers must be"), ([0], 2, "rank 2 must be in")])
def test_peer_blocks_refuse_bad_peers_and_ranks(peers, rank, match):
    """Peers named twice or outside the group, and a rank outside it, are refused before anything is read."""
    config = KVCacheConfig(2, 4, 8, 4, 16)
    moves = np.array([[0, 1, 1, 5, 4]], dtype=np.int64)
    with pytest.raises(ValueError, match=match):
        peer_blocks(config, 2, moves, rank, peers, [1 << 40, 1 << 41], True)


def test_peer_blocks_take_int32_and_empty_plans():
    """An int32 plan gives the int64 plan's blocks; an empty plan gives no blocks and every bound 0."""
    config = KVCacheConfig(2, 4, 8, 4, 16)
    moves = np.array([[0, 1, 1, 5, 4], [0, 2, 0, 6, 3]], dtype=np.int64)
    want = peer_blocks(config, 2, moves, 0, [1, 0], [1 << 40, 1 << 41], True)
    got = peer_blocks(config, 2, moves.astype(np.int32), 0, [1, 0], [1 << 40, 1 << 41], True)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1] == [0, 2, 4]
    blocks, bounds = peer_blocks(config, 2, np.zeros((0, 5), dtype=np.int64), 0, [0, 1], [1 << 40, 1 << 41], True)
    assert blocks.shape == (0, 6) and bounds == [0, 0, 0]


@pytest.mark.parametrize("geometry,match", [
    ([16, 4096, 4, 1024, 4, 128, 4, 16 * 4096], "not one pool's"),       # head_bytes != page_size * token_bytes
    ([16, 4096, 2, 1024, 4, 256, 4, 16 * 4096], "not one pool's"),       # unit_bytes != heads * head_bytes
    ([16, 4096, 4, 1024, 4, 256, 4, 15 * 4096], "not one pool's"),       # plane_bytes != num_units * unit_bytes
    ([16, 1 << 62, 1 << 52, 1024, 4, 256, 4, 1 << 62], "not one pool's"),  # heads * head_bytes overflows
    ([16, 4096, 4, 1024, 4, 256, 0, 16 * 4096], "must be positive")])
def test_the_native_pass_refuses_a_geometry_that_is_not_one_pools(geometry, match):
    """`_native.kv_peer_blocks` checks its geometry (its products without overflow) and the table's capacity before
    it writes anything: neither the table nor the bounds change on a refusal."""
    moves = np.array([[0, 1, 1, 5, 4], [0, 2, 0, 6, 3]], dtype=np.int64)
    out, bounds = np.full((8, 6), -7, dtype=np.int64), np.full(3, -7, dtype=np.int64)
    args = (moves.ctypes.data, 2, 0, 2, [0, 1], [1 << 40, 1 << 41])
    with pytest.raises(ValueError, match=match):
        _native.kv_peer_blocks(*args, geometry, out.ctypes.data, 8, bounds.ctypes.data, sending=True)
    good = [16, 2 * 1024, 2, 1024, 4, 256, 4, 16 * 2048]
    with pytest.raises(ValueError, match="4 blocks do not fit the table's 3"):
        _native.kv_peer_blocks(*args, good, out.ctypes.data, 3, bounds.ctypes.data, sending=True)
    assert (out == -7).all() and (bounds == -7).all()
    assert _native.kv_peer_blocks(*args, good, out.ctypes.data, 8, bounds.ctypes.data, sending=True) == 4
    assert bounds.tolist() == [0, 2, 4]
