"""Draining live ranks out of the group (scale-down of live ranks): the experts first, then the view.

vLLM's elastic EP scales down by sending every engine a reconfiguration, the ranks that stay and the
ones that shut down alike; the EPLB re-places the experts over the remaining ranks with the leaving
ranks' weights still readable, and only then do the leaving ranks exit. Here, on every member of the
view, the drained ranks too, at the same steps:

1. `begin_drain(buffer, rebalancer, ranks, commit_step, loader)`: a placement over the remaining
   ranks (`shrink_placement`: each expert whose copies are all on `ranks` takes a remaining rank's
   redundant slot) is begun as an online EPLB rebalance in which every member of the view, the
   drained ranks included, stages and votes (`live=` the view's mask): the weights come from the
   drained ranks' own copies, read while they live (the loader only for an expert no member holds).
2. `rebalancer.step(step, active_ranks)` each step: the chunks commit at agreed steps on every member
   (all-or-nothing; a drained rank that dies before its vote aborts them everywhere: the survivors then
   remove it as a dead rank, `shrink_experts`, its lost copies from the loader).
3. `finish_drain(buffer, rebalancer, ranks)`, between steps, once the drained ranks' tokens are done
   (the engine stopped scheduling requests on them): refused unless every expert has a copy on the
   remaining ranks, then `Buffer.shrink(ranks, drain=True)`: one decision of every member, the view
   without `ranks` sealed; the drained ranks' Buffers refuse every later call by name and are destroyed.
"""
from typing import Optional, Tuple

import numpy as np

from mooncake_ep_switch.eplb.coverage import uncovered_experts
from mooncake_ep_switch.eplb.live import alive_ranks
from mooncake_ep_switch.eplb.shrink_placement import shrink_placement

__all__ = ["begin_drain", "finish_drain"]


