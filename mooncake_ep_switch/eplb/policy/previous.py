"""Reading a deployed placement: which node each group lives on, its primaries, and repairs.

A previous slot table may come from anywhere (an older configuration, the classic greedy, a
hand-written table): `repair_previous` makes it valid before the movement-aware search starts.
"""
import numpy as np

from mooncake_ep_switch.eplb.policy.construct import Topology
from mooncake_ep_switch.eplb.policy.tables import expert_counts


def infer_group_nodes(previous: np.ndarray, topo: Topology) -> np.ndarray:
    """Assign groups to nodes as the previous placement had them, equally many per node.

    A node "covers" a group when it holds a copy of every expert of the group. Groups are first
    matched to covering nodes (a maximum bipartite matching, so a valid hierarchical placement
    is always recognised), then the rest go where they have the most copies.

    Arguments:
        previous: `[L, R]` int64, the previous slot table.
        topo: the problem's shape (hierarchical).

    Returns:
        group_node: `[L, num_groups]` int64.
    """
    num_layers = previous.shape[0]
    groups, nodes = topo.num_groups, topo.num_nodes
    group_size = topo.num_logical // groups
    per_node = groups // nodes
    slot_node = topo.gpu_node()[np.arange(topo.num_replicas) // topo.slots_per_gpu]
    rows = np.broadcast_to(np.arange(num_layers)[:, None], previous.shape)
    nodes_of = np.broadcast_to(slot_node, previous.shape)
    votes = np.zeros((num_layers, groups, nodes), dtype=np.int64)
    np.add.at(votes, (rows, previous // group_size, nodes_of), 1)
    has = np.zeros((num_layers, topo.num_logical, nodes), dtype=bool)
    has[rows, previous, nodes_of] = True
    covers = has.reshape(num_layers, groups, group_size, nodes).all(axis=2)
    group_node = np.empty((num_layers, groups), dtype=np.int64)
    for layer in range(num_layers):
        place_node = np.repeat(np.arange(nodes), per_node)
        owner = np.full(place_node.size, -1)
        preference = np.argsort(-votes[layer], axis=1, kind="stable")

        def augment(group, seen):
            for node in preference[group]:
                if not covers[layer, group, node]:
                    continue
                for place in np.nonzero(place_node == node)[0]:
                    if place in seen:
                        continue
                    seen.add(place)
                    if owner[place] < 0 or augment(owner[place], seen):
                        owner[place] = group
                        return True
            return False

        for group in range(groups):
            augment(group, set())
        matched = set(owner[owner >= 0].tolist())
        for group in sorted(set(range(groups)) - matched, key=lambda g: -votes[layer, g].max()):
            free = np.nonzero(owner < 0)[0]
            owner[free[np.argmax(votes[layer, group, place_node[free]])]] = group
        group_node[layer, owner] = place_node
    return group_node


def pinned_flags(experts: np.ndarray, home: np.ndarray, slot_node: np.ndarray) -> np.ndarray:
    """Mark, per logical expert, its first slot on its home node as the pinned primary.

    Arguments:
        experts: `[L, R]` np.int64, logical expert of each physical expert (slot).
        home: `[L, E]` np.int64, home node of each logical expert.
        slot_node: `[R]` np.int64, node of each slot.

    Returns:
        pinned: `[L, R]` np.bool_, True at the lowest-index slot of each logical expert on its home
            node (no flag for an expert without a copy there).
    """
    num_layers, num_slots = experts.shape
    rows = np.arange(num_layers)[:, None]
    on_home = slot_node[None, :] == home[rows, experts]
    candidate = np.where(on_home, np.arange(num_slots)[None, :], num_slots)
    first = np.full(home.shape, num_slots, dtype=np.int64)
    np.minimum.at(first, (np.broadcast_to(rows, experts.shape), experts), candidate)
    return np.arange(num_slots)[None, :] == first[rows, experts]


def repair_previous(weight, experts, topo: Topology, home) -> None:
    """Make a previous slot table valid in place: every expert present, no same-GPU duplicates,
    (hierarchical) a copy of every expert on its home node. Loops in Python over broken layers.

    Arguments:
        weight: `[L, E]` np.float64, load of each logical expert (decides which copies are given up).
        experts: `[L, R]` np.int64, logical expert of each physical expert (slot); repaired in place.
        topo: the `Topology`.
        home: `[L, E]` np.int64, home node of each logical expert (hierarchical mode), or None.

    Raises:
        RuntimeError: a layer has no slot that can take a missing logical expert.
    """
    num_layers, num_slots = experts.shape
    slots, num_logical = topo.slots_per_gpu, topo.num_logical
    slot_gpu = np.arange(num_slots) // slots
    slot_node = topo.gpu_node()[slot_gpu]
    counts = expert_counts(experts, num_logical)
    by_gpu = np.sort(experts.reshape(num_layers, topo.num_gpus, slots), axis=2)
    broken = (counts == 0).any(axis=1) | (by_gpu[:, :, 1:] == by_gpu[:, :, :-1]).any(axis=(1, 2))
    if home is not None:
        has_home = np.zeros((num_layers, num_logical), dtype=bool)
        rows = np.broadcast_to(np.arange(num_layers)[:, None], experts.shape)
        on_home = slot_node[None, :] == home[np.arange(num_layers)[:, None], experts]
        has_home[rows[on_home], experts[on_home]] = True
        broken |= ~has_home.all(axis=1)
    for layer in np.nonzero(broken)[0]:
        row = experts[layer]
        w = weight[layer]
        for _ in range(2 * num_slots):
            count = np.bincount(row, minlength=num_logical)
            fix = None
            # 1. a duplicate slot: free it for the expert that needs a copy most.
            for gpu in range(topo.num_gpus):
                members = row[gpu * slots:(gpu + 1) * slots]
                values, first = np.unique(members, return_index=True)
                if values.size < slots:
                    dup_pos = np.setdiff1d(np.arange(slots), first)[0]
                    fix = ("dup", gpu * slots + dup_pos)
                    break
            if fix is None:
                missing = np.nonzero(count == 0)[0]
                if missing.size:
                    fix = ("missing", int(missing[0]))
                elif home is not None:
                    home_nodes = home[layer]
                    present = np.zeros(num_logical, dtype=bool)
                    present[row[slot_node == home_nodes[row]]] = True
                    absent = np.nonzero(~present)[0]
                    if absent.size:
                        fix = ("home", int(absent[0]))
            if fix is None:
                break
            kind, what = fix
            if kind == "dup":
                slot = what
                gpu = slot_gpu[slot]
                on_gpu = set(row[gpu * slots:(gpu + 1) * slots].tolist())
                count[row[slot]] -= 1
                need = w / np.maximum(count, 1)
                need[count == 0] = np.inf
                need[list(on_gpu)] = -1.0
                need[count >= topo.num_gpus] = -1.0
                row[slot] = int(np.argmax(need))
                continue
            expert = what
            allowed = np.ones(num_slots, dtype=bool)
            if home is not None:
                allowed &= slot_node == home[layer, expert]
            holders = np.unique(slot_gpu[row == expert])
            allowed &= ~np.isin(slot_gpu, holders)
            allowed &= count[row] >= 2
            if home is not None:
                # never take a donor's last copy on its own home node
                at_home = slot_node == home[layer, row]
                home_copies = np.bincount(row[at_home], minlength=num_logical)
                allowed &= ~at_home | (home_copies[row] >= 2)
            if not allowed.any():
                raise RuntimeError(f"previous_phy2log: cannot repair layer {layer}: no slot can take logical expert {expert}")
            cost = np.where(allowed, w[row] / np.maximum(count[row] - 1, 1), np.inf)
            row[int(np.argmin(cost))] = expert
