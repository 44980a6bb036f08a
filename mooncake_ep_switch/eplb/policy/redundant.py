"""Redundant experts around fixed primaries: `place_redundant_experts`.

The "fixed primaries" layout keeps every logical expert's primary copy where a plain expert-
parallel deployment has it and only decides the redundant slots:

- logical expert `e`'s primary copy is on GPU `e // P` at slot position `e % P` of that GPU,
  with `P = E / num_gpus` primaries per GPU;
- every GPU additionally owns `redundant_per_gpu` redundant slots. Physical slot ids: GPU `g`
  owns `[g * spg, (g + 1) * spg)` with `spg = P + redundant_per_gpu`, its first `P` slots the
  primaries, the rest redundant experts;
- no GPU holds two copies of one logical expert.

Primaries never move, so a rebalance only rewrites redundant slots (cheap: nothing else is
touched, and the primary weights can stay where the model loader put them).

How (vectorised over layers; balancedness = mean GPU load / max GPU load, a logical expert's load
split evenly across its copies):

1. construction: copies per expert by largest load per copy (`replication.replica_counts`),
   the redundant copies LPT onto the GPUs (largest first to the lightest GPU, its primaries
   counted, with a free redundant slot and no copy of the expert yet); layers where LPT cannot
   avoid a duplicate are filled slot by slot instead (`_fill`: each slot to an expert of the
   heaviest GPU, on the lightest GPU that can take it);
2. refinement: `local_search.search` (compiled) lowers the heaviest GPUs by swapping redundant copies
   between GPUs, re-pointing a redundant slot at another expert ("park"), or giving an expert of a
   heavy GPU a copy in a light GPU's redundant slot ("split"); primaries are pinned and swaps
   consider only redundant positions.

With `previous`, the deployed redundant slots are kept when the layer is within
`balance_tolerance` of the fresh result; otherwise the same local search starts from them and
counts a slot as moved only when its expert changes (so an unchanged or uniformly scaled load
moves nothing). A layer the search cannot bring within the tolerance takes the fresh result,
with each GPU's redundant experts kept at their previous positions when they stay.
"""
import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_float, as_indices, as_loads
from mooncake_ep_switch.eplb.policy.construct import Topology, sorted_items
from mooncake_ep_switch.eplb.policy.tables import expert_counts
from mooncake_ep_switch.eplb.policy.local_search import search
from mooncake_ep_switch.eplb.policy.metrics import balance_of_loads
from mooncake_ep_switch.eplb.policy.packing import group_by_bin, lpt_assign
from mooncake_ep_switch.eplb.policy.placement import normalized_loads
from mooncake_ep_switch.eplb.policy.replication import replica_counts

__all__ = ["place_redundant_experts"]

NEAR = 16  # light partner GPUs per heavy GPU in the refinement (only redundant slots move: cheap)
HEAVY = 8  # heavy GPUs tried in turn when the heaviest has no move


