"""A rank's MoE expert weights as the runtime serves them, in both layouts, with redundant experts.

One object per rank that the demo and the transformers integration share:

- the unified weight memory (`switch.UnifiedWeights`): every layer's experts in the EP view (whole
  experts `[rE/R, (r+1)E/R)`) or the TP view (intermediate slice `r` of every expert), moved
  between the two by `switch_layout`;
- the TP all-reduce (`switch.TPAllReduce`) the TP layout sums its partials with;
- on the `"shm"` transport, the physical experts (`eplb.ExpertSlots`: the primaries are the unified
  memory's EP view, the redundant experts live in frames), the `eplb.OnlineRebalancer` that moves
  them to a new placement while serving continues, and the per-rank dispatch map
  (`eplb.build_dispatch_map`) rebuilt whenever a rebalance commits.
"""
from typing import Callable, List, Sequence, Union

import numpy as np
import torch

from mooncake_ep_switch.expert_restore import RestoreReport, load_missing, restore_from_peers


def initial_placement(num_layers: int, num_experts: int, num_ranks: int, redundant_per_rank: int) -> np.ndarray:
    """[L, R * slots] phy2log: each rank's primaries, then redundant copies of the next ranks' experts.

    Arguments:
        num_layers: `L`.
        num_experts: `E`, a multiple of `num_ranks`.
        num_ranks: `R`.
        redundant_per_rank: redundant experts per rank.

    Returns:
        phy2log: `[L, R * (E/R + redundant_per_rank)]` np.int64, the logical expert of every
            physical expert (slot); rank r's slots are its `E/R` primaries, then redundant experts
            `(r+1) * E/R + j` (mod `E`), the same in every layer.
    """
    local = num_experts // num_ranks
    rows = []
    for rank in range(num_ranks):
        rows += [rank * local + j for j in range(local)]
        rows += [((rank + 1) * local + j) % num_experts for j in range(redundant_per_rank)]
    return np.asarray([rows] * num_layers, dtype=np.int64)


