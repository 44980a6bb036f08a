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
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer import peer_regions
from mooncake_ep_switch.buffer.shared_region import SharedRegion
from mooncake_ep_switch.switch.umm import _check_int

EP = "ep"
TP = "tp"
LAYOUTS = (EP, TP)
_LAYOUT_CODE = {EP: 1, TP: 2}
_MAGIC = 0x4B56_4D45_5441  # "KVMETA"
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


class KVRequest(NamedTuple):
    """A request's KV state on this rank.

    Fields:
        num_tokens: tokens whose K/V are stored.
        prompt_len: prompt length (`num_tokens < prompt_len`: mid-prefill).
        pages: page ids (EP: EP page index; TP: unit index), `ceil(num_tokens / page_size)` of them.
    """

    num_tokens: int
    prompt_len: int
    pages: Tuple[int, ...]


class RankMeta(NamedTuple):
    """What a rank publishes for a switch: its layout, requests and free units."""

    layout: str
    requests: Dict[int, KVRequest]
    free: np.ndarray  # bool [num_units]


class KVPlan(NamedTuple):
    """A redistribution, identical on every rank.

    Fields:
        source: layout before.
        target: layout after.
        moves: `[M, 5]` np.int64 rows (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
        owner: request id -> EP owner rank after a TP->EP switch (before an EP->TP switch: the
            owner it came from).
        refused: "" when the plan fits, else why it cannot (nothing is touched then).
        new_requests: this rank's requests after the switch.
        new_free: this rank's free units after the switch (bool `[num_units]`).
        reserved: units of this rank that the moves write (not free during the switch).
    """

    source: str
    target: str
    moves: np.ndarray
    owner: Dict[int, int]
    refused: str
    new_requests: Dict[int, KVRequest]
    new_free: Optional[np.ndarray]
    reserved: Optional[np.ndarray]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# Allocation over a free-unit bitmap
# ------------------------------------------------------------------------------------------------

def alloc_unit(free: np.ndarray, group: int) -> int:
    """Allocate one unit (TP page) from `free` (modified): in the aligned group of `group` units with
    the fewest free units, lowest index first, so that whole groups stay free for EP pages.

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap, `num_units` a multiple of `group`; the chosen
            unit is set to False in place.
        group: units per aligned group (one EP page).

    Returns:
        unit: int index of the allocated unit, or -1 when nothing is free.
    """
    counts = free.reshape(-1, group).sum(axis=1)
    if not counts.any():
        return -1
    chosen = int(np.where(counts > 0, counts, group + 1).argmin())
    unit = chosen * group + int(np.flatnonzero(free[chosen * group:(chosen + 1) * group])[0])
    free[unit] = False
    return unit


