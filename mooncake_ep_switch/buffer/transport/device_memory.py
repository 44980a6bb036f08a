"""Device memory of the `"cuda"` transport: allocations, peers' allocations opened by CUDA IPC, torch views
of both, and the queued block copies of switches and rebalances.

The cuda transport's EP region (`cuda.py`) and the device regions of the structures built on a Buffer
(`buffer/device_region.py`) use these; only this module and `cuda.py` call the `_cuda` extension's memory
functions. Every object exposes `__cuda_array_interface__`, so a torch view (`device_view`) keeps the
memory alive as long as the view lives.
"""
import torch

try:
    from mooncake_ep_switch import _cuda
except ImportError:  # built only where nvcc was found
    _cuda = None

class DeviceMemory:
    """A range of device memory addressable here, viewable by torch without a copy.

    Exposes `__cuda_array_interface__`, so `device_view(memory, device)` (`torch.as_tensor`) views it and
    keeps it alive as long as the view lives; subclasses release the memory when the last reference goes.

    Attributes:
        ptr: the device address (0 once released).
        nbytes: size in bytes.
    """

    ptr = 0
    nbytes = 0

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def _release(self, ptr: int) -> None:
        """Give the memory at `ptr` back (the subclass's runtime call)."""

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr and _cuda is not None:
            try:
                self._release(ptr)
            except RuntimeError:
                pass  # the context is going away with the process, or the exporting process is gone


class DeviceAllocation(DeviceMemory):
    """Device memory from `cudaMalloc` (zeroed), freed when the last reference goes.

    Arguments:
        nbytes: bytes to allocate (> 0).
        device: the CUDA device index.
    """

    def __init__(self, nbytes: int, device: int):
        self.nbytes = nbytes
        self.ptr = _cuda.device_alloc(nbytes, device)

    def _release(self, ptr: int) -> None:
        _cuda.device_free(ptr)


class PeerDeviceMapping(DeviceMemory):
    """Another process's allocation opened here by its CUDA IPC handle; closed when the last reference goes
    (the caller waits for its moves first: nothing of ours may still copy through it).

    Arguments:
        handle: the 64-byte IPC handle the owner published.
        nbytes: the allocation's size.
        device: the CUDA device index to open it on.
    """

    def __init__(self, handle: bytes, nbytes: int, device: int):
        self.nbytes = nbytes
        self.ptr = open_peer(handle, nbytes, device)

    def _release(self, ptr: int) -> None:
        _cuda.ipc_close(ptr)


def open_peer(handle: bytes, nbytes: int, device: int) -> int:
    """Open a peer's allocation by its IPC handle and check it holds the `nbytes` its owner claimed.

    Arguments:
        handle: the 64-byte IPC handle the owner published.
        nbytes: the size the owner published.
        device: the CUDA device index to open it on.

    Returns:
        ptr: int, the allocation's address here.

    Raises:
        ValueError: the allocation behind the handle is smaller than `nbytes` (it is closed again).
        RuntimeError: the CUDA runtime cannot open the handle.
    """
    ptr = _cuda.ipc_open(handle, device)
    held = _cuda.allocation_bytes(ptr)
    if held < nbytes:
        _cuda.ipc_close(ptr)
        raise ValueError(f"endpoint: the device allocation behind the IPC handle holds {held} bytes, its owner "
                         f"published {nbytes}")
    return ptr


def device_view(memory: DeviceMemory, device: torch.device) -> torch.Tensor:
    """`[nbytes]` torch.uint8 view of `memory` on `device` (no copy; the view keeps `memory` alive).

    Arguments:
        memory: a `DeviceMemory`.
        device: its CUDA torch.device.

    Returns:
        view: `[memory.nbytes]` torch.uint8 tensor aliasing the memory.
    """
    return torch.as_tensor(memory, device=device)


def ipc_handle_hex(memory: DeviceAllocation) -> str:
    """The CUDA IPC handle of an allocation made here, as published in the store.

    Arguments:
        memory: a `DeviceAllocation`.

    Returns:
        handle: str, `2 * IPC_HANDLE_BYTES` lowercase hex digits.
    """
    return _cuda.ipc_handle(memory.ptr).hex()


def queue_copies(blocks, dst_range, src_range, stream: int, device_table: int = 0) -> int:
    """Queue bounds-checked strided copies on a CUDA stream (`_cuda.copy_blocks_async`).

    Arguments:
        blocks: `[n, 6]` C-contiguous np.int64 rows `(dst, src, rows, row_bytes, dst_stride, src_stride)`.
        dst_range: (lo, hi) int addresses every destination byte must lie in.
        src_range: (lo, hi) int addresses every source byte must lie in.
        stream: the `cudaStream_t` as an int.
        device_table: device memory for `[n, 6]` int64 (0: none): with it, one kernel copies every block (the table
            is copied there on `stream` first; csrc/cuda/copy_kernels.cuh) instead of one runtime copy per block
            (`DeviceMoves` passes one from `device_region.KERNEL_MIN_BLOCKS` blocks on).

    Returns:
        nbytes: int, the bytes queued.

    Raises:
        ValueError: a block outside its range (nothing queued).
    """
    return _cuda.copy_blocks_async(blocks.ctypes.data, blocks.shape[0], dst_range[0], dst_range[1], src_range[0],
                                   src_range[1], stream=stream, device_desc=device_table)


__all__ = ["DeviceMemory", "DeviceAllocation", "PeerDeviceMapping", "open_peer", "device_view", "ipc_handle_hex", "queue_copies"]