def _ranks(buffer, ranks) -> Tuple[int, ...]:
    """`ranks` as a sorted tuple: a non-empty list of distinct members of the view, seen alive by this rank."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, (list, tuple)):
        raise TypeError(f"ranks: expected a list of int ranks, got {type(ranks).__name__}")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, (int, np.integer))]
    if bad:
        raise TypeError(f"ranks: expected int ranks, got {bad[0]!r} ({type(bad[0]).__name__})")
    ranks = sorted(int(r) for r in ranks)
    if not ranks:
        raise ValueError("ranks: expected at least one rank to drain, got none")
    unknown = [r for r in ranks if not 0 <= r < buffer.num_ranks]
    if unknown:
        raise ValueError(f"ranks: expected ranks of the group in [0, {buffer.num_ranks}), got {unknown}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks: expected distinct ranks, got {ranks}")
    outside = [r for r in ranks if r not in buffer.members]
    if outside:
        raise ValueError(f"ranks: expected live members of epoch {buffer.epoch} (members {list(buffer.members)}) "
                         f"to drain, got {outside}: a rank outside the view is removed as dead (shrink_experts)")
    dead = sorted(set(ranks) & set(buffer.dead_peers()))
    if dead:
        raise ValueError(f"ranks: {dead} are dead (this rank saw their process end): a drain needs them live to hand "
                         "their experts over; remove them as dead ranks with shrink_experts")
    return tuple(ranks)


def _masks(buffer, ranks) -> Tuple[np.ndarray, np.ndarray]:
    view = alive_ranks("active_ranks", buffer.active_mask().cpu(), buffer.num_ranks)
    remaining = view.copy()
    remaining[list(ranks)] = False
    return view, remaining


def begin_drain(buffer, rebalancer, ranks, commit_step: int, loader=None, *, steps_per_chunk: int = 1):
    """Begin moving the experts that only `ranks` hold onto the other members (first half of a drain).

    Every member of the view calls it with the same arguments, the drained ranks too, between steps;
    then `rebalancer.step(step, buffer.active_mask())` every step as usual (rebuild the dispatch map
    after a commit), and once no chunk is pending, `finish_drain`.

    Arguments:
        buffer: the group's `Buffer` (`ranks` must be members of its view, not seen dead).
        rebalancer: this rank's `OnlineRebalancer` of the `ExpertSlots` (no rebalance in progress).
        ranks: the live ranks to drain.
        commit_step: the serving step at whose start the (first) chunk commits.
        loader: `loader(layer, expert) -> (gate_up, down)` for an expert no member holds (none after a
            coverage epoch), or None.
        steps_per_chunk: steps between consecutive chunks' commits.

    Returns:
        chunks: the `RebalanceChunk`s begun (empty when every expert already has a copy on the
            remaining ranks: `finish_drain` may follow at once).

    Raises:
        TypeError, ValueError: `ranks` is not a non-empty list of distinct live members of the view, would
            leave no rank, or an expert would have no slot on the remaining ranks (naming `ranks`); bad
            `commit_step`, `steps_per_chunk` or `loader` (as `OnlineRebalancer.begin`). Nothing changed.
        RuntimeError: a rebalance of these slots is in progress (a drain or another resize); nothing changed.
    """
    if rebalancer.in_progress:
        raise RuntimeError("begin_drain: a rebalance of these slots is in progress (another drain or rebalance); "
                           "drain once it is decided")
    ranks = _ranks(buffer, ranks)
    view, remaining = _masks(buffer, ranks)
    slots = rebalancer.slots
    shape = slots.shape
    target = shrink_placement(slots.phy2log, remaining, shape.slots_per_rank, shape.num_logical_experts,
                              slots.spare_frames, slots.num_primary)
    # Every member stages and votes, the drained ranks too: their copies are the sources while they live.
    return rebalancer.begin(target, commit_step, steps_per_chunk=steps_per_chunk, live=view, loader=loader)


def finish_drain(buffer, rebalancer, ranks, *, timeout_s: Optional[float] = None):
    """Take the drained `ranks` out of the group once the experts left them (second half of a drain).

    Every member of the view calls it with the same `ranks`, the drained ranks too, between steps, once
    no token of the drained ranks is in flight. On a drained rank it returns once the survivors' view
    is sealed; destroy its Buffer then (every other call of it is refused by name).

    Arguments:
        buffer: the group's `Buffer` (each Buffer of the group is drained: call `buffer.shrink(ranks,
            drain=True)` on the others, e.g. the one holding the slots' frames on the collective fallback).
        rebalancer: this rank's `OnlineRebalancer` of the `ExpertSlots`.
        ranks: the live ranks to drain (those of `begin_drain`).
        timeout_s: the shrink's deadline (`Buffer.shrink`).

    Returns:
        view: the `View` without `ranks`. Survivors: reset `active_ranks` to `buffer.active_mask()` and
            rebuild the dispatch map with it.

    Raises:
        TypeError, ValueError: bad `ranks` (as `begin_drain`), or an expert still has no copy outside
            `ranks` (the drain's move did not commit: begin it again); nothing changed.
        RuntimeError: the drain's rebalance has chunks left to commit; nothing changed.
        MembershipError: the shrink aborted (nothing changed; call again, or remove a drained rank that
            died with `shrink_experts`) or its view failed (as `Buffer.shrink`).
    """
    if rebalancer.in_progress:
        raise RuntimeError(f"finish_drain: {len(rebalancer.pending_chunks())} chunks of a rebalance are still to "
                           "commit; finish the drain once they did")
    ranks = _ranks(buffer, ranks)
    _, remaining = _masks(buffer, ranks)
    slots = rebalancer.slots
    shape = slots.shape
    missing = uncovered_experts(slots.phy2log, remaining, shape.slots_per_rank, shape.num_logical_experts)
    if missing:
        layer, experts = next(iter(missing.items()))
        raise ValueError(f"ranks: draining {list(ranks)} would leave layer {layer} without experts {list(experts)} "
                         "(their only copies are there): begin_drain moves them first (its chunks must commit)")
    return buffer.shrink(list(ranks), timeout_s=timeout_s, drain=True)
