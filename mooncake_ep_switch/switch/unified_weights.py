"""Unified weight memory (UMM): every MoE layer's expert weights of a rank in one region of L+1 slots.

EP and TP hold the same bytes per rank (the Moebius volume invariant), so one slot fits one layer in
either layout. EP layer i lives at slot i+1, TP layer i at slot i; one slot is always free (slot 0
in EP, slot L in TP). A switch moves every layer by one slot, layer by layer, each layer written
straight into the free slot of its destination ranks, so the views an engine holds for (layer,
layout) keep their addresses across any number of switches and the memory overhead is one slot.

Inside a slot the first part is gate/up, the second down:

    EP view of layer i (rank r, experts [rE/P, (r+1)E/P)):
        gate_up [E/P, 2I, H]   (gate rows then up rows of each local expert)
        down    [E/P, H, I]
    TP view of layer i (rank r, intermediate slice r of every expert, I' = I/P):
        gate_up [E, 2I', H]    (rows [0, I') = gate rows [rI', (r+1)I'), then up rows [rI', (r+1)I'))
        down    [E, H, I']     (columns [rI', (r+1)I') of down)

With gate and up sliced separately a TP rank computes SiLU(gate) * up for its slice locally.

On the `"shm"` transport the region is a `SharedRegion` (peers write into it); on `"cuda"` it is a
`DeviceRegion` (device memory peers write into over CUDA IPC, the same views on the GPU); on the
collective fallback it is private host memory. A second, small shared region of host memory holds
the switch's control words (see `switcher.py`); it is not weight memory.
"""
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer import peer_regions
from mooncake_ep_switch.buffer.ballot import Ballot
from mooncake_ep_switch.buffer.device_region import DRAIN_TIMEOUT_S, fence, new_region
from mooncake_ep_switch.buffer.shared_region import SharedRegion
from mooncake_ep_switch.switch.shards import shard_ep, shard_tp
from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.layouts import EP, LAYOUTS, TP  # noqa: F401  (layout names re-exported)

#: Layout of a rank whose switch failed in a way it cannot repair (collective fallback, fenced rank).
INVALID = "invalid"

#: Bytes of the control region per rank beyond the per-peer words (see switcher.py).
CONTROL_BASE_BYTES = 4096


class WeightShape(NamedTuple):
    """Shape of one MoE layer's expert weights (global, before sharding).

    Fields:
        num_experts: `E`, a multiple of the number of ranks.
        hidden: `H`.
        intermediate: `I`, a multiple of the number of ranks.
    """

    num_experts: int
    hidden: int
    intermediate: int


class MemoryReport(NamedTuple):
    """Memory of a `UnifiedWeights`, measured from the mapped region.

    Fields:
        region_bytes: bytes of the weight region (L+1 slots).
        layer_bytes: expert bytes of one layer on one rank (same in EP and TP).
        slot_bytes: bytes of one slot.
        weight_bytes: `num_layers * layer_bytes`, what a static layout needs.
        overhead_bytes: `region_bytes - weight_bytes` (one slot; when measured from the memory map,
            against the page-rounded size a static layout would map).
        overhead_ratio: `overhead_bytes / weight_bytes`.
        control_bytes: bytes of the separate control region (switch signals), 0 without one.
    """

    region_bytes: int
    layer_bytes: int
    slot_bytes: int
    weight_bytes: int
    overhead_bytes: int
    overhead_ratio: float
    control_bytes: int


def _mapping_bytes(address: int) -> int:
    """Size of the memory mapping starting at `address` in /proc/self/maps (0 if none starts there)."""
    try:
        with open("/proc/self/maps", "r", encoding="ascii") as maps:
            for line in maps:
                start, end = (int(v, 16) for v in line.split(None, 1)[0].split("-"))
                if start == address:
                    return end - start
    except OSError:
        pass
    return 0


def layer_bytes(shape: WeightShape, num_ranks: int) -> int:
    """Expert bytes of one layer on one rank (bf16): `(E/P) * 3 * I * H * 2`, the same in EP and TP.

    Arguments:
        shape: the `WeightShape` (`E` = `num_experts`, `H` = `hidden`, `I` = `intermediate`).
        num_ranks: `P`, ranks sharing the layer; `E` should be a multiple of it (floor division).

    Returns:
        nbytes: int, bytes of one layer's slot.
    """
    return shape.num_experts // num_ranks * 3 * shape.intermediate * shape.hidden * 2


