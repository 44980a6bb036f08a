"""The `Placement` result and the conversion from a slot table to per-expert replica tables.

Vocabulary: a logical expert is what the router picks; a physical expert is a slot holding one
copy of a logical expert's weights; a redundant expert is any physical expert beyond the first
copy of its logical expert. Physical slot `s` of a layer lives on GPU `s // (num_replicas // num_gpus)`.
"""
from typing import NamedTuple, Tuple

import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_indices


class Placement(NamedTuple):
    """Where every logical expert of every MoE layer has its physical copies.

    Unpacks like DeepSeek EPLB's result: `phy2log, log2phy, logcnt = placement`.

    Arguments:
        phy2log: `[L, num_replicas]` torch.int64, the logical expert held by each physical slot.
        log2phy: `[L, E, max_replicas]` torch.int64, the physical slots of each logical expert in
            ascending order, padded with -1.
        logcnt: `[L, E]` torch.int64, the number of physical copies of each logical expert.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor


def replica_width(num_logical: int, num_replicas: int, num_gpus: int) -> int:
    """The static width of `log2phy`: the most copies any logical expert can get.

    Arguments:
        num_logical: E, the number of logical experts per layer.
        num_replicas: the number of physical slots per layer.
        num_gpus: the number of GPUs (one copy of an expert per GPU at most).

    Returns:
        width: `min(num_replicas - num_logical + 1, num_gpus)`, at least 1. It depends only on the
            configuration, so `log2phy` keeps its shape across rebalances.
    """
    return max(1, min(num_replicas - num_logical + 1, num_gpus))


def expert_counts(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Count the physical copies of every logical expert (numpy, vectorised over layers).

    Arguments:
        phy2log: `[L, R]` int64 numpy array, logical expert of each physical slot, in `[0, E)`.
        num_logical: E.

    Returns:
        logcnt: `[L, E]` int64 numpy array.
    """
    num_layers = phy2log.shape[0]
    offsets = (np.arange(num_layers, dtype=np.int64) * num_logical)[:, None]
    flat = np.bincount((phy2log + offsets).ravel(), minlength=num_layers * num_logical)
    return flat.reshape(num_layers, num_logical).astype(np.int64)


def replica_tables(phy2log: np.ndarray, num_logical: int, width: int) -> Tuple[np.ndarray, np.ndarray]:
    """Build per-expert replica tables from a slot table (numpy, vectorised over layers).

    Arguments:
        phy2log: `[L, R]` int64 numpy array, logical expert of each physical slot, in `[0, E)`.
        num_logical: E.
        width: the last dimension of `log2phy`; must be >= the largest replica count.

    Returns:
        log2phy: `[L, E, width]` int64 numpy array, slots of each logical expert ascending, -1 padded.
        logcnt: `[L, E]` int64 numpy array, copies per logical expert.
    """
    num_layers, num_slots = phy2log.shape
    rows = np.arange(num_layers)[:, None]
    logcnt = expert_counts(phy2log, num_logical)
    if logcnt.size and int(logcnt.max()) > width:
        raise ValueError(f"phy2log: expected at most {width} copies of a logical expert, got {int(logcnt.max())}")
    # Slots sorted by (expert, slot); a slot's rank among its expert's copies is its position
    # minus the position where that expert's run starts.
    order = np.argsort(phy2log, axis=1, kind="stable")
    experts = np.take_along_axis(phy2log, order, axis=1)
    run_start = np.cumsum(logcnt, axis=1) - logcnt
    rank = np.arange(num_slots)[None, :] - np.take_along_axis(run_start, experts, axis=1)
    log2phy = np.full((num_layers, num_logical, width), -1, dtype=np.int64)
    log2phy[np.broadcast_to(rows, order.shape), experts, rank] = order
    return log2phy, logcnt


def placement_from_phy2log(phy2log, num_logical: int, num_gpus: int) -> Placement:
    """Wrap a slot table into a `Placement`, deriving `log2phy` and `logcnt`.

    Arguments:
        phy2log: `[L, num_replicas]` integer torch tensor or numpy array, values in `[0, E)`.
        num_logical: E, the number of logical experts per layer.
        num_gpus: the number of GPUs; `num_replicas` must be a multiple of it.

    Returns:
        placement: a `Placement` of torch.int64 tensors; `log2phy` has width
            `replica_width(E, num_replicas, num_gpus)`, or the largest replica count if a table
            gives some expert more copies than that (the classic greedy can).
    """
    num_logical = check_int("num_logical", num_logical, 1)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    table = as_indices("phy2log", phy2log, 2, upper=num_logical)
    if table.shape[1] % num_gpus:
        raise ValueError(f"phy2log: expected a slot count divisible by num_gpus={num_gpus}, got {table.shape[1]}")
    counts = expert_counts(table, num_logical)
    width = replica_width(num_logical, table.shape[1], num_gpus)
    if counts.size:
        width = max(width, int(counts.max()))
    log2phy, logcnt = replica_tables(table, num_logical, width)
    return Placement(torch.from_numpy(table), torch.from_numpy(log2phy), torch.from_numpy(logcnt))
