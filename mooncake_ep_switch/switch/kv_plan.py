"""KV redistribution plans between the EP and TP layouts (Moebius algorithms 3, 4).

Computed identically on every rank from every rank's published `RankMeta`; see switch/kv_cache.py
for the memory model (units, EP pages of P aligned units, TP pages of one unit).
"""
import itertools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from mooncake_ep_switch.switch.kv_alloc import group_order, unit_order
from mooncake_ep_switch.switch.kv_meta import KVRequest, RankMeta
from mooncake_ep_switch.layouts import EP, TP


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


def moves_by_peer(moves: np.ndarray, rank: int, sending: bool, num_ranks: int) -> List[np.ndarray]:
    """The moves `rank` sends (its source rank is `rank`) or receives, split by the other rank, in one pass.

    Arguments:
        moves: a plan's `[M, 5]` np.int64 moves (src_rank, src_unit, dst_rank, dst_unit, filled_tokens).
        rank: the rank.
        sending: True for the moves from `rank` (split by destination), False for those to it (by source).
        num_ranks: `P`.

    Returns:
        parts: `P` arrays `[M_r, 5]` np.int64, part r the moves between `rank` and r, in `moves`' order.
    """
    mine, other = (0, 2) if sending else (2, 0)
    rows = moves[moves[:, mine] == rank]
    rows = rows[np.argsort(rows[:, other], kind="stable")]
    bounds = np.searchsorted(rows[:, other], np.arange(num_ranks + 1))
    return [rows[bounds[r]:bounds[r + 1]] for r in range(num_ranks)]


