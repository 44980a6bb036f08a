"""Relabelling a fresh placement to overlap a previous one (fewest moved copies for that layout).

GPUs (whole nodes first in hierarchical mode) are matched by the number of logical experts they
share, then every expert that stays on its GPU keeps its slot.
"""
import numpy as np

from mooncake_ep_switch.eplb.policy.construct import Topology


def _match(overlap: np.ndarray) -> np.ndarray:
    """Greedy maximum-overlap matching of square matrices, batched: rows -> columns.

    Rounds of mutual best choices (ties to the lower index); each round matches at least the
    lexicographically first maximal pair, so it ends within K rounds (usually a few).

    Arguments:
        overlap: `[n, K, K]` numeric.

    Returns:
        column: `[n, K]` int64, the column matched to each row.
    """
    count, size = overlap.shape[:2]
    score = overlap.astype(np.float64)
    column = np.full((count, size), -1, dtype=np.int64)
    for _ in range(size):
        open_row = column < 0
        if not open_row.any():
            break
        best_col = score.argmax(axis=2)  # [n, K]
        best_row = score.argmax(axis=1)  # [n, K]
        mutual = open_row & (np.take_along_axis(best_row, best_col, axis=1) == np.arange(size)[None, :])
        layer, row = np.nonzero(mutual)
        col = best_col[layer, row]
        column[layer, row] = col
        score[layer, row, :] = -1.0
        score[layer, :, col] = -1.0
    return column


def align_to_previous(fresh: np.ndarray, previous: np.ndarray, topo: Topology) -> np.ndarray:
    """Relabel fresh placements' GPUs (nodes as blocks) and slots to overlap the previous ones.

    Arguments:
        fresh: `[n, R]` int64, fresh slot tables.
        previous: `[n, R]` int64, the previous slot tables of the same layers (valid: no
            same-GPU duplicates).
        topo: the problem's shape.

    Returns:
        aligned: `[n, R]` int64, each fresh placement with its GPUs permuted (whole nodes in
            hierarchical mode, so groups stay within a node) and, inside each GPU, every expert
            kept at its previous slot when it stays on that GPU.
    """
    count = fresh.shape[0]
    slots, gpus, num_logical = topo.slots_per_gpu, topo.num_gpus, topo.num_logical
    nodes = topo.num_nodes if topo.hierarchical else 1
    per_node = gpus // nodes
    new3, old3 = fresh.reshape(count, gpus, slots), previous.reshape(count, gpus, slots)
    layer = np.arange(count)[:, None, None]
    gpu_index = np.arange(gpus)[None, :, None]
    member_new = np.zeros((count, gpus, num_logical), dtype=np.int8)
    member_old = np.zeros((count, gpus, num_logical), dtype=np.int8)
    member_new[layer, gpu_index, new3] = 1
    member_old[layer, gpu_index, old3] = 1
    # overlap[n, new gpu, old gpu] = common experts (gathered, not a BLAS matmul: BLAS threads
    # can stall badly on a busy host).
    overlap = member_old.transpose(0, 2, 1)[layer, new3].sum(axis=2, dtype=np.int64)
    node_overlap = overlap.reshape(count, nodes, per_node, nodes, per_node).sum(axis=(2, 4))
    node_of = _match(node_overlap)  # [n, new node] -> old node
    blocks = overlap.reshape(count, nodes, per_node, nodes, per_node)
    chosen = blocks[np.arange(count)[:, None], np.arange(nodes)[None, :], :, node_of, :]  # [n, N, pn, pn]
    inner = _match(chosen.reshape(count * nodes, per_node, per_node)).reshape(count, nodes, per_node)
    old_gpu = (node_of[:, :, None] * per_node + inner).reshape(count, gpus)  # new gpu -> old gpu
    keep = old3[np.arange(count)[:, None], old_gpu]  # [n, G(new), S] previous contents
    incoming_row = new3
    stays = np.take_along_axis(member_new, keep, axis=2) > 0  # previous expert also in the new GPU
    arriving = np.take_along_axis(member_old[np.arange(count)[:, None], old_gpu], incoming_row, axis=2) == 0
    free_pos = np.argsort(stays, axis=2, kind="stable")  # free positions first
    arrive_pos = np.argsort(~arriving, axis=2, kind="stable")  # arriving experts first
    moved = arriving.sum(axis=2)  # [n, G]
    result = keep.copy()
    for j in range(slots):
        use = j < moved
        l_idx, g_idx = np.nonzero(use)
        result[l_idx, g_idx, free_pos[l_idx, g_idx, j]] = incoming_row[l_idx, g_idx, arrive_pos[l_idx, g_idx, j]]
    aligned = np.empty_like(old3)
    aligned[np.arange(count)[:, None], old_gpu] = result
    return aligned.reshape(count, -1)
