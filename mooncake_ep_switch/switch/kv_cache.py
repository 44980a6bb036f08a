"""Paged KV cache that lives in either layout, and its redistribution plans (Moebius algorithms 3, 4).

Memory. Every rank has a pool of `num_units` *units* per layer for K and for V; a unit holds
`H_kv/P` heads of one page, head-major: `[H_kv/P, page_size, D]` bf16. The pool is

    pool [L][2 (K, V)][num_units][H_kv/P][page_size][D]      (one region per rank)

- EP: a page is P consecutive units aligned to P (EP page k = units [kP, (k+1)P)), i.e. the usual
  head-major page `[H_kv, page_size, D]` with head group g in unit kP+g. The owner rank keeps all
  heads of its own requests.
- TP: a page is one unit; rank r keeps head group r (heads [rH_kv/P, (r+1)H_kv/P)) of every request.

So both layouts are made of the same units and a switch only moves whole units (of which only the
filled token rows are copied) between ranks; page tables are rewritten, page contents are not.

Requests have one page table for all layers (vLLM style), a token count and a prompt length (a
request with `num_tokens < prompt_len` is mid-prefill: its remaining prompt tokens will be written
after the switch). Prefix sharing: `fork()` makes a request share full pages of another; pages
carry reference counts, a shared page is moved once for all its users and stays shared after the
switch. The last page of a request may be partially filled; only its filled rows move.

Redistribution plans (computed identically on every rank from every rank's published metadata):

- EP -> TP (algorithm 3): every page of owner o sends head group g to rank g (g != o; the owner keeps
  its own group in place). Capacity: rank g needs one free unit per page owned by the others.
- TP -> EP (algorithm 4): requests that share pages form a family (moved together, shared pages
  once); families are assigned longest-first (by distinct pages) to the least-loaded rank that
  has room, and every rank sends its head group of their pages there. Capacity: the owner needs
  one free aligned group of P units per page.

A plan never writes into a unit that is in use: sources stay intact until every rank committed
(copy, then free). That makes the capacity check conservative (targets must fit next to the
sources), and it is what lets survivors of a failure finish a move from a dead rank's memory.
"""
import itertools
from collections import Counter
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer import peer_regions
from mooncake_ep_switch.buffer.device_region import new_region
from mooncake_ep_switch.switch.kv_alloc import cdiv, alloc_group, alloc_unit
from mooncake_ep_switch.switch.kv_meta import KVRequest, RankMeta, decode_meta, encode_meta
from mooncake_ep_switch.switch.kv_plan import KVPlan, Planner
from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.layouts import EP, LAYOUTS

_META_HEADER = 64           # bytes before the metadata payload (length word + padding)


