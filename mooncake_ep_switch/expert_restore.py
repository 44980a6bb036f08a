"""A replacement rank's expert weights from its peers' copies, the checkpoint only for what no peer holds.

With redundant experts, most of what a dead rank held still lives on other ranks: its primaries
may have redundant copies elsewhere, and its redundant experts are other ranks' primaries (or
their redundant copies). A replacement admitted by `update_ep_member()` that rebuilds its
`ExpertMemory` in the EP layout copies every physical expert (slot) of its own from a live
member's copy over shared memory (a peer's primary in its unified weights first, else a peer's
frame), and reads the caller's checkpoint loader only when some slot has no live copy; the loader
is not called at all when the peers hold everything. Only peers of this host that have loaded their
slots are read: another replacement admitted at the same time is still restoring its own (its
table reads "not loaded"), and what only it holds comes from the loader, never its zeros. The
members are not serving meanwhile (they wait in `update_ep_member()` for the replacement's
regions), so the copies are stable.

In the TP layout every rank holds only a slice of every expert, so nothing is copied from peers:
the loader provides the replacement's slices (as it does for every rank at start).
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from mooncake_ep_switch.layouts import EP


class RestoreReport(NamedTuple):
    """Where a rank's physical experts (slots) came from when its `ExpertMemory` was built.

    Fields:
        from_peers: slots copied from a live peer's copy (0 unless a replacement in the EP layout).
        from_loader: slots loaded from the caller's weights.
        loader_called: whether the caller's loader was called (it is not when peers held everything).
    """

    from_peers: int
    from_loader: int
    loader_called: bool


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _peer_copy(unified, slots, peer: int, layer: int, peer_slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """uint8 views (gate/up, down) of `peer`'s physical expert (`layer`, `peer_slot`) as mapped here.

    A primary is read from the peer's unified weights (EP layout), a redundant expert from the frame
    its frame table names (bounds-checked by `peer_frame`); the slices are bounded by the mappings.
    """
    gate_up_bytes, down_bytes = slots.gate_up_bytes, slots.down_bytes
    if peer_slot < slots.num_primary:
        region = unified.region.peer(peer)
        start = unified.slot_offset(unified.slot_of(layer, EP))
        gate_up_at = start + peer_slot * gate_up_bytes
        down_at = start + unified.gate_up_bytes() + peer_slot * down_bytes
    else:
        region = slots.region.peer(peer)
        frame = slots.peer_frame(peer, layer, peer_slot)
        gate_up_at = slots.frames_offset + frame * gate_up_bytes
        down_at = slots.down_offset + frame * down_bytes
    gate_up, down = region[gate_up_at:gate_up_at + gate_up_bytes], region[down_at:down_at + down_bytes]
    if gate_up.numel() != gate_up_bytes or down.numel() != down_bytes:
        raise RuntimeError(f"rank {peer}'s copy of layer {layer} slot {peer_slot} lies outside its mapped region")
    return gate_up, down


def _holder(slots, layer: int, expert: int, live: Sequence[int]) -> Optional[Tuple[int, int]]:
    """(peer, its local slot) of a readable peer's copy of logical `expert`: a primary first, else a frame.

    `live` holds only peers mapped here that have loaded their slots (`readable_peers`).
    """
    per_rank = slots.shape.slots_per_rank
    row = slots.phy2log[layer]
    found = [(int(slot) % per_rank >= slots.num_primary, int(slot) // per_rank, int(slot) % per_rank)
             for slot in (row == expert).nonzero()[0] if int(slot) // per_rank in live]
    if not found:
        return None
    _, peer, peer_slot = min(found)
    return peer, peer_slot


def readable_peers(slots, live: Sequence[int]) -> List[int]:
    """The ranks of `live` (this rank left out) whose copies may be read here: mapped and loaded.

    A peer on another host is not mapped, and a peer that has not loaded its slots yet (another
    replacement still restoring its own, say) holds zeros; both are skipped, so that what only they
    hold is read from the caller's weights instead.

    Arguments:
        slots: this rank's `ExpertSlots` (peers mapped).
        live: member ranks not known dead.

    Returns:
        peers: list of int ranks, in `live`'s order.
    """
    return [rank for rank in live if rank != slots.rank and slots.is_mapped(rank) and slots.is_loaded(rank)]


def restore_from_peers(unified, slots, live: Sequence[int]) -> List[Tuple[int, int]]:
    """Copy every slot of this rank that a live peer holds a copy of; returns the slots left to load.

    Arguments:
        unified: this rank's `UnifiedWeights` (EP layout; its primaries are slots `[0, num_primary)`).
        slots: this rank's `ExpertSlots` (the placement the members use; peers mapped).
        live: member ranks not known dead; only those mapped here that have loaded their slots are read
            (`readable_peers`), so a slot only another host or an unloaded peer holds is left to load.

    Returns:
        missing: `[(layer, local_slot), ...]` of this rank's slots no live peer holds.

    Raises:
        ValueError: `unified` is not in the EP layout.
        RuntimeError: a peer's copy lies outside its mapped region (a bad frame table).
    """
    if unified.layout != EP:
        raise ValueError(f"unified: weights are restored from peers in the EP layout only, got {unified.layout!r}")
    live = readable_peers(slots, live)
    missing = []
    for layer in range(slots.shape.num_layers):
        for local_slot, expert in enumerate(slots.local_experts(layer)):
            holder = _holder(slots, layer, expert, live)
            if holder is None:
                missing.append((layer, local_slot))
                continue
            gate_up, down = slots.expert(layer, local_slot)
            src_gate_up, src_down = _peer_copy(unified, slots, holder[0], layer, holder[1])
            _as_bytes(gate_up).copy_(src_gate_up)
            _as_bytes(down).copy_(src_down)
    return missing


def load_missing(slots, layers, missing: Sequence[Tuple[int, int]]) -> None:
    """Load the `missing` slots of this rank from full weights.

    Arguments:
        slots: this rank's `ExpertSlots`.
        layers: L objects with `gate_up` `[E, 2I, H]` and `down` `[E, H, I]` torch.bfloat16.
        missing: `[(layer, local_slot), ...]` from `restore_from_peers`.
    """
    for layer, local_slot in missing:
        expert = slots.local_experts(layer)[local_slot]
        gate_up, down = slots.expert(layer, local_slot)
        gate_up.copy_(layers[layer].gate_up[expert])
        down.copy_(layers[layer].down[expert])
