"""Vectorised bin packing for expert placement: LPT construction, swap refinement, duplicate repair.

All routines work on a batch of B independent problems at once (one per layer, or per layer and
node) so the Python loops run over items or refinement steps, never over layers.

A packed state is three arrays of shape `[B, num_bins, slots_per_bin]`:
`experts` (int64, the logical expert in each slot), `sizes` (float64, the load of that copy) and
`pinned` (bool, a primary copy that may only move between bins of the same node). `bin_node`
(`[num_bins]` int64) gives each bin's node. The invariants kept by every move: each bin keeps its
slot count, no bin holds two copies of one expert, a pinned copy never leaves its node.
"""
from typing import Optional

import numpy as np

_INF = np.inf


def tolerance_of(load: np.ndarray) -> np.ndarray:
    """The smallest load change that counts as an improvement: 1e-12 relative (rounding noise).

    Arguments:
        load: float64 array of loads, any shape.

    Returns:
        tolerance: float64 array of the same shape, ``1e-12 * max(|load|, 1e-300)``.
    """
    return 1e-12 * np.maximum(np.abs(load), 1e-300)


def lpt_assign(
    sizes: np.ndarray,
    keys: np.ndarray,
    num_bins: int,
    slots_per_bin: int,
    *,
    key_cap: int = 1,
    init_load: Optional[np.ndarray] = None,
    init_keycount: Optional[np.ndarray] = None,
):
    """Assign items to bins, largest first to the least-loaded bin that can take it (LPT).

    A bin can take an item if it has a free slot and holds fewer than `key_cap` items with the
    item's key. Items with equal keys must be contiguous (sort by size descending, then key). If
    no bin can take an item, it goes to the least-loaded bin with a free slot and the row is
    flagged, for `repair_duplicates` to fix after refinement.

    Arguments:
        sizes: `[B, M]` float64, item sizes, sorted descending in each row.
        keys: `[B, M]` int64, item keys (logical experts), contiguous runs of equal keys.
        num_bins: bins per row.
        slots_per_bin: free slots of every bin; `M <= num_bins * slots_per_bin`.
        key_cap: the most items of one key a bin may hold.
        init_load: `[B, num_bins]` float64, load already in each bin, or None for zero.
        init_keycount: `[B, num_bins, K]` int64, items of each key already in each bin (they
            count toward `key_cap` but not toward the slots), or None for none.

    Returns:
        bins: `[B, M]` int64, the bin of each item.
        flagged: `[B]` bool, rows where some item broke the key cap.
    """
    rows, items = sizes.shape
    index = np.arange(rows)
    load = np.zeros((rows, num_bins)) if init_load is None else init_load.astype(np.float64).copy()
    free = np.full((rows, num_bins), slots_per_bin, dtype=np.int64)
    run_count = np.zeros((rows, num_bins), dtype=np.int64)
    previous = np.full(rows, -1, dtype=np.int64)
    bins = np.empty((rows, items), dtype=np.int64)
    flagged = np.zeros(rows, dtype=bool)
    for item in range(items):
        key = keys[:, item]
        new_run = key != previous
        if new_run.any():
            if init_keycount is None:
                run_count[new_run] = 0
            else:
                run_count[new_run] = init_keycount[index[new_run], :, key[new_run]]
        previous = key
        has_room = free > 0
        allowed = has_room & (run_count < key_cap)
        choice = np.where(allowed, load, _INF).argmin(axis=1)
        stuck = ~allowed[index, choice]
        if stuck.any():
            fallback = np.where(has_room, load, _INF).argmin(axis=1)
            choice = np.where(stuck, fallback, choice)
            flagged |= stuck
        bins[:, item] = choice
        load[index, choice] += sizes[:, item]
        free[index, choice] -= 1
        run_count[index, choice] += 1
    return bins, flagged


