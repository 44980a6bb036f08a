"""Coverage restored online: logical experts that lost every copy get one on the survivors.

When a rank dies, the experts whose only copies were on it are lost (`eplb.serving` counts their
top-k entries in `slots.lost_contributions`). A *coverage epoch* is an online EPLB rebalance
(`OnlineRebalancer.begin(..., live=...)`) that runs while the rank is still dead:

* placement over the live ranks only (`coverage_placement`): each uncovered expert takes a
  survivor's redundant slot (one whose expert keeps another live copy), the survivor with the fewest
  changes first (at most `spare_frames` per rank and layer); the dead ranks' slots are not touched;
* weights from a live peer's copy where one exists, else from the engine's `loader` (the
  checkpoint): `loader(layer, expert) -> (gate_up [2I, H], down [H, I])`;
* the all-ranks vote among the live members only: the dead rank neither votes nor forces ABORT;
  a member that dies or stalls during the epoch still yields one decision on every survivor
  (the decision record of `buffer.ballot`).

`CoverageWatch` (one per `ExpertSlots`) turns the Buffer's `PeerMasked` events into
`ExpertsUncovered`, and the commit of a coverage epoch into `CoverageRestored` with the seconds
from one to the other (buffer/events.py).
"""
import time
from typing import Dict, Optional, Tuple

import numpy as np

from mooncake_ep_switch.buffer.events import CoverageRestored, ExpertsUncovered, JoinerAdmitted, PeerMasked
from mooncake_ep_switch.eplb.live import alive_ranks

__all__ = ["uncovered_experts", "coverage_placement", "check_live_target", "restore_coverage", "load_frame", "CoverageWatch"]


def uncovered_experts(phy2log: np.ndarray, alive: np.ndarray, slots_per_rank: int,
                      num_logical: int) -> Dict[int, Tuple[int, ...]]:
    """Logical experts with no copy on a live rank, per layer.

    Arguments:
        phy2log: `[L, R * slots_per_rank]` int64 placement.
        alive: `[R]` bool live ranks.
        slots_per_rank: slots per rank.
        num_logical: `E`.

    Returns:
        uncovered: {layer: (expert, ...)} for the layers with any (empty dict: all covered).
    """
    live_slot = np.repeat(alive, slots_per_rank)
    result = {}
    for layer in range(phy2log.shape[0]):
        counts = np.bincount(phy2log[layer][live_slot], minlength=num_logical)
        missing = np.nonzero(counts == 0)[0]
        if missing.size:
            result[layer] = tuple(int(e) for e in missing)
    return result


