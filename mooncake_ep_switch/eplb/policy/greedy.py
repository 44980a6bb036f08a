"""The classic DeepSeek EPLB greedy, kept in-repo as the baseline that `placement` is measured against.

The algorithm, in three steps (hierarchical mode; global mode is the same with one node and one
group):

1. pack expert groups onto nodes, exactly `num_groups // num_nodes` groups per node, heaviest group
   first to the least-loaded node with room;
2. inside each node, replicate: hand each redundant slot to the logical expert with the largest
   load per copy (`load / copies`);
3. inside each node, pack the copies onto GPUs, heaviest first to the least-loaded GPU with a free
   slot.

Its known weaknesses, which `placement.rebalance_experts` addresses: it ignores the previous
placement (most slots change on every rebalance), it may put two copies of one expert on one GPU
(and give an expert more copies than there are GPUs), and in hierarchical mode every copy stays in
its group's node, so skew between groups caps the balance.

Like the original, replication is vectorised over layers and packing loops over layers and items.
"""
import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_loads
from mooncake_ep_switch.eplb.policy.tables import Placement, replica_tables


def balanced_packing(weight: np.ndarray, num_packs: int):
    """Pack items into equally sized packs, heaviest first (ties in the order of torch's descending
    sort, as DeepSeek's code) to the least-loaded pack with room.

    Arguments:
        weight: `[X, n]` float64 (or float32: pack loads then add in float32, as DeepSeek's torch
            code does) numpy array, item weights of X independent problems; `n` must be a multiple
            of `num_packs`.
        num_packs: the number of packs per problem.

    Returns:
        pack: `[X, n]` int64 numpy array, the pack of each item.
        rank: `[X, n]` int64 numpy array, the item's position inside its pack.
    """
    rows, items = weight.shape
    per_pack = items // num_packs
    pack = np.empty((rows, items), dtype=np.int64)
    rank = np.empty((rows, items), dtype=np.int64)
    if per_pack == 1:
        pack[:] = np.arange(items)
        rank[:] = 0
        return pack, rank
    # Heaviest first in the order of torch's descending sort, as DeepSeek's code sorts: bit-exact with
    # it when loads tie (torch's CPU sort is not stable past small sizes; a stable argsort differed).
    orders = torch.from_numpy(np.ascontiguousarray(weight)).sort(-1, descending=True).indices.numpy()
    for row in range(rows):
        load = np.zeros(num_packs, dtype=weight.dtype)
        filled = np.zeros(num_packs, dtype=np.int64)
        for item in orders[row]:
            target = int(np.argmin(np.where(filled < per_pack, load, np.inf)))
            pack[row, item] = target
            rank[row, item] = filled[target]
            load[target] += weight[row, item]
            filled[target] += 1
    return pack, rank


def replicate(weight: np.ndarray, num_physical: int):
    """Give each redundant slot to the logical expert with the largest load per copy.

    Arguments:
        weight: `[X, n]` float64 (or float32: load per copy divided in float32) numpy array, loads
            of n logical experts in X problems.
        num_physical: slots per problem, >= n.

    Returns:
        phy2log: `[X, num_physical]` int64 numpy array, the first n slots hold experts 0..n-1.
        rank: `[X, num_physical]` int64 numpy array, which copy of its expert each slot is.
        logcnt: `[X, n]` int64 numpy array, copies per expert.
    """
    rows, num_logical = weight.shape
    phy2log = np.tile(np.arange(num_physical, dtype=np.int64), (rows, 1))
    rank = np.zeros((rows, num_physical), dtype=np.int64)
    logcnt = np.ones((rows, num_logical), dtype=np.int64)
    index = np.arange(rows)
    for slot in range(num_logical, num_physical):
        hottest = np.argmax(weight / logcnt.astype(weight.dtype), axis=1)
        phy2log[:, slot] = hottest
        rank[:, slot] = logcnt[index, hottest]
        logcnt[index, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(perm)
    np.put_along_axis(inverse, perm, np.arange(perm.shape[1], dtype=np.int64)[None, :].repeat(perm.shape[0], 0), axis=1)
    return inverse


def hierarchical(weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
                  with_rank: bool = False):
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_physical // num_gpus
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes

    # 1. groups -> nodes. Node-major "middle" order: node n holds middle ids
    #    [n * logical_per_node, (n + 1) * logical_per_node).
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(axis=2)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    group_base = (group_node * groups_per_node + group_rank) * group_size
    log2mlog = (group_base[:, :, None] + np.arange(group_size)).reshape(num_layers, num_logical)
    mlog2log = _inverse(log2mlog)

    # 2. replicate inside each node.
    node_weight = np.take_along_axis(weight, mlog2log, axis=1).reshape(num_layers * num_nodes, logical_per_node)
    phy2mlog, copy_rank, mlogcnt = replicate(node_weight, physical_per_node)

    # 3. pack copies onto the node's GPUs.
    copy_load = np.take_along_axis(node_weight / mlogcnt.astype(node_weight.dtype), phy2mlog, axis=1)
    gpu, gpu_rank = balanced_packing(copy_load, gpus_per_node)
    phy2pphy = gpu * slots_per_gpu + gpu_rank
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    node_base = (np.arange(num_nodes) * logical_per_node)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, physical_per_node) + node_base).reshape(num_layers, num_physical)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    if not with_rank:
        return phy2log
    # Which copy of its expert each slot holds (0 = the first): the order of DeepSeek's log2phy.
    slot_rank = np.take_along_axis(copy_rank, pphy2phy, axis=1).reshape(num_layers, num_physical)
    return phy2log, slot_rank


def greedy_rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Placement:
    """Place experts with the classic DeepSeek EPLB greedy (the baseline).

    Hierarchical when `num_groups % num_nodes == 0`, otherwise global (one node, one group), like
    the original.

    Arguments:
        weight: `[L, E]` torch tensor or numpy array of any real dtype, load of each logical expert.
        num_replicas: physical slots per layer, a multiple of `num_gpus` and >= E.
        num_groups: expert groups per layer; must divide E.
        num_nodes: server nodes; must divide `num_gpus`.
        num_gpus: GPUs; must be a multiple of `num_nodes`.

    Returns:
        placement: a `Placement` of torch.int64 tensors; `log2phy` is as wide as the largest
            replica count (this algorithm may give an expert more copies than GPUs).
    """
    loads = as_loads("weight", weight, 2)
    num_layers, num_logical = loads.shape
    num_replicas = check_int("num_replicas", num_replicas, 1)
    num_groups = check_int("num_groups", num_groups, 1)
    num_nodes = check_int("num_nodes", num_nodes, 1)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    if num_logical % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {num_logical} logical experts, got {num_groups}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes: expected a divisor of num_gpus={num_gpus}, got {num_nodes}")
    if num_replicas % num_gpus or num_replicas < num_logical:
        raise ValueError(
            f"num_replicas: expected a multiple of num_gpus={num_gpus} that is >= {num_logical} logical experts, got {num_replicas}"
        )
    if num_groups % num_nodes == 0:
        phy2log = hierarchical(loads, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = hierarchical(loads, num_replicas, 1, 1, num_gpus)
    width = max(1, num_replicas - num_logical + 1)
    log2phy, logcnt = replica_tables(phy2log, num_logical, width)
    return Placement(torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt))
