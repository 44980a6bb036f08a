"""Device memory every rank of one host writes into: a `cudaMalloc` region shared by CUDA IPC.

The "cuda" transport's counterpart of `shared_region.SharedRegion`, for the structures built on a
Buffer whose bytes live on the GPU (the switch's unified weights, the KV-cache pages, the EPLB expert
frames). It has the same surface (`local`, `peer_bases`, `peer(rank)`, `endpoint`, `connect`,
`map_peer`, `unmap_peer`, `destroy`), so `peer_regions.PeerRegions` publishes, maps and re-maps it
for a replacement exactly as it does host regions; the mechanism is the cuda transport's own
(`transport/device_memory.py`: `DeviceAllocation`, the IPC handle, `PeerDeviceMapping`).

- The region is allocated once (zeroed) and never moves: every view an engine holds keeps its address
  across any number of switches and membership changes.
- Its endpoint is (pid, IPC handle, nbytes), published in the store; a peer opens it with
  `cudaIpcOpenMemHandle` (between processes on one GPU, or over NVLink between GPUs of one host).
  Peers on other hosts are refused: device regions are reached only by CUDA IPC.
- `DeviceMoves` queues the moves (batches of strided blocks, `reshard.copy`'s format) straight from
  one device address to another (a peer's, as mapped here) on one dedicated stream per device, and
  `fence(deadline)` waits for them (and for everything queued before on the caller's stream) before
  the caller publishes the host word that tells a peer they landed. Nothing is staged in host memory.
- Control words stay in host memory (`SharedRegion`) and the decisions in the store: what peers
  *poll* is never device memory.

Releasing: `unmap_peer()` and `destroy()` first wait, with a deadline, for this rank's queued moves
(no copy of ours still reads or writes through the mapping), then drop the region's references; the
memory is unmapped / freed when the last tensor view of it goes (never, if the device did not finish
in time: leaked rather than reused under a copy).
"""
import os
import threading
import time
from typing import Dict, List, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer.shared_region import SharedRegion, peer_is_current
from mooncake_ep_switch.buffer.transport import device_memory
from mooncake_ep_switch.buffer.transport.cuda import IPC_HANDLE_BYTES


class DeviceEndpoint(NamedTuple):
    """How a peer on the same host opens a device region.

    Fields:
        pid: process id of the owner.
        handle: the region's CUDA IPC handle, hex (128 characters).
        nbytes: region size.
    """

    pid: int
    handle: str
    nbytes: int


