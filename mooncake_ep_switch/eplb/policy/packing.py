"""Bin packing for expert placement: LPT construction, swap refinement, duplicate repair.

All routines work on a batch of B independent problems at once (one per layer, or per layer and
node): LPT is vectorised over the batch (the Python loop runs over items, never over layers);
the swap refinement is compiled (csrc/eplb/refine.cpp) and runs the rows on up to 4 threads.

A packed state is three arrays of shape `[B, num_bins, slots_per_bin]`:
`experts` (int64, the logical expert in each slot), `sizes` (float64, the load of that copy) and
`pinned` (bool, a primary copy that may only move between bins of the same node). `bin_node`
(`[num_bins]` int64) gives each bin's node. The invariants kept by every move: each bin keeps its
slot count, no bin holds two copies of one expert, a pinned copy never leaves its node.
"""
import heapq
from typing import Optional

import numpy as np

from mooncake_ep_switch.eplb._convert import inplace_array, native_threads

_INF = np.inf


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
    if num_bins > _HEAP_BINS:
        return _lpt_assign_heap(sizes, keys, num_bins, slots_per_bin, key_cap, init_load, init_keycount)
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


_HEAP_BINS = 512  # above this many bins, a per-row heap beats the vectorised scan of every bin per item


def _lpt_assign_heap(sizes, keys, num_bins, slots_per_bin, key_cap, init_load, init_keycount):
    """`lpt_assign` with a heap of (load, bin) per row: O(M log G) per row instead of O(M G), the same
    choices (least load, then lowest bin; the same fallback), for many bins (10^5 GPUs)."""
    rows, items = sizes.shape
    bins = np.empty((rows, items), dtype=np.int64)
    flagged = np.zeros(rows, dtype=bool)
    for row in range(rows):
        load = (np.zeros(num_bins) if init_load is None else init_load[row].astype(np.float64)).tolist()
        free = [slots_per_bin] * num_bins
        heap = [(value, b) for b, value in enumerate(load)]
        heapq.heapify(heap)
        row_sizes = sizes[row].tolist()
        row_keys = keys[row].tolist()
        out = bins[row]
        start = 0
        while start < items:
            key = row_keys[start]
            end = start + 1
            while end < items and row_keys[end] == key:
                end += 1
            count = {}
            if init_keycount is not None:
                held = init_keycount[row, :, key]
                count = {int(b): int(held[b]) for b in np.nonzero(held)[0]}
            aside = []  # bins with room at the key cap for this run (back into the heap after it)
            for item in range(start, end):
                while heap and (free[heap[0][1]] == 0 or count.get(heap[0][1], 0) >= key_cap):
                    _, b = heapq.heappop(heap)
                    if free[b]:
                        aside.append(b)
                if heap:
                    _, b = heapq.heappop(heap)
                else:  # no bin may take the key: the least-loaded bin with room, flagged for repair
                    flagged[row] = True
                    b = min((b for b in aside if free[b]), key=lambda c: (load[c], c))
                    aside.remove(b)
                out[item] = b
                load[b] += row_sizes[item]
                free[b] -= 1
                count[b] = count.get(b, 0) + 1
                if free[b]:
                    if count[b] < key_cap:
                        heapq.heappush(heap, (load[b], b))
                    else:
                        aside.append(b)
            for b in aside:
                if free[b]:
                    heapq.heappush(heap, (load[b], b))
            start = end
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


def refine_swaps(experts, sizes, pinned, bin_node, *, sweeps: bool = True, descend_steps: int = 0, near: int = 12,
                 threads=None) -> None:
    """Swap-refine packed rows in place (compiled: csrc/eplb/refine.cpp).

    Per row: group sweeps with 1, 3, 7, ... partners per heavy bin, up to 3 sweeps each (the
    i-th heaviest of the `N // (partners + 1)` heaviest bins gets the light bins of rank i,
    i + heavy, i + 2 * heavy, ... and applies its best swap with them); then up to
    `descend_steps` times the heaviest bin's best swap, with the `near` lightest bins first and
    with every bin if none of those helps. The best swap minimises the larger of the two new
    loads and must lower the heavy load; none puts two copies of an expert in a bin or moves a
    pinned item off its node.

    Arguments:
        experts: `[B, N, S]` int64, packed state (see module docstring); modified.
        sizes: `[B, N, S]` float64; modified.
        pinned: `[B, N, S]` bool; modified.
        bin_node: `[N]` int64, node of each bin.
        sweeps: run the group sweeps.
        descend_steps: the most descent steps.
        near: light bins tried first in the descent.
        threads: threads for the rows (None: the CPUs this process may use, at most
            `MAX_NATIVE_THREADS`); the result is the same for any count.

    Raises:
        ValueError: an array of the wrong dtype, shape or layout, or a negative count.
    """
    from mooncake_ep_switch import _native
    inplace_array("experts", experts, np.int64, (None, None, None))
    shape = experts.shape
    inplace_array("sizes", sizes, np.float64, shape)
    inplace_array("pinned", pinned, np.bool_, shape)
    if int(near) < 0 or int(descend_steps) < 0:
        raise ValueError(f"near, descend_steps: expected >= 0, got {near}, {descend_steps}")
    bin_node = np.ascontiguousarray(bin_node, dtype=np.int64)
    if bin_node.shape != (shape[1],):
        raise ValueError(f"bin_node: expected shape [{shape[1]}], got {list(bin_node.shape)}")
    _native.eplb_refine(experts.ctypes.data, sizes.ctypes.data, pinned.ctypes.data, shape[0], shape[1], shape[2],
                        bin_node.ctypes.data, sweeps=bool(sweeps), descend_steps=int(descend_steps), near=int(near),
                        threads=native_threads(threads))
