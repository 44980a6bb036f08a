"""An emulated CUDA device for the "cuda" transport, so CI (no GPU) runs its Python layer for real.

`install()`, called first in a rank process, swaps only what needs a GPU:

* the `_cuda` module's kernels and launchers by `_cuda_sim`'s: the same source (csrc/cuda/
  ep_kernels.cuh) on the host block/warp emulator, whose launches complete before returning (so
  stream order holds trivially) and whose device waits poll the host clock;
* device memory by anonymous shared regions (memfd, `_native.region_create`) and CUDA IPC handles
  by (pid, fd, size), opened through /proc as the shm transport maps its peers; pinned mapped host
  memory by host tensors; the synchronous copies by `_native.copy_bytes`;
* torch.cuda's device, streams (and `cuda.current_raw_stream`), events, graph-capture query and
  `Tensor.record_stream` by host stand-ins, in the modules of the cuda path (`buffer/transport/cuda.py`,
  `buffer/device_calls.py`, `buffer/handle.py`, `buffer/device_region.py`) only; the queued block copies of switches and
  rebalances (`copy_blocks_async`) by the host's `copy_blocks`, or by the block-copy kernel on the emulator
  where the caller gave a device table (csrc/cuda/copy_kernels.cuh, as on a GPU), checked when queued and run
  only when the rank next waits for the device (an event query, a synchronize): a missing fence shows here.

Everything else is the real code: Buffer, validation, `device_calls`, `CudaTransport` (endpoints,
connect, peer table, control block, dead words, failed sources, destroy), membership and recovery.
The emulated device's tensors live on the CPU, so device-mismatch errors and CUDA graphs are left to
the GPU run (tests/test_cuda.py). Use it in fresh rank processes only: the swap is not undone.
"""
import contextlib
import os
import struct
import types

import torch

_INSTALLED = []
# Block copies queued by `copy_blocks_async` and not yet run: they land only when something waits for the
# device (an event query, a stream or device synchronize), as on a GPU, where a copy queued on a stream has
# not landed until the caller synchronised with it. A path that tells a peer about its copies without
# waiting for them first leaves the peer reading stale bytes here too (and a killed rank's queued copies
# never land).
_QUEUED = []


def _run_queued() -> None:
    while _QUEUED:
        _QUEUED.pop(0)()


class _Stream:
    """A host stand-in for torch.cuda.Stream (kernels complete in order on the host; queued block copies
    land at the next wait)."""

    cuda_stream = 0

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        _run_queued()


