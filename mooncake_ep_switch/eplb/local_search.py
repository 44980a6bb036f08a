"""Local search for the movement-aware rebalance: lower the heavy GPUs per moved copy.

`split_large_copies` gives copies to experts whose copy load is too large (one moved copy each);
`relieve_nodes` (hierarchical mode) gives experts of an overloaded node copies on other nodes;
`improve` then lowers every GPU above the target with swaps, parks and splits, ranking moves by
the drop of the heavy GPU's load per moved copy, where a slot that already changed costs nothing
more (so copies placed by earlier moves are rearranged for free).
"""
import numpy as np

from mooncake_ep_switch.eplb.construct import Topology
from mooncake_ep_switch.eplb.packing import INVALID, swap_scores

FREE = 0.25  # added to a move's cost (moved copies) when ranking gains per cost
NEAR = 8  # light partner GPUs per heavy GPU in the local search (hierarchical mode)
NEAR_GLOBAL = 4  # the same in global mode (no primaries pinned to nodes: fewer suffice)
SPLIT_ITEMS = 3  # the largest copies of a heavy GPU that a split considers
MIN_GAIN = 1e-6  # a move must lower the heaviest GPU by this fraction (per cost) to count


def _move_copies(experts, counts, active, receiver, go, choice):
    """Give slot `choice` of every row `active[go]` to its `receiver` expert; returns the rows moved."""
    rows, slot = active[go], choice[go]
    donor = experts[rows, slot]
    experts[rows, slot] = receiver[go]
    counts[rows, receiver[go]] += 1
    counts[rows, donor] -= 1
    return rows


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
        active = _move_copies(experts, counts, active, receiver, go, choice)


def relieve_nodes(weight, experts, counts, pinned, topo: Topology, node_limit, item_limit, active: np.ndarray) -> None:
    """Hierarchical mode: give experts of an overloaded node copies on other nodes, in place.

    A node whose pinned primaries grew heavier cannot shed them by swaps (a primary stays in its
    node); while the heaviest node's load exceeds `node_limit`, its expert with the largest
    reduction of the node's load per extra copy gets one more copy, overwriting a spare copy
    (an expert with >= 2 copies, not pinned) on another node. Only slots after which every node
    is lighter than the heaviest node was are used (so this never cycles); among them, the one
    lowering the sum of squared GPU loads most. One moved copy each.

    Arguments:
        weight: `[L, E]` float64.
        experts: `[L, R]` int64 slot table (modified).
        counts: `[L, E]` int64 copies (modified).
        pinned: `[L, R]` bool primaries (never overwritten).
        topo: the problem's shape (hierarchical).
        node_limit: `[L]` float64, the largest node load wanted.
        item_limit: `[L]` float64, the largest copy load allowed to appear.
        active: int64 layer indices to work on.
    """
    slots, gpus, nodes = topo.slots_per_gpu, topo.num_gpus, topo.num_nodes
    slot_gpu = np.arange(topo.num_replicas) // slots
    slot_node = topo.gpu_node()[slot_gpu]
    at_node = (slot_node[:, None] == np.arange(nodes)[None, :]).astype(np.float64)  # [R, N]
    for _ in range(topo.num_replicas - topo.num_logical):
        if active.size == 0:
            return
        w, ex, c, pn = weight[active], experts[active], counts[active], pinned[active]
        b = active.size
        sub = np.arange(b)
        per_copy = w / c
        size = np.take_along_axis(per_copy, ex, axis=1)
        gpu_load = size.reshape(b, gpus, slots).sum(axis=2)
        node_load = gpu_load.reshape(b, nodes, -1).sum(axis=2)
        heavy = node_load.argmax(axis=1)
        peak = node_load[sub, heavy]
        need = peak > node_limit[active] * (1 + 1e-12)
        per_node = np.zeros((b, w.shape[1], nodes))  # copies of each expert on each node
        np.add.at(per_node, (np.broadcast_to(sub[:, None], ex.shape), ex, np.broadcast_to(slot_node, ex.shape)), 1.0)
        # Receiver: the expert whose extra copy lowers the heavy node most.
        new_size = w / (c + 1.0)
        shrink = per_copy - new_size
        gain = per_node[sub, :, heavy] * shrink
        gain = np.where((c < gpus) & (new_size <= item_limit[active][:, None]), gain, -1.0)
        receiver = gain.argmax(axis=1)
        ok_receiver = gain[sub, receiver] > 0
        holds = (ex == receiver[:, None]).reshape(b, gpus, slots).any(axis=2)
        donor_count = np.take_along_axis(c, ex, axis=1)
        donor_w = np.take_along_axis(w, ex, axis=1)
        donor_after = donor_w / np.maximum(donor_count - 1, 1)
        usable = (donor_count >= 2) & ~pn & ~holds[:, slot_gpu] & (ex != receiver[:, None])
        usable &= donor_after <= item_limit[active][:, None]
        # Node loads after the move, for every candidate slot: the receiver's copies shrink, the
        # donor's other copies grow, the slot's node swaps the donor copy for the new copy.
        base = node_load - per_node[sub, receiver] * shrink[sub, receiver][:, None]  # [b, N]
        grow = donor_after - size  # [b, R]
        donor_nodes = np.take_along_axis(per_node, ex[..., None], axis=1)  # [b, R, N]
        after = base[:, None, :] + donor_nodes * grow[..., None]
        after += at_node[None] * (new_size[sub, receiver][:, None] - donor_after)[..., None]
        usable &= after.max(axis=2) < peak[:, None] * (1 - 1e-12)
        change = new_size[sub, receiver][:, None] - size
        effect = change * (gpu_load[:, slot_gpu] + 0.5 * change)
        choice = np.where(usable, effect, np.inf).argmin(axis=1)
        go = need & ok_receiver & usable[sub, choice]
        if not go.any():
            return
        active = _move_copies(experts, counts, active, receiver, go, choice)


