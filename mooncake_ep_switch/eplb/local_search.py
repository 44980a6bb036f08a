"""Local search for the movement-aware rebalance: lower the heaviest GPU per moved copy.

`split_large_copies` gives copies to experts whose copy load is too large (one moved copy each);
`improve` then lowers each layer's heaviest GPU with swaps (two copies), parks (one) and splits
(one) until the layer meets its target.
"""
import numpy as np

from mooncake_ep_switch.eplb.construct import Topology
from mooncake_ep_switch.eplb.packing import INVALID, swap_scores, tolerance_of


def split_large_copies(weight, experts, counts, pinned, topo: Topology, limit: np.ndarray, active: np.ndarray) -> None:
    """Split experts whose copy load exceeds `limit` by overwriting spare copies, in place.

    Arguments:
        weight: `[L, E]` float64.
        experts: `[L, R]` int64 slot table (modified).
        counts: `[L, E]` int64 copies (modified).
        pinned: `[L, R]` bool primaries (never overwritten).
        topo: the problem's shape.
        limit: `[L]` float64, the largest copy load wanted.
        active: int64 layer indices to work on.
    """
    slots = topo.slots_per_gpu
    slot_gpu = np.arange(topo.num_replicas) // slots
    for _ in range(topo.num_replicas):
        if active.size == 0:
            return
        w, ex, c, pn = weight[active], experts[active], counts[active], pinned[active]
        sub = np.arange(active.size)
        per_copy = w / c
        receiver = np.where(c < topo.num_gpus, per_copy, -1.0).argmax(axis=1)
        receiver_load = per_copy[sub, receiver]
        need = receiver_load > limit[active] * (1 + 1e-9)
        if not need.any():
            return
        gpu_load = np.take_along_axis(per_copy, ex, axis=1).reshape(active.size, topo.num_gpus, slots).sum(axis=2)
        holds = (ex == receiver[:, None]).reshape(active.size, topo.num_gpus, slots).any(axis=2)
        donor_count = np.take_along_axis(c, ex, axis=1)
        donor_after = np.take_along_axis(w, ex, axis=1) / np.maximum(donor_count - 1, 1)
        movable = (donor_count >= 2) & (ex != receiver[:, None]) & ~pn & ~holds[:, slot_gpu]
        strict = movable & (donor_after <= limit[active][:, None])
        loose = movable & (donor_after < receiver_load[:, None])
        usable = np.where(strict.any(axis=1)[:, None], strict, loose)
        new_copy = w[sub, receiver] / (c[sub, receiver] + 1.0)
        # The slot's GPU changes by `change`; pick the slot that lowers the sum of squared GPU
        # loads most (a heavy GPU when the load drops, a light one when it grows).
        change = new_copy[:, None] - np.take_along_axis(per_copy, ex, axis=1)
        effect = change * (gpu_load[:, slot_gpu] + 0.5 * change)
        choice = np.where(usable, effect, np.inf).argmin(axis=1)
        go = need & usable[sub, choice]
        if not go.any():
            return
        rows, slot = active[go], choice[go]
        donor = experts[rows, slot]
        experts[rows, slot] = receiver[go]
        counts[rows, receiver[go]] += 1
        counts[rows, donor] -= 1
        active = rows


