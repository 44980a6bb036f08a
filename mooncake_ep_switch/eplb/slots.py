"""Physical expert slots of every MoE layer of a rank, in one shared region with spare frames.

A physical expert (slot) `s` of a layer lives on rank `s // slots_per_rank` at local index
`s % slots_per_rank` and holds a copy of one logical expert's weights (gate/up `[2I, H]` and down
`[H, I]`, bf16). The weights live in *frames*: `L * slots_per_rank` frames in use plus
`spare_frames` free ones. A frame table maps (layer, local slot) to a frame, so an online
rebalance (`eplb.online`) stages a slot's new expert into a free frame while the old frame keeps
serving, and commits by switching one table entry: no copy at the commit and no address a
running step uses ever changes under it.

Region layout (a `SharedRegion`, or a `DeviceRegion` on the "cuda" transport, mapped by every rank of
the host):

    [0, 4096)                     control page: [0, 8) receives a peer's frame-table entry read
                                  over the Transfer Engine; the rest is unused
    [4096, 4096 + table_bytes)    frame table, int32 `[L, slots_per_rank]` (read by peers); every entry
                                  -2 until this rank's frames hold its weights (`mark_loaded`)
    gate/up of every frame        `[num_frames, 2I, H]` bf16
    down of every frame           `[num_frames, H, I]` bf16

Peers of this host read this rank's frame table and frames directly through the mapping. On a
Buffer whose ranks span hosts (the `"mooncake"` transport) the region is also registered with the
Buffer's Transfer Engine and its address published with the peer regions (buffer/peer_regions.py):
a peer on another host reads the table entry and then the frame one-sided over the engine
(`read_remote_frame`). Every frame id read from a peer is checked against the frame count before
it becomes an address, and every range against both regions' bounds.

Loaded before read. Construction is collective, loading is not: a peer that has mapped this rank's
region may stage from it while this rank is still loading. So the table a peer reads says "not
loaded" (-2 in every entry) until this rank's frames hold its weights (`load`, or the copies of a
grow or a replacement's restore, which then call `mark_loaded`); a read of such a table raises
`SlotsNotLoaded` before any byte of a frame is read, and a rebalance waits for that peer instead
of copying what its frames held before (zeros).

The votes and decisions of the online rebalance live in the job's store (`buffer.ballot`), one
`Ballot` per slots, created here because its keys are named by the slots' participant index.

Primaries in the unified weight memory. With `primaries=UnifiedWeights` (the memory `switch_layout`
moves between EP and TP), the first `E/R` local slots of every rank are the rank's EP experts in
that memory (logical expert `rank * E/R + j` at local slot `j`, fixed), and only the remaining
slots, the redundant experts, live in frames. A rebalance then moves redundant experts only
(`eplb.policy.redundant.place_redundant_experts` plans for this), and reads a primary copy from the peer's
unified memory, which must be in the EP layout while serving and staging.
"""
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer import peer_regions
from mooncake_ep_switch.buffer.device_region import DRAIN_TIMEOUT_S, fence, new_region
from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_indices
from mooncake_ep_switch.eplb.coverage import CoverageWatch
from mooncake_ep_switch.buffer.ballot import Ballot
from mooncake_ep_switch.errors import SlotsNotLoaded
from mooncake_ep_switch.eplb.policy.tables import expert_counts

CONTROL_BYTES = 4096
_TE_SCRATCH = 0  # control-page offset where a table entry read over the Transfer Engine lands
_PAGE = 4096
_NOT_LOADED = -2  # every frame-table entry until `mark_loaded` (a primary's entry is -1 once loaded)


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


class SlotShape(NamedTuple):
    """Geometry of the physical expert slots of every layer.

    Fields:
        num_layers: `L`, MoE layers.
        num_logical_experts: `E`, logical experts per layer.
        slots_per_rank: physical slots per rank and layer.
        hidden: `H`.
        intermediate: `I`.
    """

    num_layers: int
    num_logical_experts: int
    slots_per_rank: int
    hidden: int
    intermediate: int


