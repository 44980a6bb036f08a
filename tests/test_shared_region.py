"""SharedRegion: anonymous 0600 sealed regions, mapped by peers through /proc, nothing in /dev/shm."""
import fcntl
import os
import stat
import subprocess
import sys

import pytest
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.shared_region import RegionEndpoint, RemoteRegion, SharedRegion, region_tensor
from tests import harness


def rank_exchange(ctx, nbytes):
    region = SharedRegion(ctx.group, ctx.rank, ctx.num_ranks, nbytes)
    try:
        mode = stat.S_IMODE(os.stat(f"/proc/self/fd/{region.fd}").st_mode)
        assert mode == 0o600, oct(mode)
        region.connect()
        # Write our rank into every peer's region at our slot; read everyone's writes locally.
        for peer in range(ctx.num_ranks):
            region.peer(peer)[ctx.rank * 8:(ctx.rank + 1) * 8] = ctx.rank + 1
        torch.distributed.barrier(group=ctx.group)
        seen = [int(region.local[r * 8]) for r in range(ctx.num_ranks)]
        assert seen == [r + 1 for r in range(ctx.num_ranks)], seen
        # No region name in /dev/shm (the etcd test cluster's data directory, mep-etcd-*, may be there).
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("mep_region")]
        torch.distributed.barrier(group=ctx.group)
        return region.endpoint.pid
    finally:
        region.destroy()


def test_regions_are_shared_and_never_named():
    pids = harness.run(4, rank_exchange, 4096)
    assert len(set(pids)) == 4


def test_bad_peer_endpoints_are_rejected():

    region = SharedRegion(None, 0, 2, 4096)
    try:
        with pytest.raises(ValueError, match="expected a region of 4096"):
            region.map_peer(1, RegionEndpoint(os.getpid(), region.fd, 8192))
        with pytest.raises(ValueError, match="bytes, expected nbytes"):
            _native.region_map_peer(os.getpid(), region.fd, 8192)
        with pytest.raises(ValueError, match="expected 0 < pid"):
            _native.region_map_peer(-1, 3, 4096)
        with pytest.raises(FileNotFoundError):
            _native.region_map_peer(os.getpid(), 999_999, 4096)
        region.map_peer(1, RegionEndpoint(os.getpid(), region.fd, 4096))  # maps our own memory again
        region.peer(1)[0] = 42
        assert int(region.local[0]) == 42
    finally:
        region.destroy()


def test_remote_peer_reads_are_bounds_checked_and_registration_ends_with_the_region():
    """A peer on another host is read over the Transfer Engine (here: this process's own engine
    serving a second region); every peer-provided value and every range is checked first."""
    from mooncake_ep_switch.buffer.transport.te_endpoint import TeEndpoint

    mine, peer = SharedRegion(None, 0, 2, 8192), SharedRegion(None, 1, 2, 8192)
    with TeEndpoint(timeout_s=3, log_level="ERROR") as te:
        try:
            with pytest.raises(RuntimeError, match="not registered with a Transfer Engine"):
                mine.set_remote(1, RemoteRegion(te.session_id, peer.base, 8192))
            mine.register_te(te)
            peer.register_te(te)
            mine.register_te(te)  # idempotent
            for bad, match in [(RemoteRegion("nohost", peer.base, 8192), "session"),
                               (RemoteRegion(te.session_id, 0, 8192), "base"),
                               (RemoteRegion(te.session_id, (1 << 64) - 4096, 8192), "base"),
                               (RemoteRegion(te.session_id, peer.base, 4096), "nbytes")]:
                with pytest.raises(ValueError, match=match):
                    mine.set_remote(1, bad)
            with pytest.raises(ValueError, match="rank"):
                mine.set_remote(0, RemoteRegion(te.session_id, peer.base, 8192))
            with pytest.raises(RuntimeError, match="not reached over the Transfer Engine"):
                mine.read_peer(1, [(0, 0, 8)], 1.0)
            mine.set_remote(1, RemoteRegion(te.session_id, peer.base, 8192))
            peer.local[:] = torch.arange(8192, dtype=torch.int64).to(torch.uint8)
            mine.read_peer(1, [(100, 4000, 1000), (0, 8191, 1)], 3.0)
            assert torch.equal(mine.local[100:1100], peer.local[4000:5000]) and int(mine.local[0]) == 8191 % 256
            before = mine.local.clone()
            for ranges in ([(0, 8000, 193)], [(8000, 0, 193)], [(-1, 0, 8)], [(0, 0, 0)], [(0, 0, True)]):
                with pytest.raises(ValueError, match="outside the region"):
                    mine.read_peer(1, ranges, 1.0)
            assert torch.equal(mine.local, before)  # nothing was read
            mine.unmap_peer(1)
            assert mine.remote[1] is None
            assert set(te.registered) == {mine.base, peer.base}
            mine.destroy()
            assert set(te.registered) == {peer.base}  # unregistered before its memory went
        finally:
            mine.destroy()
    peer.destroy()  # after the endpoint closed (it unregistered everything): no error


