"""A memory region every rank of one host can write: anonymous shared memory mapped by all peers.

One mechanism for every one-sided user on a host (the EP region of the shm transport, the unified
weight memory, KV-cache moves). Each rank creates its region with memfd_create (mode 0600): it has
no name, so nothing can ever be left behind in /dev/shm, whatever kills the process. Peers map it
through /proc/<pid>/fd/<fd>, which the kernel allows only to processes of the same user with ptrace
read access; the (pid, fd) endpoint is exchanged through the group (`connect`) or the store
(re-admission of a replacement rank). The memory lives as long as some process maps it. Addresses
never change while the region lives.

Peers on other hosts. Across hosts nothing is mapped: on a Buffer with a Transfer Engine, the
region is registered with the engine (`register_te`), its address is published with its endpoint
(buffer/peer_regions.py), and a peer on another host is *remote* (`set_remote`: the peer engine's
session, the registered address and the size). `read_peer` reads a remote peer's bytes one-sided
over the engine into this rank's region, every range checked against both regions' bounds first.

Mapping lifetime: every mapping (this rank's region, each peer's) is owned by a `Mapping` object,
and every tensor view of it (`local`, `peer(rank)` and anything sliced or viewed from them, such
as `Buffer.get_next_combine_buffer()` or `UnifiedWeights.view()`) holds a reference to that owner
through its storage. `destroy()` and `unmap_peer()` drop the region's own references; the memory
is unmapped when the last view goes, so a tensor a caller still holds stays readable and writable
(it then aliases memory nobody else uses) instead of faulting.
"""
import os
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from mooncake_ep_switch import _native
from mooncake_ep_switch.errors import BufferDestroyed


class Mapping:
    """Owner of one shared mapping `[base, base + nbytes)`: unmapped when the last reference goes.

    Held by a `SharedRegion` and by every tensor made with `region_tensor(..., owner=mapping)`
    (through the tensor's storage), so the memory stays mapped for as long as any view of it lives.

    Arguments:
        base: int address returned by `_native.region_create` / `_native.region_map_peer`.
        nbytes: size of the mapping, > 0.
    """

    __slots__ = ("base", "nbytes")

    def __init__(self, base: int, nbytes: int):
        self.base, self.nbytes = base, nbytes

    def __del__(self):
        base, self.base = self.base, 0
        if base:
            try:
                _native.region_unmap(base, self.nbytes)
            except Exception:  # interpreter shutdown (module gone) or an already unmapped range
                pass


def region_tensor(base: int, nbytes: int, owner: Optional[Mapping] = None) -> torch.Tensor:
    """A torch.uint8 view `[nbytes]` of mapped memory at `base`.

    Arguments:
        base: int address of mapped memory in this process.
        nbytes: bytes to view, > 0.
        owner: the `Mapping` of that memory; the tensor (and every view made of it) keeps it, so the
            memory stays mapped while any of them lives. None: the caller keeps the memory mapped.

    Returns:
        view: `[nbytes]` torch.uint8 CPU tensor aliasing the memory (no copy).
    """
    # torch.frombuffer keeps the MappedBytes (and with it `owner`) alive as long as the storage lives
    return torch.frombuffer(_native.MappedBytes(base, nbytes, owner), dtype=torch.uint8)


class RegionEndpoint(NamedTuple):
    """How a peer on the same host maps a region.

    Fields:
        pid: process id of the owner.
        fd: the owner's file descriptor of the region.
        nbytes: region size.
    """

    pid: int
    fd: int
    nbytes: int


class RemoteRegion(NamedTuple):
    """How a peer on another host is reached: Transfer Engine reads of its registered region.

    Fields:
        session: the peer engine's session id ("host:port").
        base: the region's registered address in the peer's address space.
        nbytes: region size.
    """

    session: str
    base: int
    nbytes: int


