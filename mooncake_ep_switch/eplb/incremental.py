"""Movement-aware rebalancing: start from the deployed placement and move as few copies as possible.

Every slot whose logical expert changes costs one expert copy written during the rebalance. Per
layer, with `b_fresh` the balancedness of a fresh placement for the new load and
`target = b_fresh - balance_tolerance`:

0. repair: give a copy to any logical expert missing from the previous placement, separate
   two copies sharing a GPU, and (hierarchical) put a copy of every expert on its group's node;
1. if the layer's balancedness is already >= target, keep it as it is (moves nothing). A cheap
   upper bound on `b_fresh` (perfect balance, or the smallest possible largest copy) settles
   most unchanged layers without computing a fresh placement at all;
2. transfers (one copy each): while some expert's copy load exceeds the fresh placement's
   largest copy load, overwrite a spare copy of another expert with a copy of it, choosing the
   slot that lowers the sum of squared GPU loads most;
3. improve (`local_search.improve`): lower the heaviest GPU until it meets the target, each step taking the
   move with the best drop per moved copy among a swap (two copies), parking a spare copy on a
   cold expert (one copy) and splitting one of its experts onto a light GPU (one copy);
4. if that misses the target, or moves more than the fallback would, take the fresh placement
   with its GPUs matched to the previous ones and slots kept where the expert stays (in
   hierarchical mode also a fresh placement that keeps the previous groups on their nodes,
   when that is within the tolerance and moves fewer copies).

Hierarchical mode keeps the previous assignment of groups to nodes (groups matched to nodes that
hold all their experts), so primaries do not move between nodes except in the fallback.
"""
import numpy as np

from mooncake_ep_switch.eplb.alignment import align_to_previous
from mooncake_ep_switch.eplb.construct import Topology, fresh_placement
from mooncake_ep_switch.eplb.layout import expert_counts
from mooncake_ep_switch.eplb.local_search import improve, split_large_copies
from mooncake_ep_switch.eplb.metrics import balance_of_loads
from mooncake_ep_switch.eplb.previous import infer_group_nodes, pinned_flags, repair_previous
from mooncake_ep_switch.eplb.replication import replica_counts


def movement_aware_placement(
    weight: np.ndarray, topo: Topology, previous: np.ndarray, tolerance: float, item_share: float = 0.6
) -> np.ndarray:
    """Rebalance from a previous placement, moving few copies (see the module docstring).

    Arguments:
        weight: `[L, E]` float64, load of each logical expert.
        topo: the problem's shape and mode.
        previous: `[L, R]` int64, the deployed slot table (validated shape and range).
        tolerance: absolute balancedness the result may lose against a fresh placement, per layer.
        item_share: moves may grow a copy's load up to this fraction of the mean GPU load (or
            the fresh placement's largest copy, if larger).

    Returns:
        phy2log: `[L, R]` int64, the new slot table.
    """
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

    # A fresh placement can do no better than the largest copy allows (or perfect balance); layers
    # already within the tolerance of that bound need no fresh placement and keep everything.
    peak = peak_of(experts, counts)
    best_case = np.maximum(mean_load, (weight / replica_counts(weight, topo.num_replicas, topo.num_gpus)).max(axis=1))
    prev_balance = np.where(peak > 0, mean_load / np.where(peak > 0, peak, 1.0), 1.0)
    maybe = np.nonzero(prev_balance < np.where(best_case > 0, mean_load / np.where(best_case > 0, best_case, 1.0), 1.0) - tolerance)[0]
    if maybe.size == 0:
        return experts
    fresh = fresh_placement(weight[maybe], topo)
    target_balance = balance_of_loads(fresh.sizes.sum(axis=2)) - tolerance
    limit = np.where(target_balance > 0, mean_load[maybe] / np.maximum(target_balance, 1e-300), np.inf)
    peak_limit = np.full(num_layers, np.inf)
    peak_limit[maybe] = limit
    fresh_limit = np.zeros(num_layers)
    fresh_limit[maybe] = fresh.sizes.max(axis=(1, 2))
    fresh_table = np.zeros_like(experts)
    fresh_table[maybe] = fresh.experts.reshape(maybe.size, topo.num_replicas)

    work = maybe[peak[maybe] > limit * (1 + 1e-12)]
    if work.size == 0:
        return experts
    # The fallback, known up front: the fresh placement relabelled to overlap the previous one.
    # The incremental search gives up on a layer once it has moved as many copies.
    fallback = align_to_previous(fresh_table[work], repaired[work], topo)
    budget = np.zeros(num_layers, dtype=np.int64)
    budget[work] = (fallback != repaired[work]).sum(axis=1)
    pinned = pinned_flags(experts, home, slot_node) if home is not None else np.zeros(experts.shape, dtype=bool)
    split_large_copies(weight, experts, counts, pinned, topo, fresh_limit, work)
    # Copies up to `item_share` of the mean GPU load still pack well; never demand less than fresh.
    item_limit = np.maximum(fresh_limit, item_share * mean_load)
    improve(weight, experts, counts, pinned, topo, peak_limit * (1 + 1e-12), item_limit, work,
             max_steps=topo.num_replicas, start=repaired, budget=budget)

    moved = (experts[work] != repaired[work]).sum(axis=1)
    failed = (peak_of(experts, counts)[work] > peak_limit[work] * (1 + 1e-9)) | (moved >= budget[work])
    missed = work[failed]
    if missed.size:
        replacement = fallback[failed]
        if group_node is not None:
            # A fresh placement that keeps the previous groups on their nodes may do with fewer moves.
            kept = fresh_placement(weight[missed], topo, group_node=group_node[missed])
            kept_table = align_to_previous(kept.experts.reshape(-1, topo.num_replicas), repaired[missed], topo)
            kept_ok = kept.sizes.sum(axis=2).max(axis=1) <= peak_limit[missed] * (1 + 1e-9)
            kept_ok &= (kept_table != repaired[missed]).sum(axis=1) < (replacement != repaired[missed]).sum(axis=1)
            replacement[kept_ok] = kept_table[kept_ok]
        experts[missed] = replacement
    return experts