class DeviceRegion:
    """This rank's device region plus every same-host peer's region of the same size, opened by IPC.

    Arguments:
        group: process group for the endpoint exchange in `connect` (None when endpoints go through
            the store).
        rank: this rank.
        num_ranks: number of ranks.
        nbytes: size of every rank's region, > 0.
        device: the CUDA torch.device (the Buffer's, `Buffer.runtime.device`).
    """

    is_device = True

    def __init__(self, group, rank: int, num_ranks: int, nbytes: int, device: torch.device):
        if nbytes <= 0:
            raise ValueError(f"nbytes: expected > 0, got {nbytes}")
        self.group, self.rank, self.num_ranks, self.nbytes, self.device = group, rank, num_ranks, nbytes, device
        self._index = device.index or 0
        self._memory: List[Optional[device_memory.DeviceMemory]] = [None] * num_ranks
        self._memory[rank] = device_memory.DeviceAllocation(nbytes, self._index)
        self.base = self._memory[rank].ptr
        self.local = device_memory.device_view(self._memory[rank], device)
        self.endpoint = DeviceEndpoint(os.getpid(), device_memory.ipc_handle_hex(self._memory[rank]), nbytes)
        self.peer_bases: List[int] = [0] * num_ranks
        self.peer_bases[rank] = self.base
        self.peer_endpoints: List[Optional[DeviceEndpoint]] = [None] * num_ranks
        self.peer_endpoints[rank] = self.endpoint
        self.peer_incarnations: List[Optional[int]] = [None] * num_ranks
        self._peer_tensors: List[Optional[torch.Tensor]] = [None] * num_ranks
        self._peer_tensors[rank] = self.local
        self.remote: List[None] = [None] * num_ranks  # device regions are never reached over the Transfer Engine
        self.te = None

    def endpoint_from(self, fields) -> DeviceEndpoint:
        """A peer's published endpoint fields as a `DeviceEndpoint`, validated.

        Arguments:
            fields: sequence (pid, handle hex, nbytes) from the store or the group.

        Returns:
            endpoint: a `DeviceEndpoint`.

        Raises:
            ValueError: not three fields of those types (e.g. a host region's (pid, fd, nbytes)).
        """
        fields = list(fields) if isinstance(fields, (list, tuple)) else []
        ok = len(fields) == 3
        if ok:
            pid, handle, nbytes = fields
            ok = (type(pid) is int and pid > 0 and isinstance(handle, str) and len(handle) == 2 * IPC_HANDLE_BYTES
                  and all(c in "0123456789abcdef" for c in handle) and type(nbytes) is int and nbytes > 0)
        if not ok:
            raise ValueError(f"endpoint: expected a device region's (pid, 128-hex-digit IPC handle, nbytes), got "
                             f"{fields!r:.120}")
        return DeviceEndpoint(pid, handle, nbytes)

    def connect(self, ranks: Optional[List[int]] = None) -> None:
        """Exchange endpoints over `group` and open every peer's region (or only `ranks`); collective.

        Arguments:
            ranks: the peers to open, or None for every rank of the group.
        """
        endpoints: List = [None] * self.num_ranks
        dist.all_gather_object(endpoints, tuple(self.endpoint), group=self.group)
        for peer in range(self.num_ranks) if ranks is None else ranks:
            if endpoints[peer] is not None:
                self.map_peer(peer, self.endpoint_from(endpoints[peer]))
        dist.barrier(group=self.group)  # nobody frees its region before every rank opened it

    def map_peer(self, rank: int, endpoint: DeviceEndpoint, incarnation: Optional[int] = None) -> None:
        """Open `rank`'s region at `endpoint`; a different endpoint or incarnation replaces the old one.

        Arguments:
            rank: the peer's rank (this rank: no-op).
            endpoint: the peer's `DeviceEndpoint`.
            incarnation: the peer's incarnation that published it (None: unknown, opened anew).

        Raises:
            ValueError: the peer's region has another size, or a malformed handle.
            RuntimeError: the CUDA runtime cannot open the handle (e.g. its process ended); the old
                mapping of `rank`, if any, is kept.
            TimeoutError: the device did not finish the moves through the old mapping (it is kept).
        """
        if rank == self.rank or peer_is_current(self, rank, endpoint, incarnation):
            return
        memory = device_memory.PeerDeviceMapping(bytes.fromhex(endpoint.handle), self.nbytes, self._index)
        self.unmap_peer(rank)  # the new mapping opened: only now is the old one given up
        self._memory[rank] = memory
        self.peer_bases[rank] = memory.ptr
        self.peer_endpoints[rank] = endpoint
        self.peer_incarnations[rank] = incarnation

    def peer(self, rank: int) -> torch.Tensor:
        """`[nbytes]` torch.uint8 view (on this device) of `rank`'s region as opened here.

        Arguments:
            rank: any rank; this rank gives `local`.

        Returns:
            view: the tensor (cached); it keeps the mapping open while it lives.

        Raises:
            RuntimeError: `rank` is not mapped.
        """
        if not self.peer_bases[rank]:
            raise RuntimeError(f"rank: peer {rank} is not mapped")
        if self._peer_tensors[rank] is None:
            self._peer_tensors[rank] = device_memory.device_view(self._memory[rank], self.device)
        return self._peer_tensors[rank]

    def unmap_peer(self, rank: int) -> None:
        """Close one peer's mapping (after every copy of ours through it ended); no-op if not mapped.

        Arguments:
            rank: the peer's rank.
        """
        if rank == self.rank or not self.peer_bases[rank]:
            return
        if not _moves_landed(self.device):
            raise TimeoutError(f"rank {rank}'s region: the device did not finish this rank's moves within "
                               f"{DRAIN_TIMEOUT_S} s; it stays mapped")
        self._peer_tensors[rank] = None
        self._memory[rank] = None
        self.peer_bases[rank] = 0
        self.peer_endpoints[rank] = None

    def register_te(self, te) -> None:
        """Refused: a device region is reached only over CUDA IPC by ranks of its host."""
        raise RuntimeError("register_te: device regions are not registered with a Transfer Engine (the 'cuda' "
                           "transport reaches its peers over CUDA IPC on one host)")

    def set_remote(self, rank: int, remote) -> None:
        """Refused: see `register_te`."""
        raise ValueError(f"rank {rank} is on another host; a device region is reached only over CUDA IPC")

    def read_peer(self, rank: int, ranges, timeout_s: float) -> None:
        """Refused: no peer of a device region is remote."""
        raise RuntimeError(f"read_peer: rank {rank!r} is not reached over the Transfer Engine from rank {self.rank}")

    def destroy(self) -> None:
        """Close every peer mapping and release this rank's region (freed once no view holds it); idempotent."""
        if not self.base:
            return
        if not _moves_landed(self.device):  # a wedged device: never free what a queued move may still touch
            _NEVER_RELEASED.append([m for m in self._memory if m is not None])
        else:
            for peer in range(self.num_ranks):
                self.unmap_peer(peer)
        self._peer_tensors = [None] * self.num_ranks
        self._memory = [None] * self.num_ranks
        self.local = None
        self.peer_bases[self.rank] = 0
        self.base = 0


