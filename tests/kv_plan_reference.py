"""The KV switch's metadata decoding and plans as first written (one Python step per page): the reference the
vectorised `switch.kv_meta.decode_meta` and `switch.kv_plan.Planner` are checked against (tests/test_kv_plan_scale.py).

Same algorithms (Moebius algorithms 3 and 4), same results, same refusals; kept here only to check the library's.
Also the KV moves' copy blocks as first written (one block per move and plane), against which
tests/test_kv_blocks.py checks that `PagedKVCache.move_blocks` and `packed_blocks` copy the same bytes.
"""
from typing import Dict, List, Sequence, Tuple

import numpy as np

from mooncake_ep_switch.layouts import EP, TP
from mooncake_ep_switch.switch.kv_alloc import cdiv, group_order, unit_order
from mooncake_ep_switch.switch.kv_meta import _LAYOUT_CODE, _MAGIC, KVRequest, RankMeta
from mooncake_ep_switch.switch.kv_plan import KVPlan


class ReferencePlanner:
    """`kv_plan.Planner` one page at a time (the fields of a `Planner`)."""

    def __init__(self, config, num_ranks: int, rank: int, layout: str):
        self.config, self.num_ranks, self.rank, self.layout = config, num_ranks, rank, layout

    def plan(self, metas: Sequence[RankMeta], target: str) -> KVPlan:
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


def reference_decode_meta(data: np.ndarray, config, num_ranks: int) -> RankMeta:
    """`kv_meta.decode_meta` one request at a time."""
    try:
        data = np.asarray(data, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"metadata: expected an int64 array, got unreadable data ({error})") from None
    cfg = config
    units = cfg.num_units
    bitmap_words = cdiv(cdiv(units, 8), 8)
    if data.size < 4 + bitmap_words:
        raise ValueError(f"metadata: truncated: {data.size} words, a header and bitmap need {4 + bitmap_words}")
    if int(data[0]) != _MAGIC or int(data[2]) != units:
        raise ValueError("metadata: a peer published KV metadata of another shape or format "
                         f"(num_units {int(data[2])} vs {units})")
    layouts = {code: name for name, code in _LAYOUT_CODE.items()}
    if int(data[1]) not in layouts:
        raise ValueError(f"metadata: layout code {int(data[1])} is not one of {sorted(layouts)}")
    layout = layouts[int(data[1])]
    num_pages = units // num_ranks if layout == EP else units  # page ids of that layout
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
        if n < 0 or n > end - at - 4 or n > num_pages or n != cdiv(tokens, page_size):
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
        used = (used[:, None] * num_ranks + np.arange(num_ranks)).reshape(-1)
    if used.size and free[used].any():
        raise ValueError(f"metadata: unit {int(used[free[used]][0])} is both in a request's pages and free")
    return RankMeta(layout, requests, free)


def reference_move_blocks(cache, moves: np.ndarray, src_base: int, dst_base: int) -> np.ndarray:
    """`PagedKVCache.move_blocks` as first written: one block per (move, layer, K/V) plane, `H_kv/P` rows each."""
    cfg = cache.config
    if moves.size == 0:
        return np.zeros((0, 6), dtype=np.int64)
    planes = np.arange(cfg.num_layers * 2, dtype=np.int64)
    plane_bytes = cfg.num_units * cache.unit_bytes
    src = src_base + planes[None, :] * plane_bytes + moves[:, 1:2] * cache.unit_bytes
    dst = dst_base + planes[None, :] * plane_bytes + moves[:, 3:4] * cache.unit_bytes
    row = cfg.page_size * cfg.head_dim * 2
    blocks = np.empty((moves.shape[0], planes.size, 6), dtype=np.int64)
    blocks[..., 0] = dst
    blocks[..., 1] = src
    blocks[..., 2] = cache.heads_per_unit
    blocks[..., 3] = moves[:, 4:5] * cfg.head_dim * 2
    blocks[..., 4] = row
    blocks[..., 5] = row
    return blocks.reshape(-1, 6)


def reference_packed_blocks(cache, moves: np.ndarray, pool_base: int, packed_base: int,
                            pack: bool) -> Tuple[np.ndarray, int]:
    """`PagedKVCache.packed_blocks` as first written (one block per (move, plane))."""
    cfg = cache.config
    if moves.size == 0:
        return np.zeros((0, 6), dtype=np.int64), 0
    planes = np.arange(cfg.num_layers * 2, dtype=np.int64)
    plane_bytes = cfg.num_units * cache.unit_bytes
    unit_col = 1 if pack else 3
    pool_addr = pool_base + planes[None, :] * plane_bytes + moves[:, unit_col:unit_col + 1] * cache.unit_bytes
    filled_row = moves[:, 4:5] * cfg.head_dim * 2
    plane_packed = filled_row * cache.heads_per_unit
    move_packed = plane_packed[:, 0] * planes.size
    move_start = np.concatenate([[0], np.cumsum(move_packed)[:-1]]).astype(np.int64)
    packed_addr = packed_base + move_start[:, None] + planes[None, :] * plane_packed
    row = cfg.page_size * cfg.head_dim * 2
    blocks = np.empty((moves.shape[0], planes.size, 6), dtype=np.int64)
    blocks[..., 0] = packed_addr if pack else pool_addr
    blocks[..., 1] = pool_addr if pack else packed_addr
    blocks[..., 2] = cache.heads_per_unit
    blocks[..., 3] = filled_row
    blocks[..., 4] = filled_row if pack else row
    blocks[..., 5] = row if pack else filled_row
    return blocks.reshape(-1, 6), int(move_packed.sum())