def _holders(ex3: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """`[b, C, G]` float64: 1.0 where GPU g holds expert `experts[b, c]` (ex3 is `[b, G, S]`)."""
    slots = ex3.shape[2]
    held = ex3[:, None, :, 0] == experts[:, :, None]
    for s in range(1, slots):
        held |= ex3[:, None, :, s] == experts[:, :, None]
    return held.astype(np.float64)


def _holder_peak(ex: np.ndarray, slot_load: np.ndarray, num_logical: int) -> np.ndarray:
    """`[b, R]`: for each slot, the largest load among the GPUs holding a copy of its expert."""
    rows, num_slots = ex.shape
    key = (ex + (np.arange(rows) * num_logical)[:, None]).ravel()
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
    peaks = np.maximum.reduceat(slot_load.ravel()[order], starts)
    run = np.cumsum(np.r_[True, sorted_key[1:] != sorted_key[:-1]]) - 1
    out = np.empty(rows * num_slots)
    out[order] = peaks[run]
    return out.reshape(rows, num_slots)


def improve(
    weight, experts, counts, pinned, topo: Topology, peak_limit, item_limit, rows, max_steps: int,
    start=None, budget=None, near: int = 8,
) -> None:
    """Lower each layer's heaviest GPU until it meets `peak_limit`, moving few copies.

    Each step, for every active layer, considers three kinds of moves for the heaviest GPU and
    applies the one with the largest drop of the maximum load per moved copy:

    - swap one of its copies with a copy on another GPU (two copies move);
    - park: overwrite one of its copies of an expert that has other copies with a copy of the
      expert whose copy load is smallest (one copy moves; the expert's other copies grow);
    - split: give one of its experts an extra copy on one of the `near` lightest GPUs,
      overwriting a spare copy there (one copy moves; all copies of the expert shrink).

    Every candidate is judged by the largest new load among the GPUs it changes (computed
    exactly), so with several GPUs at the maximum, lowering one of them counts. No move makes a
    copy larger than `item_limit`, moves a pinned primary off its node, or puts two copies of an
    expert on one GPU. Modifies `experts` and `counts` in place.

    Arguments:
        weight: `[L, E]` float64.
        experts: `[L, R]` int64 slot table (modified).
        counts: `[L, E]` int64 copies (modified).
        pinned: `[L, R]` bool primaries (moved along with swapped copies).
        topo: the problem's shape.
        peak_limit: `[L]` float64, the maximum GPU load to reach.
        item_limit: `[L]` float64, the largest copy load allowed to appear.
        rows: int64 layer indices to work on.
        max_steps: the most steps.
        start: `[L, R]` int64, the table moves are counted against, or None.
        budget: `[L]` int64, a layer stops once it has moved this many copies (needs `start`).
        near: how many of the lightest GPUs a split may put its copy on.
    """
    slots, gpus, num_logical = topo.slots_per_gpu, topo.num_gpus, topo.num_logical
    gpu_node = topo.gpu_node()
    near = max(1, min(near, gpus - 1))
    gpu_ids = np.arange(gpus)
    active = np.asarray(rows, dtype=np.int64)
    for _ in range(max_steps):
        if active.size == 0:
            return
        w, ex, c, pn = weight[active], experts[active], counts[active], pinned[active]
        b = active.size
        sub = np.arange(b)
        s1 = sub[:, None]
        per_copy = w / c
        size = np.take_along_axis(per_copy, ex, axis=1)
        load = size.reshape(b, gpus, slots).sum(axis=2)
        top = load.argmax(axis=1)
        peak = load[sub, top]
        keep = peak > peak_limit[active]
        if budget is not None:
            keep &= (ex != start[active]).sum(axis=1) < budget[active]
        if not keep.all():
            active = active[keep]
            continue
        ex3, sz3, pn3 = ex.reshape(b, gpus, slots), size.reshape(b, gpus, slots), pn.reshape(b, gpus, slots)
        e_top = ex3[sub, top]  # [b, S]
        c_top = np.take_along_axis(c, e_top, axis=1).astype(np.float64)
        w_top = np.take_along_axis(w, e_top, axis=1)
        limit = item_limit[active]
        on_top = (gpu_ids[None, :] == top[:, None]).astype(np.float64)  # [b, G]
        holds_top = _holders(ex3, e_top)  # [b, S, G]: GPUs holding each expert of the top GPU

        # Swaps (cost 2) with the `near` lightest GPUs (all GPUs when nothing else helps, below).
        everyone = np.broadcast_to(gpu_ids, (b, gpus))
        light = np.argpartition(load, near - 1, axis=1)[:, :near] if near < gpus else everyone
        score = swap_scores_for(ex3, sz3, pn3, load, top, peak, light, gpu_node)
        swap_best = score.argmin(axis=1)
        swap_max = score[sub, swap_best]
        swap_partner = light[sub, (swap_best // slots) % light.shape[1]]

        # Park (cost 1): top copy of x (>= 2 copies, not pinned) -> copy of the cheapest y.
        on_top_expert = np.zeros((b, num_logical), dtype=bool)
        on_top_expert[s1, e_top] = True
        y_cost = np.where((c < gpus) & ~on_top_expert, w / (c + 1.0), np.inf)
        park_y = y_cost.argmin(axis=1)
        park_ok = (c_top >= 2) & ~pn3[sub, top] & (w_top / np.maximum(c_top - 1, 1) <= limit[:, None])
        park_ok &= np.isfinite(y_cost[sub, park_y])[:, None]
        grow_x = w_top / np.maximum(c_top - 1.0, 1.0) - w_top / c_top  # [b, S]
        y_w, y_c = w[sub, park_y], c[sub, park_y]
        shrink_y = y_w / (y_c + 1.0) - y_w / y_c  # [b]
        holds_y = _holders(ex3, park_y[:, None])[:, 0]  # [b, G]
        change = holds_top * grow_x[..., None] + (holds_y * shrink_y[:, None])[:, None, :]
        change -= on_top[:, None, :] * (grow_x + w_top / c_top - (y_w / (y_c + 1.0))[:, None])[..., None]
        # Judge a move by the GPUs it changes (loads are >= 0, so zeroing the others is neutral):
        # with several GPUs at the maximum, lowering one of them is progress.
        touched = (change != 0) | (on_top[:, None, :] > 0)
        park_max = ((load[:, None, :] + change) * touched).max(axis=2) + (~park_ok) * INVALID  # [b, S]
        park_best = park_max.argmin(axis=1)

        # Split (cost 1): expert y of the top GPU gets a copy in slot s on a light GPU.
        cand_slot = (light[:, :, None] * slots + np.arange(slots)).reshape(b, -1)  # [b, C]
        x_slot = np.take_along_axis(ex, cand_slot, axis=1)
        c_slot = np.take_along_axis(c, x_slot, axis=1).astype(np.float64)
        w_slot = np.take_along_axis(w, x_slot, axis=1)
        slot_ok = (c_slot >= 2) & ~np.take_along_axis(pn, cand_slot, axis=1) & (w_slot / np.maximum(c_slot - 1, 1) <= limit[:, None])
        new_y = w_top / (c_top + 1.0)  # [b, S]
        cand_gpu = cand_slot // slots
        cand_ok = slot_ok[:, None, :] & (c_top < gpus)[..., None]
        cand_ok &= np.take_along_axis(holds_top, np.broadcast_to(cand_gpu[:, None, :], (b, slots, cand_gpu.shape[1])), axis=2) == 0
        # Rank slots by the larger of: the new load of the slot's GPU, and the heaviest GPU among
        # the donor's holders after its copies grow (the donor's own GPU counted, pessimistically).
        effect = load[s1, cand_gpu][:, None, :] + new_y[..., None] - np.take_along_axis(size, cand_slot, axis=1)[:, None, :]
        donor_peak = _holder_peak(ex, load[:, np.arange(topo.num_replicas) // slots], num_logical)
        donor_peak = np.take_along_axis(donor_peak, cand_slot, axis=1) + w_slot / np.maximum(c_slot - 1.0, 1.0) - w_slot / c_slot
        gap = effect - donor_peak[:, None, :]
        worst = 0.5 * (effect + donor_peak[:, None, :] + np.abs(gap))  # max(effect, donor_peak)
        pick = (worst + (~cand_ok) * INVALID).argmin(axis=2)  # [b, S]
        split_ok = np.take_along_axis(cand_ok, pick[..., None], axis=2)[..., 0]
        split_slot = np.take_along_axis(cand_slot, pick, axis=1)  # [b, S]
        xs = np.take_along_axis(ex, split_slot, axis=1)
        cx = np.take_along_axis(c, xs, axis=1).astype(np.float64)
        wx = np.take_along_axis(w, xs, axis=1)
        holds_xs = _holders(ex3, xs)  # [b, S, G]
        at_s = (gpu_ids[None, None, :] == (split_slot // slots)[..., None]).astype(np.float64)
        change = holds_top * (new_y - w_top / c_top)[..., None]
        change += holds_xs * (wx / np.maximum(cx - 1.0, 1.0) - wx / cx)[..., None]
        change += at_s * (new_y - wx / np.maximum(cx - 1.0, 1.0))[..., None]
        touched = (holds_top > 0) | (holds_xs > 0) | (at_s > 0)
        split_max = ((load[:, None, :] + change) * touched).max(axis=2) + (~split_ok) * INVALID
        split_best = split_max.argmin(axis=1)

        gains = np.stack([
            (peak - swap_max) / 2.0,
            peak - park_max[sub, park_best],
            peak - split_max[sub, split_best],
        ], axis=1)
        gains = gains * (gains > tolerance_of(peak)[:, None])
        stuck = np.nonzero(gains.max(axis=1) <= 0)[0]
        if stuck.size and light.shape[1] < gpus:
            # Nothing helps with the light GPUs: try swaps with every GPU.
            full = swap_scores_for(ex3[stuck], sz3[stuck], pn3[stuck], load[stuck], top[stuck], peak[stuck], everyone[stuck], gpu_node)
            best = full.argmin(axis=1)
            best_max = full[np.arange(stuck.size), best]
            swap_best[stuck] = best
            swap_partner[stuck] = (best // slots) % gpus
            gains[stuck, 0] = (peak[stuck] - best_max) / 2.0
            gains[stuck, 0] *= gains[stuck, 0] > tolerance_of(peak[stuck])
        kind = gains.argmax(axis=1)
        go = gains[sub, kind] > 0
        if not go.any():
            active = active[go]
            continue
        for k in range(3):
            r = np.nonzero(go & (kind == k))[0]
            if r.size == 0:
                continue
            layer = active[r]
            if k == 0:
                choice = swap_best[r]
                width = np.where(np.isin(r, stuck), gpus, light.shape[1])
                slot_a = top[r] * slots + choice // (width * slots)
                slot_b = swap_partner[r] * slots + choice % slots
                for array in (experts, pinned):
                    held = array[layer, slot_a].copy()
                    array[layer, slot_a] = array[layer, slot_b]
                    array[layer, slot_b] = held
                continue
            if k == 1:
                slot = top[r] * slots + park_best[r]
                new = park_y[r]
            else:
                slot = split_slot[r, split_best[r]]
                new = e_top[r, split_best[r]]
            old = experts[layer, slot]
            experts[layer, slot] = new
            counts[layer, old] -= 1
            counts[layer, new] += 1
        active = active[go]


def swap_scores_for(ex3, sz3, pn3, load, top, peak, partners, gpu_node):
    """`packing.swap_scores` for the heaviest GPU `top` of each row against `partners` `[b, K]`."""
    sub = np.arange(ex3.shape[0])
    s1 = sub[:, None]
    return swap_scores(
        ex3[sub, top], sz3[sub, top], pn3[sub, top], peak,
        ex3[s1, partners], sz3[s1, partners], pn3[s1, partners], load[s1, partners],
        gpu_node[partners] == gpu_node[top][:, None],
    )
