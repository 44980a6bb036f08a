"""Live copies: routing around masked ranks (serving through a death), vectorised over the tables.

A source rank whose `active_ranks` mask has a 0 for rank `r` can no longer be served by any slot on
`r` (dispatch skips the rank, combine skips its entries). Every logical expert with a copy on a
rank still live in that mask is routed to live copies only, from the next dispatch on; an expert
with no live copy is lost (its top-k entries map to -1: no contribution, no renormalisation).
Each source rank decides from its own mask: no collective, and combine is exact whatever masks the
peers hold (the weights stay with the top-k entry, whichever copy served it).

Everything here works on validated numpy tables (`maps.py` and `serving.py` validate): one
`argsort` over `[L, E, W]` replica tables, one gather per token entry, no Python loop per expert or
token.
"""
from typing import Tuple

import numpy as np
import torch

from mooncake_ep_switch.eplb._convert import describe, to_numpy


def alive_ranks(name: str, mask, num_ranks: int, torch_int32: bool = False) -> np.ndarray:
    """Validate a rank mask and return it as booleans.

    Arguments:
        name: the argument's name, for error messages.
        mask: `[num_ranks]` torch tensor or numpy array of 0/1 (1 = live); integer or bool dtype
            (torch.int32 only with `torch_int32`, the Buffer's `active_ranks`).
        num_ranks: ranks the mask must cover.
        torch_int32: require a torch.int32 tensor.

    Returns:
        alive: `[num_ranks]` bool numpy array (a copy).

    Raises:
        TypeError: not a tensor/array, or a dtype other than the allowed ones.
        ValueError: a shape other than `[num_ranks]`, or a value other than 0 and 1.
    """
    if torch_int32:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.int32:
            raise TypeError(f"{name}: expected a torch.int32 tensor, got {describe(mask)}")
    elif not isinstance(mask, (torch.Tensor, np.ndarray)):
        raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {describe(mask)}")
    if tuple(mask.shape) != (num_ranks,):
        raise ValueError(f"{name}: expected shape [{num_ranks}], got {describe(mask)}")
    array = to_numpy(name, mask)
    if array.dtype != np.bool_ and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer or bool dtype, got {describe(mask)}")
    values = array.astype(np.int64)
    if values.size and (values.min() < 0 or values.max() > 1):
        raise ValueError(f"{name}: expected 0 (masked) or 1 (live) entries, got {int(values.min())}..{int(values.max())}")
    return values.astype(bool)


