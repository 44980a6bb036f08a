"""Placing the experts over a grown group and staging the newcomers' copies from the members' memory.

A grow (`buffer.membership.grow`) builds the next Buffer over `R' > R` ranks; the placement there keeps
every member's slots as they are (rank `r < R` holds the same experts at the same local slots: its
copies are a local memcpy from its current slots) and gives the newcomers' slots replicas of the logical
experts with the fewest copies that the rank lacks (the next one in expert order on ties). Every slot of the grown table
lies on a rank of the new group: no copy is placed outside the view.

After a shrink the view has holes and the grow renumbers the members densely (`membership/grow.py`):
`renumber_placement` keeps the members' columns of the current table in the order of their ids (the
removed ranks' columns dropped) and `grow_placement` grows that table, so `old_num_ranks` is then the
number of members and the member of id `members[i]` is rank `i` of the grown group.

`grow_slots` runs inside the grow's `build(buffer)` on every rank of the grown group: it builds the
`ExpertSlots` of the new placement on the new Buffer, the members copy their slots from their current
`ExpertSlots`, and after a barrier the newcomers copy each of theirs from a member's frame of the new
slots over the mapping (as a replacement restores from its peers, `expert_restore`), or from a member on
another host with one-sided Transfer Engine reads (`ExpertSlots.read_remote_frame`); the engine's
`loader` only for an expert no member holds (none when the current placement covers every expert).
"""
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
from mooncake_ep_switch.faults import FaultPoint

__all__ = ["grow_placement", "renumber_placement", "grow_slots", "GrownSlots"]

_READ_S = 30.0  # deadline of a newcomer's Transfer Engine read of a member's frame (as `ExpertSlots.peer_frame`)


def renumber_placement(phy2log, members, slots_per_rank: int) -> np.ndarray:
    """The members' slots of a placement with holes (after a shrink), numbered as the grown group numbers them.

    Arguments:
        phy2log: `[L, R * slots_per_rank]` integer current placement (over the group's `R` rank ids).
        members: the ids of the view's members (`buffer.members`), in `[0, R)`.
        slots_per_rank: slots per rank.

    Returns:
        table: `[L, len(members) * slots_per_rank]` int64: rank `i`'s slots are those of `sorted(members)[i]`.

    Raises:
        ValueError: `phy2log` not 2-D with whole ranks of slots, or `members` empty, repeated or outside
            `[0, R)` (named).
    """
    table = np.asarray(phy2log, dtype=np.int64)
    if table.ndim != 2 or table.shape[1] % slots_per_rank:
        raise ValueError(f"phy2log: expected [L, R * {slots_per_rank}] (slots_per_rank), got {list(table.shape)}")
    num_ranks = table.shape[1] // slots_per_rank
    ranks = sorted(int(r) for r in members)
    if not ranks or len(set(ranks)) != len(ranks) or not 0 <= ranks[0] <= ranks[-1] < num_ranks:
        raise ValueError(f"members: expected distinct rank ids in [0, {num_ranks}), at least one, got {list(members)}")
    columns = [r * slots_per_rank + s for r in ranks for s in range(slots_per_rank)]
    return table[:, columns].copy()


def grow_placement(phy2log, old_num_ranks: int, num_ranks: int, slots_per_rank: int, num_logical: int) -> np.ndarray:
    """The placement of the grown group: members' slots kept, newcomers' slots replicas of the least-copied experts.

    Arguments:
        phy2log: `[L, old_num_ranks * slots_per_rank]` integer current placement.
        old_num_ranks: `R`, the group's size before the grow.
        num_ranks: `R'`, after it.
        slots_per_rank: slots per rank (the same in both groups).
        num_logical: `E`.

    Returns:
        target: `[L, num_ranks * slots_per_rank]` int64.

    Raises:
        ValueError: `phy2log` is not `[L, old_num_ranks * slots_per_rank]` (named), or `num_ranks <= old_num_ranks`.
    """
    table = np.asarray(phy2log, dtype=np.int64)
    if table.ndim != 2 or table.shape[1] != old_num_ranks * slots_per_rank:
        raise ValueError(f"phy2log: expected [L, {old_num_ranks * slots_per_rank}] (old_num_ranks * slots_per_rank), "
                         f"got {list(table.shape)}")
    if num_ranks <= old_num_ranks:
        raise ValueError(f"num_ranks: expected more than old_num_ranks={old_num_ranks}, got {num_ranks}")
    layers = table.shape[0]
    target = np.empty((layers, num_ranks * slots_per_rank), dtype=np.int64)
    target[:, :table.shape[1]] = table
    for layer in range(layers):
        counts = np.bincount(table[layer], minlength=num_logical)
        for slot in range(table.shape[1], target.shape[1]):
            start = slot - slot % slots_per_rank
            taken = set(target[layer, start:slot].tolist())  # one copy of an expert per rank
            order = sorted((e for e in range(num_logical) if e not in taken), key=lambda e: (counts[e], e))
            if not order:
                raise ValueError(f"slots_per_rank: {slots_per_rank} slots per rank exceed the {num_logical} logical "
                                 "experts (a rank holds one copy of an expert)")
            expert = order[0]  # the first of the least-copied experts this rank lacks
            target[layer, slot] = expert
            counts[expert] += 1
    return target


