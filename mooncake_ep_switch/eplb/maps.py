"""Dispatch maps: which physical copy a source rank sends a token of a logical expert to.

The router picks logical experts (`topk_idx` in `[0, E)`, -1 for none). Before `dispatch`, each
entry is mapped to a physical slot holding a copy of that expert; `combine` is unchanged, since
the weights stay attached to the top-k entry, not to the copy that served it.

Two policies:

- Per-rank map (`build_dispatch_map` + `logical_to_physical`, the default): every source rank
  sends all its tokens of an expert to one copy, chosen once per rebalance: a copy on the rank
  itself, else one on the same host, else a remote one. Copies are filled least-assigned first
  (ranks per copy differ by at most one where locality allows), so with traffic spread evenly
  over source ranks each copy receives an even share. Local and same-host traffic never crosses
  the network, and the map is a plain gather.
- Token-level spreading (`spread_to_physical`): a rank spreads its tokens of an expert over all
  copies by token index. Use it when there are fewer source ranks than copies, or when traffic
  comes from a few ranks (one prefill rank, skewed data parallel): a per-rank map would send all
  of one rank's tokens of a hot expert to a single copy and leave the others idle, defeating
  the replication the placement assumed. It gives up locality: most tokens go to remote copies.

Which is right: the placement balances GPUs assuming a logical expert's load is split evenly
over its copies. The per-rank map meets that only on average over many similarly loaded source
ranks (>= copies); token-level spreading meets it for any number of sources. Prefer the per-rank
map when source ranks >= the largest replica count and traffic per rank is even (large EP decode);
prefer token spreading otherwise.

Serving through a death: all three take the source rank's mask (`active_ranks=`) and then use live
copies only (a copy is live when the mask has its rank); an expert without one maps to -1 (its
entries contribute nothing, no renormalisation) and is reported by `live_copies`. See `live.py`
and docs/eplb.md, "Serving through a death".
"""
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_indices, describe, to_numpy
from mooncake_ep_switch.eplb.live import alive_ranks, compact_live, reroute_map
from mooncake_ep_switch.eplb.policy.tables import Placement, expert_counts, replica_tables


def _slot_table(phy2log):
    """(table, E), validated before anything is sized by it: ids in `[0, E)` for a `Placement`,
    in `[0, R)` for a bare table (E = max + 1, and every expert needs one of the R slots)."""
    if isinstance(phy2log, Placement):
        num_logical = int(phy2log.logcnt.shape[1])
        return as_indices("phy2log", phy2log.phy2log, 2, upper=num_logical), num_logical
    table = as_indices("phy2log", phy2log, 2)
    if table.size and int(table.max()) >= table.shape[1]:
        raise ValueError(f"phy2log: expected logical experts < {table.shape[1]} (the slots per layer: every expert "
                         f"in [0, max] needs a slot), got a maximum of {int(table.max())}")
    return table, (int(table.max()) + 1 if table.size else 0)