class KVCacheConfig(NamedTuple):
    """Shape of a paged KV cache (the same on every rank).

    Fields:
        num_layers: attention layers `L`.
        num_kv_heads: `H_kv`, a multiple of the number of ranks.
        head_dim: `D`.
        page_size: tokens per page.
        num_units: units per rank and layer (one unit = `H_kv/P` heads of one page), a multiple of
            the number of ranks. Capacity: `num_units` TP pages or `num_units/P` EP pages.
        metadata_bytes: bytes reserved for the switch's metadata exchange (page tables); 0 picks
            `65536 + 40 * num_units`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_units: int
    metadata_bytes: int = 0


KIND = "paged_kv_cache"  # participant kind in the Buffer's peer regions


class PagedKVCache:
    """A paged K/V cache per layer whose pages can be redistributed between the EP and TP layouts.

    Collective at construction (every rank of `buffer.group` builds one with the same config).

    Arguments:
        buffer: a `mooncake_ep_switch.Buffer` (group, rank, size, transport are used).
        config: a `KVCacheConfig`.
        layout: `"ep"` or `"tp"`, the starting layout (the same as the weights').
        prefault: populate page tables of every rank's pool now (else on first touch).
    """

    def __init__(self, buffer, config: KVCacheConfig, layout: str = EP, *, prefault: bool = False):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config: expected a KVCacheConfig, got {type(config).__name__}")
        ranks = buffer.num_ranks
        check_int("config.num_layers", config.num_layers, 1)
        heads = check_int("config.num_kv_heads", config.num_kv_heads, 1)
        check_int("config.head_dim", config.head_dim, 1)
        check_int("config.page_size", config.page_size, 1)
        units = check_int("config.num_units", config.num_units, 1)
        check_int("config.metadata_bytes", config.metadata_bytes, 0)
        if heads % ranks:
            raise ValueError(f"config.num_kv_heads: expected a multiple of num_ranks={ranks}, got {heads}")
        if units % ranks:
            raise ValueError(f"config.num_units: expected a multiple of num_ranks={ranks}, got {units}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        joined = peer_regions.joined_state(buffer, KIND)  # a replacement starts empty in the members' layout
        self.config = config
        self.group = peer_regions.group_of(buffer)
        self.rank = buffer.rank
        self.num_ranks = ranks
        self.transport = buffer.transport
        self.layout = layout if joined is None else joined["layout"]
        self.heads_per_unit = _heads_per_unit(config, ranks)
        self.unit_bytes = _unit_bytes(config, ranks)
        meta = config.metadata_bytes or 65536 + 40 * units
        self.meta_bytes = (meta + _META_HEADER + 4095) // 4096 * 4096
        self.pool_bytes = config.num_layers * 2 * units * self.unit_bytes
        self.region_bytes = self.meta_bytes + self.pool_bytes
        self.requests: Dict[int, KVRequest] = {}
        self.refcount: Dict[int, int] = {}
        self.free = np.ones(units, dtype=bool)
        self.region = None  # a SharedRegion, or a DeviceRegion on the "cuda" transport
        self._private: Optional[torch.Tensor] = None
        if peer_regions.one_sided(buffer):
            device = peer_regions.memory_device(buffer)
            self.region = new_region(self.group, self.rank, ranks, self.region_bytes, device)
            self.local = self.region.local
        else:
            self._private = torch.zeros(self.region_bytes, dtype=torch.uint8)
            self.local = self._private
        self._registry = getattr(buffer, "peer_regions", None)
        peer_regions.register(buffer, self, KIND)
        if self.region is not None and not self.region.is_device and prefault:
            for peer in range(ranks):
                if self.region.peer_bases[peer]:
                    _native.prefault(self.region.peer_bases[peer], self.region_bytes)
        self.pool = self.local[self.meta_bytes:].view(torch.bfloat16).view(
            config.num_layers, 2, units, self.heads_per_unit, config.page_size, config.head_dim)

    # ------------------------------------------------------------------ geometry
    def pool_base(self, rank: Optional[int] = None) -> int:
        """Address (as mapped here) of `rank`'s pool (default this rank's).

        Arguments:
            rank: rank in [0, P), or None for this rank (a peer needs the one-sided transport).

        Returns:
            address: int, first byte of the pool (just after the metadata area).
        """
        if rank is None or rank == self.rank:
            return self.local.data_ptr() + self.meta_bytes
        return self.region.peer_bases[rank] + self.meta_bytes

    def region_range(self, rank: Optional[int] = None) -> Tuple[int, int]:
        """[start, end) addresses of `rank`'s whole region as mapped here.

        Arguments:
            rank: rank in [0, P), or None for this rank (a peer needs the one-sided transport).

        Returns:
            start: int, address of the region's first byte (the metadata area).
            end: int, `start + region_bytes`.
        """
        start = self.local.data_ptr() if rank is None or rank == self.rank else self.region.peer_bases[rank]
        return start, start + self.region_bytes

    def head_groups(self) -> List[int]:
        """Head groups (units of `H_kv/P` heads) stored here: all in EP, this rank's in TP.

        Returns:
            groups: list of int, ascending: `[0, P)` in EP, `[rank]` in TP.
        """
        return list(range(self.num_ranks)) if self.layout == EP else [self.rank]

    def num_heads_here(self) -> int:
        """KV heads stored per request here: `H_kv` in EP, `H_kv/P` in TP.

        Returns:
            heads: int.
        """
        return len(self.head_groups()) * self.heads_per_unit

    def units_of(self, rid: int, group: int) -> List[int]:
        """Units holding head group `group` of every page of request `rid`, in page order.

        Arguments:
            rid: a request id on this rank (KeyError otherwise).
            group: head group, one of `head_groups()` (ValueError otherwise).

        Returns:
            units: list of int unit indices in [0, num_units), one per page of the request.
        """
        req = self._request(rid)
        if group not in self.head_groups():
            raise ValueError(f"group: head group {group} is not stored on rank {self.rank} in layout "
                             f"{self.layout!r} (stored: {self.head_groups()})")
        if self.layout == EP:
            return [page * self.num_ranks + group for page in req.pages]
        return list(req.pages)

    def _request(self, rid: int) -> KVRequest:
        try:
            return self.requests[rid]
        except KeyError:
            raise KeyError(f"rid: request {rid} is not on rank {self.rank} (layout {self.layout!r})") from None

    def _page_units(self, page: int) -> List[int]:
        return list(range(page * self.num_ranks, (page + 1) * self.num_ranks)) if self.layout == EP else [page]

    def _alloc_page(self) -> int:
        page = alloc_group(self.free, self.num_ranks) if self.layout == EP else alloc_unit(self.free, self.num_ranks)
        if page < 0:
            raise MemoryError(f"PagedKVCache: no free {'EP page' if self.layout == EP else 'unit'} on rank "
                              f"{self.rank} (config.num_units={self.config.num_units})")
        self.refcount[page] = 1
        return page

    def _release_page(self, page: int) -> None:
        count = self.refcount[page] - 1
        if count:
            self.refcount[page] = count
            return
        del self.refcount[page]
        self.free[self._page_units(page)] = True

    # ------------------------------------------------------------------ request life cycle
    def add_request(self, rid: int, prompt_len: int) -> None:
        """Register an empty request (EP: on its owner only; TP: on every rank).

        Arguments:
            rid: request id, unique in the group.
            prompt_len: prompt length in tokens (>= 0).
        """
        rid = check_int("rid", rid, 0)
        prompt_len = check_int("prompt_len", prompt_len, 0)
        if rid in self.requests:
            raise ValueError(f"rid: request {rid} already exists on rank {self.rank}")
        self.requests[rid] = KVRequest(0, prompt_len, ())

    def fork(self, parent: int, child: int, num_tokens: int, prompt_len: int) -> None:
        """Create `child` sharing the first `num_tokens` tokens (whole pages) of `parent`'s KV.

        Arguments:
            parent: an existing request id.
            child: a new request id.
            num_tokens: shared prefix length, a multiple of `page_size`, <= the parent's tokens.
            prompt_len: the child's prompt length (>= num_tokens).
        """
        req = self._request(parent)
        page_size = self.config.page_size
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens % page_size or num_tokens > req.num_tokens:
            raise ValueError(f"num_tokens: expected a multiple of page_size={page_size} and <= "
                             f"{req.num_tokens} (the parent's tokens), got {num_tokens}")
        if prompt_len < num_tokens:
            raise ValueError(f"prompt_len: expected >= num_tokens={num_tokens}, got {prompt_len}")
        if child in self.requests:
            raise ValueError(f"child: request {child} already exists on rank {self.rank}")
        pages = req.pages[:num_tokens // page_size]
        for page in pages:
            self.refcount[page] += 1
        self.requests[child] = KVRequest(num_tokens, prompt_len, pages)

    def reserve(self, rid: int, num_new: int) -> int:
        """Make room for `num_new` more tokens of `rid` (allocating pages); returns their first position.

        Arguments:
            rid: an existing request id.
            num_new: tokens to add (>= 0).

        Returns:
            start: position of the first new token.
        """
        req = self._request(rid)
        num_new = check_int("num_new", num_new, 0)
        start = req.num_tokens
        total = start + num_new
        pages = list(req.pages)
        if start % self.config.page_size and pages and self.refcount[pages[-1]] > 1:
            raise ValueError(f"rid: request {rid}'s last page is shared and partially filled; "
                             "copy-on-write is not supported")
        need = cdiv(total, self.config.page_size) - len(pages)
        new_pages = []
        try:
            for _ in range(need):
                new_pages.append(self._alloc_page())
        except MemoryError:
            for page in new_pages:
                self._release_page(page)
            raise
        self.requests[rid] = KVRequest(total, req.prompt_len, tuple(pages + new_pages))
        return start

    def free_request(self, rid: int) -> None:
        """Drop a request; pages whose reference count reaches 0 become free.

        Arguments:
            rid: a request id on this rank (KeyError otherwise).
        """
        req = self._request(rid)
        for page in req.pages:
            self._release_page(page)
        del self.requests[rid]

    def _slots(self, rid: int, start: int, count: int):
        req = self._request(rid)
        if start < 0 or start + count > req.num_tokens:
            raise ValueError(f"start: positions [{start}, {start + count}) are outside request {rid}'s "
                             f"{req.num_tokens} reserved tokens")
        positions = torch.arange(start, start + count)
        pages = torch.tensor(req.pages, dtype=torch.int64)[positions // self.config.page_size]
        return pages, positions % self.config.page_size

    def write(self, rid: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of tokens `[start, start + n)` of `rid` for one layer (positions already reserved).

        Arguments:
            rid: request id.
            layer: attention layer in [0, L).
            start: first position.
            k: `[n, heads_here, D]` torch.bfloat16, heads_here = `num_heads_here()` (the heads of
                `head_groups()`, ascending).
            v: same as `k`.
        """
        heads = self.num_heads_here()
        shape = (k.size(0), heads, self.config.head_dim)
        for name, tensor in (("k", k), ("v", v)):
            if tensor.dim() != 3 or tuple(tensor.shape) != shape or tensor.dtype != torch.bfloat16:
                raise ValueError(f"{name}: expected a {list(shape)} torch.bfloat16 tensor, got "
                                 f"{list(tensor.shape)} {tensor.dtype}")
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.config.num_layers}), got {layer}")
        pages, offsets = self._slots(rid, start, k.size(0))
        shared = [p for p in set(pages.tolist()) if self.refcount[p] > 1]
        if shared:
            raise ValueError(f"start: request {rid} would write into shared page(s) {sorted(shared)}")
        hg = self.heads_per_unit
        device = self.pool.device  # the pool's (a CUDA device on the "cuda" transport)
        pages, offsets, k, v = pages.to(device), offsets.to(device), k.to(device), v.to(device)
        for index, group in enumerate(self.head_groups()):
            units = pages * self.num_ranks + group if self.layout == EP else pages
            heads_slice = slice(index * hg, (index + 1) * hg)
            self.pool[layer, 0][units, :, offsets, :] = k[:, heads_slice]
            self.pool[layer, 1][units, :, offsets, :] = v[:, heads_slice]

    def gather(self, rid: int, layer: int, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of one head group of a request, dense.

        Arguments:
            rid: request id.
            layer: attention layer.
            group: head group (heads `[group*H_kv/P, (group+1)*H_kv/P)`), one of `head_groups()`.

        Returns:
            k: `[H_kv/P, num_tokens, D]` torch.bfloat16.
            v: same.
        """
        units = torch.tensor(self.units_of(rid, group), dtype=torch.int64).to(self.pool.device)
        n = self.requests[rid].num_tokens
        hg, dim = self.heads_per_unit, self.config.head_dim

        def dense(kv: int) -> torch.Tensor:
            blocks = self.pool[layer, kv].index_select(0, units)  # [pages, hg, page_size, D]
            return blocks.permute(1, 0, 2, 3).reshape(hg, -1, dim)[:, :n]

        return dense(0), dense(1)

    # ------------------------------------------------------------------ switch metadata
    def used_units(self) -> int:
        """Units in use on this rank.

        Returns:
            count: int, units not free (of `num_units`; a shared page counts once, an EP page as P).
        """
        return int((~self.free).sum())

    def snapshot(self) -> RankMeta:
        """This rank's state as published for a switch.

        Returns:
            meta: a `RankMeta`: the current layout, a shallow copy of the requests and a copy of the
                free-unit bitmap (`[num_units]` np.bool_).
        """
        return RankMeta(self.layout, dict(self.requests), self.free.copy())

    def encode_meta(self) -> np.ndarray:
        """This rank's `RankMeta` as one int64 array (`kv_meta.encode_meta` of `snapshot()`).

        Returns:
            data: `[n]` np.int64 (format at `kv_meta.encode_meta`).
        """
        return encode_meta(self.snapshot(), self.config)

    def decode_meta(self, data: np.ndarray) -> RankMeta:
        """A peer's published `RankMeta`, validated against this cache (`kv_meta.decode_meta`).

        Arguments:
            data: `[n]` integer array as `encode_meta()` makes it.

        Returns:
            meta: a `RankMeta` (ValueError "metadata: ..." on anything malformed).
        """
        return decode_meta(data, self.config, self.num_ranks)

    def publish_meta(self) -> int:
        """Write `encode_meta()` into this rank's metadata area (one-sided transport); returns its bytes.

        Returns:
            nbytes: int, size of the encoded metadata (`8 * encode_meta().size`), also stored in the
                area's first 8 bytes; raises ValueError if it does not fit in the metadata area.
        """
        data = self.encode_meta()
        nbytes = data.size * 8
        if nbytes > self.meta_bytes - _META_HEADER:
            raise ValueError(f"config.metadata_bytes: the page tables need {nbytes} bytes, the metadata area "
                             f"holds {self.meta_bytes - _META_HEADER}; raise config.metadata_bytes")
        self.local[_META_HEADER:_META_HEADER + nbytes].copy_(torch.from_numpy(data.view(np.uint8)))
        self.local[:8].view(torch.int64)[0] = nbytes
        return nbytes

    def read_meta(self, rank: int) -> RankMeta:
        """Read the metadata `rank` published (after its entry signal was observed).

        Arguments:
            rank: rank in [0, P); this rank's is read locally, a peer's through shared memory.

        Returns:
            meta: a `RankMeta` (raises ValueError on a bad length or unreadable metadata).
        """
        region = self.local if rank == self.rank else self.region.peer(rank)
        nbytes = int(region[:8].view(torch.int64)[0])
        if nbytes <= 0 or nbytes > self.meta_bytes - _META_HEADER or nbytes % 8:
            raise ValueError(f"metadata: rank {rank} published a metadata length of {nbytes} bytes")
        raw = region[_META_HEADER:_META_HEADER + nbytes].to("cpu", copy=True).numpy().view(np.int64)
        try:
            return self.decode_meta(raw)
        except ValueError as error:
            raise ValueError(f"rank {rank}'s {error}") from None
        except Exception as error:  # a torn or foreign blob: report it like any bad metadata
            raise ValueError(f"metadata: rank {rank} published unreadable KV metadata ({error!r})") from None

    # ------------------------------------------------------------------ plans
    def plan(self, metas: Sequence[RankMeta], target: str) -> KVPlan:
        """This rank's `kv_plan.Planner.plan(metas, target)` (arguments and result documented there)."""
        return Planner(self.config, self.num_ranks, self.rank, self.layout).plan(metas, target)

    def move_blocks(self, moves: np.ndarray, src_base: int, dst_base: int) -> np.ndarray:
        """Copy blocks for `moves` between two pools (as mapped here): every layer, K and V, the filled token
        rows of each head (the module's `move_blocks` for this cache: a block a head, a row per plane).

        Arguments:
            moves: `[M, 5]` np.int64 (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
            src_base: address of the source rank's pool.
            dst_base: address of the destination rank's pool.

        Returns:
            blocks: `[M * H_kv/P, 6]` np.int64 for `copy_blocks`.
        """
        return move_blocks(self.config, self.num_ranks, moves, src_base, dst_base)

    def peer_blocks(self, moves: np.ndarray, peers: Sequence[int], sending: bool) -> Tuple[np.ndarray, List[int]]:
        """Copy blocks for the moves this rank sends to (or receives from) each of `peers`, grouped by peer in
        that order, between the pools as mapped here (the module's `peer_blocks` for this cache).

        Arguments:
            moves: a plan's `[M, 5]` np.int64 moves (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
            peers: distinct ranks (this one too, for its own moves); their pools must be mapped here.
            sending: True: the moves from this rank, False: those to it.

        Returns:
            blocks: `[n, 6]` np.int64 for `copy_blocks`.
            bounds: `len(peers) + 1` ints, peer i's blocks `blocks[bounds[i]:bounds[i + 1]]`.

        Raises:
            ValueError: as the module's `peer_blocks` (a bad move or peer); nothing is built.
        """
        wanted = set(peers) | {self.rank}
        bases = [self.pool_base(rank) if rank in wanted else 0 for rank in range(self.num_ranks)]
        return peer_blocks(self.config, self.num_ranks, moves, self.rank, peers, bases, sending)

    def packed_blocks(self, moves: np.ndarray, pool_base: int, packed_base: int, pack: bool) -> Tuple[np.ndarray, int]:
        """Blocks packing `moves` from this rank's pool into a contiguous buffer (or unpacking them); the packed
        form of a move is `[L][2][H_kv/P][filled][D]`, moves one after another (the module's `packed_blocks`).

        Arguments:
            moves: `[M, 5]` np.int64 (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
            pool_base: address of this rank's pool as mapped here (see `pool_base()`).
            packed_base: address of the contiguous packed buffer.
            pack: True: pool -> packed, reading unit `src_unit`; False: packed -> pool, writing unit `dst_unit`.

        Returns:
            blocks: `[M * H_kv/P, 6]` np.int64 for `copy_blocks`.
            nbytes: int, packed size in bytes (0 when `moves` is empty).
        """
        return packed_blocks(self.config, self.num_ranks, moves, pool_base, packed_base, pack)

    def commit(self, plan: KVPlan) -> None:
        """Adopt a plan's new state on this rank (after every move into this rank is done).

        Arguments:
            plan: a `KVPlan` from `plan()` that was not refused (its `new_free` is not None); sets the
                layout to `plan.target` and the requests, reference counts and free units to its own.
        """
        self.layout = plan.target
        self.requests = dict(plan.new_requests)
        self.refcount = dict(Counter(itertools.chain.from_iterable(req.pages for req in self.requests.values())))
        self.free = plan.new_free.copy()

    def memory_bytes(self) -> int:
        """Bytes of this rank's region (metadata area + pool).

        Returns:
            nbytes: int, `region_bytes` (metadata area rounded up to 4096 bytes, plus the pool).
        """
        return self.region_bytes

    # ------------------------------------------------------------------ membership (peer_regions.Participant)
    def shared_regions(self) -> list:
        """The region peers move pages into (none on the collective transport).

        Returns:
            regions: list of `SharedRegion`.
        """
        return [] if self.region is None else [self.region]

    def peer_state(self) -> dict:
        """What a replacement of this rank takes over (its cache starts empty).

        Returns:
            state: dict with `"layout"` (str).
        """
        return {"layout": self.layout}

    def readmitted(self, ranks) -> None:
        """Nothing to forget here: requests whose pages lived on `ranks` are the caller's to free."""

    def destroy(self) -> None:
        """Unmap the region; the pool becomes invalid; idempotent."""
        if getattr(self, "_registry", None) is not None:
            self._registry.remove(self)
            self._registry = None
        self.pool = None
        self.local = None
        if self.region is not None:
            self.region.destroy()
            self.region = None
        self._private = None


# ------------------------------------------------------------------------------------------------
# Copy blocks of KV moves
# ------------------------------------------------------------------------------------------------

def move_blocks(config: KVCacheConfig, num_ranks: int, moves: np.ndarray, src_base: int,
                dst_base: int) -> np.ndarray:
    """Copy blocks for `moves` between two pools: every layer, K and V, the filled token rows of each head.

    A block is one head's filled rows with a row per (layer, K/V) plane, `L * 2` rows at the pools' plane stride.
    So a move is `H_kv/P` blocks, not `L * 2` (a deep model's switch builds, checks and uploads that many times
    fewer: 122 a move at 61 layers before, 1 at `H_kv/P = 1`).

    Arguments:
        config: the cache's `KVCacheConfig`.
        num_ranks: `P` (a unit holds `H_kv/P` heads).
        moves: `[M, 5]` np.int64 (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
        src_base: address of the source rank's pool.
        dst_base: address of the destination rank's pool.

    Returns:
        blocks: `[M * H_kv/P, 6]` np.int64 for `copy_blocks`.
    """
    moves = _checked_moves(config, moves)
    if moves.size == 0:
        return np.zeros((0, 6), dtype=np.int64)
    unit = _unit_bytes(config, num_ranks)
    plane = config.num_units * unit
    row = config.page_size * config.head_dim * 2
    return _plane_blocks(config, num_ranks, dst_base + moves[:, 3] * unit, src_base + moves[:, 1] * unit,
                         moves[:, 4], plane, plane, row, row)


def peer_blocks(config: KVCacheConfig, num_ranks: int, moves: np.ndarray, rank: int, peers: Sequence[int],
                pool_bases: Sequence[int], sending: bool) -> Tuple[np.ndarray, List[int]]:
    """Copy blocks for the moves `rank` sends to (or receives from) each of `peers`, grouped by peer in that order.

    The blocks of each peer's moves are `move_blocks`' (one a head, `L * 2` rows at the plane stride), built in one
    native pass over the plan: the switch's KV phase builds every peer's table at once instead of splitting the
    plan and building each part.

    Arguments:
        config: the cache's `KVCacheConfig`.
        num_ranks: `P`.
        moves: a plan's `[M, 5]` np.int64 moves (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
        rank: the rank whose moves are wanted.
        peers: distinct ranks in [0, P), in the order wanted (`rank` itself for its own moves); the moves with
            any other rank are left out.
        pool_bases: `[P]` int addresses of each rank's pool as mapped here (only `rank`'s and `peers`' are read).
        sending: True: the moves from `rank` (to the peers), False: those to it (from the peers).

    Returns:
        blocks: `[n, 6]` np.int64 for `copy_blocks`, peers one after another, each peer's in the moves' order.
        bounds: `len(peers) + 1` ints, peer i's blocks `blocks[bounds[i]:bounds[i + 1]]`.

    Raises:
        ValueError: a move used names a unit outside [0, num_units), filled tokens outside [0, page_size] or a rank
            outside [0, P); `rank` outside [0, P); `peers` not distinct ranks in [0, P); nothing is built.
    """
    moves = np.ascontiguousarray(moves, dtype=np.int64).reshape(-1, 5)
    heads = _heads_per_unit(config, num_ranks)
    unit = _unit_bytes(config, num_ranks)
    page_row = config.page_size * config.head_dim * 2
    geometry = [config.num_units, unit, heads, page_row, config.page_size, config.head_dim * 2, config.num_layers * 2,
                config.num_units * unit]
    blocks = np.empty((moves.shape[0] * heads, 6), dtype=np.int64)  # at most every move; pages never touched stay free
    bounds = np.empty(len(peers) + 1, dtype=np.int64)
    count = _native.kv_peer_blocks(moves.ctypes.data, moves.shape[0], rank, num_ranks, list(peers), list(pool_bases),
                                   geometry, blocks.ctypes.data, blocks.shape[0], bounds.ctypes.data, sending=sending)
    return blocks[:count], bounds.tolist()


def packed_blocks(config: KVCacheConfig, num_ranks: int, moves: np.ndarray, pool_base: int, packed_base: int,
                  pack: bool) -> Tuple[np.ndarray, int]:
    """Blocks packing `moves` from a pool into a contiguous buffer (or unpacking them).

    The packed form of a move is `[L][2][H_kv/P][filled][D]`, moves one after another. Blocks as in
    `move_blocks` (one a head, `L * 2` rows each).

    Arguments:
        config: the cache's `KVCacheConfig`.
        num_ranks: `P`.
        moves: `[M, 5]` np.int64 (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
        pool_base: address of the pool as mapped here.
        packed_base: address of the contiguous packed buffer.
        pack: True: pool -> packed, reading unit `src_unit`; False: packed -> pool, writing unit `dst_unit`.

    Returns:
        blocks: `[n, 6]` np.int64 for `copy_blocks`.
        nbytes: int, packed size in bytes (0 when `moves` is empty).
    """
    moves = _checked_moves(config, moves)
    if moves.size == 0:
        return np.zeros((0, 6), dtype=np.int64), 0
    unit = _unit_bytes(config, num_ranks)
    plane = config.num_units * unit
    pool = pool_base + moves[:, 1 if pack else 3] * unit
    filled = moves[:, 4] * config.head_dim * 2                          # bytes of one head's rows
    plane_packed = filled * _heads_per_unit(config, num_ranks)          # one (layer, K/V) plane, packed
    move_packed = plane_packed * (config.num_layers * 2)
    packed = packed_base + np.cumsum(move_packed) - move_packed          # each move's start
    row = config.page_size * config.head_dim * 2
    if pack:
        blocks = _plane_blocks(config, num_ranks, packed, pool, moves[:, 4], plane_packed, plane, filled, row)
    else:
        blocks = _plane_blocks(config, num_ranks, pool, packed, moves[:, 4], plane, plane_packed, row, filled)
    return blocks, int(move_packed.sum())


def _checked_moves(config: KVCacheConfig, moves) -> np.ndarray:
    """`moves` as `[M, 5]` np.int64, every move's units in [0, num_units) and filled tokens in [0, page_size] (a block
    is a whole plane's rows: a larger fill would run into the next unit, inside the region's bounds)."""
    moves = np.asarray(moves, dtype=np.int64).reshape(-1, 5)
    if moves.size:
        lo, hi = moves.min(axis=0).tolist(), moves.max(axis=0).tolist()  # two passes for every column
        units = (min(lo[1], lo[3]), max(hi[1], hi[3]))
        if units[0] < 0 or units[1] >= config.num_units or lo[4] < 0 or hi[4] > config.page_size:
            raise ValueError(f"moves: expected units in [0, {config.num_units}) and filled tokens in "
                             f"[0, {config.page_size}], got units [{units[0]}, {units[1]}] and tokens "
                             f"[{lo[4]}, {hi[4]}]")
    return moves


def _heads_per_unit(config: KVCacheConfig, num_ranks: int) -> int:
    """Heads of one unit: `H_kv/P`."""
    return config.num_kv_heads // num_ranks


def _unit_bytes(config: KVCacheConfig, num_ranks: int) -> int:
    """Bytes of one unit: `H_kv/P` heads of one page."""
    return _heads_per_unit(config, num_ranks) * config.page_size * config.head_dim * 2


def _plane_blocks(config: KVCacheConfig, num_ranks: int, dst, src, tokens, dst_plane, src_plane, dst_head,
                  src_head) -> np.ndarray:
    """Blocks copying the filled rows of moves: one a head, with a row per (layer, K/V) plane.

    Arguments:
        dst, src: `[M]` np.int64 addresses of each move's first plane, head 0, on either side.
        tokens: `[M]` np.int64 filled tokens of each move.
        dst_plane, src_plane: the plane stride on either side (an int, or `[M]`).
        dst_head, src_head: the pitch of the heads inside a plane on either side (an int, or `[M]`).

    Returns:
        blocks: `[M * H_kv/P, 6]` np.int64 (dst, src, L * 2, filled bytes, dst_plane, src_plane), moves one after
        another, heads ascending.
    """
    heads, m = _heads_per_unit(config, num_ranks), tokens.shape[0]
    head = np.arange(heads, dtype=np.int64)
    blocks = np.empty((m, heads, 6), dtype=np.int64)
    blocks[..., 0] = dst[:, None] + head * _column(dst_head)
    blocks[..., 1] = src[:, None] + head * _column(src_head)
    blocks[..., 2] = config.num_layers * 2
    blocks[..., 3] = (tokens * (config.head_dim * 2))[:, None]
    blocks[..., 4] = _column(dst_plane)
    blocks[..., 5] = _column(src_plane)
    return blocks.reshape(-1, 6)


def _column(value):
    """A per-move `[M]` array as a column (`[M, 1]`), an int as itself (the same for every move)."""
    return value[:, None] if isinstance(value, np.ndarray) else value
