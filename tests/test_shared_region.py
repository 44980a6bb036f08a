"""SharedRegion: anonymous 0600 regions, mapped by peers through /proc, nothing in /dev/shm."""
import os
import stat

import torch

from mooncake_ep_switch.buffer.shared_region import SharedRegion
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
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("mep")]
        torch.distributed.barrier(group=ctx.group)
        return region.endpoint.pid
    finally:
        region.destroy()


def test_regions_are_shared_and_never_named():
    pids = harness.run(4, rank_exchange, 4096)
    assert len(set(pids)) == 4


def test_bad_peer_endpoints_are_rejected():
    import pytest

    from mooncake_ep_switch import _native
    from mooncake_ep_switch.buffer.shared_region import RegionEndpoint

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