def _assign_copies(copy_gpus, num_ranks: int, ranks_per_host: int):
    """For one logical expert: the copy index each source rank uses (see the module docstring)."""
    copies = len(copy_gpus)
    load = [0] * copies
    choice = [-1] * num_ranks
    local = {}
    for k, gpu in enumerate(copy_gpus):
        local.setdefault(gpu, k)
    for rank, k in local.items():
        choice[rank] = k
        load[k] += 1
    capacity = -(-num_ranks // copies)
    on_host = {}
    for k, gpu in enumerate(copy_gpus):
        on_host.setdefault(gpu // ranks_per_host, []).append(k)
    rest = []
    for rank in range(num_ranks):
        if choice[rank] >= 0:
            continue
        near = on_host.get(rank // ranks_per_host)
        if near:
            k = min(near, key=lambda j: (load[j], (j - rank) % copies))
            if load[k] < capacity:
                choice[rank] = k
                load[k] += 1
                continue
        rest.append(rank)
    for rank in rest:
        k = min(range(copies), key=lambda j: (load[j], (j - rank) % copies))
        choice[rank] = k
        load[k] += 1
    return choice


def build_dispatch_map(phy2log: Union[Placement, torch.Tensor, np.ndarray], num_gpus: int, ranks_per_host: int,
                       *, active_ranks=None) -> torch.Tensor:
    """For every source rank, layer and logical expert, the physical slot to dispatch to.

    Arguments:
        phy2log: a `Placement`, or `[L, R]` integer torch tensor / numpy array of logical experts
            per physical slot (slot s on GPU `s // (R // num_gpus)`). Every logical expert in
            `[0, E)` must have a copy (E from the `Placement`, else max + 1, so ids are < R).
        num_gpus: GPUs, which are also the source ranks; must divide R.
        ranks_per_host: ranks sharing a host (rank r is on host `r // ranks_per_host`); must
            divide `num_gpus`.
        active_ranks: None, or the source rank's `[num_gpus]` mask (torch tensor or numpy array of
            0/1, integer or bool dtype; the Buffer's `active_ranks`): only copies on live ranks are
            used. Entries whose unmasked choice is live are kept; the others are dealt over the
            expert's live copies, least loaded first, so the load stays even over them (see
            `live.reroute_map`). An expert with no live copy maps to -1.

    Returns:
        dispatch_map: `[num_gpus, L, E]` torch.int64: a copy on the source rank itself if any,
            else one on its host, else a remote one, copies filled least-assigned first; with a
            mask, live copies only and -1 for an expert without one.

    Raises:
        TypeError: `phy2log` is not an integer table, a size is not an int, or `active_ranks` is
            not a tensor/array of an integer or bool dtype.
        ValueError: an id outside `[0, E)` (`[0, R)` for a bare table), an expert without a copy,
            `num_gpus` not dividing R, `ranks_per_host` not dividing `num_gpus`, or `active_ranks`
            not of shape `[num_gpus]` or not 0/1; checked before anything is allocated.
    """
    table, num_logical = _slot_table(phy2log)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    ranks_per_host = check_int("ranks_per_host", ranks_per_host, 1)
    alive = None if active_ranks is None else alive_ranks("active_ranks", active_ranks, num_gpus)
    if num_gpus % ranks_per_host:
        raise ValueError(f"ranks_per_host: expected a divisor of num_gpus={num_gpus}, got {ranks_per_host}")
    num_layers, num_slots = table.shape
    if num_slots % num_gpus:
        raise ValueError(f"phy2log: expected a slot count divisible by num_gpus={num_gpus}, got {num_slots}")
    counts = expert_counts(table, num_logical)
    if (counts == 0).any():
        layer, expert = (int(v[0]) for v in np.nonzero(counts == 0))
        raise ValueError(f"phy2log: expected a copy of every logical expert, layer {layer} has none of expert {expert}")
    slots_per_gpu = num_slots // num_gpus
    log2phy, _ = replica_tables(table, num_logical, int(counts.max()) if counts.size else 1)
    result = np.empty((num_gpus, num_layers, num_logical), dtype=np.int64)
    # One copy: everyone uses it.
    result[:] = log2phy[None, :, :, 0]
    for layer, expert in zip(*np.nonzero(counts >= 2)):
        slots = log2phy[layer, expert, : counts[layer, expert]]
        choice = _assign_copies((slots // slots_per_gpu).tolist(), num_gpus, ranks_per_host)
        result[:, layer, expert] = slots[np.asarray(choice)]
    if alive is not None and not alive.all():
        result = reroute_map(result, log2phy, alive, slots_per_gpu)
    return torch.from_numpy(result)


class LiveCopies(NamedTuple):
    """The copies of every logical expert on ranks a mask has live (`live_copies`).

    Fields:
        log2phy: `[L, E, W]` torch.int64, each expert's live slots ascending, -1 padded.
        logcnt: `[L, E]` torch.int64, live copies per expert.
        lost: `[L, E]` torch.bool, experts with no live copy (their entries contribute nothing).
    """

    log2phy: torch.Tensor
    logcnt: torch.Tensor
    lost: torch.Tensor


def live_copies(phy2log: Union[Placement, torch.Tensor, np.ndarray], num_gpus: int, active_ranks) -> LiveCopies:
    """Which copies of every logical expert survive a mask, and which experts have none.

    Arguments:
        phy2log: a `Placement`, or `[L, R]` integer torch tensor / numpy array of logical experts
            per physical slot (slot s on GPU `s // (R // num_gpus)`).
        num_gpus: GPUs (ranks); must divide R.
        active_ranks: `[num_gpus]` mask (torch tensor or numpy array of 0/1, integer or bool).

    Returns:
        live: `LiveCopies`; `live.lost` lists the experts served by nobody under the mask.

    Raises:
        TypeError, ValueError: as `build_dispatch_map`, for `phy2log`, `num_gpus` and `active_ranks`.
    """
    table, num_logical = _slot_table(phy2log)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    alive = alive_ranks("active_ranks", active_ranks, num_gpus)
    if table.shape[1] % num_gpus:
        raise ValueError(f"phy2log: expected a slot count divisible by num_gpus={num_gpus}, got {table.shape[1]}")
    counts = expert_counts(table, num_logical)
    log2phy, _ = replica_tables(table, num_logical, max(int(counts.max()) if counts.size else 1, 1))
    live, count = compact_live(log2phy, alive, table.shape[1] // num_gpus)
    return LiveCopies(torch.from_numpy(live), torch.from_numpy(count), torch.from_numpy(count == 0))


def _index_like(name: str, topk_idx, num_logical: int):
    if isinstance(topk_idx, torch.Tensor):
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected an int32 or int64 tensor, got {describe(topk_idx)}")
    array = as_indices(name, to_numpy(name, topk_idx), 2, upper=num_logical, allow_negative_one=True)
    return array


def _like(result: np.ndarray, template):
    if isinstance(template, torch.Tensor):
        return torch.from_numpy(result).to(device=template.device, dtype=torch.int64)
    return result


def logical_to_physical(topk_idx, dispatch_map_row):
    """Map a router's logical top-k indices to physical slots with one rank's dispatch map.

    Arguments:
        topk_idx: `[N, K]` int64 (or int32) torch tensor or numpy array of logical experts, -1
            for no expert.
        dispatch_map_row: `[E]` integer torch tensor or numpy array, `dispatch_map[rank, layer]`
            from `build_dispatch_map`; -1 for an expert without a live copy (a masked map).

    Returns:
        physical_idx: `[N, K]` int64 of physical slots, -1 kept as -1 (and -1 for an expert the
            row maps to -1); a torch tensor on the input's device for torch input, else a numpy
            array. Pass it to `dispatch` in place of `topk_idx`; `topk_weights` and `combine` are
            unchanged.
    """
    row = as_indices("dispatch_map_row", dispatch_map_row, 1, allow_negative_one=True)
    index = _index_like("topk_idx", topk_idx, row.shape[0])
    physical = np.where(index >= 0, row[np.maximum(index, 0)], -1)
    return _like(physical, topk_idx)


def spread_to_physical(topk_idx, log2phy_row, logcnt_row, *, source_rank: int = 0, token_offset: int = 0,
                       active_ranks=None, slots_per_rank: Optional[int] = None):
    """Map logical top-k indices to physical slots, spreading tokens over all copies of an expert.

    Token t (counted from `token_offset`) of source rank `source_rank` uses copy
    `(token_offset + t + source_rank) % copies(e)` of its expert e, so a rank's tokens of an expert
    are spread evenly over its copies whatever the number of source ranks (see the module docstring).

    Arguments:
        topk_idx: `[N, K]` int64 (or int32) torch tensor or numpy array of logical experts, -1
            for no expert.
        log2phy_row: `[E, W]` integer torch tensor or numpy array, `placement.log2phy[layer]`.
        logcnt_row: `[E]` integer torch tensor or numpy array, `placement.logcnt[layer]`.
        source_rank: this rank (shifts the pattern so ranks start on different copies).
        token_offset: index of the first token (e.g. tokens already sent this step).
        active_ranks: None, or this source rank's `[R]` mask (torch tensor or numpy array of 0/1,
            integer or bool dtype): tokens are spread over the copies on live ranks only
            (`copies(e)` counts those), and an expert with none maps to -1. Needs `slots_per_rank`.
        slots_per_rank: slots per rank (slot s on rank `s // slots_per_rank`), with `active_ranks`.

    Returns:
        physical_idx: `[N, K]` int64 of physical slots, -1 kept as -1; torch on the input's
            device for torch input, else numpy.

    Raises:
        TypeError: a table or `topk_idx` of a non-integer dtype, or a mask of another dtype.
        ValueError: inconsistent tables, an id out of range, `active_ranks` without
            `slots_per_rank` (or the reverse), a mask not of shape `[R]` or not 0/1, or a slot of
            the table on no rank of the mask.
    """
    copies = as_indices("logcnt_row", logcnt_row, 1)
    table = as_indices("log2phy_row", log2phy_row, 2, allow_negative_one=True)
    if table.shape[0] != copies.shape[0]:
        raise ValueError(f"log2phy_row: expected {copies.shape[0]} rows like logcnt_row, got {table.shape[0]}")
    if (copies < 1).any() or (copies > table.shape[1]).any():
        raise ValueError(f"logcnt_row: expected counts in [1, {table.shape[1]}], got {copies.min()}..{copies.max()}")
    source_rank = check_int("source_rank", source_rank, 0)
    token_offset = check_int("token_offset", token_offset, 0)
    if (active_ranks is None) != (slots_per_rank is None):
        raise ValueError("active_ranks: expected together with slots_per_rank (both or neither), got "
                         f"active_ranks={'None' if active_ranks is None else describe(active_ranks)}, "
                         f"slots_per_rank={slots_per_rank!r}")
    if active_ranks is not None:
        slots_per_rank = check_int("slots_per_rank", slots_per_rank, 1)
        num_ranks = int(active_ranks.shape[0]) if hasattr(active_ranks, "shape") and len(active_ranks.shape) else 0
        alive = alive_ranks("active_ranks", active_ranks, num_ranks)
        if table.size and int(table.max()) >= num_ranks * slots_per_rank:
            raise ValueError(f"log2phy_row: expected slots < {num_ranks * slots_per_rank} (the mask's "
                             f"{num_ranks} ranks x slots_per_rank={slots_per_rank}), got {int(table.max())}")
        width = table.shape[1]
        table = np.where(np.arange(width)[None, :] < copies[:, None], table, -1)
        table, copies = compact_live(table, alive, slots_per_rank)
    index = _index_like("topk_idx", topk_idx, copies.shape[0])
    safe = np.maximum(index, 0)
    token = np.arange(index.shape[0], dtype=np.int64)[:, None] + token_offset + source_rank
    pick = token % np.maximum(copies[safe], 1)
    physical = np.where((index >= 0) & (copies[safe] > 0), table[safe, pick], -1)
    return _like(physical, topk_idx)
