"""Fresh placement: replica counts, LPT construction and swap refinement, global or hierarchical.

Global mode: copies per expert by largest load per copy (`replication.replica_counts`), all
copies packed onto all GPUs largest first (LPT, never two copies of an expert on one GPU), then
refined by swaps (`packing.refine_swaps`, compiled).

Hierarchical mode packs expert groups onto nodes (exactly `num_groups // num_nodes` per node) and
pins each expert's primary copy to its group's node, so group-limited routing finds every expert
of a group inside one node. Two node plans are built per layer, both are packed onto the GPUs,
and the one with the lighter heaviest GPU is kept:

- spread (usually the winner): redundant copies may go to any node (LPT over node loads, at most
  one copy of an expert per GPU of a node); copies move toward experts of a node whose pinned
  primaries alone overload it (`replication.relieve_pinned_nodes`). This is what lets a hot
  group's load leave its node, where the classic hierarchical greedy is capped;
- local: every copy stays in its group's node (the classic layout), which wins when a node has
  too few redundant slots to absorb a hot group, or when a hot expert's copies pair better with
  its own group's small experts.

Each plan's copies are packed onto each node's GPUs (LPT) and refined by swaps across all GPUs; a
pinned primary only moves between GPUs of its node.
"""
from typing import NamedTuple, Optional

import numpy as np

from mooncake_ep_switch.eplb.policy.packing import group_by_bin, lpt_assign, refine_swaps, repair_duplicates
from mooncake_ep_switch.eplb.policy.replication import relieve_pinned_nodes, replica_counts