def compact_live(log2phy: np.ndarray, alive: np.ndarray, slots_per_rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """The live copies of every logical expert, first in each row.

    Arguments:
        log2phy: `[..., E, W]` int64 slots of each expert (-1 padded).
        alive: `[R]` bool, live ranks (slot s on rank `s // slots_per_rank`).
        slots_per_rank: slots per rank.

    Returns:
        live: `[..., E, W]` int64, each expert's live slots in their original order, then -1.
        count: `[..., E]` int64, live copies per expert (0: the expert is lost).
    """
    valid = log2phy >= 0
    live = valid & alive[np.where(valid, log2phy, 0) // slots_per_rank]
    order = np.argsort(~live, axis=-1, kind="stable")
    table = np.take_along_axis(np.where(live, log2phy, -1), order, axis=-1)
    return table, live.sum(axis=-1).astype(np.int64)


def reroute_map(result: np.ndarray, log2phy: np.ndarray, alive: np.ndarray, slots_per_rank: int) -> np.ndarray:
    """Move a dispatch map's entries off masked ranks, spreading them evenly over live copies.

    An entry whose slot is on a live rank is kept. For every (layer, expert), the live source ranks
    whose copy is masked are taken in rank order and dealt round-robin over the expert's live
    copies, least loaded first (load: live source ranks already using the copy), so live copies
    whose loads differ by at most one before still do after. Masked source ranks' rows are filled
    too (the least loaded copy) without counting. No live copy: -1.

    Arguments:
        result: `[G, L, E]` int64 dispatch map (every entry a slot), modified and returned.
        log2phy: `[L, E, W]` int64 slots of each expert (-1 padded).
        alive: `[G]` bool live ranks (sources and slot owners).
        slots_per_rank: slots per rank.

    Returns:
        result: the same array, rerouted.
    """
    num_gpus, num_layers, num_logical = result.shape
    num_slots = num_gpus * slots_per_rank
    live, count = compact_live(log2phy, alive, slots_per_rank)
    sources = alive[:, None, None]
    masked = ~alive[result // slots_per_rank]
    keep = ~masked & sources
    layer_of = np.broadcast_to(np.arange(num_layers)[None, :, None], result.shape)
    load = np.bincount((layer_of * num_slots + result)[keep], minlength=num_layers * num_slots)
    load = load.reshape(num_layers, num_slots)
    copy_load = np.where(live >= 0, np.take_along_axis(load, np.maximum(live, 0).reshape(num_layers, -1), axis=1)
                         .reshape(live.shape), np.iinfo(np.int64).max)
    ordered = np.take_along_axis(live, np.argsort(copy_load, axis=-1, kind="stable"), axis=-1)
    moving = masked & sources
    ordinal = np.where(sources, np.cumsum(moving, axis=0) - 1, 0)
    pick = ordinal % np.maximum(count, 1)[None]
    new = ordered[np.arange(num_layers)[None, :, None], np.arange(num_logical)[None, None, :], pick]
    return np.where(masked, np.where(count[None] > 0, new, -1), result)


def slot_ok(alive: np.ndarray, slots_per_rank: int) -> np.ndarray:
    """Which slots a mask leaves live, with one extra False entry that index -1 (no slot) reads.

    Arguments:
        alive: `[R]` bool live ranks.
        slots_per_rank: slots per rank.

    Returns:
        ok: `[R * slots_per_rank + 1]` bool; `ok[s]` for slot s, `ok[-1]` False.
    """
    return np.append(np.repeat(alive, slots_per_rank), False)


def reroute_entries(topk: np.ndarray, physical: np.ndarray, row: np.ndarray, live: np.ndarray, count: np.ndarray,
                    ok: np.ndarray, first_token: int) -> np.ndarray:
    """Send a rank's top-k entries whose dispatch-map slot is on a masked rank (or is -1) to live copies.

    Token t's entries of such an expert e go to live copy `(first_token + t) % count[e]`: each
    rerouted expert's tokens are spread evenly over its live copies, whichever ranks send them.
    Entries of an expert without a live copy become -1. Two gathers over the entries when nothing
    needs rerouting.

    Arguments:
        topk: `[N, K]` int64 logical experts (-1 = none).
        physical: `[N, K]` int64, `row[topk]` (-1 kept), modified and returned.
        row: `[E]` int64 dispatch-map row (-1 = no slot).
        live, count: one layer's `compact_live` tables, `[E, W]` and `[E]`.
        ok: `slot_ok(alive, slots_per_rank)`.
        first_token: index of token 0 in the spreading pattern (the source rank, plus an offset).

    Returns:
        physical: the same array, every entry of an expert with a live copy on a live slot.
    """
    off = np.append(~ok[row], False)  # per expert, and False for topk == -1
    rows, cols = np.nonzero(off[topk])
    if rows.size:
        expert = topk[rows, cols]
        copies = count[expert]
        pick = (rows + first_token) % np.maximum(copies, 1)
        physical[rows, cols] = np.where(copies > 0, live[expert, pick], -1)
    return physical


def lost_entries(topk: np.ndarray, physical: np.ndarray, ok: np.ndarray) -> int:
    """Top-k entries (token x k) with an expert whose contribution is lost: mapped to no slot, or to
    a slot on a masked rank.

    Arguments:
        topk: `[N, K]` int64 logical experts (-1 = none, not counted).
        physical: `[N, K]` int64 slots (-1 = none; -1 wherever `topk` is -1).
        ok: `slot_ok(alive, slots_per_rank)`.

    Returns:
        lost: the number of such entries.
    """
    return int((~ok[physical]).sum()) - int((topk < 0).sum())