def place_redundant_experts(
    weight,
    num_gpus: int,
    redundant_per_gpu: int,
    *,
    previous=None,
    balance_tolerance: float = 0.01,
) -> torch.Tensor:
    """Choose the redundant experts of a fixed-primaries layout (see the module docstring).

    Arguments:
        weight: `[L, E]` torch tensor or numpy array of any real dtype (non-negative, finite), the
            load of each logical expert (e.g. tokens routed in the recent window).
        num_gpus: GPUs (EP ranks); must divide E.
        redundant_per_gpu: redundant slots per GPU, in `[0, E - E / num_gpus]` (a GPU holds at
            most one copy of each logical expert).
        previous: `[L, num_gpus * spg]` integer torch tensor or numpy array, the deployed slot
            table, or None. Its primary slots are ignored (primaries are fixed); a redundant slot
            keeps its expert unless moving it is needed to come, per layer, within
            `balance_tolerance` of the fresh result's balancedness. Invalid redundant entries
            (a second copy on one GPU) are replaced.
        balance_tolerance: absolute balancedness (per layer) `previous` may stay below the fresh
            result to move fewer copies; in [0, 1].

    Returns:
        phy2log: `[L, num_gpus * spg]` torch.int64, the logical expert of every physical slot,
            `spg = E / num_gpus + redundant_per_gpu`.
    """
    loads = as_loads("weight", weight, 2)
    num_layers, num_logical = loads.shape
    if num_layers == 0 or num_logical == 0:
        raise ValueError(f"weight: expected at least one layer and one logical expert, got shape {list(loads.shape)}")
    num_gpus = check_int("num_gpus", num_gpus, 1)
    if num_logical % num_gpus:
        raise ValueError(f"num_gpus: expected a divisor of the {num_logical} logical experts, got {num_gpus}")
    primaries = num_logical // num_gpus
    redundant_per_gpu = check_int("redundant_per_gpu", redundant_per_gpu, 0)
    if redundant_per_gpu > num_logical - primaries:
        raise ValueError(
            f"redundant_per_gpu: expected <= {num_logical - primaries} (a GPU holds at most one copy of each of "
            f"the {num_logical} logical experts and already has {primaries} primaries), got {redundant_per_gpu}"
        )
    tolerance = as_float("balance_tolerance", balance_tolerance, 0.0, 1.0)
    spg = primaries + redundant_per_gpu
    num_slots = num_gpus * spg
    prev = None
    if previous is not None:
        prev = as_indices("previous", previous, 2, upper=num_logical)
        if prev.shape != (num_layers, num_slots):
            raise ValueError(f"previous: expected shape [{num_layers}, {num_slots}], got {list(prev.shape)}")
    w = normalized_loads(loads)
    table = _fresh(w, num_gpus, primaries, redundant_per_gpu)
    if prev is not None and redundant_per_gpu > 0:
        table = _from_previous(w, prev, table, num_gpus, primaries, redundant_per_gpu, tolerance)
    return torch.from_numpy(np.ascontiguousarray(table))


def _topology(num_logical: int, num_gpus: int, spg: int) -> Topology:
    # Every GPU its own "node": pinned primaries never leave their GPU, redundant copies may.
    return Topology(num_logical, num_gpus * spg, num_gpus, num_gpus, num_gpus, True)


def _primary_table(num_layers: int, num_gpus: int, primaries: int, redundant: int) -> np.ndarray:
    """`[L, G * spg]` with the primaries in place and -1 in the redundant slots."""
    spg = primaries + redundant
    table = np.full((num_layers, num_gpus, spg), -1, dtype=np.int64)
    table[:, :, :primaries] = np.arange(num_gpus * primaries).reshape(num_gpus, primaries)
    return table.reshape(num_layers, num_gpus * spg)


def _pinned(num_layers: int, num_gpus: int, primaries: int, redundant: int) -> np.ndarray:
    flags = np.zeros((num_layers, num_gpus, primaries + redundant), dtype=bool)
    flags[:, :, :primaries] = True
    return flags.reshape(num_layers, -1)


def _gpu_loads(w: np.ndarray, table: np.ndarray, num_gpus: int) -> np.ndarray:
    counts = expert_counts(table, w.shape[1])
    per_slot = np.take_along_axis(w / np.maximum(counts, 1), table, axis=1)
    return per_slot.reshape(table.shape[0], num_gpus, -1).sum(axis=2)