KIND = "unified_weights"  # participant kind in the Buffer's peer regions


class UnifiedWeights:
    """All MoE layers' expert weights of this rank in L+1 slots, with fixed EP and TP views.

    Collective at construction (every rank of `buffer.group` builds one with the same arguments).

    Arguments:
        buffer: a `mooncake_ep_switch.Buffer`; its group, rank, size and transport are used (on
            the "cuda" transport the weights live in device memory shared by CUDA IPC and the
            views are CUDA tensors; docs/switching.md, "On device memory").
        shape: the `WeightShape` of every layer.
        num_layers: `L`, number of MoE layers, >= 1.
        layout: `"ep"` or `"tp"`, the layout the weights are loaded in.
        prefault: populate page tables of this and every peer's region now, so the first switch
            does not fault pages inside its copies (host memory only).
    """

    def __init__(self, buffer, shape: WeightShape, num_layers: int, layout: str = EP, *, prefault: bool = True):
        if not isinstance(shape, WeightShape):
            raise TypeError(f"shape: expected a WeightShape, got {type(shape).__name__}")
        num_ranks = buffer.num_ranks
        experts = check_int("shape.num_experts", shape.num_experts, 1)
        check_int("shape.hidden", shape.hidden, 1)
        inter = check_int("shape.intermediate", shape.intermediate, 1)
        if experts % num_ranks:
            raise ValueError(f"shape.num_experts: expected a multiple of num_ranks={num_ranks}, got {experts}")
        if inter % num_ranks:
            raise ValueError(f"shape.intermediate: expected a multiple of num_ranks={num_ranks}, got {inter}")
        self.num_layers = check_int("num_layers", num_layers, 1)
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        joined = peer_regions.joined_state(buffer, KIND)  # a replacement takes the members' layout and seq
        self.shape = shape
        self.group = peer_regions.group_of(buffer)
        self.rank = buffer.rank
        self.num_ranks = num_ranks
        self.transport = buffer.transport
        self.layout = layout if joined is None else joined["layout"]
        self.layer_bytes = layer_bytes(shape, num_ranks)
        self.slot_bytes = self.layer_bytes
        self.region_bytes = (self.num_layers + 1) * self.slot_bytes
        self.seq = 0 if joined is None else joined["seq"]  # switch sequence number, advanced in step by every rank
        self.dead_ranks: List[int] = []  # ranks found dead by a switch (need membership recovery)
        self.one_sided = peer_regions.one_sided(buffer)
        self.device = peer_regions.memory_device(buffer)  # the weights' CUDA device ("cuda"), None: host memory
        self.region = None  # a SharedRegion, or a DeviceRegion on the "cuda" transport
        self.control: Optional[SharedRegion] = None  # host words peers poll, on every one-sided transport
        self._private: Optional[torch.Tensor] = None
        if self.one_sided:
            self.region = new_region(self.group, self.rank, num_ranks, self.region_bytes, self.device)
            self.control = SharedRegion(self.group, self.rank, num_ranks, self.control_bytes_for(num_ranks))
            self.local = self.region.local
        else:
            self._private = torch.zeros(self.region_bytes, dtype=torch.uint8)
            self.local = self._private
        self._registry = getattr(buffer, "peer_regions", None)
        index = peer_regions.register(buffer, self, KIND)
        self.index = index  # participant index: the same on every rank (its switch group's keys name it)
        membership = getattr(buffer, "membership", None)
        # One GO/ABORT per switch in the job's store, which every rank reads the same way (one-sided
        # switches; the collective fallback agrees through its all-gather).
        self.ballot: Optional[Ballot] = None
        if self.one_sided and membership is not None and index is not None:
            self.ballot = Ballot(membership, f"switch/{index}", self.rank, num_ranks, what="switch_layout")
        if self.one_sided and prefault:
            for region in (self.region, self.control):
                if region.is_device:
                    continue  # device memory is resident from cudaMalloc on
                for peer in range(num_ranks):
                    if region.peer_bases[peer]:
                        _native.prefault(region.peer_bases[peer], region.nbytes)
        self.base = self.local.data_ptr()
        self._views: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(self.num_layers):
            for name in LAYOUTS:
                self._views[(layer, name)] = self._make_view(self.slot_of(layer, name), name)

    @staticmethod
    def control_bytes_for(num_ranks: int) -> int:
        """Bytes of the control region for `num_ranks` ranks.

        Arguments:
            num_ranks: `P`, number of ranks of the group.

        Returns:
            nbytes: int, `CONTROL_BASE_BYTES` plus 8 bytes per rank rounded up to a multiple of 4096.
        """
        return CONTROL_BASE_BYTES + ((8 * num_ranks + 4095) // 4096) * 4096

    # ------------------------------------------------------------------ geometry
    def slot_of(self, layer: int, layout: str) -> int:
        """Slot holding `layer` in `layout` (EP: layer + 1, TP: layer).

        Arguments:
            layer: MoE layer index in [0, L) (not checked).
            layout: `"ep"` or `"tp"` (any value other than `"ep"` counts as TP).

        Returns:
            slot: int in [0, L].
        """
        return layer + 1 if layout == EP else layer

    def free_slot(self, layout: Optional[str] = None) -> int:
        """The slot no layer uses in `layout` (default: the current one): 0 in EP, L in TP.

        Arguments:
            layout: `"ep"`, `"tp"`, or None for the current layout (`self.layout`).

        Returns:
            slot: int, 0 in EP, `L` (`num_layers`) in TP.
        """
        return 0 if (layout or self.layout) == EP else self.num_layers

    def slot_offset(self, slot: int) -> int:
        """Byte offset of `slot` inside the region.

        Arguments:
            slot: slot index in [0, L] (not checked).

        Returns:
            offset: int, `slot * slot_bytes`.
        """
        return slot * self.slot_bytes

    def gate_up_bytes(self) -> int:
        """Bytes of the gate/up part of a slot (the down part follows it).

        Returns:
            nbytes: int, `(E/P) * 2I * H * 2` (bf16), the same in EP and TP.
        """
        experts, hidden, inter = self.shape
        return experts // self.num_ranks * 2 * inter * hidden * 2

    def view_shapes(self, layout: str) -> Tuple[tuple, tuple]:
        """(gate_up shape, down shape) of one layer's view in `layout`.

        Arguments:
            layout: `"ep"` or `"tp"` (any value other than `"ep"` gives the TP shapes).

        Returns:
            gate_up_shape: tuple, EP `(E/P, 2I, H)` or TP `(E, 2I/P, H)`.
            down_shape: tuple, EP `(E/P, H, I)` or TP `(E, H, I/P)`.
        """
        experts, hidden, inter = self.shape
        if layout == EP:
            local = experts // self.num_ranks
            return (local, 2 * inter, hidden), (local, hidden, inter)
        part = inter // self.num_ranks
        return (experts, 2 * part, hidden), (experts, hidden, part)

    def _make_view(self, slot: int, layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
        gate_up_shape, down_shape = self.view_shapes(layout)
        start = self.slot_offset(slot)
        split = start + self.gate_up_bytes()
        end = start + self.slot_bytes
        gate_up = self.local[start:split].view(torch.bfloat16).view(gate_up_shape)
        down = self.local[split:end].view(torch.bfloat16).view(down_shape)
        return gate_up, down

    # ------------------------------------------------------------------ views
    def view(self, layer: int, layout: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Fixed-address views of one layer's expert weights.

        The same tensors (same addresses) are returned for the same (layer, layout) for the
        lifetime of this object; their contents are this layer's weights only while `layout` is the
        current layout (`self.layout`).

        Arguments:
            layer: MoE layer index in [0, L).
            layout: `"ep"` or `"tp"` (default: the current layout).

        Returns:
            gate_up: EP `[E/P, 2I, H]` or TP `[E, 2I/P, H]` torch.bfloat16.
            down: EP `[E/P, H, I]` or TP `[E, H, I/P]` torch.bfloat16.
        """
        layout = layout or self.layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return self._views[(layer, layout)]

    def load(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's shard of one layer (in the current layout) into its slot.

        Arguments:
            layer: MoE layer index in [0, L).
            gate_up: this rank's shard, shaped like `view(layer)[0]`, torch.bfloat16.
            down: this rank's shard, shaped like `view(layer)[1]`, torch.bfloat16.
        """
        dst_gate_up, dst_down = self.view(layer)
        for name, src, dst in (("gate_up", gate_up, dst_gate_up), ("down", down, dst_down)):
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != torch.bfloat16:
                raise ValueError(f"{name}: expected a {list(dst.shape)} torch.bfloat16 tensor for layout "
                                 f"{self.layout!r}, got {list(src.shape)} {src.dtype}")
            dst.copy_(src)
        fence(self.device, DRAIN_TIMEOUT_S)  # device memory: the load landed before any peer can be told of it

    def load_full(self, layers: Sequence) -> None:
        """Load every layer from full (unsharded) weights, taking this rank's shard of the current layout.

        Arguments:
            layers: L objects with `gate_up` `[E, 2I, H]` and `down` `[E, H, I]` torch.bfloat16
                (e.g. `moe_block.MoEWeights`).
        """
        if len(layers) != self.num_layers:
            raise ValueError(f"layers: expected {self.num_layers} layers, got {len(layers)}")
        shard = shard_ep if self.layout == EP else shard_tp
        for index, weights in enumerate(layers):
            gate_up, down = shard(weights.gate_up, weights.down, self.rank, self.num_ranks)
            self.load(index, gate_up, down)

    def peer_slot_base(self, peer: int, slot: int) -> int:
        """Address (as mapped here) of `slot` in `peer`'s region (one-sided transport only).

        Arguments:
            peer: rank in [0, P) (this rank included).
            slot: slot index in [0, L] (not checked).

        Returns:
            address: int, virtual address in this process of the slot's first byte.
        """
        return self.region.peer_bases[peer] + self.slot_offset(slot)

    def memory_report(self) -> MemoryReport:
        """Measured memory of the unified region against a static layout.

        On the one-sided transport the region size is read from this process's memory map
        (`/proc/self/maps`, the mapping that holds the weights), not from the requested size.

        Returns:
            report: a `MemoryReport`.
        """
        region = self.region.nbytes if self.region is not None else self._private.numel()
        weights = self.num_layers * self.layer_bytes
        static = weights
        mapped = _mapping_bytes(self.base) if self.region is not None and not self.region.is_device else 0
        if mapped:  # compare mapped with mapped: a static layout's mapping is page-rounded too
            region = mapped
            page = os.sysconf("SC_PAGE_SIZE")
            static = (weights + page - 1) // page * page
        control = self.control.nbytes if self.control is not None else 0
        return MemoryReport(region, self.layer_bytes, self.slot_bytes, weights, region - static,
                            (region - static) / static, control)

    # ------------------------------------------------------------------ membership (peer_regions.Participant)
    def shared_regions(self) -> list:
        """The regions peers map: `[region, control]` on `"shm"` and `"cuda"`, none otherwise.

        Returns:
            regions: list of `SharedRegion`.
        """
        return [region for region in (self.region, self.control) if region is not None]

    def peer_state(self) -> dict:
        """What a replacement of this rank takes over.

        Returns:
            state: dict with `"layout"` (str) and `"seq"` (int, the switch sequence number).
        """
        return {"layout": self.layout, "seq": self.seq}

    def readmitted(self, ranks) -> None:
        """`ranks` were replaced and re-admitted: a switch no longer refuses because they died in one.

        Arguments:
            ranks: iterable of int ranks.
        """
        self.dead_ranks = [rank for rank in self.dead_ranks if rank not in set(ranks)]

    def destroy(self) -> None:
        """Release the regions; idempotent.

        The object forgets its memory at once; each shared mapping is unmapped when the last view
        of it goes, so `view()` tensors a caller still holds stay valid (private) memory instead of
        faulting.
        """
        if getattr(self, "_registry", None) is not None:
            self._registry.remove(self)
            self._registry = None
        self._views.clear()
        self.local = None
        for region in (self.region, self.control):
            if region is not None:
                region.destroy()
        self.region = self.control = None
        self._private = None
