"""Quality measures of a placement: per-GPU load, balancedness, moved copies.

Balancedness of a layer is mean GPU load / max GPU load (1.0 is perfect), where a logical
expert's load is split evenly across its physical copies. A layer with no load counts as 1.0.
"""
import numpy as np

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_indices, as_loads
from mooncake_ep_switch.eplb.policy.tables import Placement, expert_counts


def _slot_table(name: str, phy2log) -> np.ndarray:
    if isinstance(phy2log, Placement):
        phy2log = phy2log.phy2log
    return as_indices(name, phy2log, 2)


def slot_loads(weight: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """Load carried by every physical slot (numpy, no validation).

    Arguments:
        weight: `[L, E]` float64 numpy array, load of each logical expert.
        phy2log: `[L, R]` int64 numpy array, logical expert of each slot.

    Returns:
        loads: `[L, R]` float64 numpy array, `weight[e] / copies(e)` for the slot's expert `e`.
    """
    counts = expert_counts(phy2log, weight.shape[1])
    share = weight / np.maximum(counts, 1)
    return np.take_along_axis(share, phy2log, axis=1)


def gpu_loads(weight, phy2log, num_gpus: int) -> np.ndarray:
    """Load of every GPU under a placement.

    Arguments:
        weight: `[L, E]` torch tensor or numpy array of any real dtype, load of each logical expert.
        phy2log: `[L, R]` integer torch tensor or numpy array (or a `Placement`), logical expert
            of each physical slot; slot `s` is on GPU `s // (R // num_gpus)`.
        num_gpus: the number of GPUs; must divide R.

    Returns:
        loads: `[L, num_gpus]` float64 numpy array.
    """
    loads = as_loads("weight", weight, 2)
    table = _slot_table("phy2log", phy2log)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    if table.shape[0] != loads.shape[0]:
        raise ValueError(f"phy2log: expected {loads.shape[0]} layers like weight, got {table.shape[0]}")
    if table.shape[1] % num_gpus:
        raise ValueError(f"phy2log: expected a slot count divisible by num_gpus={num_gpus}, got {table.shape[1]}")
    if table.size and table.max() >= loads.shape[1]:
        raise ValueError(f"phy2log: expected logical experts < {loads.shape[1]}, got {int(table.max())}")
    per_slot = slot_loads(loads, table)
    return per_slot.reshape(table.shape[0], num_gpus, -1).sum(axis=2)


def balance_of_loads(loads: np.ndarray) -> np.ndarray:
    """Balancedness of each row of a per-GPU load matrix.

    Arguments:
        loads: `[L, G]` float64 numpy array of GPU loads.

    Returns:
        balancedness: `[L]` float64 numpy array, mean / max per row, 1.0 for rows with no load.
    """
    peak = loads.max(axis=1)
    mean = loads.mean(axis=1)
    return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)


def layer_balancedness(weight, phy2log, num_gpus: int) -> np.ndarray:
    """Balancedness (mean GPU load / max GPU load) of every layer.

    Arguments:
        weight: `[L, E]` torch tensor or numpy array of any real dtype, load of each logical expert.
        phy2log: `[L, R]` integer torch tensor or numpy array (or a `Placement`).
        num_gpus: the number of GPUs; must divide R.

    Returns:
        balancedness: `[L]` float64 numpy array in (0, 1]; 1.0 for a layer with no load.
    """
    return balance_of_loads(gpu_loads(weight, phy2log, num_gpus))


def balancedness(weight, phy2log, num_gpus: int) -> float:
    """Mean over layers of the balancedness (mean GPU load / max GPU load).

    Arguments:
        weight: `[L, E]` torch tensor or numpy array of any real dtype, load of each logical expert.
        phy2log: `[L, R]` integer torch tensor or numpy array (or a `Placement`).
        num_gpus: the number of GPUs; must divide R.

    Returns:
        balancedness: a float in (0, 1]; 1.0 is perfectly balanced.
    """
    per_layer = layer_balancedness(weight, phy2log, num_gpus)
    return float(per_layer.mean()) if per_layer.size else 1.0


def moved_copies(old_phy2log, new_phy2log) -> int:
    """Number of physical slots whose logical expert changes between two placements.

    Each such slot needs one expert copy written into it during the rebalance.

    Arguments:
        old_phy2log: `[L, R]` integer torch tensor or numpy array (or a `Placement`).
        new_phy2log: `[L, R]` integer torch tensor or numpy array (or a `Placement`), same shape.

    Returns:
        moved: the number of slots `(l, s)` with `old[l, s] != new[l, s]`.
    """
    old = _slot_table("old_phy2log", old_phy2log)
    new = _slot_table("new_phy2log", new_phy2log)
    if old.shape != new.shape:
        raise ValueError(f"new_phy2log: expected shape {list(old.shape)} like old_phy2log, got {list(new.shape)}")
    return int(np.count_nonzero(old != new))
