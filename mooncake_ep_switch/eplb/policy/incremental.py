"""Movement-aware rebalancing: start from the deployed placement and move as few copies as possible.

Every slot whose logical expert changes costs one expert copy written during the rebalance. Per
layer, with `b_fresh` the balancedness of a fresh placement for the new load and
`target = b_fresh - balance_tolerance`:

0. repair: give a copy to any logical expert missing from the previous placement, separate
   two copies sharing a GPU, and (hierarchical) put a copy of every expert on its group's node;
1. if the layer's balancedness is already >= target, keep it as it is (moves nothing). A cheap
   upper bound on `b_fresh` (perfect balance, or the smallest possible largest copy) settles
   most unchanged layers without computing a fresh placement at all. In global mode a fresh
   placement nearly always reaches that bound, so the search aims at the bound and fresh
   placements are computed only for layers that miss it; hierarchical mode computes them first;
2. transfers (one copy each): while some expert's copy load exceeds `ITEM_SHARE` of the mean
   GPU load (or the fresh placement's largest copy, if larger), overwrite a spare copy of
   another expert with a copy of it, choosing the slot that lowers the sum of squared GPU loads
   most; hierarchical mode then relieves overloaded nodes the same way (node relief: the
   pinned primaries cannot leave their node, extra copies elsewhere can take their load);
3. improve (`local_search.search`, compiled): lower the heaviest GPU while it is above the
   target (the next `HEAVY` heaviest when it has no move) by swaps, parks and splits ranked by
   drop per moved copy, a slot that has already changed costing nothing more (the copies placed
   by transfers get rearranged for free). Hierarchical layers that miss get up to `RETRIES` more
   rounds of node relief and search; then changed slots whose start expert can come back
   without leaving the target get it back;
4. a layer still above the target (or past `MAX_SHARE` of its slots moved) gets more searches
   from the deployed table with other copy sizes, node headroom and partners (`RESCUES`); if those
   miss too, it takes the fresh placement with its GPUs matched to the previous ones and slots kept
   where the expert stays (in hierarchical mode also a fresh placement that keeps the previous
   groups on their nodes, when that is within the tolerance and moves fewer copies).

Hierarchical mode keeps the previous assignment of groups to nodes (groups matched to nodes that
hold all their experts), so primaries do not move between nodes except in the fallback.
"""
from typing import Optional

import numpy as np

from mooncake_ep_switch.eplb.policy.alignment import align_to_previous
from mooncake_ep_switch.eplb.policy.construct import Topology, fresh_placement, lpt_balance
from mooncake_ep_switch.eplb.policy.tables import expert_counts
from mooncake_ep_switch.eplb.policy.local_search import search
from mooncake_ep_switch.eplb.policy.metrics import balance_of_loads
from mooncake_ep_switch.eplb.policy.previous import infer_group_nodes, pinned_flags, repair_previous
from mooncake_ep_switch.eplb.policy.replication import replica_counts

NODE_MARGIN = 0.995  # node relief aims each node at this share of its GPUs' target load
RETRIES = 3  # hierarchical: more rounds of node relief (0.5 % lower each) and search for layers that miss
MAX_SHARE = 0.45  # the search gives up on a layer after moving this share of its slots
ITEM_SHARE = 0.75  # moves may grow a copy up to this share of the mean GPU load
HEAVY = 4  # heavy GPUs the local search tries in turn when the heaviest has no move
# Layers that miss get more searches from the deployed table, in this order, until one reaches the
# target: (item share, node margin, light partner GPUs or None for all).
RESCUES = ((0.6, 0.98, 0), (ITEM_SHARE, 0.98, None), (ITEM_SHARE, NODE_MARGIN, None))


