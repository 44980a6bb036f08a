"""Placing the experts over a shrunk group: every logical expert on the remaining ranks only.

After `Buffer.shrink(ranks)` the removed ranks' ids stay (sparse ids: `ExpertSlots` keeps its
`[L, R * slots_per_rank]` table), but nothing may be served from them again. The placement over
the remaining ranks is a coverage epoch (`eplb.coverage`) whose live ranks are the new view:

* each expert without a copy on the remaining ranks takes a remaining rank's redundant slot (one
  whose expert keeps another copy there), at most `spare_frames` per rank and layer, never a
  primary slot (`fixed_per_rank`); the removed ranks' slots keep their last ids and are never
  staged, voted on or dispatched to (every dispatch map is built with `active_ranks=` the view's
  mask, `Buffer.active_mask()`, which keeps them 0 for good);
* weights from a remaining rank's copy where one exists, else from the engine's `loader`;
* the move to it is one online EPLB chunk per group of layers, committed by the remaining ranks'
  vote at one agreed step (`OnlineRebalancer.begin(..., live=mask)`).

`shrink_experts` checks that such a placement exists before the group shrinks (an expert that would
have no slot is refused naming `ranks`, nothing changed), shrinks the Buffer and begins that epoch.
"""
from typing import Optional, Tuple

import numpy as np

from mooncake_ep_switch.eplb.coverage import coverage_placement
from mooncake_ep_switch.eplb.live import alive_ranks

__all__ = ["shrink_placement", "shrink_experts"]


def shrink_placement(phy2log: np.ndarray, alive: np.ndarray, slots_per_rank: int, num_logical: int,
                     spare_frames: int, fixed_per_rank: int = 0) -> np.ndarray:
    """A placement with a copy of every logical expert on the ranks of `alive` (the view after a shrink).

    Arguments:
        phy2log: `[L, R * slots_per_rank]` int64 current placement.
        alive: `[R]` bool, the ranks that remain.
        slots_per_rank: slots per rank.
        num_logical: `E`.
        spare_frames: changes per rank and layer one chunk can stage (`ExpertSlots.spare_frames`).
        fixed_per_rank: the first slots of every rank that never change (`ExpertSlots.num_primary`).

    Returns:
        target: `[L, R * slots_per_rank]` int64; the slots of ranks outside `alive` as they were.

    Raises:
        ValueError: naming `ranks`: no rank would remain, or an expert would have no slot on the
            remaining ranks (every remaining redundant slot holds the last copy of its expert, the
            spare frames are used, or the remaining slots are fewer than the experts).
    """
    alive = np.asarray(alive, dtype=bool)
    remaining = np.nonzero(alive)[0].tolist()
    gone = np.nonzero(~alive)[0].tolist()
    if not remaining:
        raise ValueError(f"ranks: removing {gone} would leave no rank to place the experts on")
    free = len(remaining) * (slots_per_rank - fixed_per_rank)
    if len(remaining) * slots_per_rank < num_logical:
        raise ValueError(f"ranks: removing {gone} leaves {len(remaining) * slots_per_rank} slots on ranks {remaining} "
                         f"for {num_logical} logical experts: some expert would have no slot")
    try:
        return coverage_placement(phy2log, alive, slots_per_rank, num_logical, spare_frames, fixed_per_rank)
    except ValueError as error:
        detail = str(error).partition(": ")[2]
        raise ValueError(f"ranks: removing {gone} leaves an expert without a slot on the remaining ranks "
                         f"({free} redundant slots there): {detail}") from None


def _view_mask(buffer) -> np.ndarray:
    return alive_ranks("active_ranks", buffer.active_mask().cpu(), buffer.num_ranks)


def shrink_experts(buffer, rebalancer, ranks, commit_step: int, loader=None, *, timeout_s: Optional[float] = None,
                   steps_per_chunk: int = 1) -> Tuple[object, tuple]:
    """Shrink the group by dead `ranks` and begin moving the experts onto the remaining ranks.

    Every surviving member calls it with the same arguments, between steps; then
    `rebalancer.step(step, buffer.active_mask())` each step as usual, and after the commit it rebuilds
    its dispatch map with `active_ranks=buffer.active_mask()`.

    Arguments:
        buffer: the group's `Buffer` (the one whose membership shrinks; its `dead_peers()` must show the
            ranks dead, or its view must not hold them).
        rebalancer: this rank's `OnlineRebalancer` of the `ExpertSlots` to re-place (no rebalance in progress).
        ranks: the dead ranks to remove for good.
        commit_step: the serving step at whose start the (first) chunk commits.
        loader: `loader(layer, expert) -> (gate_up, down)` for experts no remaining rank holds.
        timeout_s: the shrink's deadline (`Buffer.shrink`).
        steps_per_chunk: steps between consecutive chunks' commits.

    Returns:
        (view, chunks): the `View` after the shrink and the `RebalanceChunk`s begun (empty when every
            expert already had a copy on the remaining ranks, e.g. after a coverage epoch).

    Raises:
        TypeError, ValueError: bad `ranks` (as `Buffer.shrink`), or an expert that would have no slot on
            the remaining ranks (naming `ranks`); nothing changed.
        RuntimeError: a rebalance of the slots is in progress; nothing changed.
        MembershipError: the shrink aborted (nothing changed; call again) or its view failed (as
            `Buffer.shrink`).
    """
    slots = rebalancer.slots
    shape = slots.shape
    if rebalancer.in_progress:
        raise RuntimeError("shrink_experts: a rebalance of these slots is in progress; shrink once it is decided")
    planned = _view_mask(buffer)
    for rank in ranks if isinstance(ranks, (list, tuple)) else ():
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < planned.shape[0]:
            planned[rank] = False
    if planned.any():  # the other checks of `ranks` are Buffer.shrink's
        shrink_placement(slots.phy2log, planned, shape.slots_per_rank, shape.num_logical_experts, slots.spare_frames,
                         slots.num_primary)
    view = buffer.shrink(ranks, timeout_s=timeout_s)
    mask = _view_mask(buffer)
    target = shrink_placement(slots.phy2log, mask, shape.slots_per_rank, shape.num_logical_experts,
                              slots.spare_frames, slots.num_primary)
    chunks = rebalancer.begin(target, commit_step, steps_per_chunk=steps_per_chunk, live=mask, loader=loader)
    return view, chunks