def improve(
    weight, experts, counts, pinned, topo: Topology, peak_limit, item_limit, rows, max_steps: int,
    start=None, budget=None, near: int = 0, parallel: int = 8, swap_from: int = 0,
) -> None:
    """Lower every GPU above `peak_limit` until none is left, moving few copies.

    Each step takes, in every active layer, up to `parallel` GPUs above the limit (heaviest
    first). For each such "heavy" GPU it finds the best of three kinds of moves:

    - swap one of its copies with a copy on a light GPU (two copies move);
    - park: overwrite one of its copies of an expert that has other copies with a copy of the
      expert whose copy load is smallest (one copy moves; the expert's other copies grow);
    - split: give one of its experts an extra copy on a light GPU, overwriting a spare copy
      there (one copy moves; all copies of the expert shrink).

    Each heavy GPU gets its own `near` light partner GPUs (the lightest, dealt round-robin), and
    falls back to swaps with every GPU when nothing helps. A move is judged by the largest new
    load among the GPUs it changes (computed exactly) against the heavy GPU's load, per cost:
    the slots it changes that still hold their `start` expert (a slot changed already costs
    nothing more), plus `FREE`. The moves of a step that touch disjoint sets of GPUs (a park or
    split touches every GPU holding the experts whose copy count changes) are applied together,
    best first. No move makes a copy larger than `item_limit`, moves a pinned primary off its
    node, or puts two copies of an expert on one GPU. Modifies `experts`, `counts` and `pinned`
    (swapped along with their copies) in place.

    Arguments:
        weight: `[L, E]` float64.
        experts: `[L, R]` int64 slot table (modified).
        counts: `[L, E]` int64 copies (modified).
        pinned: `[L, R]` bool primaries (modified: moved along with swapped copies).
        topo: the problem's shape.
        peak_limit: `[L]` float64, the maximum GPU load to reach.
        item_limit: `[L]` float64, the largest copy load allowed to appear.
        rows: int64 layer indices to work on.
        max_steps: the most steps.
        start: `[L, R]` int64, the table moves are counted against, or None (every move costs).
        budget: `[L]` int64, a layer stops once it has moved this many copies (needs `start`).
        near: light partner GPUs per heavy GPU (0: `NEAR`, or `NEAR_GLOBAL` in global mode).
        parallel: the most heavy GPUs handled per layer and step.
        swap_from: swaps consider only the slot positions `>= swap_from` of each GPU (the
            positions before hold copies that never move, e.g. fixed primaries).
    """
    slots, gpus, num_logical = topo.slots_per_gpu, topo.num_gpus, topo.num_logical
    gpu_node = topo.gpu_node()
    slot_gpu = np.arange(topo.num_replicas) // slots
    near = max(1, min(near or (NEAR if topo.hierarchical else NEAR_GLOBAL), gpus - 1))
    gpu_ids = np.arange(gpus)
    active = np.asarray(rows, dtype=np.int64)
    for _ in range(max_steps):
        if active.size == 0:
            return
        lw, lex, lc, lpn = weight[active], experts[active], counts[active], pinned[active]
        nb = active.size
        lsize = np.take_along_axis(lw / lc, lex, axis=1)
        lload = lsize.reshape(nb, gpus, slots).sum(axis=2)
        limit_of = peak_limit[active]
        keep = lload.max(axis=1) > limit_of
        if budget is not None:
            keep &= (lex != start[active]).sum(axis=1) < budget[active]
        if not keep.all():
            active = active[keep]
            continue
        lunchanged = np.ones(lex.shape) if start is None else (lex == start[active]).astype(np.float64)
        # holder[l, e, g]: GPU g holds a copy of expert e; expert_peak: the heaviest such GPU.
        holder = np.zeros((nb, num_logical, gpus), dtype=bool)
        holder[np.arange(nb)[:, None], lex, slot_gpu[None, :]] = True
        expert_peak = np.zeros(nb * num_logical)
        np.maximum.at(expert_peak, (np.arange(nb)[:, None] * num_logical + lex).ravel(), lload[:, slot_gpu].ravel())
        expert_peak = expert_peak.reshape(nb, num_logical)

        # Rows: (layer, heavy GPU) pairs; each heavy GPU's partners are light GPUs dealt round-robin.
        order = np.argsort(-lload, axis=1, kind="stable")
        heavy_count = np.clip((lload > limit_of[:, None]).sum(axis=1), 1, min(parallel, gpus - 1))
        ri, rk = np.nonzero(np.arange(min(parallel, gpus - 1))[None, :] < heavy_count[:, None])
        top = order[ri, rk]
        light = order[ri][:, ::-1][:, :near]  # the lightest GPUs, shared by the layer's rows
        # Per-row views are gathered through `ri` (the row's layer), never copied per row.
        r1 = ri[:, None]
        ex3, sz3, pn3 = lex.reshape(nb, gpus, slots), lsize.reshape(nb, gpus, slots), lpn.reshape(nb, gpus, slots)
        unchanged3 = lunchanged.reshape(nb, gpus, slots)
        load = lload[ri]
        b = ri.size
        sub = np.arange(b)
        s1 = sub[:, None]
        peak = load[sub, top]
        e_top = ex3[ri, top]  # [b, S]
        c_top = lc[r1, e_top].astype(np.float64)
        w_top = lw[r1, e_top]
        limit = item_limit[active][ri]
        on_top = (gpu_ids[None, :] == top[:, None]).astype(np.float64)  # [b, G]
        holds_top = holder[r1, e_top].astype(np.float64)  # [b, S, G]: GPUs holding each expert of the top GPU
        cost_top = unchanged3[ri, top]  # [b, S]

        # Swaps with the light partners.
        score = _swaps(ex3, sz3, pn3, load, top, peak, light, gpu_node, holder, ri, swap_from)
        swap_cost = (cost_top[:, swap_from:, None, None] + unchanged3[r1, light][:, None, :, swap_from:]).reshape(b, -1)
        swap_rel = (peak[:, None] - score) / (swap_cost + FREE)
        swap_best = swap_rel.argmax(axis=1)
        swap_gain = swap_rel[sub, swap_best]
        swap_width = np.full(b, light.shape[1])
        movable = slots - swap_from
        swap_partner = light[sub, (swap_best // movable) % light.shape[1]]

        # Park (cost 1): top copy of x (>= 2 copies, not pinned) -> copy of the cheapest y.
        # y: per layer the `slots + 1` experts with the smallest copy load after one more copy;
        # each row takes the first one its heavy GPU does not hold.
        y_cost = np.where(lc < gpus, lw / (lc + 1.0), np.inf)
        few = min(slots + 1, num_logical)
        if few < num_logical:
            cheap = np.argpartition(y_cost, few - 1, axis=1)[:, :few]
        else:
            cheap = np.broadcast_to(np.arange(num_logical), (nb, num_logical))
        cheap = np.take_along_axis(cheap, np.argsort(np.take_along_axis(y_cost, cheap, axis=1), axis=1, kind="stable"), axis=1)
        choices = cheap[ri]  # [b, few]
        usable_y = ~(choices[:, :, None] == e_top[:, None, :]).any(axis=2) & np.isfinite(y_cost[r1, choices])
        park_y = choices[sub, usable_y.argmax(axis=1)]
        park_ok = (c_top >= 2) & ~pn3[ri, top] & (w_top / np.maximum(c_top - 1, 1) <= limit[:, None])
        park_ok &= usable_y.any(axis=1)[:, None]
        park_max = np.full((b, slots), INVALID)
        pr = np.nonzero(park_ok.any(axis=1))[0]  # rows with something to park (often few)
        holds_y = np.zeros((b, gpus))
        if pr.size:
            wt, ct = w_top[pr], c_top[pr]
            grow_x = wt / np.maximum(ct - 1.0, 1.0) - wt / ct  # [p, S]
            y_w, y_c = lw[ri[pr], park_y[pr]], lc[ri[pr], park_y[pr]]
            shrink_y = y_w / (y_c + 1.0) - y_w / y_c  # [p]
            holds_y[pr] = holder[ri[pr], park_y[pr]]
            change = holds_top[pr] * grow_x[..., None] + (holds_y[pr] * shrink_y[:, None])[:, None, :]
            change -= on_top[pr][:, None, :] * (grow_x + wt / ct - (y_w / (y_c + 1.0))[:, None])[..., None]
            # Judge a move by the GPUs it changes (loads are >= 0, so zeroing the others is neutral).
            touched = (change != 0) | (on_top[pr][:, None, :] > 0)
            park_max[pr] = ((load[pr][:, None, :] + change) * touched).max(axis=2) + (~park_ok[pr]) * INVALID  # [p, S]
        park_rel = (peak[:, None] - park_max) / (cost_top + FREE)
        park_best = park_rel.argmax(axis=1)

        # Split (cost 1): one of the `SPLIT_ITEMS` largest experts y of the top GPU gets a copy in
        # slot s on a light GPU (smaller items would gain little).
        q = min(SPLIT_ITEMS, slots)
        split_pos = np.argsort(-sz3[ri, top], axis=1, kind="stable")[:, :q]  # [b, Q]
        e_q = np.take_along_axis(e_top, split_pos, axis=1)
        c_q = np.take_along_axis(c_top, split_pos, axis=1)
        w_q = np.take_along_axis(w_top, split_pos, axis=1)
        holds_q = holder[ri[:, None], e_q]  # [b, Q, G]
        cand_slot = (light[:, :, None] * slots + np.arange(slots)).reshape(b, -1)  # [b, C]
        x_slot = lex[r1, cand_slot]
        c_slot = lc[r1, x_slot].astype(np.float64)
        w_slot = lw[r1, x_slot]
        slot_ok = (c_slot >= 2) & ~lpn[r1, cand_slot] & (w_slot / np.maximum(c_slot - 1, 1) <= limit[:, None])
        new_y = w_q / (c_q + 1.0)  # [b, Q]
        cand_gpu = cand_slot // slots
        cand_ok = slot_ok[:, None, :] & (c_q < gpus)[..., None]
        cand_ok &= ~holds_q[s1[:, :, None], np.arange(q)[None, :, None], cand_gpu[:, None, :]]
        # Rank slots by the larger of: the new load of the slot's GPU, and the heaviest GPU among
        # the donor's holders after its copies grow (the donor's own GPU counted, pessimistically).
        effect = load[s1, cand_gpu][:, None, :] + new_y[..., None] - lsize[r1, cand_slot][:, None, :]
        donor_peak = expert_peak[ri[:, None], x_slot] + w_slot / np.maximum(c_slot - 1.0, 1.0) - w_slot / c_slot
        gap = effect - donor_peak[:, None, :]
        worst = 0.5 * (effect + donor_peak[:, None, :] + np.abs(gap))  # max(effect, donor_peak)
        pick = (worst + (~cand_ok) * INVALID).argmin(axis=2)  # [b, Q]
        split_ok = np.take_along_axis(cand_ok, pick[..., None], axis=2)[..., 0]
        split_slot = np.take_along_axis(cand_slot, pick, axis=1)  # [b, Q]
        xs = lex[r1, split_slot]
        cx = lc[r1, xs].astype(np.float64)
        wx = lw[r1, xs]
        holds_xs = holder[ri[:, None], xs]  # [b, Q, G]
        at_s = gpu_ids[None, None, :] == (split_slot // slots)[..., None]
        change = holds_q * (new_y - w_q / c_q)[..., None]
        change += holds_xs * (wx / np.maximum(cx - 1.0, 1.0) - wx / cx)[..., None]
        change += at_s * (new_y - wx / np.maximum(cx - 1.0, 1.0))[..., None]
        split_touched = holds_q | holds_xs | at_s
        split_max = ((load[:, None, :] + change) * split_touched).max(axis=2) + (~split_ok) * INVALID
        split_rel = (peak[:, None] - split_max) / (lunchanged[r1, split_slot] + FREE)
        split_best = split_rel.argmax(axis=1)

        gains = np.stack([swap_gain, park_rel[sub, park_best], split_rel[sub, split_best]], axis=1)
        gains = gains * (gains > MIN_GAIN * peak[:, None])
        stuck = np.nonzero(gains.max(axis=1) <= 0)[0]
        if stuck.size and light.shape[1] < gpus:
            # Nothing helps with the light partners: try swaps with every GPU.
            everyone = np.broadcast_to(gpu_ids, (stuck.size, gpus))
            full = _swaps(ex3, sz3, pn3, load[stuck], top[stuck], peak[stuck], everyone, gpu_node, holder, ri[stuck], swap_from)
            full_cost = (cost_top[stuck][:, swap_from:, None, None] + unchanged3[ri[stuck]][:, None, :, swap_from:]).reshape(stuck.size, -1)
            full_rel = (peak[stuck][:, None] - full) / (full_cost + FREE)
            best = full_rel.argmax(axis=1)
            swap_best[stuck] = best
            swap_width[stuck] = gpus
            swap_partner[stuck] = (best // movable) % gpus
            gains[stuck, 0] = full_rel[np.arange(stuck.size), best]
            gains[stuck, 0] *= gains[stuck, 0] > MIN_GAIN * peak[stuck]
        kind = gains.argmax(axis=1)
        gain = gains[sub, kind]
        go = gain > 0
        if not go.any():
            active = np.zeros(0, dtype=np.int64)
            continue

        # GPUs each move touches; accept moves of a layer best first while they are disjoint.
        touched_swap = on_top + (gpu_ids[None, :] == swap_partner[:, None])
        touched_park = (on_top + holds_top[sub, park_best] + holds_y) > 0
        touched_split = split_touched[sub, split_best]
        moved = np.where((kind == 0)[:, None], touched_swap > 0, np.where((kind == 1)[:, None], touched_park, touched_split))
        rank_order = np.lexsort((-gain, ri))
        position = np.empty(b, dtype=np.int64)
        first = np.r_[0, np.flatnonzero(np.diff(ri[rank_order])) + 1]
        position[rank_order] = np.arange(b) - np.repeat(first, np.diff(np.r_[first, b]))
        used = np.zeros((nb, gpus), dtype=bool)
        accept = np.zeros(b, dtype=bool)
        for j in range(int(position.max()) + 1):
            r = np.nonzero((position == j) & go)[0]
            if r.size == 0:
                continue
            free = ~(used[ri[r]] & moved[r]).any(axis=1)
            r = r[free]
            accept[r] = True
            used[ri[r]] |= moved[r]
        for k in range(3):
            r = np.nonzero(accept & (kind == k))[0]
            if r.size == 0:
                continue
            layer = active[ri[r]]
            if k == 0:
                choice = swap_best[r]
                slot_a = top[r] * slots + swap_from + choice // (swap_width[r] * movable)
                slot_b = swap_partner[r] * slots + swap_from + choice % movable
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
                new = e_q[r, split_best[r]]
            old = experts[layer, slot]
            experts[layer, slot] = new
            counts[layer, old] -= 1
            counts[layer, new] += 1
        progressed = np.zeros(nb, dtype=bool)
        progressed[ri[accept]] = True
        active = active[progressed]


def _swaps(ex3, sz3, pn3, load, top, peak, partners, gpu_node, holder, layer_of, swap_from):
    """Swap scores `[b, S' * K * S']` of the slot positions `>= swap_from` (see `packing.swap_scores`).

    `ex3`, `sz3`, `pn3` are per layer (`[n, G, S]`); row i of the other arguments belongs to layer
    `layer_of[i]`. With `swap_from > 0` the fixed copies before it are not candidates, but a swap
    is still invalid when either GPU holds the incoming expert anywhere (`holder[layer, expert, gpu]`).
    """
    ex_m, sz_m, pn_m = ex3[:, :, swap_from:], sz3[:, :, swap_from:], pn3[:, :, swap_from:]
    e_a = ex_m[layer_of, top]  # [b, S']
    e_b = ex_m[layer_of[:, None], partners]  # [b, K, S']
    score = swap_scores(
        e_a, sz_m[layer_of, top], pn_m[layer_of, top], peak,
        e_b, sz_m[layer_of[:, None], partners], pn_m[layer_of[:, None], partners], load[np.arange(top.size)[:, None], partners],
        gpu_node[partners] == gpu_node[top][:, None],
    )
    if swap_from == 0:
        return score
    clash = holder[layer_of[:, None, None], e_a[:, :, None], partners[:, None, :]][..., None]  # a already on the partner
    clash = clash | holder[layer_of[:, None, None], e_b, top[:, None, None]][:, None]  # b already on the heavy GPU
    return score + clash.reshape(score.shape) * INVALID