def movement_aware_placement(
    weight: np.ndarray, topo: Topology, previous: np.ndarray, tolerance: float, item_share: Optional[float] = None
) -> np.ndarray:
    """Rebalance from a previous placement, moving few copies (see the module docstring).

    Arguments:
        weight: `[L, E]` float64, load of each logical expert.
        topo: the problem's shape and mode.
        previous: `[L, R]` int64, the deployed slot table (validated shape and range).
        tolerance: absolute balancedness the result may lose against a fresh placement, per layer.
        item_share: moves may grow a copy's load up to this fraction of the mean GPU load (or
            the fresh placement's largest copy, if larger); None for `ITEM_SHARE`.

    Returns:
        phy2log: `[L, R]` int64, the new slot table.
    """
    item_share = ITEM_SHARE if item_share is None else item_share
    num_layers = weight.shape[0]
    slots = topo.slots_per_gpu
    slot_node = topo.gpu_node()[np.arange(topo.num_replicas) // slots]
    mean_load = weight.sum(axis=1) / topo.num_gpus

    experts = previous.copy()
    group_node = home = None
    if topo.hierarchical:
        group_node = infer_group_nodes(previous, topo)
        home = np.repeat(group_node, topo.num_logical // topo.num_groups, axis=1)
    repair_previous(weight, experts, topo, home)
    repaired = experts.copy()
    counts = expert_counts(experts, topo.num_logical)

    def peak_of(table, cnt):  # [L] heaviest GPU load of every layer
        per_slot = np.take_along_axis(weight / np.maximum(cnt, 1), table, axis=1)
        return per_slot.reshape(num_layers, topo.num_gpus, slots).sum(axis=2).max(axis=1)

    def limit_of(balance, rows):  # [n] the heaviest GPU load allowed for a target balancedness
        target = balance - tolerance
        return np.where(target > 0, mean_load[rows] / np.maximum(target, 1e-300), np.inf)

    # A fresh placement can do no better than the largest copy allows (or perfect balance); layers
    # already within the tolerance of that bound need no fresh placement and keep everything.
    peak = peak_of(experts, counts)
    counts_fresh = replica_counts(weight, topo.num_replicas, topo.num_gpus)
    largest_copy = (weight / counts_fresh).max(axis=1)
    best_case = np.maximum(mean_load, largest_copy)
    prev_balance = np.where(peak > 0, mean_load / np.where(peak > 0, peak, 1.0), 1.0)
    bound = np.where(best_case > 0, mean_load / np.where(best_case > 0, best_case, 1.0), 1.0)
    maybe = np.nonzero(prev_balance < bound - tolerance)[0]
    if maybe.size == 0:
        return experts
    peak_limit = np.full(num_layers, np.inf)
    fresh_limit = np.zeros(num_layers)  # the fresh placement's largest copy
    fresh_table = {}  # layer -> fresh slot table, computed only where needed

    def fresh_for(rows):  # compute fresh placements and their targets for these layers
        fresh = fresh_placement(weight[rows], topo)
        peak_limit[rows] = limit_of(balance_of_loads(fresh.sizes.sum(axis=2)), rows)
        fresh_limit[rows] = fresh.sizes.max(axis=(1, 2))
        fresh_table.update(zip(rows.tolist(), fresh.experts.reshape(rows.size, topo.num_replicas)))

    if topo.hierarchical:
        fresh_for(maybe)
    else:
        # Global mode: a fresh placement nearly always reaches the bound, so aim at the bound and
        # compute fresh placements only for the layers that miss it, and for layers that might
        # already be within the tolerance of one (the LPT construction bounds it from below).
        peak_limit[maybe] = limit_of(bound[maybe], maybe)
        fresh_limit[maybe] = largest_copy[maybe]
        unsure = maybe[prev_balance[maybe] >= lpt_balance(weight[maybe], counts_fresh[maybe], topo) - tolerance]
        if unsure.size:
            fresh_for(unsure)
    work = maybe[peak[maybe] > peak_limit[maybe] * (1 + 1e-12)]
    if work.size == 0:
        return experts
    budget = np.full(num_layers, int(MAX_SHARE * topo.num_replicas))
    pinned = pinned_flags(experts, home, slot_node) if home is not None else np.zeros(experts.shape, dtype=bool)
    item_limit = np.maximum(fresh_limit, item_share * mean_load)
    _search(weight, experts, counts, pinned, topo, peak_limit, item_limit, work, repaired, budget)

    def missed(rows):
        moved = (experts[rows] != repaired[rows]).sum(axis=1)
        return rows[(peak_of(experts, counts)[rows] > peak_limit[rows] * (1 + 1e-9)) | (moved > budget[rows])]

    failed = missed(work)
    if failed.size and not topo.hierarchical:
        # The bound was out of reach: aim at the fresh placement instead, from where the search is.
        fresh_for(failed)
        item_limit[failed] = np.maximum(fresh_limit[failed], item_share * mean_load[failed])
        _search(weight, experts, counts, pinned, topo, peak_limit, item_limit, failed, repaired, budget)
        failed = missed(failed)
    for rescue_share, rescue_margin, rescue_near in RESCUES:
        if failed.size == 0:
            break
        # Another search from the deployed table (other copy sizes, node headroom, partners)
        # takes another path; layers it brings within the target keep its result.
        keep = experts[failed].copy(), counts[failed].copy(), pinned[failed].copy()
        experts[failed], counts[failed] = repaired[failed], expert_counts(repaired[failed], topo.num_logical)
        if home is not None:
            pinned[failed] = pinned_flags(repaired[failed], home[failed], slot_node)
        item_limit[failed] = np.maximum(fresh_limit[failed], rescue_share * mean_load[failed])
        _search(weight, experts, counts, pinned, topo, peak_limit, item_limit, failed, repaired, budget, rescue_margin,
                near=topo.num_gpus - 1 if rescue_near is None else rescue_near)
        still = missed(failed)
        back = np.isin(failed, still)
        experts[failed[back]], counts[failed[back]], pinned[failed[back]] = (a[back] for a in keep)
        failed = still
    if failed.size == 0:
        return experts
    # Fallback: the fresh placement relabelled to overlap the previous one (in hierarchical mode
    # also a fresh placement keeping the previous groups on their nodes, if within the target).
    fresh_rows = np.array([r for r in failed.tolist() if r not in fresh_table], dtype=np.int64)
    if fresh_rows.size:
        fresh_for(fresh_rows)
    replacement = align_to_previous(np.stack([fresh_table[r] for r in failed.tolist()]), repaired[failed], topo)
    if group_node is not None:
        kept = fresh_placement(weight[failed], topo, group_node=group_node[failed])
        kept_table = align_to_previous(kept.experts.reshape(-1, topo.num_replicas), repaired[failed], topo)
        kept_ok = kept.sizes.sum(axis=2).max(axis=1) <= peak_limit[failed] * (1 + 1e-9)
        kept_ok &= (kept_table != repaired[failed]).sum(axis=1) < (replacement != repaired[failed]).sum(axis=1)
        replacement[kept_ok] = kept_table[kept_ok]
    experts[failed] = replacement
    return experts


def _search(weight, experts, counts, pinned, topo: Topology, peak_limit, item_limit, rows, start, budget, margin=None,
            near=0) -> None:
    """Transfers, node relief (hierarchical), the local search and its retries, in place, for `rows`."""
    search(weight, experts, counts, pinned, topo, peak_limit, item_limit, rows, start=start, budget=budget,
           node_margin=NODE_MARGIN if margin is None else margin, retries=RETRIES if topo.hierarchical else 0,
           heavy=HEAVY, near=near)