def check_phy2log(name: str, phy2log, num_layers: int, num_slots: int, num_logical: int,
                  slots_per_rank: int) -> np.ndarray:
    """Validate a placement: a copy of every logical expert, no two copies of one on a rank.

    Arguments:
        name: argument name used in error messages.
        phy2log: `[L, num_slots]` integer torch tensor, numpy array or nested sequence, the logical
            expert of every physical expert (slot).
        num_layers: `L`, MoE layers.
        num_slots: physical experts (slots) per layer, `R * slots_per_rank`.
        num_logical: `E`, logical experts per layer; every entry must be in `[0, E)`.
        slots_per_rank: physical slots per rank and layer.

    Returns:
        phy2log: `[L, num_slots]` np.int64, a copy of the validated placement.

    Raises:
        TypeError: `phy2log` is not an integer array.
        ValueError: a wrong shape, an entry outside `[0, E)`, a logical expert without a copy in
            some layer, or two copies of one logical expert on one rank.
    """
    table = as_indices(name, phy2log, 2, upper=num_logical)
    if table.shape != (num_layers, num_slots):
        raise ValueError(f"{name}: expected shape [{num_layers}, {num_slots}], got {list(table.shape)}")
    counts = expert_counts(table, num_logical)
    if (counts == 0).any():
        layer, expert = (int(v[0]) for v in np.nonzero(counts == 0))
        raise ValueError(f"{name}: expected a copy of every logical expert; layer {layer} has none of expert {expert}")
    per_rank = np.sort(table.reshape(num_layers, -1, slots_per_rank), axis=2)
    same = per_rank[:, :, 1:] == per_rank[:, :, :-1]
    if same.any():
        layer, rank, _ = (int(v[0]) for v in np.nonzero(same))
        raise ValueError(f"{name}: layer {layer} puts two copies of one logical expert on rank {rank}")
    return table.copy()


KIND = "expert_slots"  # participant kind in the Buffer's peer regions


