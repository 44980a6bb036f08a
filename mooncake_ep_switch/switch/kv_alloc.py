"""Unit allocation of the paged KV cache: which free units (TP pages) or aligned groups (EP pages) come next.

Pure functions over a rank's free-unit bitmap (`[num_units]` np.bool_, True = free); the same order
on every rank, so plans computed independently agree.
"""
import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# Allocation over a free-unit bitmap
# ------------------------------------------------------------------------------------------------

def alloc_unit(free: np.ndarray, group: int) -> int:
    """Allocate one unit (TP page) from `free` (modified): in the aligned group of `group` units with
    the fewest free units, lowest index first, so that whole groups stay free for EP pages.

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap, `num_units` a multiple of `group`; the chosen
            unit is set to False in place.
        group: units per aligned group (one EP page).

    Returns:
        unit: int index of the allocated unit, or -1 when nothing is free.
    """
    counts = free.reshape(-1, group).sum(axis=1)
    if not counts.any():
        return -1
    chosen = int(np.where(counts > 0, counts, group + 1).argmin())
    unit = chosen * group + int(np.flatnonzero(free[chosen * group:(chosen + 1) * group])[0])
    free[unit] = False
    return unit


def unit_order(free: np.ndarray, group: int) -> np.ndarray:
    """Free units in the order `alloc_unit` would hand them out if nothing were freed in between:
    groups with the fewest free units first (lowest index on ties), units ascending inside a group.

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap (not modified), `num_units` a multiple of `group`.
        group: units per aligned group (one EP page).

    Returns:
        units: `[num_free]` np.int64 unit indices in allocation order.
    """
    counts = free.reshape(-1, group).sum(axis=1)
    units = np.flatnonzero(free)
    keys = counts[units // group] * len(free) + units  # (group's free count, unit index)
    return units[np.argsort(keys, kind="stable")].astype(np.int64)


def group_order(free: np.ndarray, group: int) -> np.ndarray:
    """Wholly free aligned groups (EP pages), ascending: the order `alloc_group` hands them out.

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap (not modified), `num_units` a multiple of `group`.
        group: units per aligned group (one EP page).

    Returns:
        pages: `[num_free_pages]` np.int64 page (group) indices, ascending.
    """
    return np.flatnonzero(free.reshape(-1, group).all(axis=1)).astype(np.int64)


def alloc_group(free: np.ndarray, group: int) -> int:
    """Allocate one EP page (an aligned group of `group` free units) from `free` (modified).

    Arguments:
        free: `[num_units]` np.bool_ free-unit bitmap, `num_units` a multiple of `group`; the page's
            units are set to False in place.
        group: units per aligned group (one EP page).

    Returns:
        page: int index of the lowest wholly free page (its units are `page * group + [0, group)`),
            or -1 when no page is wholly free.
    """
    whole = np.flatnonzero(free.reshape(-1, group).all(axis=1))
    if whole.size == 0:
        return -1
    page = int(whole[0])
    free[page * group:(page + 1) * group] = False
    return page