def peer_is_current(region, rank: int, endpoint, incarnation: Optional[int]) -> bool:
    """Whether `region` already maps `rank` at `endpoint` as published by `incarnation`; first checks the size.

    Shared by the host (`SharedRegion`) and device (`device_region.DeviceRegion`) regions' `map_peer`.

    Arguments:
        region: the region (its `nbytes`, `peer_bases`, `peer_endpoints` and `peer_incarnations` are read).
        rank: the peer's rank.
        endpoint: the peer's endpoint (a NamedTuple whose `nbytes` is the peer region's size).
        incarnation: the peer's incarnation that published it, or None when unknown (never current then).

    Returns:
        current: bool, True when nothing needs to be (re-)mapped.

    Raises:
        ValueError: the peer's region has another size than `region`.
    """
    if endpoint.nbytes != region.nbytes:
        raise ValueError(f"endpoint: expected a region of {region.nbytes} bytes for rank {rank}, got {endpoint.nbytes}")
    return bool(region.peer_bases[rank] and region.peer_endpoints[rank] == endpoint and incarnation is not None
                and region.peer_incarnations[rank] == incarnation)


class SharedRegion:
    """This rank's region plus mappings of every peer's region of the same size.

    Arguments:
        group: process group used for the endpoint exchange in `connect` (may be None when
            endpoints are exchanged otherwise, e.g. through the store).
        rank: this rank.
        num_ranks: number of ranks.
        nbytes: size of every rank's region, > 0.
    """

    is_device = False  # host memory (`device_region.DeviceRegion` is the device's)

    def __init__(self, group, rank: int, num_ranks: int, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"nbytes: expected > 0, got {nbytes}")
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.nbytes = nbytes
        self.fd, self.base = _native.region_create(nbytes)
        self.endpoint = RegionEndpoint(os.getpid(), self.fd, nbytes)
        self._mappings: List[Optional[Mapping]] = [None] * num_ranks
        self._mappings[rank] = Mapping(self.base, nbytes)
        self.local = region_tensor(self.base, nbytes, self._mappings[rank])
        self.peer_bases: List[int] = [0] * num_ranks
        self.peer_bases[rank] = self.base
        self.peer_endpoints: List[Optional[RegionEndpoint]] = [None] * num_ranks
        self.peer_endpoints[rank] = self.endpoint
        self.peer_incarnations: List[Optional[int]] = [None] * num_ranks  # who published each mapped endpoint
        self._peer_tensors: List[Optional[torch.Tensor]] = [None] * num_ranks
        self._peer_tensors[rank] = self.local
        self.remote: List[Optional[RemoteRegion]] = [None] * num_ranks  # peers reached over the TE
        self.te = None  # the TeEndpoint this region is registered with (peers on other hosts read it)

    @staticmethod
    def endpoint_from(fields) -> RegionEndpoint:
        """A peer's published endpoint fields (pid, fd, nbytes) as a `RegionEndpoint`.

        Arguments:
            fields: sequence of three ints from the store or the group.

        Returns:
            endpoint: a `RegionEndpoint`.

        Raises:
            ValueError: not three ints (e.g. a device region's endpoint).
        """
        fields = list(fields) if isinstance(fields, (list, tuple)) else []
        if len(fields) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in fields):
            raise ValueError(f"endpoint: expected a host region's (pid, fd, nbytes), got {fields!r:.120}")
        return RegionEndpoint(*fields)

    def connect(self, ranks: Optional[List[int]] = None) -> None:
        """Exchange endpoints over `group` and map every peer (or only `ranks`).

        Collective over `group`. Peers already mapped at the same endpoint stay mapped at the same
        address.

        Arguments:
            ranks: the peers to map, or None for every rank of the group.

        Raises:
            ValueError: a peer's region has a different size (see `map_peer`).
        """
        endpoints: List[Optional[RegionEndpoint]] = [None] * self.num_ranks
        dist.all_gather_object(endpoints, tuple(self.endpoint), group=self.group)
        wanted = range(self.num_ranks) if ranks is None else ranks
        for peer in wanted:
            if endpoints[peer] is not None:
                self.map_peer(peer, RegionEndpoint(*endpoints[peer]))
        # Nobody returns (and could destroy its region, closing the fd a slower peer is about to
        # open, or reuse that fd number for a new region) before every rank has mapped.
        dist.barrier(group=self.group)

    def map_peer(self, rank: int, endpoint: RegionEndpoint, incarnation: Optional[int] = None) -> None:
        """Map `rank`'s region at `endpoint`; a different endpoint or incarnation replaces the old.

        No-op for this rank and for a peer already mapped at the same endpoint by the same incarnation.
        (A process that destroyed its Buffer and built a new one can publish the same pid and fd
        number for a different region: the descriptor was reused. The incarnation tells them apart.)

        Arguments:
            rank: the peer's rank.
            endpoint: the peer's `RegionEndpoint` (pid, fd, nbytes).
            incarnation: the peer's incarnation that published `endpoint`, or None when unknown (then
                an equal endpoint is mapped anew).

        Raises:
            ValueError: `endpoint.nbytes` differs from this region's size, or the endpoint does not
                name a region made by `SharedRegion` (a memfd "mep_region" sealed against
                resizing) of that size: a forged endpoint never maps another file of this user.
            FileNotFoundError: no such process or descriptor (e.g. the peer died).
        """
        if rank == self.rank or peer_is_current(self, rank, endpoint, incarnation):
            return
        self.unmap_peer(rank)
        base = _native.region_map_peer(endpoint.pid, endpoint.fd, self.nbytes)
        self._mappings[rank] = Mapping(base, self.nbytes)
        self.peer_bases[rank] = base
        self.peer_endpoints[rank] = endpoint
        self.peer_incarnations[rank] = incarnation

    def register_te(self, te) -> None:
        """Register this region with a Transfer Engine endpoint, so peers on other hosts can read it.

        Idempotent for the same endpoint; `destroy()` unregisters it before the memory goes.

        Arguments:
            te: a `TeEndpoint` (the Buffer's, `OneSidedTransport.te`).

        Raises:
            RuntimeError: the region is destroyed, or already registered with another endpoint.
        """
        if not self.base:
            raise BufferDestroyed("register_te: the region is destroyed")
        if self.te is te:
            return
        if self.te is not None:
            raise RuntimeError("register_te: the region is registered with another Transfer Engine endpoint")
        te.register(self.base, self.nbytes)
        self.te = te

    def set_remote(self, rank: int, remote: RemoteRegion) -> None:
        """Reach `rank`'s region over the Transfer Engine at `remote` (a peer on another host).

        Drops a shared-memory mapping of `rank` if there is one (a replacement on another host).

        Arguments:
            rank: the peer's rank (not this rank).
            remote: the peer's `RemoteRegion` (validated here: a session str, an address >= 1 with
                `address + nbytes` inside 64 bits, this region's size).

        Raises:
            ValueError: a bad rank or `remote`, naming what was expected.
            RuntimeError: this region is not registered with a Transfer Engine (`register_te`).
        """
        if not isinstance(rank, int) or not 0 <= rank < self.num_ranks or rank == self.rank:
            raise ValueError(f"rank: expected a peer rank in [0, {self.num_ranks}) other than {self.rank}, got {rank!r}")
        if self.te is None:
            raise RuntimeError(f"set_remote: rank {rank} is on another host, but this region is not registered with "
                               "a Transfer Engine (a Buffer on the 'mooncake' transport registers it)")
        session, base, nbytes = remote
        if not isinstance(session, str) or not session.rpartition(":")[0]:
            raise ValueError(f"remote.session: expected 'host:port', got {session!r} for rank {rank}")
        if isinstance(base, bool) or not isinstance(base, int) or not 1 <= base or base + self.nbytes > 1 << 64:
            raise ValueError(f"remote.base: expected an address >= 1 with {self.nbytes} bytes after it inside 64 "
                             f"bits, got {base!r} for rank {rank}")
        if nbytes != self.nbytes:
            raise ValueError(f"remote.nbytes: expected a region of {self.nbytes} bytes for rank {rank}, got {nbytes!r}")
        self.unmap_peer(rank)
        self.remote[rank] = RemoteRegion(session, base, nbytes)

    def read_peer(self, rank: int, ranges, timeout_s: float) -> None:
        """Copy ranges of a remote peer's region into this region, one-sided over the Transfer Engine.

        Arguments:
            rank: a peer set with `set_remote`.
            ranges: (local_offset, remote_offset, nbytes) int tuples, offsets into this region and
                the peer's; every range must lie inside both regions (nbytes >= 1).
            timeout_s: deadline in seconds for all of them, > 0.

        Raises:
            ValueError: a range outside either region (nothing is read).
            RuntimeError: `rank` is not reached over the Transfer Engine, or the region is destroyed.
            ConnectionError / TimeoutError: the read failed or missed the deadline (the local
                ranges may be partly written).
        """
        remote = self.remote[rank] if isinstance(rank, int) and 0 <= rank < self.num_ranks else None
        if remote is None or self.te is None or not self.base:
            raise RuntimeError(f"read_peer: rank {rank!r} is not reached over the Transfer Engine from rank {self.rank}")
        locals_, remotes, lengths = [], [], []
        for index, (local_offset, remote_offset, nbytes) in enumerate(ranges):
            for name, offset in (("local_offset", local_offset), ("remote_offset", remote_offset)):
                if (isinstance(offset, bool) or not isinstance(offset, int) or isinstance(nbytes, bool)
                        or not isinstance(nbytes, int) or nbytes < 1 or offset < 0 or offset + nbytes > self.nbytes):
                    raise ValueError(f"ranges[{index}]: {name}={offset!r} with nbytes={nbytes!r} is outside the "
                                     f"region of {self.nbytes} bytes")
            locals_.append(self.base + local_offset)
            remotes.append(remote.base + remote_offset)
            lengths.append(nbytes)
        self.te.read_batch(remote.session, locals_, remotes, lengths, timeout_s=timeout_s)

    def peer(self, rank: int) -> torch.Tensor:
        """torch.uint8 `[nbytes]` view of `rank`'s region as mapped here (writes land in the peer).

        Arguments:
            rank: any rank; this rank gives `local`.

        Returns:
            view: `[nbytes]` torch.uint8 CPU tensor aliasing the mapping (cached); it keeps the
                mapping alive, also after `unmap_peer(rank)` or `destroy()`.

        Raises:
            RuntimeError: `rank` is not mapped.
        """
        if not self.peer_bases[rank]:
            raise RuntimeError(f"rank: peer {rank} is not mapped")
        if self._peer_tensors[rank] is None:
            self._peer_tensors[rank] = region_tensor(self.peer_bases[rank], self.nbytes, self._mappings[rank])
        return self._peer_tensors[rank]

    def unmap_peer(self, rank: int) -> None:
        """Drop the mapping of one peer (a dead rank's memory is released once nobody maps it).

        No-op for this rank and for a peer not mapped. The region forgets the peer at once; the
        memory is unmapped when the last view from `peer(rank)` goes (at once if there is none).

        Arguments:
            rank: the peer's rank.
        """
        if rank != self.rank:
            self.remote[rank] = None
        if rank != self.rank and self.peer_bases[rank]:
            self._peer_tensors[rank] = None
            self._mappings[rank] = None  # munmap now, or when the last view goes
            self.peer_bases[rank] = 0
            self.peer_endpoints[rank] = None

    def destroy(self) -> None:
        """Drop every mapping and close the descriptor; idempotent.

        The region forgets its addresses at once (`base` and `peer_bases` become 0); each mapping
        is unmapped when the last tensor viewing it goes (at once if there is none), so a view a
        caller still holds stays valid memory.
        """
        te, self.te = self.te, None
        if te is not None and self.base:  # peers stop reading it before the memory can go
            try:
                te.unregister(self.base)
            except (KeyError, RuntimeError):  # the endpoint closed first (it unregistered everything)
                pass
        for peer in range(self.num_ranks):
            self.unmap_peer(peer)
        self._peer_tensors = [None] * self.num_ranks
        self.local = None
        if self.base:
            self._mappings[self.rank] = None
            self.peer_bases[self.rank] = 0
            self.base = 0
        if self.fd >= 0:
            _native.region_close_fd(self.fd)
            self.fd = -1