# ---- region_map_peer maps only sealed memfd regions created by region_create ----

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _holder(fd: int) -> subprocess.Popen:
    """Another process of this user that holds `fd` open (as its fd 0) until killed."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdin=fd)


def _memfd(name: str, nbytes: int, seals: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _regular_file(tmp_path, nbytes: int) -> int:
    path = tmp_path / "victim.bin"
    path.write_bytes(b"\0" * nbytes)
    return os.open(path, os.O_RDWR)


@pytest.mark.parametrize("kind, match", [
    ("regular file", r"is not a region .*a regular file"),
    ("tmpfs file", r"is not a region .*a regular file not sealed"),
    ("unsealed memfd", r"is not a region .*not sealed"),
    ("memfd without grow seal", r"is not a region .*not sealed"),
    ("sealed memfd of another name", r"is not a region .*memfd:other"),
    ("pipe", r"is not a region .*not a regular file but a pipe"),
])
def test_region_map_peer_refuses_what_is_not_a_region(tmp_path, kind, match):
    """A forged (pid, fd) endpoint naming anything but one of our sealed regions is refused,
    whichever process holds it, and nothing of it is mapped or written."""
    nbytes = 4096
    extra = -1
    if kind == "regular file":
        fd = _regular_file(tmp_path, nbytes)
    elif kind == "tmpfs file":  # shared memory too, but a named file, not one of our regions
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        path = f"/dev/shm/victim-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        os.ftruncate(fd, nbytes)
    elif kind == "unsealed memfd":
        fd = _memfd("mep_region", nbytes, 0)
    elif kind == "memfd without grow seal":
        fd = _memfd("mep_region", nbytes, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    elif kind == "sealed memfd of another name":
        fd = _memfd("other", nbytes, _SEALS)
    else:
        fd, extra = os.pipe()
    holder = _holder(fd)
    try:
        for pid, peer_fd in ((holder.pid, 0), (os.getpid(), fd)):
            with pytest.raises(ValueError, match=match) as info:
                _native.region_map_peer(pid, peer_fd, nbytes)
            assert f"/proc/{pid}/fd/{peer_fd}" in str(info.value)
        if kind == "regular file":
            assert (tmp_path / "victim.bin").read_bytes() == b"\0" * nbytes
    finally:
        holder.kill()
        holder.wait(10)
        os.close(fd)
        if extra >= 0:
            os.close(extra)


def test_region_map_peer_refuses_a_dead_pid_and_a_wrong_size():
    region = SharedRegion(None, 0, 2, 4096)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(30)
        with pytest.raises(FileNotFoundError, match=f"/proc/{dead.pid}/fd/{region.fd}"):
            _native.region_map_peer(dead.pid, region.fd, 4096)
        for wrong in (4095, 8192):
            with pytest.raises(ValueError, match=f"has 4096 bytes, expected nbytes = {wrong}"):
                _native.region_map_peer(os.getpid(), region.fd, wrong)
        # The region still maps afterwards, from another process too.
        holder = _holder(region.fd)
        try:
            base = _native.region_map_peer(holder.pid, 0, 4096)
            try:
                region_tensor(base, 4096)[7] = 99
                assert int(region.local[7]) == 99
            finally:
                _native.region_unmap(base, 4096)
        finally:
            holder.kill()
            holder.wait(10)
    finally:
        region.destroy()


def test_regions_are_sealed_against_resizing():
    """No peer (nor the owner) can shrink or grow a region under its mappers."""
    region = SharedRegion(None, 0, 1, 8192)
    try:
        seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
        assert seals & _SEALS == _SEALS, hex(seals)
        assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:mep_region")
        peer = os.open(f"/proc/{os.getpid()}/fd/{region.fd}", os.O_RDWR)
        try:
            for size in (0, 4096, 16384):
                with pytest.raises(PermissionError):
                    os.ftruncate(peer, size)
            with pytest.raises(PermissionError):
                fcntl.fcntl(peer, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(peer).st_size == 8192
        finally:
            os.close(peer)
        region.local[-1] = 5  # the last byte is still there and writable
        assert int(region.local[-1]) == 5
    finally:
        region.destroy()