class GrownSlots(NamedTuple):
    """What `grow_slots` built on one rank.

    Fields:
        slots: the `ExpertSlots` of the grown placement on the new Buffer.
        from_members: slots copied from a member's copy (a newcomer's), or from this member's current slots.
        from_loader: slots loaded with the engine's loader (an expert no member held).
    """

    slots: ExpertSlots
    from_members: int
    from_loader: int

    def destroy(self) -> None:
        """Destroy the slots (a grow that failed after its build discards them so)."""
        self.slots.destroy()


def _member_holding(slots: ExpertSlots, layer: int, expert: int, old_num_ranks: int):
    per_rank = slots.shape.slots_per_rank
    for slot in np.nonzero(slots.phy2log[layer, :old_num_ranks * per_rank] == expert)[0].tolist():
        return slot // per_rank, slot % per_rank
    return None


def grow_slots(buffer, shape: SlotShape, phy2log, old_num_ranks: int, current: Optional[ExpertSlots] = None,
               spare_frames: Optional[int] = None, loader: Optional[Callable] = None) -> GrownSlots:
    """Build the grown placement's slots on the new Buffer and fill them (module docstring). Collective over the
    grown group (every rank, members with `current`, newcomers without).

    Arguments:
        buffer: the new `Buffer` of the grown group (a grow's `build` argument).
        shape: the `SlotShape` (as the members' current slots).
        phy2log: `[L, R' * slots_per_rank]` the grown placement (`grow_placement`).
        old_num_ranks: `R`: ranks below it are members, the others newcomers.
        current: a member's current `ExpertSlots` (frames only: no primaries), None on a newcomer.
        spare_frames: as `ExpertSlots`.
        loader: optional `loader(layer, expert) -> (gate_up, down)` for an expert no member holds.

    Returns:
        grown: a `GrownSlots`.

    Raises:
        ValueError: a member without `current`, a newcomer with it, `current` with primaries, or an expert
            no member holds and no loader (named).
        ConnectionError, TimeoutError: a newcomer's Transfer Engine read of a member's frame on another host
            failed or missed its deadline (30 s).
    """
    member = buffer.rank < old_num_ranks
    if member != (current is not None):
        raise ValueError(f"current: expected the current ExpertSlots on a member (rank < {old_num_ranks}) and None on "
                         f"a newcomer, got {'None' if current is None else 'slots'} on rank {buffer.rank}")
    if current is not None and current.num_primary:
        raise ValueError("current: slots with primaries (unified weights) are not grown yet")
    slots = ExpertSlots(buffer, shape, phy2log, spare_frames=spare_frames)
    per_rank = shape.slots_per_rank
    copied = loaded = 0
    if member:
        for layer in range(shape.num_layers):
            for local in range(per_rank):
                gate_up, down = slots.expert(layer, local)
                src_gate_up, src_down = current.expert(layer, local)
                gate_up.copy_(src_gate_up)
                down.copy_(src_down)
                copied += 1
    if member:
        slots.mark_loaded()  # fenced: the copies landed (as `ExpertSlots.load`) ...
    dist.barrier(group=buffer.group)  # ... on every member before a newcomer reads them
    if not member:
        fault = FaultPoint.parse(buffer.settings.fault_point)  # test-only (None unless MEP_FAULT_POINT is set)
        if fault is not None:  # a newcomer dies or freezes in its weight copy
            fault.hit("grow_weight_copy", buffer.rank)
        for layer in range(shape.num_layers):
            for local, expert in enumerate(slots.local_experts(layer)):
                gate_up, down = slots.expert(layer, local)
                holder = _member_holding(slots, layer, expert, old_num_ranks)
                if holder is None:
                    if loader is None:
                        raise ValueError(f"loader: layer {layer} expert {expert} has no copy on a member; pass "
                                         "a loader")
                    src_gate_up, src_down = loader(layer, expert)
                    gate_up.copy_(src_gate_up)
                    down.copy_(src_down)
                    loaded += 1
                    continue
                peer, peer_slot = holder
                if not slots.is_mapped(peer):  # a member on another host: one-sided Transfer Engine reads
                    slots.read_remote_frame(int(slots.frame_of[layer, local]), peer, layer, peer_slot, _READ_S)
                    copied += 1
                    continue
                frame = slots.peer_frame(peer, layer, peer_slot)
                region = slots.region.peer(peer)
                at_gate_up = slots.frames_offset + frame * slots.gate_up_bytes
                at_down = slots.down_offset + frame * slots.down_bytes
                gate_up.reshape(-1).view(torch.uint8).copy_(region[at_gate_up:at_gate_up + slots.gate_up_bytes])
                down.reshape(-1).view(torch.uint8).copy_(region[at_down:at_down + slots.down_bytes])
                copied += 1
    if not member:
        slots.mark_loaded()  # a newcomer's frames too (fenced), before the grow's closing barrier
    return GrownSlots(slots, copied, loaded)