def _fill(w: np.ndarray, table: np.ndarray, num_gpus: int, primaries: int, redundant: int) -> None:
    """Fill the -1 (free) redundant slots of `table` in place, one slot per layer and step.

    Each step serves the heaviest GPU: among its experts, the one whose extra copy, on the
    lightest GPU with a free slot that does not hold it, gives the smallest new maximum of the
    heaviest and the receiving GPU. If no copy lowers the heaviest GPU, the lightest GPU with a
    free slot takes a copy of the expert with the largest load per copy that it does not hold.
    """
    num_layers, num_logical = w.shape
    spg = primaries + redundant
    table3 = table.reshape(num_layers, num_gpus, spg)
    valid = table3 >= 0
    holder = np.zeros((num_layers, num_logical, num_gpus), dtype=bool)
    li, gi, si = np.nonzero(valid)
    holder[li, table3[li, gi, si], gi] = True
    counts = holder.sum(axis=2)
    free = (~valid).sum(axis=2)  # [L, G]
    for _ in range(int(free.sum(axis=1).max(initial=0))):
        active = np.nonzero(free.sum(axis=1) > 0)[0]
        if active.size == 0:
            break
        sub = np.arange(active.size)
        wa, ca, fa = w[active], counts[active], free[active]
        per = wa / np.maximum(ca, 1)
        ex3 = table3[active]
        size3 = np.where(ex3 >= 0, np.take_along_axis(per, np.maximum(ex3, 0).reshape(active.size, -1), axis=1).reshape(ex3.shape), 0.0)
        load = size3.sum(axis=2)
        top = load.argmax(axis=1)
        cand = ex3[sub, top]  # [b, S] experts of the heaviest GPU (-1: free)
        safe = np.maximum(cand, 0)
        held = holder[active[:, None], safe]  # [b, S, G]
        allowed = (fa[:, None, :] > 0) & ~held
        dest = np.where(allowed, load[:, None, :], np.inf).argmin(axis=2)  # [b, S]
        cw, cc = np.take_along_axis(wa, safe, axis=1), np.take_along_axis(ca, safe, axis=1)
        new_copy = cw / (cc + 1.0)
        top_after = load[sub, top][:, None] - (cw / np.maximum(cc, 1) - new_copy)
        dest_after = np.take_along_axis(load, dest, axis=1) + new_copy
        ok = (cand >= 0) & allowed.any(axis=2) & (cc < num_gpus)
        score = np.where(ok, np.maximum(top_after, dest_after), np.inf)
        best = score.argmin(axis=1)
        helps = score[sub, best] < load[sub, top] * (1 - 1e-12)
        expert = safe[sub, best]
        gpu = dest[sub, best]
        # Otherwise: the lightest GPU with a free slot takes the largest copy it does not hold.
        light = np.where(fa > 0, load, np.inf).argmin(axis=1)
        other = np.where(~holder[active, :, light] & (ca < num_gpus), per, -1.0).argmax(axis=1)
        expert = np.where(helps, expert, other)
        gpu = np.where(helps, gpu, light)
        position = (table3[active, gpu] < 0).argmax(axis=1)  # the GPU's first free slot (any position)
        table3[active, gpu, position] = expert
        holder[active, expert, gpu] = True
        counts[active, expert] += 1
        free[active, gpu] -= 1


