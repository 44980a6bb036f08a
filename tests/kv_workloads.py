"""Random KV-cache states for the switch's plans: every rank's `RankMeta` in the EP or the TP layout.

Requests share prefixes (a fork shares its parent's first pages), last pages are partly filled, the free-unit
bitmaps hold other allocations too; `serving_metas` builds the large states of the plan benchmark.
"""
from typing import Dict, List

import numpy as np

from mooncake_ep_switch.layouts import EP, TP
from mooncake_ep_switch.switch.kv_alloc import cdiv
from mooncake_ep_switch.switch.kv_meta import KVRequest, RankMeta


def _requests(rng: np.random.Generator, count: int, first_rid: int, page_size: int, max_tokens: int,
              share: float) -> Dict[int, List]:
    """Request records (rid -> [tokens, prompt, page slots]) whose pages are slots 0.. of a pool; a fork reuses
    its parent's first slots."""
    records: Dict[int, List] = {}
    slot = 0
    rids = [first_rid + i for i in range(count)]
    for rid in rids:
        tokens = 0 if rng.random() < 0.1 else int(rng.integers(1, max_tokens + 1))  # some admitted, not started
        pages = cdiv(tokens, page_size)
        parents = [r for r in records if records[r][0] >= page_size]
        if parents and pages and rng.random() < share:
            parent = parents[int(rng.integers(len(parents)))]
            shared = int(rng.integers(1, records[parent][0] // page_size + 1))  # full pages of the parent
            shared = min(shared, pages)
            slots = records[parent][2][:shared] + list(range(slot, slot + pages - shared))
            slot += pages - shared
        else:
            slots = list(range(slot, slot + pages))
            slot += pages
        records[rid] = [tokens, tokens + int(rng.integers(0, 3)), slots]
    return records


def _fitted(records: Dict[int, List], capacity: int) -> Dict[int, List]:
    """`records` without its newest requests until their slots fit in `capacity` (slots are handed out in rid
    order, so dropping the newest frees the highest)."""
    while records and 1 + max((max(r[2]) for r in records.values() if r[2]), default=-1) > capacity:
        records.pop(max(records))
    return records


def tp_metas(rng: np.random.Generator, ranks: int, units: int, requests: int, page_size: int = 4,
             max_tokens: int = 40, share: float = 0.3, busy: float = 0.1) -> List[RankMeta]:
    """Every rank's state in the TP layout: the same requests and sharing, each rank's own unit ids."""
    records = _fitted(_requests(rng, requests, int(rng.integers(0, 5)), page_size, max_tokens, share), units)
    slots = 1 + max((max(r[2]) for r in records.values() if r[2]), default=-1)
    metas = []
    for _ in range(ranks):
        units_of = rng.permutation(units)[:slots]  # slot -> this rank's unit
        free = rng.random(units) >= busy
        free[units_of] = False
        reqs = {rid: KVRequest(t, p, tuple(int(units_of[s]) for s in pages)) for rid, (t, p, pages) in records.items()}
        metas.append(RankMeta(TP, reqs, free))
    return metas


def ep_metas(rng: np.random.Generator, ranks: int, units: int, requests: int, page_size: int = 4,
             max_tokens: int = 40, share: float = 0.3, busy: float = 0.1) -> List[RankMeta]:
    """Every rank's state in the EP layout: each owner its own requests on its own EP pages."""
    metas, rid = [], int(rng.integers(0, 5))
    pages_per_rank = units // ranks
    for _ in range(ranks):
        count = int(rng.integers(0, requests + 1))
        records = _fitted(_requests(rng, count, rid, page_size, max_tokens, share), pages_per_rank)
        rid += count + int(rng.integers(0, 3))
        slots = 1 + max((max(r[2]) for r in records.values() if r[2]), default=-1)
        page_of = rng.permutation(pages_per_rank)[:slots]  # slot -> EP page
        free = rng.random(units) >= busy
        for page in page_of.tolist():
            free[page * ranks:(page + 1) * ranks] = False
        reqs = {r: KVRequest(t, p, tuple(int(page_of[s]) for s in pages)) for r, (t, p, pages) in records.items()}
        metas.append(RankMeta(EP, reqs, free))
    return metas


def serving_metas(layout: str, ranks: int, requests: int, tokens: int, page_size: int = 16):
    """A serving-scale state: `requests` requests of `tokens` tokens each, no sharing, twice the units needed.

    Returns:
        (metas, num_units).
    """
    pages = cdiv(tokens, page_size)
    units = (2 * requests * pages // ranks + 1) * ranks
    if layout == TP:
        free = np.ones(units, dtype=bool)
        free[:requests * pages] = False
        reqs = {rid: KVRequest(tokens, tokens, tuple(range(rid * pages, (rid + 1) * pages))) for rid in range(requests)}
        return [RankMeta(TP, reqs, free.copy()) for _ in range(ranks)], units
    metas = []
    per_rank = requests // ranks
    for owner in range(ranks):
        free = np.ones(units, dtype=bool)
        free[:per_rank * pages * ranks] = False
        reqs = {owner * per_rank + i: KVRequest(tokens, tokens, tuple(range(i * pages, (i + 1) * pages)))
                for i in range(per_rank)}
        metas.append(RankMeta(EP, reqs, free))
    return metas, units