class Planner(NamedTuple):
    """Plans for one rank of a cache (`PagedKVCache.plan` builds one per call).

    Fields:
        config: the `KVCacheConfig`.
        num_ranks: `P`.
        rank: this rank.
        layout: the current layout (`"ep"` or `"tp"`).
    """

    config: object
    num_ranks: int
    rank: int
    layout: str

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

    def _entries(self, requests: Dict[int, KVRequest], rids: Sequence[int]) -> "_Entries":
        """The page entries of `requests[rid]` for `rid` in `rids`, requests one after another (`_Entries`)."""
        reqs = [requests[rid] for rid in rids]
        lengths = np.fromiter((len(req.pages) for req in reqs), dtype=np.int64, count=len(reqs))
        total = int(lengths.sum())
        pages = np.fromiter(itertools.chain.from_iterable(req.pages for req in reqs), dtype=np.int64, count=total)
        tokens = np.fromiter((req.num_tokens for req in reqs), dtype=np.int64, count=len(reqs))
        offsets = np.cumsum(lengths) - lengths
        index = np.arange(total, dtype=np.int64) - np.repeat(offsets, lengths)  # page index inside its request
        fills = np.minimum(self.config.page_size, np.repeat(tokens, lengths) - index * self.config.page_size)
        return _Entries(list(rids), lengths, offsets, pages, fills, np.repeat(np.arange(len(reqs)), lengths))

    def _plan_ep_to_tp(self, metas: Sequence[RankMeta]) -> KVPlan:
        ranks = self.num_ranks
        owner: Dict[int, int] = {}
        entries_of: List[_Entries] = []
        pages_of: List[np.ndarray] = []  # per owner: its distinct EP pages, ascending
        fills_of: List[np.ndarray] = []  # filled tokens of each of those pages (the fullest use of it)
        for o, meta in enumerate(metas):
            if meta.layout != EP:
                return self._refuse(TP, f"rank {o} is in layout {meta.layout!r}, expected 'ep'")
            for rid in meta.requests:
                if rid in owner:
                    return self._refuse(TP, f"request {rid} is on ranks {owner[rid]} and {o}")
                owner[rid] = o
            entries = self._entries(meta.requests, list(meta.requests))
            pages, inverse = np.unique(entries.pages, return_inverse=True)
            fills = np.zeros(pages.size, dtype=np.int64)
            np.maximum.at(fills, inverse.reshape(-1), entries.fills)
            entries_of.append(entries)
            pages_of.append(pages)
            fills_of.append(fills)
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
            entries = entries_of[o]
            if o == mine:  # my pages keep my head group in place
                units = entries.pages * ranks + mine
            else:  # the units my head group of owner o's pages went to
                units = units_for[(mine, o)][np.searchsorted(pages_of[o], entries.pages)]
            new_requests.update(entries.tables(meta.requests, units))
        all_moves = np.concatenate(moves) if moves else np.zeros((0, 5), dtype=np.int64)
        return KVPlan(EP, TP, all_moves.astype(np.int64).reshape(-1, 5), owner, "", new_requests, free_after,
                      reserved)

    def _tp_states_differ(self, metas: Sequence[RankMeta], rids: List[int], first: np.ndarray,
                          inverse: np.ndarray, pages_of: List[np.ndarray]) -> str:
        """Why the ranks' TP states are not one state up to each rank's own unit ids, or "" when they are; rank by
        rank: its layout, its requests and their lengths, then whether rank 0's page ids map one-to-one onto its
        own (the same sharing). Fills `pages_of[g]` with rank g's page entries in rank 0's entry order.

        Arguments:
            rids: rank 0's requests, ascending; `first`, `inverse`: np.unique's of rank 0's page entries in that
                order (`pages_of[0]`).
        """
        base = metas[0]
        for g, meta in enumerate(metas):
            if meta.layout != TP:
                return f"rank {g} is in layout {meta.layout!r}, expected 'tp'"
            if set(meta.requests) != set(base.requests):
                return f"TP state differs: rank {g} holds other requests than rank 0"
            for rid, req in meta.requests.items():
                ref = base.requests[rid]
                if (req.num_tokens, req.prompt_len, len(req.pages)) != (ref.num_tokens, ref.prompt_len,
                                                                         len(ref.pages)):
                    return f"TP state differs: request {rid} on rank {g} vs rank 0"
            if g == 0:
                continue
            pages = pages_of[g] = _pages(meta.requests, rids, pages_of[0].size)
            # a function of rank 0's page (each entry pairs as the page's first entry does), and one-to-one
            if np.array_equal(pages, pages[first[inverse]]) and _distinct(pages[first]):
                continue
            # Named as a check in rank g's request order would: the first entry that pairs otherwise than an
            # earlier entry, either way.
            order = list(meta.requests)
            mine, theirs = self._entries(meta.requests, order), self._entries(base.requests, order)
            differs = np.zeros(mine.pages.size, dtype=bool)
            for key, value in ((theirs.pages, mine.pages), (mine.pages, theirs.pages)):
                _, at, back = np.unique(key, return_index=True, return_inverse=True)
                differs |= value != value[at[back.reshape(-1)]]
            rid = order[int(mine.request[np.argmax(differs)])]
            return f"TP state differs: request {rid} shares pages differently on rank {g} than on rank 0"
        return ""

    def _plan_tp_to_ep(self, metas: Sequence[RankMeta]) -> KVPlan:
        ranks = self.num_ranks
        base = metas[0]
        # Entries of rank 0's requests, ascending request ids; a page's first entry names it.
        rids = sorted(base.requests)
        entries = self._entries(base.requests, rids)
        distinct, first, inverse = np.unique(entries.pages, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        pages_of = [entries.pages] * ranks
        differs = self._tp_states_differ(metas, rids, first, inverse, pages_of)
        if differs:
            return self._refuse(EP, differs)
        # Families: requests sharing a page. Each later entry of a page joins its request to the page's first user.
        parent = list(range(len(rids)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        later = np.flatnonzero(np.arange(entries.pages.size) != first[inverse])
        for a, b in zip(entries.request[later].tolist(), entries.request[first[inverse[later]]].tolist()):
            a, b = find(a), find(b)
            parent[max(a, b)] = min(a, b)
        root = np.fromiter((find(i) for i in range(len(rids))), dtype=np.int64, count=len(rids))
        # Distinct pages in the order a scan of ascending requests meets them, each with its family (the index
        # of its lowest request) and its fullest fill; a family's pages keep that order.
        fill = np.full(distinct.size, np.iinfo(np.int64).min, dtype=np.int64)  # every page has an entry
        np.maximum.at(fill, inverse, entries.fills)
        scan = np.argsort(first, kind="stable")                  # distinct pages, in scan order
        family_of = root[entries.request[first[scan]]]          # family of each, in scan order
        grouping = np.argsort(family_of, kind="stable")
        by_family, page_family = scan[grouping], family_of[grouping]  # grouped by family, scan order inside
        roots = np.unique(root)                                  # every family (one of requests without pages too)
        starts = np.searchsorted(page_family, roots)
        sizes = np.searchsorted(page_family, roots, side="right") - starts
        members: Dict[int, List[int]] = {}
        for i, r in enumerate(root.tolist()):
            members.setdefault(r, []).append(rids[i])
        # Longest first to the least-loaded rank with room (ties: lowest rank).
        room = [int(meta.free.reshape(-1, ranks).all(axis=1).sum()) for meta in metas]
        load = [0] * ranks
        owner_of = np.zeros(len(rids), dtype=np.int64)   # by family root (a request index)
        order = sorted(range(roots.size), key=lambda f: (-int(sizes[f]), rids[int(roots[f])]))
        for f in order:
            size = int(sizes[f])
            fits = [r for r in range(ranks) if load[r] + size <= room[r]]
            if not fits:
                return self._refuse(EP, f"KV capacity: no rank has {size} free EP pages for the requests "
                                        f"{members[int(roots[f])]} (free EP pages per rank {room}, assigned "
                                        f"{load})")
            chosen = min(fits, key=lambda r: (load[r], r))
            owner_of[roots[f]] = chosen
            load[chosen] += size
        # Destination pages on each owner, and the moves: head group g of every page from rank g.
        groups = [group_order(meta.free, ranks) for meta in metas]  # free EP pages, in allocation order
        cursor = [0] * ranks
        placed = [by_family[starts[f]:starts[f] + sizes[f]] for f in order]   # distinct pages, family by family
        new_page = np.zeros(distinct.size, dtype=np.int64)
        owner_page = np.zeros(distinct.size, dtype=np.int64)
        for f, pages in zip(order, placed):
            o = int(owner_of[roots[f]])
            new_page[pages] = groups[o][cursor[o]:cursor[o] + pages.size]
            owner_page[pages] = o
            cursor[o] += pages.size
        ordered = np.concatenate(placed) if placed else np.zeros(0, dtype=np.int64)
        at = first[ordered]                                        # each page's first entry
        group = np.arange(ranks, dtype=np.int64)
        moves = np.empty((ordered.size, ranks, 5), dtype=np.int64)  # page by page, head group g from rank g
        moves[:, :, 0] = group
        for g in range(ranks):
            moves[:, g, 1] = pages_of[g][at]
        moves[:, :, 2] = owner_page[ordered][:, None]
        moves[:, :, 3] = new_page[ordered][:, None] * ranks + group
        moves[:, :, 4] = fill[ordered][:, None]
        mine = self.rank
        owner = {rid: int(owner_of[root[i]]) for i, rid in enumerate(rids)}
        ours = sorted((i for i in range(len(rids)) if owner_of[root[i]] == mine), key=lambda i: (root[i], i))
        positions = (np.concatenate([np.arange(entries.offsets[i], entries.offsets[i] + entries.lengths[i])
                                     for i in ours]) if ours else np.zeros(0, dtype=np.int64))
        new_requests = _tables([rids[i] for i in ours], entries.lengths[ours], base.requests,
                               new_page[inverse[positions]])
        reserved = np.zeros(self.config.num_units, dtype=bool)
        taken = groups[mine][:cursor[mine]]
        reserved[(taken[:, None] * ranks + group).reshape(-1)] = True
        free_after = ~reserved  # every old TP unit of mine leaves, the new EP pages stay
        return KVPlan(TP, EP, moves.reshape(-1, 5), owner, "", new_requests, free_after, reserved)


class _Entries(NamedTuple):
    """Page entries of some requests, one request after another.

    Fields:
        rids: the requests, in entry order.
        lengths: `[n]` np.int64 pages of each.
        offsets: `[n]` np.int64 index of each request's first entry.
        pages: `[E]` np.int64 page ids.
        fills: `[E]` np.int64 tokens filled in each page.
        request: `[E]` np.int64 index (into `rids`) of each entry's request.
    """

    rids: List[int]
    lengths: np.ndarray
    offsets: np.ndarray
    pages: np.ndarray
    fills: np.ndarray
    request: np.ndarray

    def tables(self, requests: Dict[int, KVRequest], values: np.ndarray) -> Dict[int, KVRequest]:
        """`requests[rid]` with its pages replaced by `values` (one per entry), for every request here."""
        return _tables(self.rids, self.lengths, requests, values)


def _distinct(values: np.ndarray) -> bool:
    """Whether no value of `values` repeats (a sort: numpy's hashing unique is slower at these sizes)."""
    ordered = np.sort(values)
    return not bool((ordered[1:] == ordered[:-1]).any())


def _pages(requests: Dict[int, KVRequest], rids: Sequence[int], total: int) -> np.ndarray:
    """`[total]` np.int64: the pages of `requests[rid]` for `rid` in `rids`, one request after another."""
    return np.fromiter(itertools.chain.from_iterable(requests[rid].pages for rid in rids), dtype=np.int64,
                       count=total)


def _tables(rids: List[int], lengths: np.ndarray, requests: Dict[int, KVRequest],
            values: np.ndarray) -> Dict[int, KVRequest]:
    """rid -> `requests[rid]` with its pages replaced by the next `lengths[i]` of `values`, rids in order."""
    flat, out, at = values.tolist(), {}, 0
    for rid, n in zip(rids, lengths.tolist()):
        req = requests[rid]
        out[rid] = KVRequest(req.num_tokens, req.prompt_len, tuple(flat[at:at + n]))
        at += n
    return out