def _fresh(w: np.ndarray, num_gpus: int, primaries: int, redundant: int) -> np.ndarray:
    """Copies by largest load per copy, redundant copies LPT onto the GPUs' primaries, refinement."""
    num_layers, num_logical = w.shape
    spg = primaries + redundant
    table = _primary_table(num_layers, num_gpus, primaries, redundant)
    if redundant == 0:
        return table
    counts = replica_counts(w, num_gpus * spg, num_gpus)
    per = w / counts
    base = per.reshape(num_layers, num_gpus, primaries).sum(axis=2)
    keys, sizes = sorted_items(per, counts - 1)
    primary_of = np.zeros((num_layers, num_gpus, num_logical), dtype=np.int64)
    primary_of[:, np.arange(num_logical) // primaries, np.arange(num_logical)] = 1
    gpu, flagged = lpt_assign(sizes, keys, num_gpus, redundant, init_load=base, init_keycount=primary_of)
    (red,) = group_by_bin(gpu, num_gpus, keys)
    table3 = table.reshape(num_layers, num_gpus, spg)
    table3[:, :, primaries:] = red
    if flagged.any():
        # Some copy found no GPU without its expert: rebuild those layers slot by slot.
        rows = np.nonzero(flagged)[0]
        table3[rows, :, primaries:] = -1
        sub_table = table3[rows].reshape(rows.size, -1)
        _fill(w[rows], sub_table, num_gpus, primaries, redundant)
        table3[rows] = sub_table.reshape(rows.size, num_gpus, spg)
    topo = _topology(num_logical, num_gpus, spg)
    counts = expert_counts(table, num_logical)
    pinned = _pinned(num_layers, num_gpus, primaries, redundant)
    mean = w.sum(axis=1) / num_gpus
    search(w, table, counts, pinned, topo, mean * (1 + 1e-9), np.full(num_layers, np.inf), np.arange(num_layers),
           split=False, relieve=False, max_steps=32 * num_gpus * redundant, swap_from=primaries, near=NEAR, heavy=HEAVY)
    return _sorted_redundant(table, num_gpus, primaries, redundant)


def _sorted_redundant(table: np.ndarray, num_gpus: int, primaries: int, redundant: int) -> np.ndarray:
    """Each GPU's redundant experts in ascending order (a canonical form of a fresh result)."""
    table3 = table.reshape(table.shape[0], num_gpus, primaries + redundant).copy()
    table3[:, :, primaries:] = np.sort(table3[:, :, primaries:], axis=2)
    return table3.reshape(table.shape)


def _from_previous(w, prev, fresh, num_gpus: int, primaries: int, redundant: int, tolerance: float) -> np.ndarray:
    num_layers, num_logical = w.shape
    spg = primaries + redundant
    # The previous table with the primaries restored and invalid redundant entries freed.
    start = _primary_table(num_layers, num_gpus, primaries, redundant).reshape(num_layers, num_gpus, spg)
    old = prev.reshape(num_layers, num_gpus, spg)
    for position in range(primaries, spg):
        candidate = old[:, :, position]
        clash = (start == candidate[:, :, None]).any(axis=2)
        start[:, :, position] = np.where(clash, -1, candidate)
    start = start.reshape(num_layers, -1)
    _fill(w, start, num_gpus, primaries, redundant)
    mean = w.sum(axis=1) / num_gpus
    fresh_balance = balance_of_loads(_gpu_loads(w, fresh, num_gpus))
    target = fresh_balance - tolerance
    peak_limit = np.where(target > 0, mean / np.maximum(target, 1e-300), np.inf)
    result = start.copy()
    work = np.nonzero(_gpu_loads(w, result, num_gpus).max(axis=1) > peak_limit * (1 + 1e-12))[0]
    if work.size == 0:
        return result
    topo = _topology(num_logical, num_gpus, spg)
    counts = expert_counts(result, num_logical)
    pinned = _pinned(num_layers, num_gpus, primaries, redundant)
    fallback = _align(fresh, start, num_gpus, primaries, redundant)
    budget = (fallback != start).sum(axis=1)
    search(w, result, counts, pinned, topo, peak_limit, np.full(num_layers, np.inf), work, start=start, budget=budget,
           split=False, relieve=False, max_steps=32 * num_gpus * redundant, swap_from=primaries, near=NEAR, heavy=HEAVY)
    peak = _gpu_loads(w, result, num_gpus).max(axis=1)
    failed = work[(peak[work] > peak_limit[work] * (1 + 1e-9)) | ((result[work] != start[work]).sum(axis=1) >= budget[work])]
    result[failed] = fallback[failed]
    return result


def _align(fresh, start, num_gpus: int, primaries: int, redundant: int) -> np.ndarray:
    """The fresh table with each GPU's redundant experts at their `start` positions when they stay."""
    num_layers = fresh.shape[0]
    spg = primaries + redundant
    new = fresh.reshape(num_layers, num_gpus, spg)[:, :, primaries:]
    old = start.reshape(num_layers, num_gpus, spg)[:, :, primaries:]
    stays = (old[..., :, None] == new[..., None, :]).any(axis=3)  # old position keeps its expert
    arriving = ~(new[..., :, None] == old[..., None, :]).any(axis=3)
    result = np.where(stays, old, -1)
    free_pos = np.argsort(stays, axis=2, kind="stable")  # free positions first
    arrive_order = np.argsort(~arriving, axis=2, kind="stable")  # arriving experts first
    count = arriving.sum(axis=2)
    for j in range(redundant):
        li, gi = np.nonzero(j < count)
        result[li, gi, free_pos[li, gi, j]] = new[li, gi, arrive_order[li, gi, j]]
    out = fresh.reshape(num_layers, num_gpus, spg).copy()
    out[:, :, primaries:] = result
    return out.reshape(num_layers, -1)