def coverage_placement(phy2log: np.ndarray, alive: np.ndarray, slots_per_rank: int, num_logical: int,
                       spare_frames: int, fixed_per_rank: int = 0) -> np.ndarray:
    """A placement that gives every uncovered expert a copy on a live rank, changing as few slots as that.

    Each uncovered expert (layer by layer, in id order) replaces the expert of one live slot that has
    another live copy: on the live rank with the fewest changes in this layer so far (at most
    `spare_frames`), not holding the expert already, the slot whose expert has the most live copies.
    Slots of masked ranks keep their experts.

    Arguments:
        phy2log: `[L, R * slots_per_rank]` int64 current placement.
        alive: `[R]` bool live ranks.
        slots_per_rank: slots per rank.
        num_logical: `E`.
        spare_frames: the slots' spare frames (changes per rank and layer a chunk can stage).
        fixed_per_rank: the first slots of every rank that never change (`ExpertSlots.num_primary`: the
            primaries kept in the unified weight memory); only the slots after them take an expert.

    Returns:
        target: `[L, R * slots_per_rank]` int64, a new array (equal to `phy2log` when all is covered).

    Raises:
        ValueError: no live rank is left, or the live ranks have no redundant slot left for an
            uncovered expert (naming `active_ranks`, the layer and the expert).
    """
    if not alive.any():
        raise ValueError("active_ranks: expected at least one live rank, got none")
    target = phy2log.copy()
    num_ranks = alive.shape[0]
    live_slot = np.repeat(alive, slots_per_rank)
    for layer, experts in uncovered_experts(phy2log, alive, slots_per_rank, num_logical).items():
        row = target[layer]
        counts = np.bincount(row[live_slot], minlength=num_logical)
        changes = np.zeros(num_ranks, dtype=np.int64)
        for expert in experts:
            best = None
            for slot in np.nonzero(live_slot)[0]:
                rank = slot // slots_per_rank
                on_rank = row[rank * slots_per_rank:(rank + 1) * slots_per_rank]
                if (slot % slots_per_rank < fixed_per_rank or counts[row[slot]] < 2 or changes[rank] >= spare_frames
                        or (on_rank == expert).any()):
                    continue
                key = (changes[rank], -counts[row[slot]], slot)
                best = key if best is None or key < best else best
            if best is None:
                raise ValueError(f"active_ranks: the live ranks {np.nonzero(alive)[0].tolist()} have no redundant slot "
                                 f"left for expert {expert} of layer {layer} (every live slot holds the last live copy "
                                 f"of its expert, or spare_frames={spare_frames} changes per rank are used)")
            slot = int(best[2])
            counts[row[slot]] -= 1
            row[slot] = expert
            counts[expert] += 1
            changes[slot // slots_per_rank] += 1
    return target


def check_live_target(target: np.ndarray, current: np.ndarray, alive: np.ndarray, slots_per_rank: int,
                      num_logical: int) -> None:
    """Refuse a coverage target that changes a masked rank's slots or leaves an expert without a live copy.

    Arguments:
        target: `[L, S]` int64 validated target (`new_phy2log`).
        current: `[L, S]` int64 current placement.
        alive: `[R]` bool, the ranks taking part (`live`).
        slots_per_rank: slots per rank.
        num_logical: `E`.

    Raises:
        ValueError: naming `new_phy2log` and what is wrong.
    """
    dead_slot = ~np.repeat(alive, slots_per_rank)
    changed = (target != current) & dead_slot[None]
    if changed.any():
        layer, slot = (int(v[0]) for v in np.nonzero(changed))
        raise ValueError(f"new_phy2log: layer {layer} changes slot {slot} of rank {slot // slots_per_rank}, which "
                         "live excludes (a masked rank's slots cannot be staged; keep them as they are)")
    missing = uncovered_experts(target, alive, slots_per_rank, num_logical)
    if missing:
        layer, experts = next(iter(missing.items()))
        raise ValueError(f"new_phy2log: expected a copy of every logical expert on the live ranks "
                         f"{np.nonzero(alive)[0].tolist()}; layer {layer} has none of experts {list(experts)}")


def load_frame(slots, loader, frame: int, layer: int, expert: int) -> None:
    """Copy the loader's (the checkpoint's) weights of `expert` into one of this rank's frames.

    Arguments:
        slots: the `ExpertSlots`.
        loader: `loader(layer, expert) -> (gate_up, down)`, or None.
        frame, layer, expert: where to, and what.

    Raises:
        RuntimeError: no loader. ValueError: the loader returned another shape or dtype (named).
    """
    if loader is None:
        raise RuntimeError(f"no live rank holds expert {expert} of layer {layer} and begin() got no loader")
    weights = loader(layer, expert)
    for name, source, view in zip(("gate_up", "down"), weights, slots.frame_views(frame)):
        if getattr(source, "shape", None) != view.shape or getattr(source, "dtype", None) != view.dtype:
            raise ValueError(f"loader: expected {name} of shape {list(view.shape)} and dtype {view.dtype}, "
                             f"got {getattr(source, 'shape', type(source).__name__)}")
        view.copy_(source)


def restore_coverage(rebalancer, active_ranks, commit_step: int, loader=None, *, steps_per_chunk: int = 1):
    """Begin a coverage epoch: every expert without a live copy gets one on the live ranks.

    Every live rank calls it with the same mask and step (e.g. after its `active_ranks` showed the
    death, agreed as the engine agrees any rebalance), then `rebalancer.step(step, active_ranks)`
    each step as usual.

    Arguments:
        rebalancer: this rank's `OnlineRebalancer`.
        active_ranks: `[R]` torch.int32 or numpy 0/1 mask, the live ranks (1).
        commit_step: the step at whose start the (first) chunk commits.
        loader: `loader(layer, expert) -> (gate_up, down)` torch.bfloat16 tensors of `[2I, H]` and
            `[H, I]` from the checkpoint, for experts no live rank holds; None: such an expert's
            staging fails and the epoch aborts.
        steps_per_chunk: steps between the commits of consecutive chunks.

    Returns:
        chunks: the `RebalanceChunk`s begun (empty when every expert has a live copy).

    Raises:
        TypeError, ValueError: a bad mask (naming `active_ranks`), or no redundant slot on the live
            ranks for an uncovered expert; nothing is begun.
    """
    slots = rebalancer.slots
    alive = alive_ranks("active_ranks", active_ranks, slots.num_ranks)
    shape = slots.shape
    target = coverage_placement(slots.phy2log, alive, shape.slots_per_rank, shape.num_logical_experts,
                                slots.spare_frames, slots.num_primary)
    return rebalancer.begin(target, commit_step, steps_per_chunk=steps_per_chunk, live=alive, loader=loader)


class CoverageWatch:
    """Derives `ExpertsUncovered` / `CoverageRestored` for one `ExpertSlots` from its Buffer's events.

    Arguments:
        slots: the `ExpertSlots`.
        buffer: its Buffer (anything without `subscribe` gets no events).
    """

    def __init__(self, slots, buffer):
        self.slots = slots
        self.masked = set()
        self.uncovered: Dict[int, Tuple[int, ...]] = {}
        self.since: Optional[float] = None  # monotonic time the experts were found uncovered
        subscribe = getattr(buffer, "subscribe", None)
        self.subscription = subscribe(self._on_event) if subscribe is not None else None

    def _alive(self) -> np.ndarray:
        alive = np.ones(self.slots.num_ranks, dtype=bool)
        alive[sorted(self.masked)] = False
        return alive

    def _on_event(self, event) -> None:
        if isinstance(event, PeerMasked):
            self.masked.add(event.rank)
            self.check()
        elif isinstance(event, JoinerAdmitted):
            self.masked.difference_update(event.ranks)

    def check(self) -> None:
        """Emit `ExpertsUncovered` when the current placement leaves more experts uncovered than before."""
        shape = self.slots.shape
        found = uncovered_experts(self.slots.phy2log, self._alive(), shape.slots_per_rank, shape.num_logical_experts)
        grew = any(set(v) - set(self.uncovered.get(k, ())) for k, v in found.items())
        self.uncovered = found
        if grew and self.subscription is not None:
            if self.since is None:
                self.since = time.monotonic()
            self.subscription.emit(ExpertsUncovered(found, tuple(sorted(self.masked))))

    def committed(self, epoch: int, layers: Tuple[int, ...], alive: np.ndarray) -> None:
        """A coverage chunk committed (live ranks `alive`): emit `CoverageRestored` once all is covered."""
        self.masked.update(int(r) for r in np.nonzero(~alive)[0])
        shape = self.slots.shape
        self.uncovered = uncovered_experts(self.slots.phy2log, self._alive(), shape.slots_per_rank,
                                           shape.num_logical_experts)
        if not self.uncovered and self.subscription is not None:
            since, self.since = self.since, None
            self.subscription.emit(CoverageRestored(epoch, tuple(layers),
                                                    0.0 if since is None else time.monotonic() - since))

    def close(self) -> None:
        """Unsubscribe; idempotent."""
        if self.subscription is not None:
            self.subscription.close()
            self.subscription = None