class ExpertSlots:
    """This rank's physical experts of every layer, in frames of a region every rank of the host maps.

    Collective at construction over `buffer.group` (every rank builds one with the same arguments).

    Arguments:
        buffer: a `mooncake_ep_switch.Buffer` on a one-sided transport: `"shm"` (one host), or
            `"mooncake"` (ranks of several hosts: peers of another host are read over the Transfer
            Engine; primaries then are not supported). Its group, rank, size and store are used.
        shape: the `SlotShape`.
        phy2log: `[L, R * slots_per_rank]` integer torch tensor or numpy array, the initial placement
            (logical expert of every physical slot).
        spare_frames: free frames for staging; an online rebalance moves at most this many slots
            of this rank per chunk of layers (default: `slots_per_rank`, one layer's worth).
        prefault: populate the page tables of this and every peer's region now.
        primaries: a `UnifiedWeights` holding the primary copies (see the module docstring), or None
            (every slot in frames).
        events: the Buffer (of this rank and group) whose masks `ExpertsUncovered` / `CoverageRestored`
            follow and whose subscribers get them (eplb.coverage); None: `buffer`. On the collective
            fallback, the collective Buffer that dispatches while the slots sit on a shm one.
    """

    def __init__(self, buffer, shape: SlotShape, phy2log, *, spare_frames: Optional[int] = None,
                 prefault: bool = True, primaries=None, events=None):
        if not isinstance(shape, SlotShape):
            raise TypeError(f"shape: expected a SlotShape, got {type(shape).__name__}")
        if events is not None and not callable(getattr(events, "subscribe", None)):
            raise TypeError(f"events: expected None or a Buffer (its subscribe() gets the coverage events), got "
                            f"{type(events).__name__}")
        if events is not None and (events.rank, events.num_ranks) != (buffer.rank, buffer.num_ranks):
            raise ValueError(f"events: expected a Buffer of rank {buffer.rank} of {buffer.num_ranks} ranks (buffer's), "
                             f"got rank {events.rank} of {events.num_ranks}")
        if buffer.transport not in ("shm", "mooncake", "cuda"):
            raise ValueError("buffer: expert slots are moved one-sided (shared memory, CUDA IPC, or Transfer Engine "
                             f"reads across hosts); expected a Buffer on transport 'shm', 'cuda' or 'mooncake', got "
                             f"{buffer.transport!r}")
        num_layers = check_int("shape.num_layers", shape.num_layers, 1)
        num_logical = check_int("shape.num_logical_experts", shape.num_logical_experts, 1)
        per_rank = check_int("shape.slots_per_rank", shape.slots_per_rank, 1)
        hidden = check_int("shape.hidden", shape.hidden, 1)
        inter = check_int("shape.intermediate", shape.intermediate, 1)
        spare = per_rank if spare_frames is None else check_int("spare_frames", spare_frames, 1)
        joined = peer_regions.joined_state(buffer, KIND)  # a replacement takes the members' placement
        if joined is not None:
            phy2log = np.asarray(joined["phy2log"], dtype=np.int64)
        self.shape = SlotShape(num_layers, num_logical, per_rank, hidden, inter)
        self.rank = buffer.rank
        self.num_ranks = buffer.num_ranks
        self.group = peer_regions.group_of(buffer)
        self.dead_peers = buffer.dead_peers  # ranks whose process ended: votes are not waited for
        self.num_slots = self.num_ranks * per_rank
        if self.num_slots < num_logical:
            raise ValueError(f"shape.slots_per_rank: {per_rank} slots on {self.num_ranks} ranks cannot hold "
                             f"{num_logical} logical experts")
        self.phy2log = check_phy2log("phy2log", phy2log, num_layers, self.num_slots, num_logical, per_rank)
        self.primaries = primaries
        self.num_primary = 0
        # Chunk epochs used on these slots by every OnlineRebalancer (their votes and decision
        # words are per slots, so the numbering must be too), and the rebalancer now moving them.
        self.chunk_epoch = 0 if joined is None else joined["chunk_epoch"]
        self.active_rebalancer = None  # weakref.ref of an OnlineRebalancer, or None
        if primaries is not None:
            from mooncake_ep_switch.switch.unified_weights import UnifiedWeights

            if not isinstance(primaries, UnifiedWeights):
                raise TypeError(f"primaries: expected a UnifiedWeights or None, got {type(primaries).__name__}")
            if (primaries.num_layers, tuple(primaries.shape)) != (num_layers, (num_logical, hidden, inter)):
                raise ValueError(f"primaries: expected {num_layers} layers of shape ({num_logical}, {hidden}, {inter}), "
                                 f"got {primaries.num_layers} of {tuple(primaries.shape)}")
            if primaries.region is None:
                raise ValueError("primaries: expected a UnifiedWeights on the 'shm' or 'cuda' transport")
            self.num_primary = num_logical // self.num_ranks
            if per_rank < self.num_primary:
                raise ValueError(f"shape.slots_per_rank: expected >= {self.num_primary} (the primaries), got {per_rank}")
            self.check_primaries("phy2log", self.phy2log)
        self.num_redundant = per_rank - self.num_primary
        self.num_frames = num_layers * self.num_redundant + spare
        self.spare_frames = spare
        self.gate_up_bytes = 2 * inter * hidden * 2
        self.down_bytes = hidden * inter * 2
        self.frame_bytes = self.gate_up_bytes + self.down_bytes
        self.table_offset = CONTROL_BYTES
        self.frames_offset = CONTROL_BYTES + _round_up(num_layers * per_rank * 4, _PAGE)
        self.down_offset = self.frames_offset + self.num_frames * self.gate_up_bytes
        nbytes = self.down_offset + self.num_frames * self.down_bytes
        self.device = peer_regions.memory_device(buffer)  # the frames' CUDA device ("cuda"), None: host memory
        self.region = new_region(self.group, self.rank, self.num_ranks, nbytes, self.device)
        self.frame_of = np.full((num_layers, per_rank), -1, dtype=np.int64)  # -1: a primary (not in a frame)
        self.frame_of[:, self.num_primary:] = np.arange(num_layers * self.num_redundant).reshape(num_layers, -1)
        self.free_frames: List[int] = list(range(num_layers * self.num_redundant, self.num_frames))
        self.loaded = False  # the frames hold this rank's weights (`mark_loaded`); peers read -2 until then
        # "Not loaded" before any peer maps the region (`register` below): its zeroed table would name frame 0.
        self.publish_table()
        self._registry = getattr(buffer, "peer_regions", None)
        self.te_reads = 0  # frames staged from another host over the Transfer Engine
        # [L] top-k entries eplb.serving lost (expert on no live copy), cumulative: diff it per step
        self.lost_contributions = np.zeros(num_layers, dtype=np.int64)
        self.te_read_bytes = 0
        index = peer_regions.register(buffer, self, KIND)
        membership = getattr(buffer, "membership", None)
        # Votes and decisions of online rebalances (None without a store: a rebalance then refuses).
        self.ballot = None if membership is None or index is None else Ballot(membership, f"eplb/{index}", self.rank,
                                                                               self.num_ranks)
        if prefault and not self.region.is_device:
            for peer in range(self.num_ranks):
                if self.region.peer_bases[peer]:
                    _native.prefault(self.region.peer_bases[peer], nbytes)
        local = self.region.local
        self._gate_up = local[self.frames_offset:self.down_offset].view(torch.bfloat16).view(
            self.num_frames, 2 * inter, hidden)
        self._down = local[self.down_offset:nbytes].view(torch.bfloat16).view(self.num_frames, hidden, inter)
        self.version = 0 if joined is None else joined["version"]  # advanced at every committed placement change
        self.coverage = CoverageWatch(self, buffer if events is None else events)  # eplb.coverage's events

    # ------------------------------------------------------------------ placement
    def check_primaries(self, name: str, table: np.ndarray) -> None:
        """With primaries: every rank's first E/R slots hold its EP experts, else a clear error.

        Arguments:
            name: the argument name the error message names.
            table: `[L, num_slots]` integer numpy array, a phy2log slot table.

        Returns:
            None (raises ValueError naming `name` when a primary slot holds another expert).
        """
        if not self.num_primary:
            return
        per_rank = self.shape.slots_per_rank
        expected = (np.arange(self.num_ranks)[:, None] * self.num_primary + np.arange(self.num_primary)[None, :])
        got = table.reshape(table.shape[0], self.num_ranks, per_rank)[:, :, :self.num_primary]
        if not (got == expected[None]).all():
            raise ValueError(f"{name}: expected rank r's first {self.num_primary} slots to hold its primaries "
                             f"r*{self.num_primary}+j (they live in the unified weight memory and do not move)")

    def _check_primaries_serving(self) -> None:
        from mooncake_ep_switch.switch.unified_weights import EP

        if self.primaries.layout != EP:
            raise RuntimeError(f"primaries: the unified weights are in layout {self.primaries.layout!r}; physical "
                               "experts are served and staged in the 'ep' layout only")

    def local_experts(self, layer: int) -> List[int]:
        """Logical expert of each of this rank's physical experts (slots) of `layer` (local index order).

        Arguments:
            layer: MoE layer in `[0, L)`.

        Returns:
            experts: list of `slots_per_rank` int logical expert ids in `[0, E)`, from the current
                `phy2log`.
        """
        per_rank = self.shape.slots_per_rank
        return self.phy2log[layer, self.rank * per_rank:(self.rank + 1) * per_rank].tolist()

    def expert(self, layer: int, local_slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Weights of this rank's slot `local_slot` of `layer`.

        Arguments:
            layer: MoE layer in `[0, L)`.
            local_slot: local slot index in `[0, slots_per_rank)`.

        Returns:
            gate_up: `[2I, H]` torch.bfloat16 (gate rows then up rows), a view of the frame.
            down: `[H, I]` torch.bfloat16, a view of the frame.
        """
        if local_slot < self.num_primary:
            self._check_primaries_serving()
            gate_up, down = self.primaries.view(layer, "ep")
            return gate_up[local_slot], down[local_slot]
        frame = int(self.frame_of[layer, local_slot])
        return self._gate_up[frame], self._down[frame]

    def frame_views(self, frame: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Views of one of this rank's frames.

        Arguments:
            frame: frame id in `[0, num_frames)` (not bounds-checked here).

        Returns:
            gate_up: `[2I, H]` torch.bfloat16, a view of the frame.
            down: `[H, I]` torch.bfloat16, a view of the frame.
        """
        return self._gate_up[frame], self._down[frame]

    def load(self, layers: Sequence) -> None:
        """Copy this rank's slots of every layer from full (unsharded) weights.

        Arguments:
            layers: L objects with `gate_up` `[E, 2I, H]` and `down` `[E, H, I]` torch.bfloat16
                (e.g. `moe_block.MoEWeights`), indexed by logical expert.
        """
        if len(layers) != self.shape.num_layers:
            raise ValueError(f"layers: expected {self.shape.num_layers} layers, got {len(layers)}")
        for index, weights in enumerate(layers):
            for local_slot, expert in enumerate(self.local_experts(index)):
                if local_slot < self.num_primary:
                    continue  # loaded into the unified weights by their owner
                gate_up, down = self.expert(index, local_slot)
                gate_up.copy_(weights.gate_up[expert])
                down.copy_(weights.down[expert])
        self.mark_loaded()

    def mark_loaded(self) -> None:
        """Tell peers this rank's frames hold its weights: they may read them from now on.

        `load` calls it; call it yourself only after filling every frame another way (the copies of
        `eplb.grow_slots` and of a replacement's restore do). Until then the frame table peers read
        says "not loaded" and a rebalance staging from this rank waits for it (`SlotsNotLoaded`).
        With primaries, load the unified weights first: peers read them once this is called.
        """
        fence(self.device, DRAIN_TIMEOUT_S)  # device frames: loaded before any peer can stage from them
        self.loaded = True
        self.publish_table()

    def take_free_frame(self) -> int:
        """Take a free frame for staging: one that no abandoned Transfer Engine read may still land in.

        A staging read that missed its deadline is abandoned with its frame freed (the chunk
        aborts), but the read stays in flight inside the engine until it finishes or fails; a
        frame it may still land in is skipped until then (`TeEndpoint.reading_into`).

        Returns:
            frame: frame id in `[0, num_frames)`, removed from `free_frames`.

        Raises:
            RuntimeError: no free frame, or every free frame still has an abandoned read in flight.
        """
        te = self.region.te
        base = self.region.base
        for index in range(len(self.free_frames) - 1, -1, -1):
            frame = self.free_frames[index]
            if te is None or not (
                    te.reading_into(base + self.frames_offset + frame * self.gate_up_bytes, self.gate_up_bytes)
                    or te.reading_into(base + self.down_offset + frame * self.down_bytes, self.down_bytes)):
                return self.free_frames.pop(index)
        if not self.free_frames:
            raise RuntimeError("no free frame left for staging")
        raise RuntimeError(f"no free frame left for staging: all {len(self.free_frames)} free frames still have "
                           "Transfer Engine reads abandoned at an earlier deadline in flight")

    # ------------------------------------------------------------------ frame tables
    def publish_table(self) -> None:
        """Write this rank's frame table where peers read it (every entry "not loaded" before `mark_loaded`)."""
        per_rank = self.shape.slots_per_rank
        count = self.shape.num_layers * per_rank
        view = self.region.local[self.table_offset:self.table_offset + 4 * count].view(torch.int32)
        table = self.frame_of.reshape(-1) if self.loaded else np.full(count, _NOT_LOADED)
        view.copy_(torch.from_numpy(table.astype(np.int32)))

    def _not_loaded(self, rank: int) -> SlotsNotLoaded:
        return SlotsNotLoaded(f"rank {rank}'s expert slots are not loaded yet (its frame table says so: "
                              "ExpertSlots.load has not finished there); nothing was read from its frames", rank)

    def is_loaded(self, rank: int) -> bool:
        """Whether `rank`'s frames and primaries hold its weights (its published table says so).

        Arguments:
            rank: this rank, or a peer whose region is mapped here (`is_mapped`).

        Returns:
            loaded: bool; False until `rank` called `mark_loaded` (`load`, a grow, a replacement's restore).

        Raises:
            RuntimeError: `rank`'s region is not mapped here.
        """
        if rank == self.rank:
            return self.loaded
        entry = self.region.peer(rank)[self.table_offset:self.table_offset + 4].view(torch.int32)
        return int(entry[0]) != _NOT_LOADED

    def _check_peer_loaded(self, rank: int) -> None:
        """Raise `SlotsNotLoaded` unless mapped `rank` published its table after loading (its first entry)."""
        if not self.is_loaded(rank):
            raise self._not_loaded(rank)

    def peer_frame(self, rank: int, layer: int, local_slot: int, timeout_s: float = 30.0) -> int:
        """Frame of `rank`'s slot (`layer`, `local_slot`), read from its table and bounds-checked.

        Arguments:
            rank: owner rank of the physical expert (slot); this rank reads its own table in memory,
                a peer of this host through the mapping, a peer of another host over the Transfer
                Engine.
            layer: MoE layer in `[0, L)`.
            local_slot: local slot index in `[num_primary, slots_per_rank)` (a redundant expert's slot).
            timeout_s: deadline of a Transfer Engine read in seconds, > 0.

        Returns:
            frame: frame id in `[0, num_frames)` on `rank`.

        Raises:
            ValueError: `local_slot` is a primary (lives in the unified weights, not a frame), or the
                peer's table names a frame outside `[0, num_frames)`.
            SlotsNotLoaded: `rank`'s table says its slots are not loaded yet.
            RuntimeError: `rank` is neither mapped nor reached over the Transfer Engine.
            ConnectionError / TimeoutError: the Transfer Engine read failed or missed its deadline.
        """
        if local_slot < self.num_primary:
            raise ValueError(f"local_slot: {local_slot} is a primary (in the unified weights), not a frame")
        if rank == self.rank:
            if not self.loaded:
                raise self._not_loaded(rank)
            return int(self.frame_of[layer, local_slot])
        index = layer * self.shape.slots_per_rank + local_slot
        at = self.table_offset + 4 * index
        if self.region.peer_bases[rank]:
            value = int(self.region.peer(rank)[at:at + 4].view(torch.int32)[0])
        else:
            scratch = self.region.local[_TE_SCRATCH:_TE_SCRATCH + 4]
            scratch.view(torch.int32)[0] = -1
            self.region.read_peer(rank, [(_TE_SCRATCH, at, 4)], timeout_s)
            value = int(scratch.view(torch.int32)[0])
        if value == _NOT_LOADED:
            raise self._not_loaded(rank)
        if not 0 <= value < self.num_frames:
            raise ValueError(f"rank {rank}'s frame table names frame {value} for layer {layer} slot {local_slot}; "
                             f"expected a frame in [0, {self.num_frames})")
        return value

    def is_mapped(self, rank: int) -> bool:
        """Whether `rank`'s region is mapped here (this rank, or a peer of this host).

        Arguments:
            rank: rank in `[0, R)`.

        Returns:
            mapped: bool.
        """
        return bool(self.region.peer_bases[rank])

    def is_reachable(self, rank: int) -> bool:
        """Whether `rank`'s slots can be read from here: mapped, or over the Transfer Engine.

        Arguments:
            rank: rank in `[0, R)`.

        Returns:
            reachable: bool.
        """
        return bool(self.region.peer_bases[rank]) or self.region.remote[rank] is not None

    def read_remote_frame(self, dst_frame: int, src_rank: int, layer: int, src_slot: int, timeout_s: float) -> int:
        """Copy the weights of `src_rank`'s slot (`layer`, `src_slot`) into this rank's `dst_frame`
        with one-sided Transfer Engine reads (a peer on another host).

        Arguments:
            dst_frame: destination frame id on this rank, in `[0, num_frames)`.
            src_rank: a rank reached over the Transfer Engine.
            layer: MoE layer in `[0, L)`.
            src_slot: local slot index on `src_rank`, a redundant expert's (`>= num_primary`).
            timeout_s: deadline of each read in seconds, > 0.

        Returns:
            nbytes: int, the weight bytes read (`frame_bytes`).

        Raises:
            ValueError: a bad frame id (`dst_frame`, or one in `src_rank`'s table).
            SlotsNotLoaded: `src_rank`'s slots are not loaded yet (nothing was read).
            RuntimeError: `src_rank` is not reached over the Transfer Engine.
            ConnectionError / TimeoutError: a read failed or missed the deadline (the frame is then
                partly written: it is a free frame, nothing serves from it).
        """
        if not 0 <= dst_frame < self.num_frames:
            raise ValueError(f"dst_frame: expected a frame in [0, {self.num_frames}), got {dst_frame}")
        if self.region.remote[src_rank] is None:
            raise RuntimeError(f"rank {src_rank}'s expert slots are not reached over the Transfer Engine")
        src_frame = self.peer_frame(src_rank, layer, src_slot, timeout_s)
        gate_up, down = self.gate_up_bytes, self.down_bytes
        self.region.read_peer(src_rank, [
            (self.frames_offset + dst_frame * gate_up, self.frames_offset + src_frame * gate_up, gate_up),
            (self.down_offset + dst_frame * down, self.down_offset + src_frame * down, down)], timeout_s)
        self.te_reads += 1
        self.te_read_bytes += self.frame_bytes
        return self.frame_bytes

    def source_blocks(self, dst_frame: int, src_rank: int, layer: int, src_slot: int) -> Tuple[np.ndarray, Tuple[int, int]]:
        """`copy_blocks` descriptors copying `src_rank`'s slot (`layer`, `src_slot`) into this rank's `dst_frame`.

        A primary source slot (`src_slot < num_primary`) is read from `src_rank`'s unified weights
        (which must be in the EP layout), any other from its frame via `peer_frame`.

        Arguments:
            dst_frame: destination frame id on this rank.
            src_rank: rank owning the source physical expert (slot).
            layer: MoE layer in `[0, L)`.
            src_slot: local slot index on `src_rank` in `[0, slots_per_rank)`.

        Returns:
            blocks: `[2, 6]` np.int64, rows `(dst, src, rows, row_bytes, dst_stride, src_stride)` for
                gate/up then down.
            src_range: (lo, hi) int addresses of the source region as mapped here.

        Raises:
            ValueError: a bad frame id in `src_rank`'s table (see `peer_frame`).
            SlotsNotLoaded: `src_rank`'s slots are not loaded yet.
            RuntimeError: the primaries are not serving in the EP layout, or `src_rank`'s region is not mapped.
        """
        dst_base = self.region.peer_bases[self.rank]
        if src_slot < self.num_primary:
            from mooncake_ep_switch.switch.unified_weights import EP

            self._check_primaries_serving()
            self._check_peer_loaded(src_rank)
            unified = self.primaries
            base = unified.peer_slot_base(src_rank, unified.slot_of(layer, EP))
            sources = (base + src_slot * self.gate_up_bytes,
                       base + unified.gate_up_bytes() + src_slot * self.down_bytes)
            lo = unified.region.peer_bases[src_rank]
            src_range = (lo, lo + unified.region_bytes)
        else:
            src_frame = self.peer_frame(src_rank, layer, src_slot)
            src_base = self.region.peer_bases[src_rank]
            sources = (src_base + self.frames_offset + src_frame * self.gate_up_bytes,
                       src_base + self.down_offset + src_frame * self.down_bytes)
            src_range = self.region_range(src_rank)
        rows = [(dst_base + self.frames_offset + dst_frame * self.gate_up_bytes, sources[0], 1, self.gate_up_bytes,
                 self.gate_up_bytes, self.gate_up_bytes),
                (dst_base + self.down_offset + dst_frame * self.down_bytes, sources[1], 1, self.down_bytes,
                 self.down_bytes, self.down_bytes)]
        return np.asarray(rows, dtype=np.int64), src_range

    def region_range(self, rank: int) -> Tuple[int, int]:
        """Address range of `rank`'s region as mapped in this process.

        Arguments:
            rank: rank in `[0, R)`.

        Returns:
            range: (lo, hi) int addresses, hi exclusive.

        Raises:
            RuntimeError: `rank`'s region is not mapped.
        """
        base = self.region.peer_bases[rank]
        if not base:
            raise RuntimeError(f"rank {rank}'s expert slots are not mapped")
        return base, base + self.region.nbytes

    # ------------------------------------------------------------------ membership (peer_regions.Participant)
    def shared_regions(self) -> list:
        """The region peers read slot tables and frames from.

        Returns:
            regions: `[region]` (empty once destroyed).
        """
        return [] if self.region is None else [self.region]

    def peer_state(self) -> dict:
        """What a replacement of this rank takes over.

        Returns:
            state: dict with `"phy2log"` (`[L, num_slots]` nested list of int, the current
                placement), `"chunk_epoch"` and `"version"` (int).
        """
        return {"phy2log": self.phy2log.tolist(), "chunk_epoch": self.chunk_epoch, "version": self.version}

    def readmitted(self, ranks) -> None:
        """Nothing to forget: the replacement's table is published from the members' placement."""

    def destroy(self) -> None:
        """Unmap the region; views of the frames become invalid; idempotent."""
        if getattr(self, "coverage", None) is not None:
            self.coverage.close()
        if getattr(self, "_registry", None) is not None:
            self._registry.remove(self)
            self._registry = None
        self._gate_up = self._down = None
        if self.region is not None:
            self.region.destroy()
            self.region = None
