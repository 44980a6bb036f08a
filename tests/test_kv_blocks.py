"""KV moves' copy blocks (`kv_cache.move_blocks`, `packed_blocks`): one block a head of a move, with a row per (layer,
K/V) plane, copy exactly the bytes the first version's blocks did (one per move and plane,
tests/kv_plan_reference.py), through the native bounds-checked `copy_blocks`; and far fewer of them."""
import zlib

import numpy as np
import pytest
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, move_blocks, packed_blocks
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