class Topology(NamedTuple):
    """The shape of one placement problem.

    Arguments:
        num_logical: E, logical experts per layer.
        num_replicas: physical slots per layer.
        num_groups: expert groups per layer (E // num_groups consecutive experts each).
        num_nodes: server nodes.
        num_gpus: GPUs; slot s is on GPU s // slots_per_gpu.
        hierarchical: keep each group's primary copies within one node.
    """

    num_logical: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int
    hierarchical: bool

    @property
    def slots_per_gpu(self) -> int:
        """Physical expert slots per GPU.

        Returns:
            count: int, ``num_replicas // num_gpus``.
        """
        return self.num_replicas // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        """GPUs per server node.

        Returns:
            count: int, ``num_gpus // num_nodes``.
        """
        return self.num_gpus // self.num_nodes

    def gpu_node(self) -> np.ndarray:
        """The node of each GPU (all 0 in global mode).

        Returns:
            node: `[num_gpus]` np.int64, ``gpu // gpus_per_node`` in hierarchical mode, else zeros.
        """
        if not self.hierarchical:
            return np.zeros(self.num_gpus, dtype=np.int64)
        return np.arange(self.num_gpus, dtype=np.int64) // self.gpus_per_node


class Packed(NamedTuple):
    """A placement as a packed state (see `packing`): `[L, num_gpus, slots_per_gpu]` arrays.

    Arguments:
        experts: `[L, G, S]` int64, logical expert of each slot.
        sizes: `[L, G, S]` float64, load of each copy.
        pinned: `[L, G, S]` bool, primary copies bound to their group's node.
    """

    experts: np.ndarray
    sizes: np.ndarray
    pinned: np.ndarray


def sorted_items(per_copy: np.ndarray, counts: np.ndarray):
    """All copies of every expert, largest copy load first, copies of one expert adjacent.

    Arguments:
        per_copy: `[B, E]` float64, load of one copy of each expert.
        counts: `[B, E]` int64, copies to list per expert (rows sum to the same M).

    Returns:
        keys: `[B, M]` int64, the expert of each item.
        sizes: `[B, M]` float64, the item loads, descending per row.
    """
    order = np.argsort(-per_copy, axis=1, kind="stable")
    repeats = np.take_along_axis(counts, order, axis=1)
    rows = per_copy.shape[0]
    keys = np.repeat(order.ravel(), repeats.ravel()).reshape(rows, -1)
    return keys, np.take_along_axis(per_copy, keys, axis=1)


def refine(packed: Packed, gpu_node: np.ndarray, flagged: Optional[np.ndarray] = None) -> None:
    """Swap-refine a packed state in place, then remove any same-GPU duplicates.

    Arguments:
        packed: the state to refine.
        gpu_node: `[G]` int64, node of each GPU.
        flagged: `[L]` bool, rows the constructor could not keep duplicate-free, or None.
    """
    experts, sizes, pinned = packed
    if flagged is not None and flagged.any():
        repair_duplicates(experts, sizes, pinned, gpu_node, rows=np.nonzero(flagged)[0])
    refine_swaps(experts, sizes, pinned, gpu_node, descend_steps=4 * experts.shape[1])


def pack_groups(group_load: np.ndarray, num_nodes: int) -> np.ndarray:
    """Assign expert groups to nodes, equally many per node, balancing the node loads.

    Arguments:
        group_load: `[L, num_groups]` float64.
        num_nodes: nodes; must divide num_groups.

    Returns:
        group_node: `[L, num_groups]` int64, node of each group.
    """
    num_layers, num_groups = group_load.shape
    per_node = num_groups // num_nodes
    order = np.argsort(-group_load, axis=1, kind="stable")
    sizes = np.take_along_axis(group_load, order, axis=1)
    bins, _ = lpt_assign(sizes, order, num_nodes, per_node)
    experts, packed_sizes = group_by_bin(bins, num_nodes, order, sizes)
    pinned = np.zeros(experts.shape, dtype=bool)
    nodes = np.arange(num_nodes, dtype=np.int64)
    refine_swaps(experts, packed_sizes, pinned, nodes, descend_steps=2 * num_nodes)
    group_node = np.empty((num_layers, num_groups), dtype=np.int64)
    rows = np.arange(num_layers)[:, None, None]
    group_node[rows, experts] = nodes[None, :, None]
    return group_node


def _assign_redundant_exactly(weight, counts, home, keys, nodes: int, capacity: int, gpus_per_node: int):
    """One layer's redundant copies -> nodes, changing copy counts where a copy fits no node.

    Copies go largest first to the least-loaded node with a free redundant slot and fewer than
    `gpus_per_node` copies of the expert. A copy that fits nowhere is replaced by a copy, on the
    least-loaded node with a free slot, of the expert with the largest load per copy that fits
    there. Modifies `counts` in place.

    Returns:
        keys: `[M]` int64, the expert of each redundant copy.
        node: `[M]` int64, its node.
    """
    num_logical = weight.shape[0]
    max_copies = nodes * gpus_per_node
    held = np.zeros((nodes, num_logical), dtype=np.int64)
    held[home, np.arange(num_logical)] = 1
    load = np.zeros(nodes)
    np.add.at(load, home, weight / counts)
    free = np.full(nodes, capacity, dtype=np.int64)
    out_keys = keys.copy()
    out_node = np.empty(keys.shape, dtype=np.int64)
    for i, expert in enumerate(keys.tolist()):
        fits = (free > 0) & (held[:, expert] < gpus_per_node)
        if fits.any():
            node = int(np.argmin(np.where(fits, load, np.inf)))
        else:
            node = int(np.argmin(np.where(free > 0, load, np.inf)))
            room = (held[node] < gpus_per_node) & (counts < max_copies)
            room[expert] = False
            replacement = int(np.argmax(np.where(room, weight / (counts + 1.0), -1.0)))
            if not room[replacement]:
                raise RuntimeError("placement: no expert copy fits the remaining node slots; the topology is infeasible")
            counts[expert] -= 1
            counts[replacement] += 1
            expert = replacement
        out_keys[i], out_node[i] = expert, node
        held[node, expert] += 1
        free[node] -= 1
        load[node] += weight[expert] / counts[expert]
    return out_keys, out_node


def _global(weight: np.ndarray, counts: np.ndarray, topo: Topology) -> Packed:
    per_copy = weight / counts
    keys, sizes = sorted_items(per_copy, counts)
    bins, flagged = lpt_assign(sizes, keys, topo.num_gpus, topo.slots_per_gpu)
    experts, packed_sizes = group_by_bin(bins, topo.num_gpus, keys, sizes)
    packed = Packed(experts, packed_sizes, np.zeros(experts.shape, dtype=bool))
    refine(packed, topo.gpu_node(), flagged)
    return packed


class _NodePlan(NamedTuple):
    home: np.ndarray  # [L, E] node of each expert's primary copy
    counts: np.ndarray  # [L, E] copies per expert
    red_keys: np.ndarray  # [L, R - E] expert of each redundant copy
    red_node: np.ndarray  # [L, R - E] node of each redundant copy
    node_load: np.ndarray  # [L, N] resulting node loads


def _plan_spread(weight, topo: Topology, group_node) -> _NodePlan:
    """Node plan letting redundant copies leave their group's node (our default)."""
    num_layers, num_logical = weight.shape
    nodes, gpus_per_node = topo.num_nodes, topo.gpus_per_node
    group_size = num_logical // topo.num_groups
    rows = np.arange(num_layers)[:, None]
    counts = replica_counts(weight, topo.num_replicas, topo.num_gpus)
    if group_node is None:
        group_load = (weight / counts).reshape(num_layers, topo.num_groups, group_size).sum(axis=2)
        group_node = pack_groups(group_load, nodes)
    home = np.repeat(group_node, group_size, axis=1)
    counts = relieve_pinned_nodes(weight, counts, home, nodes, topo.num_gpus)
    per_copy = weight / counts

    # Redundant copies -> nodes: LPT over node loads that start with the primaries; a node holds at
    # most gpus_per_node copies of one expert (one per GPU), its primary included.
    num_redundant = topo.num_replicas - num_logical
    node_load = np.zeros((num_layers, nodes))
    np.add.at(node_load, (np.broadcast_to(rows, home.shape), home), per_copy)
    red_keys, red_sizes = sorted_items(per_copy, counts - 1)
    if num_redundant == 0:
        return _NodePlan(home, counts, red_keys, np.zeros(red_keys.shape, dtype=np.int64), node_load)
    keycount = np.zeros((num_layers, nodes, num_logical), dtype=np.int64)
    keycount[np.broadcast_to(rows, home.shape), home, np.arange(num_logical)[None, :]] = 1
    red_node, flagged = lpt_assign(
        red_sizes, red_keys, nodes, num_redundant // nodes,
        key_cap=gpus_per_node, init_load=node_load, init_keycount=keycount,
    )
    for layer in np.nonzero(flagged)[0]:
        # Some copy fits no node (its node-mates' redundant slots are too few): re-assign this
        # layer exactly, turning unplaceable copies into copies that fit.
        red_keys[layer], red_node[layer] = _assign_redundant_exactly(
            weight[layer], counts[layer], home[layer], red_keys[layer], nodes, num_redundant // nodes, gpus_per_node
        )
    per_copy = weight / counts
    node_load = np.zeros((num_layers, nodes))
    np.add.at(node_load, (np.broadcast_to(rows, home.shape), home), per_copy)
    np.add.at(node_load, (np.broadcast_to(rows, red_node.shape), red_node), np.take_along_axis(per_copy, red_keys, axis=1))
    return _NodePlan(home, counts, red_keys, red_node, node_load)


