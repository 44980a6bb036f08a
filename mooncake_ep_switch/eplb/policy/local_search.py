"""Local search for the movement-aware rebalance: lower the heavy GPUs per moved copy.

The search runs in native code (csrc/eplb/search.cpp), one layer at a time (layers on up to four
threads; the result does not depend on how many) and one move at a time. Per layer, in order:

1. split large copies: while some expert's copy load exceeds `item_limit`, give it one more copy
   by overwriting a spare copy (an expert with >= 2 copies, not pinned) on a GPU that does not
   hold it, choosing the slot that lowers the sum of squared GPU loads most among the slots whose
   donor stays within `item_limit` (else among those whose donor stays below the receiver's copy
   load); one moved copy each;
2. relieve nodes (hierarchical mode): while the heaviest node is above its share of the target,
   the expert whose extra copy lowers that node most gets a copy on another node, in a slot
   after which every node is lighter than the heaviest node was (a pinned primary cannot leave
   its node; extra copies elsewhere take its load);
3. improve: while the heaviest GPU is above `peak_limit`, apply its best move:
   - swap one of its copies with a copy on another GPU (two copies move);
   - park: overwrite one of its copies of an expert that has other copies with a copy of the
     expert whose copy load after one more copy is smallest (one copy moves);
   - split: give one of its 3 largest experts an extra copy in a spare slot on a light GPU
     (one copy moves; all copies of the expert shrink).
   Swaps and splits look at the `near` lightest GPUs, swaps at every GPU when nothing helps. A
   move is judged exactly, by the largest new load among the GPUs it changes, against the heavy
   GPU's load, per cost: the slots it changes that still hold their `start` expert (a slot
   changed already costs nothing more) plus 0.25; it must gain 1e-6 of the load per cost. No move
   makes a copy larger than `item_limit`, moves a pinned primary off its node, or puts two copies
   of an expert on one GPU; pinned flags travel with swapped copies. A layer stops when no move
   lowers its heaviest GPU, after `max_steps` moves, or once `budget` slots differ from `start`;
4. (hierarchical) layers still above the target get up to `retries` more rounds of node relief,
   0.5 % lower each time, and improvement;
5. with `start`: every changed slot whose start expert can come back (no copy of it on that GPU,
   the slot not pinned, no GPU above max(`peak_limit`, the heaviest load) and no copy above
   `item_limit` afterwards) gets it back: moves the search made on its way but does not need.
"""
import numpy as np

from mooncake_ep_switch import _native
from mooncake_ep_switch.eplb._convert import inplace_array, native_threads
from mooncake_ep_switch.eplb.policy.construct import Topology
from mooncake_ep_switch.eplb.policy.tables import expert_counts

NEAR = 16  # light partner GPUs per heavy GPU in the local search (hierarchical mode)
NEAR_GLOBAL = 4  # the same in global mode (no primaries pinned to nodes: fewer suffice)


