"""One-sided writes into (and reads from) peers' registered memory over the Mooncake Transfer Engine (TE).

`TeEndpoint` is the put primitive of the `mooncake` transport (docs/protocol.md): it owns one
`mooncake.engine.TransferEngine` in P2PHANDSHAKE mode (no etcd; peers are addressed by the
"host:port" session id of their engine), registers local memory so that peers can write into it,
and performs synchronous writes that always return within a deadline.

What the Transfer Engine does underneath (handshakes, busy-polling, ordering, reads, failures) and
why this class looks the way it does: docs/transports.md, "How the Transfer Engine behaves".
"""
from __future__ import annotations

import atexit
import socket
import threading
import time
import weakref
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.transport.sockets import (abort_connections, listening, parse_session,
                                                        socket_inodes)
from mooncake_ep_switch.config import set_transfer_engine_defaults
from mooncake_ep_switch.errors import PeerBusy, TransferFailed  # noqa: F401 (re-exported)
from mooncake_ep_switch.checks import check_int

__all__ = ["PeerBusy", "PeerWrite", "TransferFailed", "TeEndpoint", "load_transfer_engine"]


# PeerBusy and TransferFailed live in errors.py (one hierarchy), re-exported here.


class _Abandoned(NamedTuple):
    """A batch abandoned at a deadline that TE still owns: it may land at any time until reaped."""

    batch_id: int
    peer: str
    nbytes: int  # 0: a handshake (writes nothing)
    local: Tuple[int, int]  # a read's destination range here [lo, hi); (0, 0) for a write


class PeerWrite(NamedTuple):
    """The writes `TeEndpoint.write_each` makes to one peer: `data` first, then `signal`.

    Each range is (local_addr, remote_addr, nbytes). The ranges of `data` land in no particular
    order among themselves; `signal` is submitted only once every `data` range completed, so a
    peer that sees a signal also sees the data before it (the protocol's "data, then signal").
    """

    peer_session: str
    data: Sequence[Tuple[int, int, int]]
    signal: Sequence[Tuple[int, int, int]]

_WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}
SETTLE_S = 0.005  # how long a transfer waits for abandoned ones with its peer to finish before PeerBusy
SPIN_MAX_BYTES = 256 << 10  # write_each spins (spin_s) only when its data is at most this many bytes
REAPER_PERIOD_S = 0.02  # while the engine is destroyed: how often inbound handshakes are shut down
REAPER_MAX_S = 600.0  # the longest the reaper waits for a helper thread that still holds the engine
# An engine still not destroyed this long after close() has the reaper write to stderr what each thread of
# the process waits in (its destructor may hold the GIL, so only a native thread can say; issue 28 item 1).
REAPER_REPORT_AFTER_S = 10.0
_MAX_BATCH_ID = 1 << 63
_LIVE: "weakref.WeakSet[TeEndpoint]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # A thread still inside a TE call when the interpreter finalizes aborts the process
    # (std::terminate from pybind11), so end handshakes and release engines first.
    for endpoint in list(_LIVE):
        try:
            endpoint.close(reap_timeout_s=0.5)
        except Exception:
            pass


def load_transfer_engine():
    """The `TransferEngine` class, or ImportError that says what is missing.

    Returns:
        engine_class: `mooncake.engine.TransferEngine` (the class, not an instance).

    Raises:
        ImportError: the package or its system libraries are missing (the message says which to install).
    """
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:  # libibverbs1 / libnuma1 missing, or package not installed
        raise ImportError(
            "the Mooncake Transfer Engine cannot be imported (`from mooncake.engine import "
            "TransferEngine` failed: %s). Install `mooncake-transfer-engine-non-cuda` (or "
            "`mooncake-transfer-engine`) and its system libraries (libibverbs1, libnuma1)." % exc
        ) from exc
    return TransferEngine