def _plan_local(weight, topo: Topology, group_node) -> _NodePlan:
    """Node plan keeping every copy in its group's node (the classic layout, copies capped per GPU)."""
    num_layers, num_logical = weight.shape
    nodes, gpus_per_node = topo.num_nodes, topo.gpus_per_node
    group_size = num_logical // topo.num_groups
    if group_node is None:
        group_node = pack_groups(weight.reshape(num_layers, topo.num_groups, group_size).sum(axis=2), nodes)
    home = np.repeat(group_node, group_size, axis=1)
    # Experts in node-major order, replicated inside each node.
    order = np.argsort(home, axis=1, kind="stable")
    node_weight = np.take_along_axis(weight, order, axis=1).reshape(num_layers * nodes, num_logical // nodes)
    node_counts = replica_counts(node_weight, topo.num_replicas // nodes, gpus_per_node)
    counts = np.empty((num_layers, num_logical), dtype=np.int64)
    np.put_along_axis(counts, order, node_counts.reshape(num_layers, num_logical), axis=1)
    red_keys, _ = sorted_items(weight / counts, counts - 1)
    red_node = np.take_along_axis(home, red_keys, axis=1)
    node_load = weight.reshape(num_layers, -1)[np.arange(num_layers)[:, None], order].reshape(num_layers, nodes, -1).sum(axis=2)
    return _NodePlan(home, counts, red_keys, red_node, node_load)


def hierarchical(weight: np.ndarray, topo: Topology, group_node: Optional[np.ndarray]) -> Packed:
    num_layers, num_logical = weight.shape
    # Two node plans, each packed onto the GPUs; per layer keep the one with the lighter heaviest
    # GPU. Spreading copies across nodes usually wins; keeping them home wins when a few redundant
    # slots per node cannot absorb a hot group's primaries, or when a hot expert's copies pair
    # better with its own group's small experts (the lighter heaviest node is not enough to
    # choose: it can leave a heavier GPU).
    spread = _plan_spread(weight, topo, group_node)
    if not num_logical < topo.num_replicas <= num_logical * topo.gpus_per_node:  # the local plan does not fit
        return _pack_plan(weight, topo, spread)
    local = _plan_local(weight, topo, group_node)
    both = _pack_plan(np.concatenate([weight, weight]), topo, _NodePlan(*(np.concatenate([a, b]) for a, b in zip(spread, local))))
    peak = both.sizes.sum(axis=2).max(axis=1)
    use_local = peak[num_layers:] < peak[:num_layers] * (1 - 1e-12)
    pick = np.where(use_local, np.arange(num_layers) + num_layers, np.arange(num_layers))
    return Packed(*(a[pick] for a in both))


def _pack_plan(weight: np.ndarray, topo: Topology, plan: _NodePlan) -> Packed:
    """Pack a node plan's copies onto the GPUs of each node (LPT), then swap-refine across all GPUs."""
    num_layers, num_logical = weight.shape
    nodes, gpus_per_node, slots = topo.num_nodes, topo.gpus_per_node, topo.slots_per_gpu
    home, counts, red_keys, red_node = plan.home, plan.counts, plan.red_keys, plan.red_node
    per_copy = weight / counts
    red_sizes = np.take_along_axis(per_copy, red_keys, axis=1)

    # Items of every node: primaries (pinned) and redundant copies, sorted by (size desc, expert,
    # primary first) so that the copies of one expert are adjacent.
    primary_keys = np.broadcast_to(np.arange(num_logical, dtype=np.int64), (num_layers, num_logical))
    all_keys = np.concatenate([primary_keys, red_keys], axis=1)
    all_sizes = np.concatenate([per_copy, red_sizes], axis=1)
    all_pinned = np.concatenate([np.ones((num_layers, num_logical), bool), np.zeros(red_keys.shape, bool)], axis=1)
    all_node = np.concatenate([home, red_node], axis=1)
    grouped = group_by_bin(all_node, nodes, all_keys, all_sizes, all_pinned)
    keys, sizes, pinned = (a.reshape(num_layers * nodes, -1) for a in grouped)
    order = np.lexsort((~pinned, keys, -sizes), axis=1)
    keys, sizes, pinned = (np.take_along_axis(a, order, axis=1) for a in (keys, sizes, pinned))

    # Copies -> GPUs inside each node, then refinement across all GPUs.
    gpu_bins, flagged_gpus = lpt_assign(sizes, keys, gpus_per_node, slots)
    experts, sizes, pinned = group_by_bin(gpu_bins, gpus_per_node, keys, sizes, pinned)
    shape = (num_layers, topo.num_gpus, slots)
    packed = Packed(experts.reshape(shape), sizes.reshape(shape), pinned.reshape(shape))
    refine(packed, topo.gpu_node(), flagged_gpus.reshape(num_layers, nodes).any(axis=1))
    return packed


def lpt_balance(weight: np.ndarray, counts: np.ndarray, topo: Topology) -> np.ndarray:
    """Global mode: balancedness after the LPT construction alone, a lower bound on `fresh_placement`'s.

    The swap refinement that follows LPT never raises the heaviest GPU, so a fresh placement is at
    least this balanced; rows where LPT had to break the one-copy-per-GPU rule (repaired later by
    swaps that may raise it) get 0.

    Arguments:
        weight: `[L, E]` float64.
        counts: `[L, E]` int64, `replica_counts(weight, num_replicas, num_gpus)`.
        topo: the problem's shape (global mode).

    Returns:
        balance: `[L]` float64.
    """
    keys, sizes = sorted_items(weight / counts, counts)
    bins, flagged = lpt_assign(sizes, keys, topo.num_gpus, topo.slots_per_gpu)
    loads = np.zeros((weight.shape[0], topo.num_gpus))
    np.add.at(loads, (np.broadcast_to(np.arange(weight.shape[0])[:, None], bins.shape), bins), sizes)
    peak = loads.max(axis=1)
    mean = loads.mean(axis=1)
    balance = np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    return np.where(flagged, 0.0, balance)


def fresh_placement(weight: np.ndarray, topo: Topology, group_node: Optional[np.ndarray] = None) -> Packed:
    """Place every layer from scratch.

    Arguments:
        weight: `[L, E]` float64 numpy array, load of each logical expert.
        topo: the problem's shape and mode.
        group_node: `[L, num_groups]` int64, a fixed node for each group (hierarchical mode only),
            or None to pack the groups onto nodes.

    Returns:
        packed: the placement; every slot's order inside its GPU is by expert id.
    """
    if topo.hierarchical:
        packed = hierarchical(weight, topo, group_node)
    else:
        packed = _global(weight, replica_counts(weight, topo.num_replicas, topo.num_gpus), topo)
    order = np.argsort(packed.experts, axis=2, kind="stable")
    return Packed(*(np.take_along_axis(a, order, axis=2) for a in packed))