def group_by_bin(bins: np.ndarray, num_bins: int, *arrays: np.ndarray):
    """Reorder per-item arrays into `[B, num_bins, slots]` by their bin (stable).

    Arguments:
        bins: `[B, M]` int64, the bin of each item; every bin must get `M // num_bins` items.
        num_bins: bins per row.
        arrays: `[B, M]` arrays to reorder.

    Returns:
        grouped: one `[B, num_bins, M // num_bins]` array per input array.
    """
    order = np.argsort(bins, axis=1, kind="stable")
    rows, items = bins.shape
    return tuple(np.take_along_axis(a, order, axis=1).reshape(rows, num_bins, items // num_bins) for a in arrays)


def _apply_swaps(experts, sizes, pinned, rows, bin_a, pos_a, bin_b, pos_b) -> None:
    for array in (experts, sizes, pinned):
        held = array[rows, bin_a, pos_a].copy()
        array[rows, bin_a, pos_a] = array[rows, bin_b, pos_b]
        array[rows, bin_b, pos_b] = held


INVALID = 1e300  # added to the score of an invalid move


def swap_scores(eh, sh, ph, lh, el, sl, pl, ll, same_node):
    """Score every swap between a heavy bin and its partner bins.

    Full-size passes are few: the clash and node conditions are folded into `[R, S, K]` and
    `[R, K, S]` masks first, and `np.where`/`np.maximum` (slow on unpredictable data) are avoided.

    Arguments:
        eh, sh, ph: `[R, S]` experts, sizes, pinned flags of the heavy bin of each of R problems.
        lh: `[R]` its load.
        el, sl, pl: `[R, K, S]` the same for K partner bins.
        ll: `[R, K]` their loads.
        same_node: `[R, K]` bool, partner on the heavy bin's node.

    Returns:
        score: `[R, S * K * S]` float64, the larger of the two loads after swapping item a of the
            heavy bin with item b of partner k (flattened as a, k, b), or `INVALID` where the swap
            is invalid (duplicate expert, pinned item leaving its node) or does not lower the
            heavy load.
    """
    rows, slots = eh.shape
    half_gap = 0.5 * (lh[:, None] - ll)  # [R, K]
    # max(lh - d, ll + d) == (lh + ll) / 2 + |d - (lh - ll) / 2|; it is < lh iff 0 < d < lh - ll,
    # i.e. iff |d - (lh - ll) / 2| < (lh - ll) / 2.
    off = sh[:, :, None, None] - sl[:, None, :, :]  # [R, S, K, S] = d
    off -= half_gap[:, None, :, None]
    off = np.abs(off, out=off)
    clash_a = el[:, None, :, 0] == eh[:, :, None]  # a's expert on the partner: [R, S, K]
    clash_b = el == eh[:, 0, None, None]  # b's expert on the heavy bin: [R, K, S]
    for s in range(1, slots):
        clash_a |= el[:, None, :, s] == eh[:, :, None]
        clash_b |= el == eh[:, s, None, None]
    crossing = ~same_node
    if crossing.any():
        clash_a |= crossing[:, None, :] & ph[:, :, None]
        clash_b |= crossing[:, :, None] & pl
    # The distance must stay below `limit`; an item that cannot move gets a limit nothing meets.
    limit = np.broadcast_to((half_gap - tolerance_of(lh)[:, None])[:, None, :], clash_a.shape).copy()
    limit[clash_a] = -1.0
    invalid = off >= limit[..., None]
    invalid |= clash_b[:, None]
    off += (lh[:, None] - half_gap)[:, None, :, None]  # now the new larger load
    np.copyto(off, INVALID, where=invalid)
    return off.reshape(rows, -1)


def group_sweeps(experts, sizes, pinned, bin_node, heavy: int, partners: int, max_sweeps: int = 32) -> np.ndarray:
    """Lower many heavy bins per step, each by its best swap with its own group of light bins.

    Each sweep sorts the bins of each row by load; the i-th heaviest of the `heavy` heaviest bins
    gets the light bins of rank i, i + heavy, i + 2 * heavy, ... (`partners` of them, all
    distinct, heaviest paired with lightest) and applies the one swap with them that most lowers
    the larger of the two loads, if it improves on its own load. The groups are disjoint, so all
    swaps of a sweep apply at once. Sweeps stop when nothing improves. Modifies the arrays in place.

    Arguments:
        experts: `[B, N, S]` int64, packed state (see module docstring).
        sizes: `[B, N, S]` float64.
        pinned: `[B, N, S]` bool.
        bin_node: `[N]` int64, node of each bin.
        heavy: how many heavy bins to lower per sweep; `heavy * (partners + 1) <= N`.
        partners: light bins offered to each heavy bin.
        max_sweeps: the most sweeps.

    Returns:
        swaps: `[B]` int64, swaps applied per row.
    """
    rows, num_bins, slots = experts.shape
    swaps = np.zeros(rows, dtype=np.int64)
    if heavy < 1 or partners < 1 or heavy * (partners + 1) > num_bins or slots == 0:
        return swaps
    active = np.arange(rows)
    for _ in range(max_sweeps):
        if active.size == 0:
            break
        ex, sz, pn = experts[active], sizes[active], pinned[active]
        count = active.size
        load = sz.sum(axis=2)
        order = np.argsort(load, axis=1, kind="stable")
        top = order[:, ::-1][:, :heavy]  # [b, m]
        mates = order[:, : heavy * partners].reshape(count, partners, heavy).transpose(0, 2, 1)  # [b, m, k]
        s1, s2 = np.arange(count)[:, None], np.arange(count)[:, None, None]
        flat = count * heavy
        score = swap_scores(
            ex[s1, top].reshape(flat, slots), sz[s1, top].reshape(flat, slots), pn[s1, top].reshape(flat, slots),
            load[s1, top].reshape(flat),
            ex[s2, mates].reshape(flat, partners, slots), sz[s2, mates].reshape(flat, partners, slots),
            pn[s2, mates].reshape(flat, partners, slots), load[s2, mates].reshape(flat, partners),
            (bin_node[mates] == bin_node[top][:, :, None]).reshape(flat, partners),
        )
        best = score.argmin(axis=1)
        improved = (score[np.arange(flat), best] < INVALID).reshape(count, heavy)
        if not improved.any():
            break
        r, i = np.nonzero(improved)
        choice = best.reshape(count, heavy)[r, i]
        pos_a = choice // (partners * slots)
        mate = mates[r, i, (choice // slots) % partners]
        _apply_swaps(ex, sz, pn, r, top[r, i], pos_a, mate, choice % slots)
        experts[active], sizes[active], pinned[active] = ex, sz, pn
        counts = improved.sum(axis=1)
        swaps[active] += counts
        active = active[counts > 0]
    return swaps


def sweep_schedule(experts, sizes, pinned, bin_node) -> np.ndarray:
    """Group sweeps with ever more partners per heavy bin: 1, 3, 7, ... (see `group_sweeps`).

    Arguments:
        experts: `[B, N, S]` int64, packed state (see module docstring).
        sizes: `[B, N, S]` float64.
        pinned: `[B, N, S]` bool.
        bin_node: `[N]` int64, node of each bin.

    Returns:
        swaps: `[B]` int64, swaps applied per row.
    """
    num_bins = experts.shape[1]
    swaps = np.zeros(experts.shape[0], dtype=np.int64)
    partners = 1
    while num_bins // (partners + 1) >= 2:
        swaps += group_sweeps(experts, sizes, pinned, bin_node, num_bins // (partners + 1), partners, max_sweeps=3)
        partners = 2 * partners + 1
    return swaps


def _best_swaps(ex, sz, pn, load, top, peak, partners, bin_node):
    """Best swap between each row's heaviest bin and its candidate partner bins.

    Returns `(improved [b] bool, pos_a [b], bin_b [b], pos_b [b])`.
    """
    rows, count = partners.shape
    slots = ex.shape[2]
    sub = np.arange(rows)
    s1 = sub[:, None]
    score = swap_scores(
        ex[sub, top], sz[sub, top], pn[sub, top], peak,
        ex[s1, partners], sz[s1, partners], pn[s1, partners], load[s1, partners],
        bin_node[partners] == bin_node[top][:, None],
    )
    best = score.argmin(axis=1)
    improved = score[sub, best] < INVALID
    pos_a = best // (count * slots)
    bin_b = partners[sub, (best // slots) % count]
    return improved, pos_a, bin_b, best % slots


def descend_max(
    experts,
    sizes,
    pinned,
    bin_node,
    *,
    target: Optional[np.ndarray] = None,
    max_steps: int = 256,
    rows: Optional[np.ndarray] = None,
    near: int = 12,
) -> np.ndarray:
    """Lower the heaviest bin of each row by its best single swap, repeatedly.

    Each step, for every active row, looks for the swap between the heaviest bin and another bin
    that minimises the larger of the two new loads, first among the `near` lightest bins and,
    if none of those improves, among all bins; it applies the swap if that larger load is below
    the current maximum. A row stops when no swap improves it or its maximum load is <= `target`.
    Modifies the arrays in place.

    Arguments:
        experts: `[B, N, S]` int64, packed state (see module docstring).
        sizes: `[B, N, S]` float64.
        pinned: `[B, N, S]` bool.
        bin_node: `[N]` int64, node of each bin.
        target: `[B]` float64, stop a row once its maximum bin load is <= this, or None.
        max_steps: the most steps.
        rows: int64 indices of the rows to work on, or None for all.
        near: how many of the lightest bins to try first.

    Returns:
        swaps: `[B]` int64, swaps applied per row.
    """
    total_rows, num_bins, slots = experts.shape
    swaps = np.zeros(total_rows, dtype=np.int64)
    active = np.arange(total_rows) if rows is None else np.asarray(rows, dtype=np.int64)
    if num_bins < 2 or slots == 0:
        return swaps
    near = min(near, num_bins - 1)
    for _ in range(max_steps):
        if active.size == 0:
            break
        ex, sz, pn = experts[active], sizes[active], pinned[active]
        load = sz.sum(axis=2)
        top = load.argmax(axis=1)
        peak = load[np.arange(active.size), top]
        keep = np.ones(active.size, dtype=bool) if target is None else peak > target[active]
        if not keep.all():
            active, ex, sz, pn, load, top, peak = (x[keep] for x in (active, ex, sz, pn, load, top, peak))
            if active.size == 0:
                break
        if near < num_bins - 1:
            light = np.argpartition(load, near, axis=1)[:, :near]
            improved, pos_a, bin_b, pos_b = _best_swaps(ex, sz, pn, load, top, peak, light, bin_node)
            retry = np.nonzero(~improved)[0]
            if retry.size:
                everyone = np.broadcast_to(np.arange(num_bins), (retry.size, num_bins))
                sub_result = _best_swaps(ex[retry], sz[retry], pn[retry], load[retry], top[retry], peak[retry], everyone, bin_node)
                for full, part in zip((improved, pos_a, bin_b, pos_b), sub_result):
                    full[retry] = part
        else:
            everyone = np.broadcast_to(np.arange(num_bins), (active.size, num_bins))
            improved, pos_a, bin_b, pos_b = _best_swaps(ex, sz, pn, load, top, peak, everyone, bin_node)
        if not improved.any():
            break
        r = np.nonzero(improved)[0]
        _apply_swaps(ex, sz, pn, r, top[r], pos_a[r], bin_b[r], pos_b[r])
        experts[active], sizes[active], pinned[active] = ex, sz, pn
        swaps[active[r]] += 1
        active = active[r]
    return swaps


def duplicate_rows(experts: np.ndarray) -> np.ndarray:
    """Rows where some bin holds two copies of one expert.

    Arguments:
        experts: `[B, N, S]` int64.

    Returns:
        rows: int64 indices of the offending rows.
    """
    ordered = np.sort(experts, axis=2)
    return np.nonzero((ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=(1, 2)))[0]


def repair_duplicates(experts, sizes, pinned, bin_node, rows=None) -> int:
    """Remove same-bin duplicates by swapping one copy with an item of another bin.

    Rare (only when LPT flagged a row), so this loops in Python. For each duplicate it picks,
    among the valid swaps, the one giving the smallest larger load of the two bins. Modifies the
    arrays in place.

    Arguments:
        experts: `[B, N, S]` int64, packed state (see module docstring).
        sizes: `[B, N, S]` float64.
        pinned: `[B, N, S]` bool.
        bin_node: `[N]` int64, node of each bin.
        rows: indices of rows to check, or None for all.

    Returns:
        swaps: the number of swaps applied.
    """
    candidates = duplicate_rows(experts) if rows is None else np.asarray(rows, dtype=np.int64)
    num_bins, slots = experts.shape[1:]
    applied = 0
    for row in candidates:
        ex, sz, pn = experts[row], sizes[row], pinned[row]
        for _ in range(num_bins * slots):
            found = None
            for b in range(num_bins):
                values, first, counts = np.unique(ex[b], return_index=True, return_counts=True)
                if (counts > 1).any():
                    expert = values[np.argmax(counts > 1)]
                    positions = np.nonzero((ex[b] == expert) & ~pn[b])[0]
                    found = (b, int(positions[0] if positions.size else np.nonzero(ex[b] == expert)[0][-1]))
                    break
            if found is None:
                break
            b, p = found
            load = sz.sum(axis=1)
            expert = ex[b, p]
            best, best_score = None, _INF
            for other in range(num_bins):
                if other == b or (ex[other] == expert).any():
                    continue
                for q in range(slots):
                    if (ex[b] == ex[other, q]).any():
                        continue
                    if bin_node[other] != bin_node[b] and (pn[b, p] or pn[other, q]):
                        continue
                    delta = sz[b, p] - sz[other, q]
                    score = max(load[b] - delta, load[other] + delta)
                    if score < best_score:
                        best, best_score = (other, q), score
            if best is None:
                raise RuntimeError(f"placement: cannot separate the copies of logical expert {expert} (row {row}); no valid swap")
            other, q = best
            for array in (ex, sz, pn):
                array[b, p], array[other, q] = array[other, q], array[b, p]
            applied += 1
    return applied
