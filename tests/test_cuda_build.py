"""The CUDA data plane is built and refuses cleanly where it cannot run (these run on every machine).

setup.py compiles csrc/cuda/ with nvcc whenever nvcc is on the PATH (CI has it, with no GPU and no
driver); a compile error fails the install, and these tests fail if the module is missing. On a
machine without a device, the "cuda" transport must say why and "auto" must keep choosing "shm".
"""
import shutil
import struct
from pathlib import Path

import pytest
import torch

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.buffer.transport import cuda as cuda_transport
from tests import harness

NVCC = shutil.which("nvcc")



@pytest.mark.skipif(NVCC is None, reason="no CUDA device")  # a machine without nvcc has none either
def test_cuda_module_was_built_with_hopper_code():
    from mooncake_ep_switch import _cuda

    assert _cuda.device_count() >= 0
    assert isinstance(_cuda.device_status(), str)
    for name in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "ipc_open", "check_values"):
        assert callable(getattr(_cuda, name)), name
    # The module carries machine code for the H100/H200 (sm_90) and the A100 (sm_80), and PTX.
    entries = _fatbin_entries(Path(_cuda.__file__).read_bytes())
    assert ("elf", 90) in entries and ("elf", 80) in entries and ("ptx", 90) in entries, entries


def _fatbin_entries(data: bytes) -> set:
    """(kind, arch) of every entry of the CUDA fat binaries embedded in a shared object.

    A fat binary starts with the magic 0xBA55ED50, a 2-byte version, a 2-byte header size and an
    8-byte payload size; each entry has a 2-byte kind (1 = PTX, 2 = ELF machine code), a 4-byte
    header size at offset 4, an 8-byte payload size at offset 8 and the architecture (e.g. 90) at
    offset 28.
    """
    found, at = set(), data.find(struct.pack("<I", 0xBA55ED50))
    while at >= 0:
        header_size, size = struct.unpack_from("<HQ", data, at + 6)
        entry, end = at + header_size, at + header_size + size
        while entry < end:
            kind, entry_header, entry_size = struct.unpack_from("<HxxIQ", data, entry)
            found.add(({1: "ptx", 2: "elf"}.get(kind, kind), struct.unpack_from("<I", data, entry + 28)[0]))
            entry += entry_header + entry_size
        at = data.find(struct.pack("<I", 0xBA55ED50), at + 4)
    return found


def test_scratch_sizes_are_validated_shapes():
    """The native layout helper agrees with the region layout's shapes (a pure host function)."""
    if cuda_transport._cuda is None:
        pytest.fail("mooncake_ep_switch._cuda is missing: the package was installed without nvcc")
    one = cuda_transport._cuda.dispatch_scratch_bytes(2, 128, 7168, 32, 8)
    more = cuda_transport._cuda.dispatch_scratch_bytes(2, 256, 7168, 32, 8)
    assert one > 0 and more > one and one % 256 == 0


def rank_cuda_refused(ctx):
    """Where no device is usable: "cuda" raises naming the reason; "auto" picks "shm"."""
    reason = cuda_transport.cuda_unavailable_reason()
    size = Buffer.get_ep_buffer_size_hint(8, 128, ctx.num_ranks, 2 * ctx.num_ranks)
    with Buffer(ctx.group, size, transport="host") as buffer:  # "auto" without cuda, on any machine
        assert buffer.transport == "shm" and buffer.device is None
    if reason:
        with pytest.raises(RuntimeError, match="transport: 'cuda' cannot run here"):
            Buffer(ctx.group, size, transport="cuda")
        with Buffer(ctx.group, size) as buffer:
            assert buffer.transport == "shm" and buffer.device is None
            # A CUDA tensor to a host Buffer: a clear error naming x (a meta tensor stands in for one here).
            with pytest.raises(ValueError, match="x: expected a CPU tensor"):
                buffer.dispatch(torch.empty((1, 128), dtype=torch.bfloat16, device="meta"),
                                torch.zeros((1, 1), dtype=torch.int64), buffer.active_mask(), 8, 2 * ctx.num_ranks, -1)
    return reason


def test_cuda_transport_refuses_without_a_device():
    reasons = harness.run(2, rank_cuda_refused)
    assert len(set(reasons)) == 1
