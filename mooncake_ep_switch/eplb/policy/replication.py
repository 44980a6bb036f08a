"""How many physical copies each logical expert gets.

Redundant slots go one at a time to the logical expert with the largest load per copy
(`load / copies`), which minimises the largest copy load (the D'Hondt apportionment). An expert
never gets more copies than there are GPUs, because two copies of one expert never share a GPU.
"""
import numpy as np


def replica_counts(weight: np.ndarray, num_replicas: int, max_copies: int) -> np.ndarray:
    """Copies per logical expert: one each, then each redundant slot to the largest load per copy.

    Ties go to the lower expert id, so the result is deterministic.

    Arguments:
        weight: `[L, E]` float64 numpy array, load of each logical expert.
        num_replicas: physical slots per layer, in `[E, E * max_copies]`.
        max_copies: the most copies of one expert (the number of GPUs).

    Returns:
        logcnt: `[L, E]` int64 numpy array, each row summing to `num_replicas`.
    """
    num_layers, num_logical = weight.shape
    counts = np.ones((num_layers, num_logical), dtype=np.int64)
    index = np.arange(num_layers)
    for _ in range(num_replicas - num_logical):
        per_copy = np.where(counts < max_copies, weight / counts, -1.0)
        counts[index, per_copy.argmax(axis=1)] += 1
    return counts


def smallest_copies_sum(per_copy: np.ndarray, multiplicity: np.ndarray, k: int) -> np.ndarray:
    """Sum of the k smallest items when expert e contributes `multiplicity[e]` items of `per_copy[e]`.

    Arguments:
        per_copy: `[L, E]` float64.
        multiplicity: `[L, E]` int64, items per expert (rows sum to >= k).
        k: how many items to sum.

    Returns:
        total: `[L]` float64.
    """
    order = np.argsort(per_copy, axis=1, kind="stable")
    values = np.take_along_axis(per_copy, order, axis=1)
    mult = np.take_along_axis(multiplicity, order, axis=1)
    before = np.cumsum(mult, axis=1) - mult
    taken = np.clip(k - before, 0, mult)
    return (taken * values).sum(axis=1)


def relieve_pinned_nodes(
    weight: np.ndarray,
    counts: np.ndarray,
    home: np.ndarray,
    num_nodes: int,
    max_copies: int,
    max_copy_share: float = 0.75,
) -> np.ndarray:
    """Move copies toward experts whose node is overloaded by its pinned primary copies.

    In hierarchical mode the primary copy of every expert stays in its group's node, so a node's
    load is at least the sum of its primaries' copy loads plus the smallest redundant copies
    that fill its remaining slots. When that floor exceeds the mean node load, no packing can
    balance the nodes; giving the node's experts more copies (the extra copies can go to other
    nodes) lowers the floor. Each step moves one copy, per layer, from the expert outside the
    node whose copy load grows least to the expert of the heaviest node whose primary shrinks
    most.

    Arguments:
        weight: `[L, E]` float64, load of each logical expert.
        counts: `[L, E]` int64, copies from `replica_counts`.
        home: `[L, E]` int64, node of each expert's primary copy.
        num_nodes: nodes.
        max_copies: the most copies of one expert (number of GPUs).
        max_copy_share: a donor's copy load may grow up to this fraction of the mean GPU load.

    Returns:
        counts: `[L, E]` int64, adjusted copies (a new array, row sums unchanged).
    """
    counts = counts.copy()
    num_layers, num_logical = weight.shape
    if num_layers == 0:
        return counts
    num_redundant = int(counts[0].sum()) - num_logical
    redundant_per_node = num_redundant // num_nodes
    if redundant_per_node == 0:
        return counts
    fair = weight.sum(axis=1) / num_nodes
    copy_limit = max_copy_share * weight.sum(axis=1) / max_copies
    node_mask = home[:, None, :] == np.arange(num_nodes)[None, :, None]  # [L, N, E]
    active = np.arange(num_layers)
    for _ in range(num_redundant):
        if active.size == 0:
            break
        w, c, hm, nm = weight[active], counts[active], home[active], node_mask[active]
        sub = np.arange(active.size)
        per_copy = w / c
        primary = (nm * per_copy[:, None, :]).sum(axis=2)  # [l, N]
        floor = smallest_copies_sum(per_copy, c - 1, redundant_per_node)
        heavy = primary.argmax(axis=1)
        need = primary[sub, heavy] + floor > fair[active] * (1 + 1e-9)
        in_heavy = hm == heavy[:, None]
        gain = np.where(in_heavy & (c < max_copies), w / (c * (c + 1.0)), -1.0)
        receiver = gain.argmax(axis=1)
        # Donor: outside the heavy node, >= 2 copies, smallest copy load after losing one, its
        # own node staying below the fair load, its copies staying small enough to pack.
        after = w / np.maximum(c - 1.0, 1.0)
        donor_node = np.take_along_axis(primary, hm, axis=1) + after - per_copy
        limit = np.maximum(per_copy.max(axis=1), copy_limit[active])
        donor_ok = (~in_heavy) & (c >= 2) & (donor_node + floor[:, None] <= fair[active][:, None]) & (after <= limit[:, None])
        donor_cost = np.where(donor_ok, after, np.inf)
        donor = donor_cost.argmin(axis=1)
        go = need & (gain[sub, receiver] > 0) & np.isfinite(donor_cost[sub, donor])
        if not go.any():
            break
        rows = active[go]
        counts[rows, receiver[go]] += 1
        counts[rows, donor[go]] -= 1
        active = rows
    return counts