class TeEndpoint:
    """One Transfer Engine: register local memory, write synchronously into peers' memory.

    Arguments:
        bind_host: address advertised to peers (the host part of `session_id`). Must be a
            concrete address peers can reach; a wildcard is rejected. See the module docstring
            for what TE really binds.
        protocol: TE transport, "tcp" here ("rdma" where NICs exist).
        device_name: comma-separated NIC filter for RDMA, "" for all.
        timeout_s: default deadline of `write`/`write_batch` (seconds, > 0).
        require_registered_source: check that every source range lies in memory registered
            with this endpoint (needed for RDMA, not for TCP).
        tcp_stall_timeout_s: if given, sets MC_TCP_PROGRESS_TIMEOUT_SEC and
            MC_TCP_STATUS_TIMEOUT_SEC (unless already set) before the engine starts, so that TE
            itself gives up on a stalled peer (and releases abandoned writes) after that long.
        log_level: if given ("INFO", "WARNING", "ERROR"), sets MC_LOG_LEVEL (unless already set)
            before the engine starts; TE logs to stderr through glog.
        tcp_lanes_per_peer: if given (>= 1), sets MC_TCP_LANES_PER_PEER (unless already set)
            before the engine starts: how many TCP connections TE opens to one peer (1-16, its default 4).
        spin_s: how long a write polls for completion without sleeping before it starts
            sleeping between polls (10% of the time waited, 50 us to 2 ms).
    """

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        *,
        timeout_s: float = 5.0,
        require_registered_source: bool = True,
        tcp_stall_timeout_s: Optional[int] = None,
        log_level: Optional[str] = None,
        spin_s: float = 0.0003,
        tcp_lanes_per_peer: Optional[int] = None,
    ) -> None:
        if not isinstance(bind_host, str) or bind_host.strip() in _WILDCARDS:
            raise ValueError(
                f"bind_host must be a concrete address peers can reach, got {bind_host!r}")
        if ":" in bind_host and not bind_host.startswith("["):
            if bind_host.count(":") == 1:
                raise ValueError(
                    f"bind_host takes no port ({bind_host!r}): in P2PHANDSHAKE mode TE picks the "
                    "port itself (see session_id)")
        if not (timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.bind_host = bind_host.strip()
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        self.require_registered_source = bool(require_registered_source)
        self.spin_s = float(spin_s)
        if tcp_stall_timeout_s is not None:
            tcp_stall_timeout_s = check_int("tcp_stall_timeout_s", tcp_stall_timeout_s, 1)
        if tcp_lanes_per_peer is not None:
            tcp_lanes_per_peer = check_int("tcp_lanes_per_peer", tcp_lanes_per_peer, 1, 16)  # TE caps it at 16
        set_transfer_engine_defaults(tcp_stall_timeout_s, log_level, tcp_lanes_per_peer)

        self._engine = None
        self._closed = True  # until the engine is up
        engine_class = load_transfer_engine()
        self._lock = threading.RLock()
        self._regions: Dict[int, int] = {}  # base -> nbytes
        self._opened: Set[str] = set()  # peers whose handshake completed
        self._opening: Dict[str, threading.Event] = {}  # peers with a handshake in a helper thread
        self._orphans: List[_Abandoned] = []  # batches abandoned at a deadline, still owned by TE

        sockets_before = socket_inodes()
        engine = engine_class()
        ret = engine.initialize(self.bind_host, "P2PHANDSHAKE", protocol, device_name)
        if ret != 0:
            raise RuntimeError(
                f"TransferEngine.initialize({self.bind_host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) failed with {ret}; see the engine's log on stderr")
        self._engine = engine
        self._closed = False
        self._engine_inodes = socket_inodes() - sockets_before
        self.rpc_port = int(engine.get_rpc_port())
        host = self.bind_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.session_id = f"{host}:{self.rpc_port}"
        _LIVE.add(self)

    # ------------------------------------------------------------------ introspection

    @property
    def listen_addresses(self) -> List[str]:
        """What the engine's listening sockets are bound to ('addr:port'), from /proc.

        Returns:
            addresses: sorted list of str, e.g. "0.0.0.0:15123" or "[::]:15124".
        """
        return listening(self._engine_inodes)

    @property
    def registered(self) -> Dict[int, int]:
        """A copy of the registered regions, base -> nbytes.

        Returns:
            regions: dict int address -> int bytes (a copy; changing it changes nothing).
        """
        with self._lock:
            return dict(self._regions)

    @property
    def num_abandoned(self) -> int:
        """Writes abandoned at a deadline that TE has not finished yet.

        Reaps the ones TE has finished first (while the engine is open).

        Returns:
            count: int, abandoned batches still in flight.
        """
        with self._lock:
            if self._engine is not None:
                self._reap()
            return len(self._orphans)

    def abandoned_with(self, peer_session: str) -> int:
        """Transfers to or from `peer_session` abandoned at a deadline that TE has not finished yet.

        While this is non-zero every new write to (or read from) that peer raises `PeerBusy`: an
        abandoned write may still land over newer bytes. Reaps finished ones first.

        Arguments:
            peer_session: the peer engine's session id, "host:port".

        Returns:
            count: int, abandoned transfers that move bytes (handshakes excluded) still in flight.
        """
        with self._lock:
            if self._engine is not None:
                self._reap()
            return self._abandoned_count(peer_session)

    def reading_into(self, addr: int, nbytes: int) -> bool:
        """Whether an abandoned read may still land in local [addr, addr + nbytes).

        Memory for which this is True must not be reused for anything that is read later (a
        staging frame, a scratch word) until it turns False. Reaps finished reads first.

        Arguments:
            addr: int local address, >= 1.
            nbytes: int bytes, >= 1.

        Returns:
            busy: bool.
        """
        addr = check_int("addr", addr, 1)
        nbytes = check_int("nbytes", nbytes, 1)
        with self._lock:
            if self._engine is not None:
                self._reap()
            return self._reading_into(addr, addr + nbytes)

    def wait_reaped(self, peer_session: str, timeout_s: float) -> int:
        """Wait until no transfer abandoned with `peer_session` is in flight, or `timeout_s` passed.

        Arguments:
            peer_session: the peer engine's session id, "host:port".
            timeout_s: seconds to wait, >= 0.

        Returns:
            count: int, abandoned transfers with that peer still in flight (0: the peer may be used).
        """
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        while True:
            left = self.abandoned_with(peer_session)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ memory

    def register(self, base: int, nbytes: int) -> None:
        """Register [base, base + nbytes) so that peers can write into it.

        Arguments:
            base: int address, >= 1.
            nbytes: int bytes, >= 1.

        Raises:
            TypeError: a non-integer argument.
            ValueError: a bad value, or an overlap with a registered region.
            RuntimeError: the endpoint is closed, or TE refused the registration.
        """
        base = check_int("base", base, 1)
        nbytes = check_int("nbytes", nbytes, 1)
        with self._lock:
            self._check_open()
            for other, size in self._regions.items():
                if base < other + size and other < base + nbytes:
                    raise ValueError(
                        f"[{base:#x}, {base + nbytes:#x}) overlaps the registered region "
                        f"[{other:#x}, {other + size:#x})")
            ret = self._engine.register_memory(base, nbytes)
            if ret != 0:
                raise RuntimeError(f"TransferEngine.register_memory({base:#x}, {nbytes}) failed with {ret}")
            self._regions[base] = nbytes

    def unregister(self, base: int) -> None:
        """Unregister the region registered at `base`; later writes into it are rejected.

        Arguments:
            base: int address a region was registered at.

        Raises:
            KeyError: no region is registered at `base`.
            RuntimeError: the endpoint is closed, or TE reported a failure (the region is
                forgotten anyway).
        """
        base = check_int("base", base, 1)
        with self._lock:
            self._check_open()
            if base not in self._regions:
                raise KeyError(f"no region registered at {base:#x}")
            ret = self._engine.unregister_memory(base)
            del self._regions[base]
            if ret != 0:
                raise RuntimeError(f"TransferEngine.unregister_memory({base:#x}) failed with {ret}")

    # ------------------------------------------------------------------ writes

    def connect(self, peer_session: str, timeout_s: Optional[float] = None) -> None:
        """Handshake with a peer now (a zero-length write), so later writes never handshake.

        Best done for every peer while all are known healthy (set-up, membership change): TE
        handshakes under an engine-wide lock, so a first contact with a hung peer holds up every
        other write of this endpoint until it is aborted at the deadline of the call that
        started it, whereas a connected peer that dies or hangs later only fails the writes
        addressed to it. Errors as `write`.

        Arguments:
            peer_session: the peer engine's session id, "host:port".
            timeout_s: deadline in seconds (> 0), or None for the endpoint's `timeout_s`.
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not (timeout > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout
        parse_session(peer_session)
        with self._lock:
            self._check_open()
            self._reap()
        pending = [self._submit(peer_session, 1, 1, 0, deadline)]
        try:
            self._wait(peer_session, pending, deadline)
        except BaseException:
            self._abandon(peer_session, pending, 0)
            raise

    def is_connected(self, peer_session: str) -> bool:
        """Whether the handshake with this peer has been done (it may have died since).

        Arguments:
            peer_session: the peer engine's session id, "host:port".

        Returns:
            connected: bool.
        """
        with self._lock:
            return peer_session in self._opened

    def write(self, peer_session: str, local_addr: int, remote_addr: int, nbytes: int,
              timeout_s: Optional[float] = None) -> None:
        """Copy [local_addr, +nbytes) into the peer's [remote_addr, +nbytes); returns when done.

        Raises ConnectionRefusedError if the peer's engine is gone, TransferFailed (a ConnectionError)
        if the peer is reachable but the write failed (typically: the remote range is not inside memory
        the peer registered; or the first write after TE lost its connection to the peer), TimeoutError
        if it did not finish within `timeout_s` (the write may still land later: treat the peer as
        failed), PeerBusy (a ConnectionError, nothing submitted) while transfers abandoned with that
        peer are still in flight. Bad arguments raise TypeError/ValueError, a closed endpoint
        RuntimeError.

        Arguments:
            peer_session: the peer engine's session id, "host:port".
            local_addr: int source address, >= 1 (inside a registered region when
                `require_registered_source`).
            remote_addr: int destination address in the peer's address space, >= 1.
            nbytes: int bytes, >= 1.
            timeout_s: deadline in seconds (> 0), or None for the endpoint's `timeout_s`.
        """
        self.write_batch(peer_session, [local_addr], [remote_addr], [nbytes], timeout_s)

    def write_batch(self, peer_session: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
                    lengths: Sequence[int], timeout_s: Optional[float] = None) -> None:
        """Several writes to one peer, all finished on return (no order among them is implied:
        to order a signal after data, call again after this returns). Errors as `write`.

        Arguments:
            peer_session: the peer engine's session id, "host:port".
            local_addrs: int source addresses, >= 1 each.
            remote_addrs: int destination addresses in the peer's address space, one per source.
            lengths: int bytes per range, >= 1 each; the three sequences have one equal, non-zero length.
            timeout_s: deadline in seconds for the whole batch (> 0), or None for the endpoint's `timeout_s`.
        """
        self._batch(peer_session, local_addrs, remote_addrs, lengths, timeout_s, read=False)

    def read_batch(self, peer_session: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
                   lengths: Sequence[int], timeout_s: Optional[float] = None) -> None:
        """Copy the peer's [remote_addr, +nbytes) ranges into local memory; all finished on return.

        A one-sided read (the peer's process does nothing): the peer must have registered the
        remote ranges, and the local ranges must lie in memory registered here. Handshakes first
        if the peer was never contacted (`connect`). Errors as `write`: ConnectionRefusedError
        (the peer's engine is gone), TransferFailed (typically a remote range outside the
        peer's registered memory: TE refuses it, nothing is read), TimeoutError (the reads may
        still land later: do not use the local ranges as complete, and `reading_into` says when
        they may be reused), PeerBusy (nothing submitted) while transfers abandoned with that
        peer, or reads abandoned into the same local bytes, are still in flight.

        Arguments:
            peer_session: the peer engine's session id, "host:port".
            local_addrs: int destination addresses here, >= 1 each, inside registered memory.
            remote_addrs: int source addresses in the peer's address space, one per destination.
            lengths: int bytes per range, >= 1 each; the three sequences have one equal, non-zero length.
            timeout_s: deadline in seconds for the whole batch (> 0), or None for the endpoint's `timeout_s`.
        """
        self._batch(peer_session, local_addrs, remote_addrs, lengths, timeout_s, read=True)

    def _batch(self, peer_session: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
               lengths: Sequence[int], timeout_s: Optional[float], read: bool) -> None:
        """`write_batch` (read=False) or `read_batch` (read=True): checks, submits, waits with one deadline."""
        what = "read" if read else "write"
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not (timeout > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout
        parse_session(peer_session)
        local_addrs, remote_addrs, lengths = list(local_addrs), list(remote_addrs), list(lengths)
        if not (len(local_addrs) == len(remote_addrs) == len(lengths)):
            raise ValueError(
                f"local_addrs, remote_addrs and lengths differ in length "
                f"({len(local_addrs)}, {len(remote_addrs)}, {len(lengths)})")
        if not lengths:
            raise ValueError(f"{what}_batch needs at least one range")
        entries = [(check_int(f"local_addrs[{i}]", local, 1), check_int(f"remote_addrs[{i}]", remote, 1),
                    check_int(f"lengths[{i}]", size, 1))
                   for i, (local, remote, size) in enumerate(zip(local_addrs, remote_addrs, lengths))]
        with self._lock:
            self._check_open()
            # A read lands here: never outside registered memory. A write's source must be registered
            # when require_registered_source (RDMA needs it).
            if read or self.require_registered_source:
                for local, _, size in entries:
                    self._check_local(local, size)
        self._settle([peer_session], entries if read else (), deadline)
        with self._lock:
            self._check_not_busy(peer_session, entries if read else ())
        if read and not self.is_connected(peer_session):
            self.connect(peer_session, max(0.001, deadline - time.monotonic()))
        pending: List[int] = []
        ranges: Dict[int, Tuple[int, int]] = {}  # batch id -> (local address, bytes)
        try:
            for local, remote, size in entries:
                pending.append(self._submit(peer_session, local, remote, size, deadline, read=read))
                ranges[pending[-1]] = (local, size)
            self._wait(peer_session, pending, deadline, what)
        except BaseException:
            self._abandon(peer_session, pending, ranges, read=read)
            raise

    def write_each(self, writes: Sequence[PeerWrite], timeout_s: Optional[float] = None,
                   in_flight: Optional[Callable[[], None]] = None) -> Dict[int, Exception]:
        """Write to several peers at once, each its data then its signal; one peer's failure or
        slowness never delays the others beyond the shared deadline.

        Every peer's data ranges are submitted before any completion is awaited; a peer's signal
        ranges are submitted as soon as its own data completed. A peer whose write fails, or does not
        finish by the deadline, is reported and the rest go on (what it had in flight may still land
        later: treat that peer as failed). Bad arguments raise before anything is submitted.

        Arguments:
            writes: one `PeerWrite` per peer (a peer at most once); ranges as (local_addr >= 1,
                remote_addr >= 1, nbytes >= 1), local ranges inside registered memory when
                `require_registered_source`.
            timeout_s: deadline in seconds for all of them (> 0), or None for the endpoint's `timeout_s`.
            in_flight: work to overlap with the transfers: called once, after every peer's data ranges
                were submitted and before any completion is awaited (an exception from it propagates
                once what was submitted has finished, or at the deadline: what is still in flight then
                is left to TE and reaped later, like a write abandoned at a deadline).

        Returns:
            failures: dict index into `writes` -> the exception `write` would have raised for that
                peer (ConnectionRefusedError, TransferFailed, ConnectionError, TimeoutError, or PeerBusy when
                nothing was submitted to it because earlier abandoned writes to it are still in flight);
                empty when all landed.

        Raises:
            TypeError / ValueError: a malformed write (names the write and range); RuntimeError: closed.
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not (timeout > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout
        phases: List[List[List[Tuple[int, int, int]]]] = []
        seen = set()
        for index, write in enumerate(writes):
            if not isinstance(write, PeerWrite):
                raise TypeError(f"writes[{index}] must be a PeerWrite, got {type(write).__name__}")
            parse_session(write.peer_session)
            if write.peer_session in seen:
                raise ValueError(f"writes[{index}]: peer {write.peer_session} appears twice")
            seen.add(write.peer_session)
            checked = []
            for part in ("data", "signal"):
                ranges = []
                for j, entry in enumerate(getattr(write, part)):
                    if len(entry) != 3:
                        raise ValueError(f"writes[{index}].{part}[{j}] must be (local_addr, remote_addr, nbytes)")
                    ranges.append((check_int(f"writes[{index}].{part}[{j}] local_addr", entry[0], 1),
                                   check_int(f"writes[{index}].{part}[{j}] remote_addr", entry[1], 1),
                                   check_int(f"writes[{index}].{part}[{j}] nbytes", entry[2], 1)))
                checked.append(ranges)
            phases.append(checked)
        with self._lock:
            self._check_open()
            if self.require_registered_source:
                for data, signal in phases:
                    for src, _, size in data + signal:
                        self._check_local(src, size)
        self._settle([write.peer_session for write in writes], (), deadline)
        with self._lock:
            busy = {index: self._busy_error(write.peer_session) for index, write in enumerate(writes)}

        failures: Dict[int, Exception] = {}
        rejected: Dict[int, str] = {}  # index -> what failed (classified after the others finished)
        pending: Dict[int, List[int]] = {}
        stage: Dict[int, int] = {}  # index -> 0 data in flight, 1 signal in flight
        # Peers already handshaken first: a first contact may have to wait for TE's handshake.
        order = sorted(range(len(phases)), key=lambda i: not self.is_connected(writes[i].peer_session))

        def submit(index: int, part: int) -> None:
            ids = pending.setdefault(index, [])
            stage[index] = part
            try:
                for src, dst, size in phases[index][part]:
                    ids.append(self._submit(writes[index].peer_session, src, dst, size, deadline))
            except (ConnectionError, TimeoutError) as exc:
                drop(index, exc)

        def drop(index: int, exc: Optional[Exception], what: str = "") -> None:
            self._abandon(writes[index].peer_session, pending.pop(index, []), 1)
            stage.pop(index, None)
            if exc is not None:
                failures[index] = exc
            else:
                rejected[index] = what

        for index, error in busy.items():
            if error is not None:  # nothing was submitted to it: it is not waited for either
                failures[index] = error
        order = [index for index in order if busy[index] is None]
        try:
            for index in order:
                submit(index, 0)
            if in_flight is not None:
                in_flight()
            started = progress = time.monotonic()
            # Spinning only pays for writes that can finish within it: a large one leaves the core to
            # the engine's I/O thread, which has the bytes to move (2 cores: the spin slowed it down).
            small = sum(size for data, _ in phases for _, _, size in data) <= SPIN_MAX_BYTES
            spin_until = started + (self.spin_s if small else 0.0)
            check = self._engine.transfer_check_status
            while stage:
                for index in list(stage):
                    ids = pending[index]
                    for k in range(len(ids) - 1, -1, -1):
                        status = check(ids[k])
                        if status == 1:
                            ids.pop(k)
                            progress = time.monotonic()
                        elif status != 0:  # -1 failed (freed by TE), -2 TE-level timeout (kept by TE)
                            ids.pop(k)
                            peer = writes[index].peer_session
                            drop(index, None, f"a TE write to {peer} failed" if status == -1
                                 else f"a TE write to {peer} timed out inside TE ({status})")
                            break
                    if index in stage and not ids:
                        if stage[index] == 0:
                            submit(index, 1)
                        if index in stage and not pending[index]:
                            stage.pop(index)
                            pending.pop(index)
                if not stage:
                    break
                now = time.monotonic()
                if now >= deadline:
                    for index in list(stage):
                        count = len(pending.get(index, ()))
                        drop(index, TimeoutError(
                            f"{count} TE write(s) to {writes[index].peer_session} did not complete before the "
                            "deadline (peer hung or overloaded); they may still land later"))
                    break
                if now < spin_until:
                    continue
                # Back off relative to the last completion, not the start: the 8-byte signal that follows
                # a long data write lands in ~0.1 ms and should not wait out a pause sized by the data.
                pause = min(0.001, max(0.00005, 0.05 * (now - progress)))
                time.sleep(min(pause, max(0.0, deadline - now)))
        except BaseException as error:
            # An exception (from `in_flight`, say) while writes are in flight: let them finish within
            # the call's deadline first, so that the peer is not left busy (PeerBusy) by writes that
            # were about to complete; only what is still in flight at the deadline is abandoned.
            if isinstance(error, Exception):
                self._finish_within(pending, deadline)
            for index, ids in pending.items():
                self._abandon(writes[index].peer_session, ids, 1)
            raise
        for index, what in rejected.items():
            failures[index] = self._failure_error(writes[index].peer_session, what,
                                                  max(0.05, min(0.5, deadline - time.monotonic())))
        return failures

    # ------------------------------------------------------------------ lifecycle

    def close(self, reap_timeout_s: float = 2.0) -> None:
        """Unregister everything and release the engine (its sockets and threads).

        Waits up to `reap_timeout_s` for abandoned writes and pending handshakes to end first.
        Idempotent. Takes about 1 s: the engine's destructor waits that long for its I/O threads;
        a peer that stopped or stalls in the middle of a handshake with this engine does not extend
        it (its connection is shut down while the engine is destroyed).

        Arguments:
            reap_timeout_s: seconds to wait for abandoned writes and handshakes (a handshake still
                pending then has its socket shut down).

        Raises:
            RuntimeError: TE failed to unregister some region (the engine is released anyway).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + max(0.0, reap_timeout_s)
        with self._lock:
            opening = list(self._opening.items())
        for peer, event in opening:
            if not event.wait(max(0.0, deadline - time.monotonic())):
                abort_connections(peer)
                event.wait(0.5)
        with self._lock:
            self._reap()
        while self._orphans and time.monotonic() < deadline:
            time.sleep(0.01)
            with self._lock:
                self._reap()
        with self._lock:
            errors = []
            for base in list(self._regions):
                ret = self._engine.unregister_memory(base)
                if ret != 0:
                    errors.append((base, ret))
            self._regions.clear()
            engine, self._engine = self._engine, None
        # A helper thread still inside TE holds its own reference, so the engine is destroyed
        # when the last user lets go, never under a running call. The destructor joins TE's
        # handshake listener, which reads one inbound handshake at a time with a 5 s timeout per
        # read: a peer stopped (or trickling bytes) mid-handshake would hold it, and the GIL, for as
        # long as it likes. A native thread shuts those connections down until the engine is gone.
        # It stops once the engine is gone (a weakref's callback runs after the C++ destructor), in
        # whichever thread lets go of it last, or after REAPER_MAX_S if that never happens. If the
        # engine is still there after REAPER_REPORT_AFTER_S, it writes to stderr what every thread of
        # the process waits in: a teardown that takes long names its own cause.
        try:
            reaper = _native.InboundReaper(self.rpc_port, REAPER_PERIOD_S, REAPER_MAX_S,
                                           report_after_s=REAPER_REPORT_AFTER_S)
            weakref.finalize(engine, reaper.stop)
        finally:
            del engine
        if errors:
            raise RuntimeError(f"unregister_memory failed during close: {errors}")

    def __enter__(self) -> "TeEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close(reap_timeout_s=0.0)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regions)} regions"
        return f"TeEndpoint({self.session_id}, {self.protocol}, {state})"

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TeEndpoint is closed")

    def _check_local(self, addr: int, nbytes: int) -> None:
        for base, size in self._regions.items():
            if base <= addr and addr + nbytes <= base + size:
                return
        raise ValueError(
            f"source range [{addr:#x}, {addr + nbytes:#x}) is not inside memory registered with "
            "this endpoint (register() it first; RDMA needs registered sources)")

    def _reap(self) -> None:
        """Forget abandoned batches that TE has finished (check_status frees them)."""
        if self._orphans:
            self._orphans = [orphan for orphan in self._orphans
                             if self._engine.transfer_check_status(orphan.batch_id) == 0]

    def _abandon(self, peer: str, ids: Sequence[int], sizes, read: bool = False) -> None:
        """Keep batches given up at a deadline until TE finishes them. `sizes`: bytes of every batch
        (an int), or batch id -> (local address, bytes) (a read's destination, busy until reaped)."""
        with self._lock:
            for batch_id in ids:
                if isinstance(sizes, dict):
                    local, size = sizes.get(batch_id, (0, 1))
                else:
                    local, size = 0, sizes
                span = (local, local + size) if read and local else (0, 0)
                self._orphans.append(_Abandoned(batch_id, peer, size, span))

    def _abandoned_count(self, peer: str) -> int:
        """Abandoned transfers with `peer` that move bytes (handshakes excluded). Holds the lock."""
        return sum(1 for orphan in self._orphans if orphan.peer == peer and orphan.nbytes)

    def _reading_into(self, lo: int, hi: int) -> bool:
        return any(o.local[0] < hi and lo < o.local[1] for o in self._orphans)

    def _busy_error(self, peer: str, reads: Sequence[Tuple[int, int, int]] = ()) -> Optional[PeerBusy]:
        """`PeerBusy` when `peer` has abandoned transfers in flight or a read would land where an abandoned
        read still may; None when the transfer may go. Holds the lock; reaped just before."""
        count = self._abandoned_count(peer)
        if count:
            return PeerBusy(
                f"{count} TE transfer(s) with {peer} abandoned at an earlier deadline are still in flight (they may "
                "still land over newer bytes): nothing more goes to that peer until TE has finished them")
        for local, _, size in reads:
            if self._reading_into(local, local + size):
                return PeerBusy(
                    f"a TE read abandoned at an earlier deadline may still land in [{local:#x}, {local + size:#x}): "
                    "no new read into those bytes until TE has finished it")
        return None

    def _finish_within(self, pending: Dict[int, List[int]], deadline: float) -> None:
        """Poll the batches in `pending` (index -> batch ids) until each completed or failed, or until
        `deadline`; what completed or failed (freed by TE) is removed, what remains is still in
        flight (or kept by TE after its own timeout) and must be abandoned by the caller."""
        check = self._engine.transfer_check_status
        while True:
            for ids in pending.values():
                for k in range(len(ids) - 1, -1, -1):
                    status = check(ids[k])
                    if status in (1, -1):  # completed, or failed and freed by TE
                        ids.pop(k)
            if not any(pending.values()) or time.monotonic() >= deadline:
                return
            time.sleep(0.0002)

    def _settle(self, peers: Sequence[str], reads: Sequence[Tuple[int, int, int]], deadline: float) -> None:
        """Reap; while a transfer with `peers` (or into `reads`) is still abandoned, poll for up to
        SETTLE_S (a write given up by an exception a moment ago finishes within microseconds)."""
        until = min(deadline, time.monotonic() + SETTLE_S)
        while True:
            with self._lock:
                self._check_open()
                self._reap()
                if all(self._busy_error(peer, reads) is None for peer in peers) or time.monotonic() >= until:
                    return
            time.sleep(0.0002)

    def _check_not_busy(self, peer: str, reads: Sequence[Tuple[int, int, int]] = ()) -> None:
        error = self._busy_error(peer, reads)
        if error is not None:
            raise error

    def _submit(self, peer: str, src: int, dst: int, size: int, deadline: float, read: bool = False) -> int:
        """Submit one write (a read with `read`: `src` is then the local destination and `dst` the
        peer's source), return its batch id. Never blocks past `deadline`.

        TE handshakes on the first write to a peer while holding an engine-wide lock, so: with
        no handshake in progress and the peer known, submit directly (it does not block);
        otherwise wait for the handshake in progress, or start one in a helper thread (writes
        only: a read is submitted to a peer whose handshake is done, see `read_batch`).
        """
        while True:
            with self._lock:
                self._check_open()
                if not self._opening:
                    if peer in self._opened:
                        if read:
                            batch_id = self._engine.batch_transfer_async_read(peer, [src], [dst], [size])
                        else:
                            batch_id = self._engine.transfer_submit_write(peer, src, dst, size)
                        return self._checked_id(peer, batch_id, dst, size)
                    if read:
                        raise ConnectionError(f"TE read from {peer}: no handshake with that peer (connect first)")
                    done, result = self._start_handshake(peer, src, dst, size)
                    break
                busy_peer, busy = next(iter(self._opening.items()))
            if not busy.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"TE could not start a write to {peer} before the deadline: the engine is "
                    f"blocked by a handshake with {busy_peer} (hung peer?)")
        done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            finished = done.is_set()
            if not finished:  # decided under the lock, so the helper sees it when it finishes
                result["abandoned"] = True
        if not finished:
            # Unblock TE (and its engine-wide lock) now instead of after its ~60 s read timeout.
            aborted = abort_connections(peer)
            done.wait(0.5)
            raise TimeoutError(
                f"TE handshake with {peer} did not finish before the deadline (peer hung?); "
                f"{'aborted it' if aborted else 'it continues in the background'}")
        if "error" in result:
            raise ConnectionError(f"TE submit to {peer} failed: {result['error']}")
        return self._checked_id(peer, result["id"], dst, size)

    def _start_handshake(self, peer: str, src: int, dst: int, size: int):
        """Run the first submit to `peer` (which handshakes) in a helper thread. Holds the lock."""
        engine = self._engine  # the helper keeps the engine alive until it returns
        done = threading.Event()
        result: Dict[str, object] = {}
        self._opening[peer] = done

        def run():
            try:
                result["id"] = engine.transfer_submit_write(peer, src, dst, size)
            except BaseException as exc:  # pragma: no cover - the binding returns codes
                result["error"] = exc
            with self._lock:
                batch_id = result.get("id")
                if isinstance(batch_id, int) and 0 < batch_id < _MAX_BATCH_ID:
                    self._opened.add(peer)
                    if result.get("abandoned"):
                        self._orphans.append(_Abandoned(batch_id, peer, size, (0, 0)))
                del self._opening[peer]
                done.set()

        threading.Thread(target=run, name=f"te-handshake-{peer}", daemon=True).start()
        return done, result

    def _checked_id(self, peer: str, batch_id, dst: int, size: int) -> int:
        if isinstance(batch_id, int) and 0 < batch_id < _MAX_BATCH_ID:
            if peer not in self._opened:
                self._opened.add(peer)
            return batch_id
        self._raise_failure(peer, f"TE could not submit a write of {size} bytes to {dst:#x} on {peer}")

    def _wait(self, peer: str, pending: List[int], deadline: float, what: str = "write") -> None:
        """Poll `pending` until all completed; removes finished ids from the list in place."""
        started = time.monotonic()
        spin_until = started + self.spin_s
        check = self._engine.transfer_check_status
        while pending:
            for index in range(len(pending) - 1, -1, -1):
                status = check(pending[index])
                if status == 1:  # completed (TE freed the batch)
                    pending.pop(index)
                elif status == -1:  # failed (TE freed the batch)
                    pending.pop(index)
                    self._raise_failure(peer, f"a TE {what} {'from' if what == 'read' else 'to'} {peer} failed")
                elif status != 0:  # -2: TE-level timeout; TE keeps the batch, nothing to reap
                    pending.pop(index)
                    self._raise_failure(peer, f"a TE {what} {'from' if what == 'read' else 'to'} {peer} timed out "
                                              f"inside TE ({status})")
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"{len(pending)} TE {what}(s) {'from' if what == 'read' else 'to'} {peer} did not complete "
                    "before the deadline "
                    "(peer hung or overloaded); they may still land later")
            # Spin briefly (a small loopback write completes in ~50 us), then sleep so that an
            # oversubscribed CPU is left to the engine's I/O threads; sleeping ~10% of the time
            # waited so far bounds the overshoot to ~10% (at least 50 us, at most 2 ms).
            if now < spin_until:
                continue
            pause = min(0.002, max(0.00005, 0.1 * (now - started)))
            time.sleep(min(pause, max(0.0, deadline - now)))

    def _raise_failure(self, peer: str, what: str):
        """Tell a dead peer from a rejected write (`_failure_error`) and raise that."""
        raise self._failure_error(peer, what)

    @staticmethod
    def _failure_error(peer: str, what: str, probe_s: float = 0.5) -> Exception:
        """The error for a failed write: probes the peer's handshake port for up to `probe_s`."""
        host, port = parse_session(peer)
        try:
            with socket.create_connection((host, port), timeout=probe_s):
                pass
        except ConnectionRefusedError:
            return ConnectionRefusedError(f"{what}: the peer's engine is gone (connection to {peer} refused)")
        except (ConnectionResetError, ConnectionAbortedError) as exc:
            # Its host answered: a listener torn down with the connection in its queue (a process ending, its
            # descriptors closed one by one) resets it. Not "no answer": the caller asks the peer watcher.
            return ConnectionError(f"{what}: the peer's engine reset the probe ({exc}): its process may be ending")
        except OSError as exc:
            error = ConnectionError(f"{what}: the peer is unreachable ({exc})")
            error.__cause__ = exc  # no answer from its host (`OneSidedTransport` tells it from a refusal)
            return error
        return TransferFailed(
            f"{what}: the peer's engine answers, so TE rejected the transfer (is every remote range inside memory "
            "the peer registered, and not unregistered since?), the peer stalled it, or TE had lost its "
            "connection to the peer (a link outage: TE connects again after a 1 s cooldown)")