def search(
    weight, experts, counts, pinned, topo: Topology, peak_limit, item_limit, rows, *, start=None, budget=None,
    split: bool = True, relieve: bool = True, revert: bool = True, node_margin: float = 1.0, retries: int = 0, max_steps=None,
    near: int = 0, swap_from: int = 0, heavy: int = 1, threads=None,
) -> None:
    """Run the local search (see the module docstring) on the layers in `rows`, in place.

    Arguments:
        weight: `[L, E]` float64, load of each logical expert.
        experts: `[L, R]` int64 slot table (modified): logical expert of each physical expert (slot).
        counts: `[L, E]` int64 copies per logical expert (modified; must match `experts`, which
            must hold at most one copy of an expert per GPU).
        pinned: `[L, R]` bool primaries (modified: flags move with swapped copies).
        topo: the problem's shape.
        peak_limit: `[L]` float64, the heaviest GPU load to reach.
        item_limit: `[L]` float64, the largest copy load allowed to appear.
        rows: int64 layer indices to work on.
        start: `[L, R]` int64, the table moves are counted against, or None (every move costs).
        budget: `[L]` int64 >= 0, the most slots a layer's improvement may leave different from
            `start` (steps 1 and 2 do not count against it), or None.
        split: run step 1.
        relieve: run step 2 (and 4); hierarchical mode only.
        revert: run step 5 (needs `start`).
        node_margin: node relief aims each node at this share of its GPUs' target load.
        retries: rounds of step 4.
        max_steps: the most moves per improvement round (None: 4 x slots per layer).
        near: light partner GPUs per heavy GPU (0: `NEAR`, or `NEAR_GLOBAL` in global mode).
        swap_from: swaps consider only slot positions `>= swap_from` of each GPU (the positions
            before hold copies that never move, e.g. fixed primaries).
        heavy: when the heaviest GPU has no move, try the next heaviest GPUs above `peak_limit`,
            up to this many GPUs in all (lowering them can open moves for the heaviest later).
        threads: threads to search layers on (None: the CPUs this process may use, at most
            `MAX_NATIVE_THREADS`); the result is the same for any count.

    Raises:
        ValueError: an array of the wrong dtype, shape or layout, values out of range (weights,
            experts, start, budget, repeated or out-of-range rows), counts that disagree with
            experts, or a GPU holding two copies of one expert.
    """
    num_layers = weight.shape[0] if isinstance(weight, np.ndarray) and weight.ndim == 2 else -1
    table = (num_layers, topo.num_replicas)
    inplace_array("weight", weight, np.float64, (num_layers, topo.num_logical))
    inplace_array("experts", experts, np.int64, table)
    inplace_array("counts", counts, np.int64, (num_layers, topo.num_logical))
    inplace_array("pinned", pinned, np.bool_, table)
    peak_limit = inplace_array("peak_limit", np.ascontiguousarray(peak_limit, dtype=np.float64), np.float64, (num_layers,))
    item_limit = inplace_array("item_limit", np.ascontiguousarray(item_limit, dtype=np.float64), np.float64, (num_layers,))
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= num_layers)):
        raise ValueError(f"rows: expected layer indices in [0, {num_layers}), got {rows.tolist()}")
    if rows.size != np.unique(rows).size:
        raise ValueError(f"rows: expected distinct layer indices, got {rows.tolist()}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("weight: expected finite, non-negative loads")
    if experts.size and (experts.min() < 0 or experts.max() >= topo.num_logical):
        raise ValueError(f"experts: expected logical experts in [0, {topo.num_logical})")
    if not np.array_equal(counts, expert_counts(experts, topo.num_logical)):
        raise ValueError("counts: expected the copies of each logical expert in experts")
    per_gpu = np.sort(experts.reshape(num_layers, topo.num_gpus, topo.slots_per_gpu), axis=2)
    if (per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).any():
        raise ValueError("experts: expected at most one copy of a logical expert per GPU")
    if start is not None:
        start = inplace_array("start", np.ascontiguousarray(start, dtype=np.int64), np.int64, table)
        if start.size and (start.min() < 0 or start.max() >= topo.num_logical):
            raise ValueError(f"start: expected logical experts in [0, {topo.num_logical})")
    if budget is not None:
        budget = inplace_array("budget", np.ascontiguousarray(budget, dtype=np.int64), np.int64, (num_layers,))
        if (budget < 0).any():
            raise ValueError(f"budget: expected non-negative slot counts, got a minimum of {budget.min()}")
    if not 0 <= swap_from < topo.slots_per_gpu:
        raise ValueError(f"swap_from: expected a slot position in [0, {topo.slots_per_gpu}), got {swap_from}")
    if near < 0 or heavy < 1 or (max_steps is not None and max_steps < 0):
        raise ValueError(f"near, heavy, max_steps: expected >= 0, >= 1, >= 0, got {near}, {heavy}, {max_steps}")
    if rows.size == 0:
        return
    _native.eplb_search(topo.num_logical, topo.num_replicas, topo.num_gpus, topo.gpus_per_node,
                        hierarchical=topo.hierarchical, weight=weight.ctypes.data, experts=experts.ctypes.data,
                        counts=counts.ctypes.data, pinned=pinned.ctypes.data,
                        start=0 if start is None else start.ctypes.data, rows=rows.ctypes.data, num_rows=rows.size,
                        peak_limit=peak_limit.ctypes.data, item_limit=item_limit.ctypes.data,
                        budget=0 if budget is None else budget.ctypes.data, split=bool(split), relieve=bool(relieve),
                        revert=bool(revert), node_margin=float(node_margin), retries=int(retries),
                        max_steps=4 * topo.num_replicas if max_steps is None else int(max_steps),
                        near=int(near or (NEAR if topo.hierarchical else NEAR_GLOBAL)), swap_from=int(swap_from),
                        heavy=int(heavy), threads=native_threads(threads))