class _Event:
    """A host stand-in for torch.cuda.Event: querying it waits for everything queued before."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        _run_queued()
        return True

    def synchronize(self) -> None:
        _run_queued()


class _TorchOnTheHost(types.ModuleType):
    """torch, with `cuda`, `device` and `as_tensor` answering for the emulated device."""

    def __getattr__(self, name):
        return getattr(torch, name)


def install():
    """Swap the cuda transport's device for the emulated one in this process (idempotent).

    Returns:
        fake: the namespace standing in for `mooncake_ep_switch._cuda`.
    """
    if _INSTALLED:
        return _INSTALLED[0]
    from mooncake_ep_switch import _cuda_sim, _native
    from mooncake_ep_switch.buffer import device_calls, device_region, handle
    from mooncake_ep_switch.buffer.transport import cuda as cuda_transport
    from mooncake_ep_switch.buffer.transport import device_memory

    regions, opened, host, sizes = {}, {}, {}, {}
    fake = types.SimpleNamespace()
    for name in ("Call", "Region", "call_word_size", "check_values", "combine_recv", "combine_send", "dispatch_recv",
                 "dispatch_scratch_bytes", "dispatch_send"):
        setattr(fake, name, getattr(_cuda_sim, name))

    def device_alloc(nbytes, device):
        fd, base = _native.region_create(nbytes)
        regions[base] = (fd, nbytes)
        return base

    def device_free(ptr):
        fd, nbytes = regions.pop(ptr)
        _native.region_unmap(ptr, nbytes)
        _native.region_close_fd(fd)

    def mapped_host_alloc(nbytes):
        block = torch.zeros(nbytes, dtype=torch.uint8)
        host[block.data_ptr()] = block
        return block.data_ptr()

    def ipc_open(handle_bytes, device):
        pid, fd, nbytes = struct.unpack("<qqq", handle_bytes[:24])
        held = os.stat(f"/proc/{pid}/fd/{fd}").st_size  # what the driver knows of the allocation
        ptr = _native.region_map_peer(pid, fd, min(nbytes, held))
        opened[ptr], sizes[ptr] = min(nbytes, held), held
        return ptr

    def allocation_bytes(ptr):
        return sizes[ptr] if ptr in sizes else regions[ptr][1]

    fake.device_alloc, fake.device_free = device_alloc, device_free
    fake.mapped_host_alloc, fake.mapped_host_free = mapped_host_alloc, lambda ptr: host.pop(ptr)
    fake.ipc_handle = lambda base: struct.pack("<qqq", os.getpid(), *regions[base]).ljust(64, b"\0")
    fake.ipc_open, fake.allocation_bytes = ipc_open, allocation_bytes
    fake.ipc_close = lambda ptr: _native.region_unmap(ptr, opened.pop(ptr)) or sizes.pop(ptr, None)
    fake.copy_to_device = fake.copy_to_host = lambda dst, src, nbytes: _native.copy_bytes(dst, src, nbytes)
    fake.device_count, fake.device_status = (lambda: 1), (lambda: "")

    def copy_blocks_async(desc_ptr, n, dst_lo, dst_hi, src_lo, src_hi, stream, device_desc=0):
        """Checked now (as the device's: nothing queued on a bad block), copied at the next wait."""
        if n < 0:
            raise ValueError(f"copy_blocks_async: n = {n} must be >= 0")
        if n == 0:
            return 0
        blocks = torch.frombuffer(_native.MappedBytes(desc_ptr, 48 * n), dtype=torch.int64).view(n, 6).clone()
        for index, (dst, src, rows, width, dst_stride, src_stride) in enumerate(blocks.tolist()):
            for side, start, stride, lo, hi in (("destination", dst, dst_stride, dst_lo, dst_hi),
                                                ("source", src, src_stride, src_lo, src_hi)):
                if rows < 0 or width < 0 or stride < 0 or (rows > 1 and width and stride < width):
                    raise ValueError(f"copy_blocks_async: block {index} {side} has a bad rows/row_bytes/stride")
                end = start + (rows - 1) * stride + width if rows and width else start
                if rows and width and (start < lo or end > hi):
                    raise ValueError(f"copy_blocks_async: block {index} {side} [{start}, {end}) is outside its "
                                     f"region [{lo}, {hi})")
        if device_desc:  # as on a GPU: the table goes to device memory, then the block-copy kernel (emulated)
            def run_kernel():
                _native.copy_bytes(device_desc, blocks.data_ptr(), 48 * n)
                _cuda_sim.copy_blocks_kernel(device_desc, n)
            _QUEUED.append(run_kernel)
        else:
            _QUEUED.append(lambda: _native.copy_blocks(blocks.data_ptr(), n, dst_lo, dst_hi, src_lo, src_hi))
        return int((blocks[:, 2] * blocks[:, 3]).sum())

    fake.copy_blocks_async = copy_blocks_async

    @contextlib.contextmanager
    def on_stream(stream):
        yield

    def synchronize(device=None):
        _run_queued()

    cuda = types.SimpleNamespace(
        current_device=lambda: 0, current_stream=lambda device=None: _Stream(), Stream=_Stream, Event=_Event,
        stream=on_stream, synchronize=synchronize, is_current_stream_capturing=lambda: False,
        is_available=lambda: True, device=lambda device=None: contextlib.nullcontext())
    on_host = _TorchOnTheHost("torch")
    on_host.cuda = cuda
    on_host.device = lambda *args: torch.device("cpu")

    def as_tensor(obj, device=None):
        if isinstance(obj, device_memory.DeviceMemory):  # a view of the emulated device's memory
            return torch.frombuffer(_native.MappedBytes(obj.ptr, obj.nbytes, obj), dtype=torch.uint8)
        return torch.as_tensor(obj, device=device)

    on_host.as_tensor = as_tensor
    for module in (cuda_transport, device_calls, handle, device_region, device_memory):
        module.torch = on_host
    cuda_transport._cuda = device_memory._cuda = fake
    cuda_transport.cuda_unavailable_reason = lambda: ""
    cuda_transport.current_raw_stream = lambda device_index: _Stream.cuda_stream
    torch.Tensor.record_stream = lambda self, stream: None
    _INSTALLED.append(fake)
    return fake


def run_emulated(ctx, module: str, function: str, *args, **kwargs):
    """Rank function: install the emulated device, then run `module.function(ctx, *args, **kwargs)`."""
    import importlib

    install()
    return getattr(importlib.import_module(module), function)(ctx, *args, **kwargs)