def unit_order(free: np.ndarray, group: int) -> np.ndarray:
    """Free units in the order `alloc_unit` would hand them out if nothing were freed in between:
    groups with the fewest free units first (lowest index on ties), units ascending inside a group.

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap (not modified), `num_units` a multiple of `group`.
        group: units per aligned group (one EP page).

    Returns:
        units: `[num_free]` np.int64 unit indices in allocation order.
    """
    counts = free.reshape(-1, group).sum(axis=1)
    units = np.flatnonzero(free)
    keys = counts[units // group] * len(free) + units  # (group's free count, unit index)
    return units[np.argsort(keys, kind="stable")].astype(np.int64)


def group_order(free: np.ndarray, group: int) -> np.ndarray:
    """Wholly free aligned groups (EP pages), ascending: the order `alloc_group` hands them out.

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap (not modified), `num_units` a multiple of `group`.
        group: units per aligned group (one EP page).

    Returns:
        pages: `[num_free_pages]` np.int64 page (group) indices, ascending.
    """
    return np.flatnonzero(free.reshape(-1, group).all(axis=1)).astype(np.int64)


def alloc_group(free: np.ndarray, group: int) -> int:
    """Allocate one EP page (an aligned group of `group` free units) from `free` (modified).

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap, `num_units` a multiple of `group`; the page's
            units are set to False in place.
        group: units per aligned group (one EP page).

    Returns:
        page: int index of the lowest wholly free page (its units are `page * group + [0, group)`),
            or -1 when no page is wholly free.
    """
    whole = np.flatnonzero(free.reshape(-1, group).all(axis=1))
    if whole.size == 0:
        return -1
    page = int(whole[0])
    free[page * group:(page + 1) * group] = False
    return page


# ------------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------------

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
        _check_int("config.num_layers", config.num_layers, 1)
        heads = _check_int("config.num_kv_heads", config.num_kv_heads, 1)
        _check_int("config.head_dim", config.head_dim, 1)
        _check_int("config.page_size", config.page_size, 1)
        units = _check_int("config.num_units", config.num_units, 1)
        _check_int("config.metadata_bytes", config.metadata_bytes, 0)
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
        self.heads_per_unit = heads // ranks
        self.unit_bytes = self.heads_per_unit * config.page_size * config.head_dim * 2
        meta = config.metadata_bytes or 65536 + 40 * units
        self.meta_bytes = (meta + _META_HEADER + 4095) // 4096 * 4096
        self.pool_bytes = config.num_layers * 2 * units * self.unit_bytes
        self.region_bytes = self.meta_bytes + self.pool_bytes
        self.requests: Dict[int, KVRequest] = {}
        self.refcount: Dict[int, int] = {}
        self.free = np.ones(units, dtype=bool)
        self.region: Optional[SharedRegion] = None
        self._private: Optional[torch.Tensor] = None
        if self.transport == "shm":
            self.region = SharedRegion(self.group, self.rank, ranks, self.region_bytes)
            self.local = self.region.local
        else:
            self._private = torch.zeros(self.region_bytes, dtype=torch.uint8)
            self.local = self._private
        self._registry = getattr(buffer, "peer_regions", None)
        peer_regions.register(buffer, self, KIND)
        if self.region is not None and prefault:
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
        rid = _check_int("rid", rid, 0)
        prompt_len = _check_int("prompt_len", prompt_len, 0)
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
        num_tokens = _check_int("num_tokens", num_tokens, 0)
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
        num_new = _check_int("num_new", num_new, 0)
        start = req.num_tokens
        total = start + num_new
        pages = list(req.pages)
        if start % self.config.page_size and pages and self.refcount[pages[-1]] > 1:
            raise ValueError(f"rid: request {rid}'s last page is shared and partially filled; "
                             "copy-on-write is not supported")
        need = _cdiv(total, self.config.page_size) - len(pages)
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
        units = torch.tensor(self.units_of(rid, group), dtype=torch.int64)
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
        """This rank's `RankMeta` as one int64 array (no pickle: peers read it from shared memory).

        Returns:
            data: `[n]` np.int64: header (magic, layout code, num_units, request count), then per
                request in rid order (rid, num_tokens, prompt_len, page count, page ids...), then the
                free-unit bitmap packed to bits and zero-padded to whole int64 words.
        """
        head = [_MAGIC, _LAYOUT_CODE[self.layout], self.config.num_units, len(self.requests)]
        body: List[int] = []
        for rid in sorted(self.requests):
            req = self.requests[rid]
            body += [rid, req.num_tokens, req.prompt_len, len(req.pages), *req.pages]
        bits = np.packbits(self.free.astype(np.uint8))
        bits = np.concatenate([bits, np.zeros((-bits.size) % 8, dtype=np.uint8)]).view(np.int64)
        return np.concatenate([np.asarray(head + body, dtype=np.int64), bits])

    def decode_meta(self, data: np.ndarray) -> RankMeta:
        """Inverse of `encode_meta`, validating what a peer published before any loop over it.

        Every count, length and page id is checked against the array's size and this cache's
        limits first, so corrupt metadata (a count of 2^40, a negative length, a page id past the
        pool) fails in time bounded by the array's size and never becomes an address.

        Arguments:
            data: `[n]` integer array as `encode_meta()` makes it (converted to np.int64).

        Returns:
            meta: a `RankMeta`.

        Raises:
            ValueError: ("metadata: ...") the magic, layout or `num_units` differ from this cache's, a
                request count or page count is negative or larger than the data holds, a request's
                page count is not `ceil(num_tokens / page_size)`, a page id is outside the layout's
                pages, a request id is negative or repeated, a token count is negative, or the
                data is truncated or has words after the free-unit bitmap.
        """
        try:
            data = np.asarray(data, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError, OverflowError) as error:
            raise ValueError(f"metadata: expected an int64 array, got unreadable data ({error})") from None
        cfg = self.config
        units = cfg.num_units
        bitmap_words = _cdiv(_cdiv(units, 8), 8)
        if data.size < 4 + bitmap_words:
            raise ValueError(f"metadata: truncated: {data.size} words, a header and bitmap need {4 + bitmap_words}")
        if int(data[0]) != _MAGIC or int(data[2]) != units:
            raise ValueError("metadata: a peer published KV metadata of another shape or format "
                             f"(num_units {int(data[2])} vs {units})")
        layouts = {code: name for name, code in _LAYOUT_CODE.items()}
        if int(data[1]) not in layouts:
            raise ValueError(f"metadata: layout code {int(data[1])} is not one of {sorted(layouts)}")
        layout = layouts[int(data[1])]
        num_pages = units // self.num_ranks if layout == EP else units  # page ids of that layout
        end = data.size - bitmap_words
        count = int(data[3])
        if count < 0 or 4 + 4 * count > end:
            raise ValueError(f"metadata: request count {count} is negative or more than the {end - 4} words "
                             "of request records hold")
        page_size = cfg.page_size
        at, requests = 4, {}
        for index in range(count):  # bounded: every record takes >= 4 of the `end` words
            if at + 4 > end:
                raise ValueError(f"metadata: truncated at request {index} of {count}")
            rid, tokens, prompt, n = (int(v) for v in data[at:at + 4])
            if rid < 0 or rid in requests:
                raise ValueError(f"metadata: request id {rid} is negative or repeated")
            if tokens < 0 or prompt < 0:
                raise ValueError(f"metadata: request {rid} has {tokens} tokens and prompt length {prompt}, "
                                 "expected >= 0")
            if n < 0 or n > end - at - 4 or n > num_pages or n != _cdiv(tokens, page_size):
                raise ValueError(f"metadata: request {rid} lists {n} pages; expected ceil({tokens} tokens / "
                                 f"{page_size}) within the {end - at - 4} words left and <= {num_pages} pages")
            pages = data[at + 4:at + 4 + n]
            if n and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
                raise ValueError(f"metadata: request {rid} has a page id outside [0, {num_pages}) "
                                 f"({int(pages.min())}..{int(pages.max())})")
            if n > 1 and np.unique(pages).size != n:  # requests may share pages (prefixes), a request may not
                raise ValueError(f"metadata: request {rid} lists a page more than once ({pages.tolist()})")
            requests[rid] = KVRequest(tokens, prompt, tuple(pages.tolist()))
            at += 4 + n
        if at != end:
            raise ValueError(f"metadata: {end - at} words between the last request and the free-unit bitmap")
        free = np.unpackbits(data[end:].view(np.uint8))[:units].astype(bool)
        used = np.asarray([p for req in requests.values() for p in req.pages], dtype=np.int64)
        if layout == EP:
            used = (used[:, None] * self.num_ranks + np.arange(self.num_ranks)).reshape(-1)
        if used.size and free[used].any():
            raise ValueError(f"metadata: unit {int(used[free[used]][0])} is both in a request's pages and free")
        return RankMeta(layout, requests, free)

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
        raw = region[_META_HEADER:_META_HEADER + nbytes].clone().numpy().view(np.int64)
        try:
            return self.decode_meta(raw)
        except ValueError as error:
            raise ValueError(f"rank {rank}'s {error}") from None
        except Exception as error:  # a torn or foreign blob: report it like any bad metadata
            raise ValueError(f"metadata: rank {rank} published unreadable KV metadata ({error!r})") from None

    # ------------------------------------------------------------------ plans
    def plan(self, metas: Sequence[RankMeta], target: str) -> KVPlan:
        """The redistribution from every rank's published state to `target` (same result on every rank).

        Arguments:
            metas: every rank's `RankMeta`, indexed by rank.
            target: `"ep"` or `"tp"`, different from the current layout.

        Returns:
            plan: a `KVPlan`; `plan.refused` says why it does not fit (then nothing may be touched).
        """
        if target == TP:
            return self._plan_ep_to_tp(metas)
        return self._plan_tp_to_ep(metas)

    def _refuse(self, target: str, reason: str) -> KVPlan:
        return KVPlan(self.layout, target, np.zeros((0, 5), dtype=np.int64), {}, reason, {}, None, None)

    def _fill(self, req: KVRequest, index: int) -> int:
        return min(self.config.page_size, req.num_tokens - index * self.config.page_size)

    def _plan_ep_to_tp(self, metas: Sequence[RankMeta]) -> KVPlan:
        ranks = self.num_ranks
        owner: Dict[int, int] = {}
        pages_of: List[np.ndarray] = []  # per owner: its distinct EP pages, ascending
        fills_of: List[np.ndarray] = []  # filled tokens of each of those pages
        for o, meta in enumerate(metas):
            if meta.layout != EP:
                return self._refuse(TP, f"rank {o} is in layout {meta.layout!r}, expected 'ep'")
            fills: Dict[int, int] = {}
            for rid, req in meta.requests.items():
                if rid in owner:
                    return self._refuse(TP, f"request {rid} is on ranks {owner[rid]} and {o}")
                owner[rid] = o
                for index, page in enumerate(req.pages):
                    fills[page] = max(fills.get(page, 0), self._fill(req, index))
            pages = np.array(sorted(fills), dtype=np.int64)
            pages_of.append(pages)
            fills_of.append(np.array([fills[p] for p in pages.tolist()], dtype=np.int64))
        # Rank g receives head group g of every page of every other owner, owners ascending, into
        # its free units in allocation order (partially used groups first).
        units_for: Dict[Tuple[int, int], np.ndarray] = {}
        moves = []
        for g in range(ranks):
            order = unit_order(metas[g].free, ranks)
            need = sum(pages_of[o].size for o in range(ranks) if o != g)
            if need > order.size:
                return self._refuse(TP, f"KV capacity: rank {g} needs {need} free units for the TP layout, "
                                        f"has {order.size}")
            at = 0
            for o in range(ranks):
                if o == g:
                    continue
                units = order[at:at + pages_of[o].size]
                at += units.size
                units_for[(g, o)] = units
                moves.append(np.stack([np.full_like(units, o), pages_of[o] * ranks + g, np.full_like(units, g),
                                       units, fills_of[o]], axis=1))
        mine = self.rank
        reserved = np.zeros(self.config.num_units, dtype=bool)
        free_after = metas[mine].free.copy()
        for o in range(ranks):
            if o != mine:
                reserved[units_for[(mine, o)]] = True
        free_after &= ~reserved
        own = pages_of[mine]
        for other in range(ranks):  # the other head groups of my own pages leave
            if other != mine:
                free_after[own * ranks + other] = True
        new_requests = {}
        for o, meta in enumerate(metas):
            if o == mine:
                mapping = {int(p): int(p) * ranks + mine for p in own.tolist()}
            else:
                mapping = dict(zip(pages_of[o].tolist(), units_for[(mine, o)].tolist()))
            for rid, req in meta.requests.items():
                new_requests[rid] = KVRequest(req.num_tokens, req.prompt_len, tuple(mapping[p] for p in req.pages))
        all_moves = np.concatenate(moves) if moves else np.zeros((0, 5), dtype=np.int64)
        return KVPlan(EP, TP, all_moves.astype(np.int64).reshape(-1, 5), owner, "", new_requests, free_after,
                      reserved)

    def _plan_tp_to_ep(self, metas: Sequence[RankMeta]) -> KVPlan:
        ranks = self.num_ranks
        base = metas[0]
        for g, meta in enumerate(metas):
            if meta.layout != TP:
                return self._refuse(EP, f"rank {g} is in layout {meta.layout!r}, expected 'tp'")
            if set(meta.requests) != set(base.requests):
                return self._refuse(EP, f"TP state differs: rank {g} holds other requests than rank 0")
            for rid, req in meta.requests.items():
                ref = base.requests[rid]
                if (req.num_tokens, req.prompt_len, len(req.pages)) != (ref.num_tokens, ref.prompt_len,
                                                                         len(ref.pages)):
                    return self._refuse(EP, f"TP state differs: request {rid} on rank {g} vs rank 0")
            # Sharing must be the same everywhere: rank 0's page ids map one-to-one onto rank g's.
            forward: Dict[int, int] = {}
            backward: Dict[int, int] = {}
            for rid, req in meta.requests.items():
                for page0, page in zip(base.requests[rid].pages, req.pages):
                    if forward.setdefault(page0, page) != page or backward.setdefault(page, page0) != page0:
                        return self._refuse(EP, f"TP state differs: request {rid} shares pages differently on "
                                                f"rank {g} than on rank 0")
        # Families: requests sharing a page (rank 0's page ids; every rank has the same structure).
        rids = sorted(base.requests)
        parent = {rid: rid for rid in rids}

        def find(rid: int) -> int:
            while parent[rid] != rid:
                parent[rid] = parent[parent[rid]]
                rid = parent[rid]
            return rid

        first_user: Dict[int, int] = {}
        for rid in rids:
            for page in base.requests[rid].pages:
                if page in first_user:
                    a, b = find(rid), find(first_user[page])
                    parent[max(a, b)] = min(a, b)
                else:
                    first_user[page] = rid
        families: Dict[int, List[int]] = {}
        for rid in rids:
            families.setdefault(find(rid), []).append(rid)
        # Distinct pages of a family, each named by its first (request, index), with its fill.
        family_pages: Dict[int, List[Tuple[int, int, int]]] = {}
        for root, members in families.items():
            seen: Dict[int, int] = {}
            entries: List[Tuple[int, int, int]] = []
            for rid in members:
                req = base.requests[rid]
                for index, page in enumerate(req.pages):
                    fill = self._fill(req, index)
                    if page in seen:
                        pos = seen[page]
                        r0, i0, f0 = entries[pos]
                        entries[pos] = (r0, i0, max(f0, fill))
                    else:
                        seen[page] = len(entries)
                        entries.append((rid, index, fill))
            family_pages[root] = entries
        # Longest first to the least-loaded rank with room (ties: lowest rank).
        room = [int(meta.free.reshape(-1, ranks).all(axis=1).sum()) for meta in metas]
        load = [0] * ranks
        owner_of_family: Dict[int, int] = {}
        for root in sorted(families, key=lambda f: (-len(family_pages[f]), f)):
            size = len(family_pages[root])
            fits = [r for r in range(ranks) if load[r] + size <= room[r]]
            if not fits:
                return self._refuse(EP, f"KV capacity: no rank has {size} free EP pages for the requests "
                                        f"{families[root]} (free EP pages per rank {room}, assigned {load})")
            chosen = min(fits, key=lambda r: (load[r], r))
            owner_of_family[root] = chosen
            load[chosen] += size
        # Destination pages on each owner, and the moves: head group g of every page from rank g.
        groups = [group_order(meta.free, ranks) for meta in metas]  # free EP pages, in allocation order
        cursor = [0] * ranks
        new_page: Dict[Tuple[int, int], int] = {}  # (rid, index) of a family page -> EP page on its owner
        moves = []
        for root in sorted(families, key=lambda f: (-len(family_pages[f]), f)):
            o = owner_of_family[root]
            for rid, index, fill in family_pages[root]:
                page = int(groups[o][cursor[o]])
                cursor[o] += 1
                new_page[(rid, index)] = page
                for g in range(ranks):
                    moves.append((g, metas[g].requests[rid].pages[index], o, page * ranks + g, fill))
        mine = self.rank
        owner = {rid: owner_of_family[find(rid)] for rid in rids}
        new_requests = {}
        for root, members in families.items():
            if owner_of_family[root] != mine:
                continue
            name_of: Dict[int, Tuple[int, int]] = {}
            for rid, index, _ in family_pages[root]:
                name_of[base.requests[rid].pages[index]] = (rid, index)
            for rid in members:
                req = base.requests[rid]
                pages = tuple(new_page[name_of[page]] for page in req.pages)
                new_requests[rid] = KVRequest(req.num_tokens, req.prompt_len, pages)
        reserved = np.zeros(self.config.num_units, dtype=bool)
        for page in groups[mine][:cursor[mine]].tolist():
            reserved[page * ranks:(page + 1) * ranks] = True
        free_after = ~reserved  # every old TP unit of mine leaves, the new EP pages stay
        return KVPlan(TP, EP, np.asarray(moves, dtype=np.int64).reshape(-1, 5), owner, "", new_requests,
                      free_after, reserved)

    def move_blocks(self, moves: np.ndarray, src_base: int, dst_base: int) -> np.ndarray:
        """Copy blocks for `moves` between two pools (as mapped here): every layer, K and V, the filled
        token rows of each head.

        Arguments:
            moves: `[M, 5]` np.int64 (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
            src_base: address of the source rank's pool.
            dst_base: address of the destination rank's pool.

        Returns:
            blocks: `[M * L * 2, 6]` np.int64 for `copy_blocks`.
        """
        cfg = self.config
        if moves.size == 0:
            return np.zeros((0, 6), dtype=np.int64)
        planes = np.arange(cfg.num_layers * 2, dtype=np.int64)           # (layer, K/V) plane index
        plane_bytes = cfg.num_units * self.unit_bytes
        src = src_base + planes[None, :] * plane_bytes + moves[:, 1:2] * self.unit_bytes
        dst = dst_base + planes[None, :] * plane_bytes + moves[:, 3:4] * self.unit_bytes
        row = cfg.page_size * cfg.head_dim * 2
        blocks = np.empty((moves.shape[0], planes.size, 6), dtype=np.int64)
        blocks[..., 0] = dst
        blocks[..., 1] = src
        blocks[..., 2] = self.heads_per_unit
        blocks[..., 3] = moves[:, 4:5] * cfg.head_dim * 2
        blocks[..., 4] = row
        blocks[..., 5] = row
        return blocks.reshape(-1, 6)

    def packed_blocks(self, moves: np.ndarray, pool_base: int, packed_base: int, pack: bool) -> Tuple[np.ndarray, int]:
        """Blocks packing `moves` from this rank's pool into a contiguous buffer (or unpacking them).

        The packed form of a move is `[L][2][H_kv/P][filled][D]`, moves one after another.

        Arguments:
            moves: `[M, 5]` np.int64 (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
            pool_base: address of this rank's pool as mapped here (see `pool_base()`).
            packed_base: address of the contiguous packed buffer.
            pack: True: pool -> packed, reading unit `src_unit`; False: packed -> pool, writing
                unit `dst_unit`.

        Returns:
            blocks: `[M * L * 2, 6]` np.int64 for `copy_blocks`.
            nbytes: int, packed size in bytes (0 when `moves` is empty).
        """
        cfg = self.config
        if moves.size == 0:
            return np.zeros((0, 6), dtype=np.int64), 0
        planes = np.arange(cfg.num_layers * 2, dtype=np.int64)
        plane_bytes = cfg.num_units * self.unit_bytes
        unit_col = 1 if pack else 3
        pool_addr = pool_base + planes[None, :] * plane_bytes + moves[:, unit_col:unit_col + 1] * self.unit_bytes
        filled_row = moves[:, 4:5] * cfg.head_dim * 2                    # bytes of one head's rows
        plane_packed = filled_row * self.heads_per_unit                   # one (layer, K/V) plane
        move_packed = plane_packed[:, 0] * planes.size
        move_start = np.concatenate([[0], np.cumsum(move_packed)[:-1]]).astype(np.int64)
        packed_addr = packed_base + move_start[:, None] + planes[None, :] * plane_packed
        row = cfg.page_size * cfg.head_dim * 2
        blocks = np.empty((moves.shape[0], planes.size, 6), dtype=np.int64)
        blocks[..., 0] = packed_addr if pack else pool_addr
        blocks[..., 1] = pool_addr if pack else packed_addr
        blocks[..., 2] = self.heads_per_unit
        blocks[..., 3] = filled_row
        blocks[..., 4] = filled_row if pack else row
        blocks[..., 5] = row if pack else filled_row
        return blocks.reshape(-1, 6), int(move_packed.sum())

    def commit(self, plan: KVPlan) -> None:
        """Adopt a plan's new state on this rank (after every move into this rank is done).

        Arguments:
            plan: a `KVPlan` from `plan()` that was not refused (its `new_free` is not None); sets the
                layout to `plan.target` and the requests, reference counts and free units to its own.
        """
        self.layout = plan.target
        self.requests = dict(plan.new_requests)
        refcount: Dict[int, int] = {}
        for req in self.requests.values():
            for page in req.pages:
                refcount[page] = refcount.get(page, 0) + 1
        self.refcount = refcount
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