class _BlockTable:
    """A block table of the block-copy kernel: `[rows * 6]` int64 in pinned host memory and its copy in device
    memory, and the event recorded after the last call that read them (`busy` until it completed).

    Arguments:
        rows: blocks it holds at most.
        device: the CUDA torch.device.
    """

    def __init__(self, rows: int, device: torch.device):
        self.rows = rows
        self.pinned = torch.empty(rows * 6, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.on_device = torch.empty(rows * 6, dtype=torch.int64, device=device)
        self.event = torch.cuda.Event()
        self.busy = False


class DeviceMoves:
    """The copies of switches and rebalances into device regions, on one dedicated stream.

    Arguments:
        device: the CUDA torch.device.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.unfenced_bytes = 0  # queued since the last fence
        # The block-copy kernel's tables, reused (`_BlockTable`): at most `MAX_TABLES`, each taken again only
        # once the device finished the call that last read it.
        self._tables: List[_BlockTable] = []
        # (event, tensors) of calls whose one-off tables (every kept table busy) may still be read by the device:
        # kept until it has
        self._in_flight: List[tuple] = []
        self._lock = threading.Lock()

    def copy(self, blocks: np.ndarray, dst_range, src_range) -> int:
        """Queue `blocks` after everything queued so far on the caller's stream (checked first).

        Arguments:
            blocks: `[n, 6]` int64 rows `(dst, src, rows, row_bytes, dst_stride, src_stride)`, device
                addresses as mapped here.
            dst_range: (lo, hi) int addresses every destination byte must lie in.
            src_range: (lo, hi) int addresses every source byte must lie in.

        Returns:
            nbytes: int, the bytes queued.

        Raises:
            ValueError: a block outside its range (nothing queued).
        """
        blocks = block_table(blocks)
        if blocks.shape[0] == 0:
            return 0
        with self._lock:  # a table is taken and marked busy by one thread at a time
            return self._queue(blocks, [(0, blocks.shape[0], dst_range, src_range)])[0]

    def copy_parts(self, blocks: np.ndarray, parts) -> List[int]:
        """Queue the parts of one table, each between its own pair of regions, in order (see `copy`): one pinned
        table, one wait for the caller's stream and one event for all of them (each kernel part uploads its own
        rows of the table, at its offset in the device copy).

        Arguments:
            blocks: `[n, 6]` int64 rows as for `copy`.
            parts: (start, stop, dst_range, src_range) tuples: `blocks[start:stop]` lies in those ranges.

        Returns:
            nbytes: `[len(parts)]` ints, the bytes each part queued.

        Raises:
            ValueError: a part's block outside its ranges; that part and those after it are not queued (the
                earlier ones are). Parts whose bounds are not `0 <= start <= stop <= n`: nothing queued.
        """
        blocks = block_table(blocks)
        _check_parts(parts, blocks.shape[0])
        parts = [part for part in parts if part[1] > part[0]]
        if not parts:
            return []
        with self._lock:
            return self._queue(blocks, parts)

    def _queue(self, blocks: np.ndarray, parts) -> List[int]:
        self._in_flight = [entry for entry in self._in_flight if not entry[0].query()]
        table = None
        kernel = [_needs_kernel(blocks[start:stop], dst_range, src_range)
                  for start, stop, dst_range, src_range in parts]
        if any(kernel):
            # One kernel a part: the table goes up from pinned memory (an upload from pageable memory would make
            # the driver wait for the stream, with no deadline) into device memory, both reused only once it landed.
            table = self._free_table(blocks.shape[0])
            table.pinned[:blocks.size].copy_(torch.from_numpy(blocks.reshape(-1)))
            blocks = table.pinned[:blocks.size].numpy().reshape(-1, 6)
        queued: List[int] = []
        try:
            with torch.cuda.device(self.device):
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                stream = self.stream.cuda_stream
                device_table = 0 if table is None else table.on_device.data_ptr()
                for (start, stop, dst_range, src_range), whole_kernel in zip(parts, kernel):
                    queued.append(device_memory.queue_copies(blocks[start:stop], dst_range, src_range, stream,
                                                             device_table + 48 * start if whole_kernel else 0))
        except ValueError:
            if table is not None and queued:  # an earlier part's upload is queued: held until it landed
                self._hold(table)
            raise  # this part was refused before anything of it was queued
        except BaseException:
            if table is not None:  # the table's upload may be queued (a launch failed after it): never reused
                _NEVER_RELEASED.append([table])
                self._tables = [kept for kept in self._tables if kept is not table]
            raise
        finally:
            self.unfenced_bytes += sum(queued)
        if table is not None:  # queued
            self._hold(table)
        return queued

    def _hold(self, table: "_BlockTable") -> None:
        """Mark `table` read by what this stream queued so far: reused (or released) only once that completed."""
        table.event.record(self.stream)
        table.busy = True
        if not any(kept is table for kept in self._tables):
            self._in_flight.append((table.event, table))

    def _free_table(self, rows: int) -> "_BlockTable":
        """A table of at least `rows` blocks the device no longer reads: a kept one, a new kept one (up to
        `MAX_TABLES`, replacing a free one too small when full), or a one-off when every kept table is busy."""
        free = [table for table in self._tables if not table.busy or table.event.query()]
        for table in free:
            table.busy = False
        fits = [table for table in free if table.rows >= rows]
        if fits:
            return min(fits, key=lambda table: table.rows)
        table = _BlockTable(max(TABLE_MIN_ROWS, 1 << (rows - 1).bit_length()), self.device)
        if table.rows > TABLE_MAX_ROWS:
            return table  # a one-off: the kept tables never hold more than TABLE_MAX_ROWS blocks each
        if len(self._tables) >= MAX_TABLES and free:
            self._tables.remove(min(free, key=lambda old: old.rows))
        if len(self._tables) < MAX_TABLES:
            self._tables.append(table)
        return table

    def fence(self, timeout_s: float) -> None:
        """Wait until every queued move and everything queued before on the caller's stream completed.

        Polls an event up to `timeout_s`: yielding the core between queries for the first `FENCE_SPIN_S` (a
        switch fences once per layer, and its copies take tens of microseconds: a sleep, ~60 us at least on
        Linux, would overshoot each), then sleeping with a growing pause; the caller's stream then also waits
        for the moves.

        Arguments:
            timeout_s: deadline in seconds (> 0).

        Raises:
            TimeoutError: the device did not finish in time (a wedged device, never a slow peer:
                copies do not wait for anybody).
        """
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        event.record(self.stream)
        owed = self.unfenced_bytes
        started = time.monotonic()
        deadline, spin_until = started + timeout_s, started + FENCE_SPIN_S
        pause = 1e-5
        while not event.query():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"the device did not finish {self.unfenced_bytes} queued bytes of moves within "
                                   f"{timeout_s:.3g} s")
            if now < spin_until:
                os.sched_yield()
                continue
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        with self._lock:  # what another thread queued after this fence's event stays owed and held until it landed
            self.unfenced_bytes -= owed
            self._in_flight = [entry for entry in self._in_flight if not entry[0].query()]


_MOVES: Dict[str, DeviceMoves] = {}
_MOVES_LOCK = threading.Lock()
#: Seconds a wait for this rank's queued moves (or loads) may take when no call deadline applies: `unmap_peer()`,
#: `destroy()`, the loads, a failed switch's drain.
DRAIN_TIMEOUT_S = 30.0
#: Seconds a fence yields the core between event queries before it sleeps between them (`DeviceMoves.fence`).
FENCE_SPIN_S = 2e-4
#: Below this many blocks a move is one runtime copy per block, from this many on one kernel (csrc/cuda).
KERNEL_MIN_BLOCKS = 8
#: The largest stride a runtime 2D copy takes (cudaDevAttrMaxPitch, 2^31 - 1 on current GPUs): a move with a larger
#: one goes to the kernel whatever its blocks (a KV block's rows are a whole plane apart).
MAX_RUNTIME_PITCH = (1 << 31) - 1
#: Block tables a `DeviceMoves` keeps for reuse, and the fewest and most blocks a kept one holds (sizes are powers
#: of two; a larger call's table is a one-off).
MAX_TABLES, TABLE_MIN_ROWS, TABLE_MAX_ROWS = 8, 64, 1 << 16
# Device memory a wedged device might still touch: never released (destroy() after a failed drain).
_NEVER_RELEASED: List[list] = []


def _needs_kernel(blocks: np.ndarray, dst_range, src_range) -> bool:
    """Whether a move goes to the block-copy kernel rather than one runtime copy per block: from
    `KERNEL_MIN_BLOCKS` blocks on, and for any block a runtime 2D copy does not take: a stride past
    `MAX_RUNTIME_PITCH`, or, inside one region, source and destination spans that overlap (a 2D copy's areas may
    not; the rows of a rank's own KV move, a whole plane apart, interleave)."""
    if blocks.shape[0] >= KERNEL_MIN_BLOCKS:
        return True
    rows = blocks.tolist()  # under KERNEL_MIN_BLOCKS: plain ints cost less than numpy's calls (a weight chunk is 3)
    if any(row[4] > MAX_RUNTIME_PITCH or row[5] > MAX_RUNTIME_PITCH for row in rows):
        return True
    if tuple(dst_range) != tuple(src_range):
        return False
    for dst, src, count, width, dst_stride, src_stride in rows:
        last = max(count - 1, 0)
        if dst < src + last * src_stride + width and src < dst + last * dst_stride + width:
            return True
    return False


def _check_parts(parts, num_blocks: int) -> None:
    """Every part's rows inside the table: `0 <= start <= stop <= num_blocks` (a device table's part is uploaded at
    its start's offset), or a ValueError naming the part."""
    for index, (start, stop, _, _) in enumerate(parts):
        if not 0 <= start <= stop <= num_blocks:
            raise ValueError(f"parts: expected 0 <= start <= stop <= {num_blocks} (the table's blocks), got part "
                             f"{index} = [{start}, {stop})")


def _moves_landed(device: torch.device) -> bool:
    """Whether this process's moves on `device` (and the caller's stream) finished within `DRAIN_TIMEOUT_S`."""
    try:
        moves_for(device).fence(DRAIN_TIMEOUT_S)
    except TimeoutError:
        return False
    return True


def block_table(blocks) -> np.ndarray:
    """`blocks` as a C-contiguous `[n, 6]` np.int64 table, or a ValueError naming the shape it has.

    Arguments:
        blocks: rows `(dst, src, rows, row_bytes, dst_stride, src_stride)` (np array or convertible).

    Returns:
        table: `[n, 6]` np.int64 (n may be 0).
    """
    table = np.ascontiguousarray(blocks, dtype=np.int64)
    if table.size == 0:
        return table.reshape(0, 6)
    if table.ndim != 2 or table.shape[1] != 6:
        raise ValueError(f"blocks: expected an [n, 6] table of (dst, src, rows, row_bytes, dst_stride, src_stride), "
                         f"got shape {list(table.shape)}")
    return table


def moves_for(device: torch.device) -> DeviceMoves:
    """The process's `DeviceMoves` of `device` (made on first use).

    Arguments:
        device: a CUDA torch.device.

    Returns:
        moves: the `DeviceMoves`.
    """
    key = str(device)
    moves = _MOVES.get(key)
    if moves is None:
        with _MOVES_LOCK:  # one per device: a second one's stream would be one no fence waits for
            moves = _MOVES.get(key)
            if moves is None:
                moves = _MOVES[key] = DeviceMoves(device)
    return moves


def copy_blocks(blocks: np.ndarray, dst_range, src_range, device: Optional[torch.device]) -> int:
    """Copy `blocks` between regions (every block checked against its range first): on the host with the
    native `copy_blocks` when `device` is None, else queued on `device`'s `DeviceMoves` stream (call
    `fence` before telling a peer they landed).

    Arguments:
        blocks: `[n, 6]` int64 rows `(dst, src, rows, row_bytes, dst_stride, src_stride)`.
        dst_range: (lo, hi) int addresses every destination byte must lie in.
        src_range: (lo, hi) int addresses every source byte must lie in.
        device: the regions' CUDA torch.device, or None (host memory).

    Returns:
        nbytes: int, `sum(rows * row_bytes)` (0 for no blocks).

    Raises:
        ValueError: a block with a negative field, an overflow, or an extent outside its range; nothing
            is copied then.
    """
    blocks = block_table(blocks)
    if blocks.shape[0] == 0:
        return 0
    if device is not None:
        return moves_for(device).copy(blocks, dst_range, src_range)
    from mooncake_ep_switch import _native

    _native.copy_blocks(blocks.ctypes.data, blocks.shape[0], dst_range[0], dst_range[1], src_range[0], src_range[1])
    return int((blocks[:, 2] * blocks[:, 3]).sum())


def copy_block_parts(blocks: np.ndarray, parts, device: Optional[torch.device]) -> List[int]:
    """Copy the parts of one block table, each between its own pair of regions, in order (`copy_blocks` for each;
    on a device `DeviceMoves.copy_parts`: one pinned table, stream wait and event for all of them).

    Arguments:
        blocks: `[n, 6]` int64 rows `(dst, src, rows, row_bytes, dst_stride, src_stride)`.
        parts: (start, stop, dst_range, src_range) tuples: `blocks[start:stop]` lies in those (lo, hi) ranges.
        device: the regions' CUDA torch.device, or None (host memory).

    Returns:
        nbytes: `[len(parts)]` ints, the bytes of each part (0 for an empty one).

    Raises:
        ValueError: a part's block outside its ranges; that part and those after it are not copied (the earlier
            ones are). Parts whose bounds are not `0 <= start <= stop <= n`: nothing copied.
    """
    blocks = block_table(blocks)
    if device is None:
        _check_parts(parts, blocks.shape[0])
        return [copy_blocks(blocks[start:stop], dst_range, src_range, None)
                for start, stop, dst_range, src_range in parts]
    queued = iter(moves_for(device).copy_parts(blocks, parts))
    return [next(queued) if stop > start else 0 for start, stop, _, _ in parts]


def fence(device: Optional[torch.device], timeout_s: float) -> None:
    """Wait until the moves queued on `device` completed (`DeviceMoves.fence`); no-op for host memory
    (None: host copies complete before they return).

    Arguments:
        device: a CUDA torch.device, or None.
        timeout_s: deadline in seconds (> 0).
    """
    if device is not None:
        moves_for(device).fence(timeout_s)


def new_region(group, rank: int, num_ranks: int, nbytes: int, device: Optional[torch.device]):
    """The region a participant's peers write into: a `DeviceRegion` on `device`, a host `SharedRegion`
    when `device` is None.

    Arguments:
        group, rank, num_ranks, nbytes: as `SharedRegion` / `DeviceRegion`.
        device: the CUDA torch.device of the Buffer's transport, or None (host memory).

    Returns:
        region: a `DeviceRegion` or a `SharedRegion`.
    """
    if device is None:
        return SharedRegion(group, rank, num_ranks, nbytes)
    return DeviceRegion(group, rank, num_ranks, nbytes, device)


__all__ = ["DRAIN_TIMEOUT_S", "DeviceEndpoint", "DeviceRegion", "DeviceMoves", "block_table", "copy_blocks", "fence", "moves_for", "new_region"]