class ExpertMemory:
    """This rank's expert weights (EP/TP unified memory), TP all-reduce, physical experts and rebalancer.

    Collective at construction over the Buffer's members (every rank builds one with the same
    arguments), with one exception: a replacement rank, once its `update_ep_member()` admitted it,
    builds its own with the same call alone while the members wait in theirs. It then takes the
    members' state over through the Buffer's `peer_regions` (the weights' layout and switch
    sequence, the all-reduce's call counter, the current placement and rebalance epochs), ignoring
    `layout` and `phy2log`. Its weights: in the EP layout with expert slots, every physical expert
    (slot) a live member holds a copy of is copied from that member (`expert_restore.py`), and
    `layers` (a checkpoint loader in a real engine) is called only for the rest, not at all when the
    members hold everything; otherwise from `layers`. `restored` says which.

    Arguments:
        buffer: the `Buffer` (its members, rank, transport and membership are used).
        shape: the `switch.WeightShape` of every layer (`E` and `I` multiples of `R`).
        layers: L objects with `gate_up` `[E, 2I, H]` and `down` `[E, H, I]` torch.bfloat16 (the full
            weights; this rank loads its shards and slots), or a callable with no arguments that
            returns them (called at most once, here, and only when needed), or None for a
            replacement whose members hold a copy of every slot it needs.
        layout: `"ep"` or `"tp"`, the layout the weights start in.
        max_tp_tokens: the most rows one TP all-reduce sums.
        phy2log: `[L, R * (E/R + redundant_per_rank)]` initial placement (see `initial_placement`),
            or None for primaries only; used on the `"shm"` and `"cuda"` transports only.
        redundant_per_rank: redundant experts per rank (slots beyond the primaries).
        timeout_us: vote deadline of the rebalancer's commits.
        weights_from_peers: a replacement copies what live members hold (default True); False loads
            everything from `layers`.

    Attributes:
        restored: a `RestoreReport` (slots from peers, slots from the loader, whether it was called).

    Raises:
        TypeError: `layers` is none of the accepted kinds.
        ValueError: `layers` is None but some slot has no live copy (or this is no replacement).
    """

    def __init__(self, buffer, shape, layers: Union[None, Sequence, Callable[[], Sequence]], *, layout: str,
                 max_tp_tokens: int, phy2log=None, redundant_per_rank: int = 0, timeout_us: int = 30_000_000,
                 weights_from_peers: bool = True):
        from mooncake_ep_switch.buffer import peer_regions
        from mooncake_ep_switch.buffer.device_region import DRAIN_TIMEOUT_S, fence
        from mooncake_ep_switch.eplb.online import OnlineRebalancer
        from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
        from mooncake_ep_switch.switch import TPAllReduce, UnifiedWeights
        from mooncake_ep_switch.switch.unified_weights import KIND as UNIFIED_KIND

        if layers is not None and not callable(layers) and not isinstance(layers, Sequence):
            raise TypeError(f"layers: expected a sequence of layers, a callable returning one, or None, got "
                            f"{type(layers).__name__}")
        replacement = peer_regions.joined_state(buffer, UNIFIED_KIND) is not None
        with_slots = peer_regions.one_sided(buffer) and phy2log is not None
        loaded: List[Sequence] = []

        def full_layers() -> Sequence:  # the caller's weights, read at most once and only when needed
            if not loaded:
                if layers is None:
                    raise ValueError("layers: expected the full weights or a loader, got None (None is for a replacement "
                                     "in the EP layout whose live members hold a copy of every slot it needs)")
                loaded.append(layers() if callable(layers) else layers)
            return loaded[0]

        self.rank, self.num_ranks = buffer.rank, buffer.num_ranks
        self.unified = self.all_reduce = self.slots = self.rebalancer = None
        try:
            if phy2log is not None:  # L from the placement, so that a loader need not run
                num_layers = int(np.asarray(phy2log).shape[0])
            else:
                num_layers = len(full_layers())
            self.unified = UnifiedWeights(buffer, shape, num_layers, layout=layout)
            from_peers = replacement and weights_from_peers and with_slots and self.unified.layout == "ep"
            if not from_peers:
                self.unified.load_full(full_layers())
            self.all_reduce = TPAllReduce(buffer, max_tp_tokens, shape.hidden)
            counts = (0, 0)
            if with_slots:
                local = shape.num_experts // buffer.num_ranks
                slot_shape = SlotShape(self.unified.num_layers, shape.num_experts, local + redundant_per_rank,
                                       shape.hidden, shape.intermediate)
                self.slots = ExpertSlots(buffer, slot_shape, phy2log, primaries=self.unified,
                                         spare_frames=max(1, redundant_per_rank))
                if from_peers:
                    live = [rank for rank in buffer.members if rank not in buffer.dead_peers()]
                    missing = restore_from_peers(self.unified, self.slots, live)
                    if missing:
                        load_missing(self.slots, full_layers(), missing)
                    # device copies from the peers' memory have landed before anyone is told (a rebalance
                    # may then reuse a frame this rank read from)
                    fence(self.slots.device, timeout_us / 1e6 if timeout_us > 0 else DRAIN_TIMEOUT_S)
                    self.slots.mark_loaded()  # peers may stage from these slots from now on
                    total = self.unified.num_layers * slot_shape.slots_per_rank
                    counts = (total - len(missing), len(missing))
                else:
                    self.slots.load(full_layers())
                self.rebalancer = OnlineRebalancer(self.slots, timeout_us=timeout_us, frames_per_step=1)
            if not from_peers:  # every physical expert of this rank from the caller's weights
                per_rank = self.slots.shape.slots_per_rank if self.slots else shape.num_experts // buffer.num_ranks
                counts = (0, self.unified.num_layers * per_rank)
            self.restored = RestoreReport(counts[0], counts[1], bool(loaded))
        except BaseException:
            self.destroy()
            raise
        self._map = None
        self._map_version = -1

    @property
    def layout(self) -> str:
        """The current layout of the unified weights (`"ep"` or `"tp"`)."""
        return self.unified.layout

    def dispatch_row(self, layer: int) -> torch.Tensor:
        """This rank's logical -> physical map of `layer` for the current placement.

        Arguments:
            layer: MoE layer in `[0, L)`.

        Returns:
            row: `[E]` torch.int64, `build_dispatch_map(slots.phy2log, R, R)[rank, layer]`, rebuilt
                after every committed rebalance (requires expert slots).
        """
        from mooncake_ep_switch.eplb.maps import build_dispatch_map

        if self._map_version != self.slots.version:
            self._map = build_dispatch_map(self.slots.phy2log, self.num_ranks, self.num_ranks)
            self._map_version = self.slots.version
        return self._map[self.rank, layer]

    def destroy(self) -> None:
        """Destroy the rebalancer, slots, all-reduce and unified weights, in that order (idempotent)."""
        for name in ("rebalancer", "slots", "all_reduce", "unified"):
            item = getattr(self, name, None)
            setattr(self, name, None)
            destroy = getattr(item, "destroy", None)
            if destroy is not None:
                destroy()
