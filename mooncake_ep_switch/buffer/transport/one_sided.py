"""The one-sided transports, `"shm"` and `"mooncake"`: one protocol, a route per peer.

Every rank owns one region (an anonymous shared region, `SharedRegion`) laid out as in
docs/protocol.md. A sender writes rows into the receiver's region and then a tagged signal; a
receiver polls only its own region, with the call's deadline, so the receive side is the same
whatever carried the bytes. Each peer gets a route:

* `self`: this rank's own region (written directly by the native kernels);
* `shm`: a peer on this host, mapped through /proc/<pid>/fd (native kernels write into it);
* `te`: a peer elsewhere (or any peer when `disable_p2p=True`), reached with Mooncake Transfer
  Engine writes: the native kernels pack the rows for that peer into a local staging copy of the
  region at the same offsets, a batch write carries the data ranges, and only after it completed a
  second write carries the signals (TE does not order writes inside a batch). The self and shm
  writes of the call run while that data is on the wire. Combine rows for a TE
  owner are packed compactly (only the routed rows, one range per owner; docs/protocol.md).

A failed or timed-out write marks the destination inactive in the caller's `active_ranks` (and
as evidence for membership) instead of raising or hanging.
"""
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs, bias_args
from mooncake_ep_switch.buffer.layout import RegionLayout, RegionLayouts, check_half_not_reused
from mooncake_ep_switch.buffer.shared_region import RegionEndpoint, SharedRegion
from mooncake_ep_switch.buffer.transport.contract import HostMemoryTransport
from mooncake_ep_switch.buffer.transport.members import connect_view
from mooncake_ep_switch.buffer.transport.peer_watch import PeerWatch
from mooncake_ep_switch.buffer.transport.te_endpoint import PeerWrite
from mooncake_ep_switch.faults import FaultPoint
from mooncake_ep_switch.errors import BufferDestroyed, PeerBusy, TransferFailed

_TAG_SPACE = (1 << 32) - 1
SELF, SHM, TE = "self", "shm", "te"
CONTROL_BYTES = _native.CONTROL_BYTES  # the region's control block, before the two halves
PROBE_BYTES = 8  # the control block (first CONTROL_BYTES of a region) holds one probe word per source rank
# A connect probe that TE failed at once (within PROBE_FAST_FAIL_S) while the peer answers is tried again after
# PROBE_RETRY_S, for up to PROBE_RETRY_WINDOW_S (TE's reconnect cooldown is 1 s; `write_probe`).
PROBE_RETRY_S = 0.2
PROBE_FAST_FAIL_S = 1.0
PROBE_RETRY_WINDOW_S = 3.0
PROBE_KICK_S = 0.3  # how long the probes of every TE peer at once (`_kick`) are waited for


def peer_probe_offset(rank: int) -> int:
    """Offset in a peer's region of the word that `rank` writes to prove its TE data path (ranks
    beyond the control block share words: nothing reads them)."""
    return PROBE_BYTES * (rank % (CONTROL_BYTES // PROBE_BYTES))


def write_probe(te, session: str, local_addr: int, remote_addr: int, deadline: float) -> None:
    """Prove the Transfer Engine's data path to a peer: write the PROBE_BYTES at `local_addr` into its
    probe word at `remote_addr` by `deadline`.

    A write that TE failed at once while the peer's engine answers (`TransferFailed` within
    PROBE_FAST_FAIL_S) is tried again every PROBE_RETRY_S, for up to PROBE_RETRY_WINDOW_S after the first
    such failure: the probe's range is valid, so it means TE lost its only connection to the peer (a link
    outage): the first write after that fails at once and starts TE's 1 s reconnect cooldown, after which
    TE connects again. A slow failure (a stalled peer, failed by TE's stall timeout), a refused, reset or
    unreachable peer, a timeout and PeerBusy are not tried again.

    Arguments:
        te: the `TeEndpoint`.
        session: the peer engine's session id, "host:port".
        local_addr: int, this rank's staging address of the probe word.
        remote_addr: int, the probe word's address in the peer's region.
        deadline: `time.monotonic()` deadline in seconds.

    Raises:
        as `TeEndpoint.write`.
    """
    first_failure = None
    while True:
        started = time.monotonic()
        try:
            te.write(session, local_addr, remote_addr, PROBE_BYTES, timeout_s=max(0.1, deadline - started))
            return
        except TransferFailed:
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if (now - started >= PROBE_FAST_FAIL_S or now - first_failure >= PROBE_RETRY_WINDOW_S
                    or now + PROBE_RETRY_S >= deadline):
                raise
            time.sleep(PROBE_RETRY_S)


DEFAULT_TE_TIMEOUT_S = 30.0  # TE writes when the call has no deadline (timeout_us == -1)


def _compact_fits(layout: RegionLayout) -> bool:
    """Whether a compact dispatch fits the layout: at least 2 local experts, and the per-expert token
    lists (at most L*T int32) inside one T-row block (docs/protocol.md)."""
    return layout.num_local_experts >= 2 and 4 * layout.num_local_experts <= layout.row_bytes


def signal_tag(call: int) -> int:
    """The 32-bit, never-zero signal tag of call number `call` (wraps after 2**32 - 1 calls).

    Arguments:
        call: call number (int; calls are numbered from 1).

    Returns:
        tag: int in `[1, 2**32 - 1]`, `(call - 1) % (2**32 - 1) + 1`.
    """
    return (call - 1) % _TAG_SPACE + 1


class TePeer(NamedTuple):
    """A peer reached over the Transfer Engine.

    Fields:
        session: the peer engine's session id ("host:port").
        base: address of the peer's registered region in the peer's address space.
    """

    session: str
    base: int


class OneSidedTransport(HostMemoryTransport):
    """Dispatch/combine by one-sided writes into peers' regions (shm and/or Transfer Engine).

    Arguments:
        name: `"shm"` (every peer must be on this host) or `"mooncake"` (Transfer Engine for
            peers on other hosts, or for every peer when `allow_shm` is False).
        rank: this rank.
        num_ranks: group size.
        num_ep_buffer_bytes: size of every rank's region.
        settings: the runtime `Settings` (host identity, TE bind address and protocol, faults).
        allow_shm: whether same-host peers may be reached through shared memory.
    """


    def __init__(self, name: str, rank: int, num_ranks: int, num_ep_buffer_bytes: int, settings,
                 allow_shm: bool = True):
        if num_ep_buffer_bytes <= 0:
            raise ValueError(f"num_ep_buffer_bytes: the {name} transport needs a region, expected > 0 "
                             f"(see Buffer.get_ep_buffer_size_hint), got {num_ep_buffer_bytes}")
        self.name = name
        self.rank = rank
        self.num_ranks = num_ranks
        self.nbytes = num_ep_buffer_bytes
        self.settings = settings
        self.allow_shm = allow_shm
        self.fault = FaultPoint.parse(settings.fault_point)
        self.region = SharedRegion(None, rank, num_ranks, num_ep_buffer_bytes)
        self.base = self.region.base
        self.routes: List[Optional[str]] = [None] * num_ranks
        self.routes[rank] = SELF
        self._halves = {}  # half offset -> direct half bases; cleared whenever a route changes
        self._layouts = RegionLayouts(num_ranks, num_ep_buffer_bytes)  # (T, hidden, E) -> layout that fits
        self.te_peers: Dict[int, TePeer] = {}
        self.failed_sources: List[int] = []
        self._link_failed: Dict[int, bool] = {}  # peers a Transfer Engine write failed to -> refused (mask_cause)
        # Address of an int64 word the owner raises to stop every native receive wait (RuntimeError):
        # Buffer.destroy() never waits for a call with no deadline. 0 = none.
        self.abort_ptr = 0
        self.latest_dispatch = 0  # call number of the latest dispatch (its half is no earlier call's)
        self.te = None
        self.staging: Optional[torch.Tensor] = None
        # FP8 rows and scales of the current dispatch, quantized once for the staging pack and the
        # direct writes (both native sends read them; neither needs them after dispatch returns).
        self._fp8_rows: Optional[torch.Tensor] = None
        self._fp8_scales: Optional[torch.Tensor] = None
        # Fails a dead peer's receive waits at once (a listener only where peers may be on other hosts).
        self.watch = PeerWatch(num_ranks, rank, settings.bind_host if name == "mooncake" else None)
        if name == "mooncake":
            from mooncake_ep_switch.buffer.transport.te_endpoint import TeEndpoint
            from mooncake_ep_switch.config import TE_TCP_LANES_PER_PEER, TE_TCP_STALL_TIMEOUT_S

            self.te = TeEndpoint(settings.bind_host, settings.te_protocol, log_level="ERROR",
                                 tcp_stall_timeout_s=TE_TCP_STALL_TIMEOUT_S, tcp_lanes_per_peer=TE_TCP_LANES_PER_PEER)
            self.te.register(self.base, self.nbytes)
            # Untouched (torch.empty: fresh mmapped pages): only the bytes a round packs become resident.
            # torch.zeros wrote every page, keeping a whole region's worth resident per rank (issue 28).
            self.staging = torch.empty(self.nbytes, dtype=torch.uint8)
            self.te.register(self.staging.data_ptr(), self.nbytes)
        elif name != "shm":
            raise ValueError(f"name: expected 'shm' or 'mooncake', got {name!r}")

    def maps_peer_memory(self) -> bool:
        """Whether same-host peers are mapped through shared memory (`allow_shm`: not `disable_p2p`)."""
        return self.allow_shm

    # ------------------------------------------------------------------ routes
    def peer_routes(self) -> List[Optional[str]]:
        """How each rank is reached: "self", "shm", "te", or None (see `contract.Transport`)."""
        return list(self.routes)

    def transfer_engine(self):
        """This rank's `TeEndpoint` ("mooncake"), or None ("shm")."""
        return self.te

    def te_peer(self, peer: int) -> Optional[TePeer]:
        """`peer`'s Transfer Engine session and region base when it is reached over TE, else None."""
        return self.te_peers.get(peer)

    # ------------------------------------------------------------------ membership
    def endpoint(self) -> dict:
        """What peers need to reach this rank (published in the store).

        Returns:
            endpoint: dict with `"region"`: [pid, fd, nbytes] of this rank's `SharedRegion`, and on
                `"mooncake"` also `"te_session"` (str, "host:port") and `"te_base"` (int, the
                region's registered address). The Buffer adds `"host_id"` before publishing.
        """
        found = {"region": list(self.region.endpoint)}
        if self.te is not None:
            found.update(te_session=self.te.session_id, te_base=self.base, watch_port=self.watch.port)
        return found

    def connect_members(self, view, membership, deadline: float, construction: bool = False) -> None:
        """Route and map every member of `view`; drop everything else. No group collective.

        Waits (until `deadline`) for each member's endpoint in the store; same-host members are
        mapped through shared memory when allowed, others reached over the Transfer Engine.

        Arguments:
            view: the membership `View` (epoch, ranks) to connect.
            membership: the `Membership` whose store holds the endpoints (None is refused).
            deadline: `time.monotonic()` deadline in seconds.
            construction: True at the Buffer's construction (every member connects at once), False after a
                membership change (`members.connect_view`).

        Raises:
            RuntimeError: `membership` is None (no store).
            ValueError: a member on another host under `"shm"`, or a member with no usable
                Transfer Engine endpoint.
            MembershipError: members that cannot be reached (named in the error), or a member
                missing from the final barrier.
        """
        from mooncake_ep_switch.buffer.membership.protocol import MembershipError

        connect_view(self.rank, self.num_ranks, view, membership, deadline,
                     lambda peer, found: self._route(peer, found, deadline), self._drop,
                     (OSError, ConnectionError, TimeoutError, MembershipError), construction=construction,
                     before_routes=lambda found: self._kick(found, deadline))

    def _kick(self, found: Dict[int, dict], deadline: float) -> None:
        """One probe write to every peer reached over TE before (handshaken) at its published endpoint, all at
        once, failures ignored: where TE lost its only connection to a peer (a link outage), the first write
        fails at once and starts TE's 1 s reconnect cooldown, so the cooldowns of all peers run together
        instead of one after another in `_route`'s probes (`write_probe`)."""
        if self.te is None:
            return
        writes = []
        for peer, endpoint in sorted(found.items()):
            session, base = endpoint.get("te_session"), endpoint.get("te_base")
            if self._over_shm(endpoint) or not isinstance(session, str) or not isinstance(base, int) \
                    or base <= 0 or not self.te.is_connected(session):
                continue
            writes.append(PeerWrite(session, [(*self._probe_word(base), PROBE_BYTES)], []))
        left = deadline - time.monotonic()
        if writes and left > 0:
            try:
                self.te.write_each(writes, timeout_s=min(PROBE_KICK_S, left))
            except (ValueError, TypeError):  # a malformed endpoint: `_route` names it
                pass

    def _over_shm(self, found: dict) -> bool:
        """Whether a peer at the published endpoint `found` is reached through shared memory (its host is this one)."""
        return self.allow_shm and found.get("host_id") == self.settings.host_id

    def _probe_word(self, base: int) -> Tuple[int, int]:
        """(this rank's staging address, the address in a peer's region at `base`) of this rank's probe word."""
        probe = peer_probe_offset(self.rank)
        return self.staging.data_ptr() + probe, base + probe

    def _route(self, peer: int, found: dict, deadline: float) -> None:
        """Reach `peer` at its published endpoint: shared memory on this host, else the TE; watch it."""
        self._layouts.settle(peer)  # mapped anew: it writes in the current layout (docs/recovery.md, section 4)
        if self._over_shm(found):
            # Watched before the region is mapped: the mapping then proves the pid is the peer's.
            self.watch.watch_process(peer, RegionEndpoint(*found["region"]).pid)
            self._halves.clear()
            self.region.map_peer(peer, RegionEndpoint(*found["region"]), found.get("incarnation"))
            self.te_peers.pop(peer, None)
            self.routes[peer] = SHM
        else:
            if self.te is None:
                raise ValueError(f"transport: 'shm' cannot reach rank {peer} on host {found.get('host_id')!r} "
                                 f"(this host: {self.settings.host_id!r}); use 'mooncake' or 'auto'")
            session, base = found.get("te_session"), found.get("te_base")
            if not isinstance(session, str) or not isinstance(base, int) or base <= 0:
                raise ValueError(f"rank {peer} published no usable Transfer Engine endpoint: {found}")
            self._halves.clear()
            self.region.unmap_peer(peer)
            self.te_peers[peer] = TePeer(session, base)
            self.routes[peer] = TE
            self.te.connect(session, timeout_s=max(0.1, deadline - time.monotonic()))
            # The handshake (a zero-length write) never touches the data connection, which after a
            # link outage can still sit in TCP's retransmission back-off for seconds: a view whose
            # first rounds would mask the peer again. Prove the data path with a real write into
            # this rank's probe word in the peer's control block (nothing reads it), within the deadline.
            # Nothing goes to a peer while writes abandoned at an earlier deadline (an outage, a
            # stopped peer) may still land in its region (TeEndpoint refuses with PeerBusy): give TE
            # until the deadline to finish them (after a link outage they complete once it is back).
            self.te.wait_reaped(session, max(0.0, deadline - time.monotonic()))
            write_probe(self.te, session, *self._probe_word(base), deadline)
            port = found.get("watch_port")
            if isinstance(port, int) and 0 < port < 65536:
                host = session.rpartition(":")[0]
                self.watch.watch_address(peer, host, port, timeout_s=max(0.1, min(10.0, deadline - time.monotonic())))

    def _drop(self, peer: int) -> None:
        self.watch.forget(peer)
        self._halves.clear()
        self.region.unmap_peer(peer)
        self.te_peers.pop(peer, None)
        self.routes[peer] = None

    def dead_peers(self) -> List[int]:
        """Ranks whose process the peer watcher saw end since they were last connected.

        Returns:
            ranks: list of int, ascending.
        """
        return self.watch.dead_ranks()

    def destroy(self) -> None:
        """Close the Transfer Engine (if any) and release the region and every mapping."""
        self.watch.close()
        if self.te is not None:
            self.te.close()
            self.te = None
        self._halves.clear()
        self.region.destroy()
        self.base = 0

    # ------------------------------------------------------------------ helpers
    def _direct_halves(self, offset: int) -> List[int]:
        """Half bases of the peers the native kernels write directly (self and shm routes)."""
        halves = self._halves.get(offset)
        if halves is None:
            halves = [base + offset if base and self.routes[peer] in (SELF, SHM) else 0
                      for peer, base in enumerate(self.region.peer_bases)]
            self._halves[offset] = halves
        return halves

    def mask_cause(self, rank: int) -> str:
        """Why a call masked `rank`: its process ended (the peer watcher), a Transfer Engine write to it
        failed or timed out (`"link"`, reported once per failed write; a write refused or reset waits
        for the peer watcher's verdict first, `PeerWatch.confirm_gone`: `"process_end"` if it saw the
        process end), else a receive's deadline passed.

        Arguments:
            rank: a rank this transport appended to `failed_sources`.

        Returns:
            cause: `"process_end"`, `"link"` or `"deadline"`.
        """
        if rank in self.dead_peers():
            self._link_failed.pop(rank, None)
            return "process_end"
        if rank in self._link_failed:
            refused = self._link_failed.pop(rank)
            return "process_end" if refused and self.watch.confirm_gone(rank) else "link"
        return "deadline"

    def _masked(self, ranks: List[int], key) -> None:
        """Calls masked `ranks` (evidence for membership); a live one holds the region's layout."""
        self.failed_sources.extend(ranks)
        self._layouts.hold(ranks, self.dead_peers(), key)

    def _te_timeout(self, timeout_us: int) -> float:
        return DEFAULT_TE_TIMEOUT_S if timeout_us < 0 else max(0.05, timeout_us / 1e6)

    def _te_send(self, targets: List[int], ranges: Callable[[int], List[Tuple[int, int, int]]],
                 signals: Callable[[int], Tuple[int, int, int]], active: torch.Tensor, timeout_s: float,
                 direct: Callable[[], None]) -> None:
        """Write every target's ranges (staging offset, region offset, length) into its region, then its
        signals: all targets in flight at once, so a dead or slow peer delays no other. A peer whose
        write fails or times out is cleared in `active` and neither sent to nor waited for again.
        `direct` (the writes into this rank's and its same-host peers' regions) runs while the data
        is on the wire."""
        staging = self.staging.data_ptr()
        writes = []
        for dest in targets:
            peer = self.te_peers[dest]
            data = [(staging + src, peer.base + dst, n) for src, dst, n in ranges(dest) if n > 0]
            src, dst, n = signals(dest)
            writes.append(PeerWrite(peer.session, data, [(staging + src, peer.base + dst, n)]))
        failures = self.te.write_each(writes, timeout_s, in_flight=direct)
        for index in sorted(failures):
            active[targets[index]] = 0
            self._masked([targets[index]], None)
            # Its host answered (refused, or up and the write reset): its process may be ending (`mask_cause`).
            # Not so: a deadline, writes still in flight (PeerBusy), no answer (the probe's OSError chained).
            error = failures[index]
            self._link_failed[targets[index]] = (isinstance(error, ConnectionError) and not isinstance(error, PeerBusy)
                                                 and error.__cause__ is None)

    def _staging_bases(self, offset: int, targets: List[int]) -> List[int]:
        """Half bases for a native send into the staging copy (by destination) for `targets`."""
        halves = [0] * self.num_ranks
        for dest in targets:
            halves[dest] = self.staging.data_ptr() + offset
        return halves

    def combine_buffer(self, call: int, shape, device) -> torch.Tensor:
        """Region-resident zero-copy combine buffer `[L, R*T, hidden]` bf16 for the half of `call`.

        Arguments:
            call: call number of the dispatch (selects the region half).
            shape: (L, R*T, hidden), `L` local experts per rank.
            device: unused (the region is CPU memory).

        Returns:
            buffer: `[L, R*T, hidden]` torch.bfloat16, a view of the region half of `call` (the
                same memory serves every call of the same parity).

        Raises:
            ValueError: the call shape does not fit in the region.
        """
        return self._layouts.combine_view(self.region.local, call, shape)

    def _te_targets(self, active: torch.Tensor) -> List[int]:
        order = [(self.rank + step) % self.num_ranks for step in range(1, self.num_ranks)]
        return [peer for peer in order if self.routes[peer] == TE and int(active[peer])]

    def _check_receive(self, what: str, region, base: int, call: int) -> None:
        """A receive phase may run: the memory it captured at send time is still there (the transport
        was not destroyed first) and its half was not reused by a later call."""
        if region is None or not base:
            raise BufferDestroyed(f"{what}: the transport was destroyed before this receive phase ran")
        check_half_not_reused(what, call, self.latest_dispatch)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple[None, Callable[[], None]]:
        """Write this rank's tokens into every active peer's region; return the receive phase.

        A peer whose Transfer Engine write fails or times out is cleared in `call.active_ranks` and
        appended to `failed_sources`, and so is a source the receive phase times out on.

        Arguments:
            call: the validated `DispatchCall`.
            outputs: the `DispatchOutputs` the receive phase fills.

        Returns:
            private: None (this transport keeps no plan for combine).
            receive: callable with no arguments that waits (up to `call.timeout_us` per source) for
                every active source's signal and fills `outputs`.
        """
        tokens, experts, hidden = call.num_max_dispatch_tokens_per_rank, call.num_experts, call.x.size(1)
        layout = self._layouts.fit(tokens, hidden, experts)
        self._layouts.use((tokens, hidden, experts), self.dead_peers)  # refuses before anything is written
        offset = layout.half_offset(call.call)
        tag = signal_tag(call.call)
        self.latest_dispatch = call.call
        args = (call.x.data_ptr(), call.x.size(0), hidden, call.topk_idx.data_ptr(), call.topk_idx.size(1), experts,
                self.num_ranks, self.rank, tokens, call.active_ranks.data_ptr())
        mid_dispatch = self.fault is not None and self.fault.point == "dispatch_after_data"
        if mid_dispatch:  # test-only: data lands in peers, signals never do
            _native.dispatch_send(*args, self._direct_halves(offset), tag, use_fp8=call.use_fp8, write_signals=False)
            self.fault.hit("dispatch_after_data", self.rank, call.call)

        # With Transfer Engine peers the direct writes are compact too (each token once per destination,
        # as over the wire; the receiver expands either form): this rank's own rows are then copied
        # 1.25x instead of twice at K=8 with 2 ranks. The shm transport keeps its fused per-pair path.
        compact = self.te is not None and _compact_fits(layout)
        remote = self.te is not None and bool(self._te_targets(call.active_ranks))
        # Two native sends (staging pack, direct writes) read the same FP8 rows: quantize them once.
        fp8 = self._quantize(call.x) if remote and call.use_fp8 else (0, 0)

        def direct() -> None:
            _native.dispatch_send(*args, self._direct_halves(offset), tag, use_fp8=call.use_fp8, compact=compact,
                                  fp8_rows_ptr=fp8[0], fp8_scales_ptr=fp8[1])

        if remote:
            self._dispatch_te(call, layout, offset, tag, args, direct, fp8)  # runs `direct` with its data in flight
        else:
            direct()

        region = self.region.local  # the receive may run late: its memory stays mapped until it ran
        base = self.base

        def receive() -> None:
            self._check_receive("dispatch", region, base, call.call)
            scales = outputs.recv_scales.data_ptr() if outputs.recv_scales is not None else 0
            newly = _native.dispatch_recv(base + offset, self.num_ranks, self.rank, tokens, hidden, experts, tag,
                                          call.active_ranks.data_ptr(), call.timeout_us, use_fp8=call.use_fp8,
                                          recv_x_ptr=outputs.recv_x.data_ptr(), recv_scales_ptr=scales,
                                          src_info_ptr=outputs.src_info.data_ptr(),
                                          layout_range_ptr=outputs.layout_range.data_ptr(),
                                          recv_count_ptr=outputs.recv_count.data_ptr(), abort_ptr=self.abort_ptr,
                                          dead_ptr=self.watch.dead_ptr)
            if newly:
                self._masked(newly, (tokens, hidden, experts))

        return None, receive

    def dispatch_sync(self, call: DispatchCall, outputs: DispatchOutputs) -> None:
        """`dispatch` followed at once by its receive phase (a synchronous call), in one native call
        when every peer is written directly (self and shm routes, no fault injection).

        Arguments:
            call: the validated `DispatchCall`.
            outputs: the `DispatchOutputs` to fill.

        Returns:
            private: None (the plan for combine, which this transport does not keep).
        """
        if self.te is not None or self.fault is not None:
            private, receive = self.dispatch(call, outputs)
            receive()
            return private
        x, topk = call.x, call.topk_idx
        num_tokens, hidden = x.shape
        tokens, experts = call.num_max_dispatch_tokens_per_rank, call.num_experts
        layout = self._layouts.get((tokens, hidden, experts)) or self._layouts.fit(tokens, hidden, experts)
        self._layouts.use((tokens, hidden, experts), self.dead_peers)  # refuses before anything is written
        offset = layout.control_bytes + (call.call & 1) * layout.half_bytes
        self.latest_dispatch = call.call
        scales = outputs.recv_scales
        newly = _native.dispatch_round(x.data_ptr(), num_tokens, hidden, topk.data_ptr(), topk.shape[1], experts,
                                       self.num_ranks, self.rank, tokens, call.active_ranks.data_ptr(),
                                       self._direct_halves(offset), signal_tag(call.call), use_fp8=call.use_fp8,
                                       local_half_base=self.base + offset, timeout_us=call.timeout_us,
                                       recv_x_ptr=outputs.recv_x.data_ptr(),
                                       recv_scales_ptr=0 if scales is None else scales.data_ptr(),
                                       src_info_ptr=outputs.src_info.data_ptr(),
                                       layout_range_ptr=outputs.layout_range.data_ptr(),
                                       recv_count_ptr=outputs.recv_count.data_ptr(), abort_ptr=self.abort_ptr,
                                       dead_ptr=self.watch.dead_ptr)
        if newly:
            self._masked(newly, (tokens, hidden, experts))
        return None

    def _quantize(self, x: torch.Tensor) -> Tuple[int, int]:
        """Quantize every row of `x` ([N, H] bf16, contiguous) to FP8 into this transport's scratch
        (grown as needed); returns the (rows, scales) addresses `dispatch_send` takes."""
        n, hidden = x.shape
        if self._fp8_rows is None or self._fp8_rows.numel() < n * hidden:
            self._fp8_rows = torch.empty(n * hidden, dtype=torch.uint8)
            self._fp8_scales = torch.empty(n * hidden // 128, dtype=torch.float32)
        rows, scales = self._fp8_rows.data_ptr(), self._fp8_scales.data_ptr()
        _native.quantize_fp8_rows(x.data_ptr(), hidden * 2, 0, n, hidden, rows, scales)
        return rows, scales

    def _dispatch_te(self, call: DispatchCall, layout: RegionLayout, offset: int, tag: int, args,
                     direct: Callable[[], None], fp8: Tuple[int, int] = (0, 0)) -> None:
        """Pack every Transfer Engine destination's rows into its own column of the staging copy (one
        native call), then write each destination its rows and signals into column `rank` of its region;
        `direct` (the self and shm writes) runs while those rows are on the wire.

        Compact (whenever the layout has room: at least 2 local experts, docs/protocol.md): each token
        crosses once per destination however many of its experts it selected, so a destination gets
        one range of rows, one of per-expert token lists (and one of FP8 scales), then its signals."""
        targets = self._te_targets(call.active_ranks)
        R, rank = self.num_ranks, self.rank
        L, T, G = layout.num_local_experts, call.num_max_dispatch_tokens_per_rank, layout.num_scale_groups
        compact = _compact_fits(layout)
        _native.dispatch_send(*args, self._staging_bases(offset, targets), tag, use_fp8=call.use_fp8,
                              by_destination=True, compact=compact, fp8_rows_ptr=fp8[0], fp8_scales_ptr=fp8[1])
        signal_words = self.staging[offset + layout.dispatch_signals:].view(torch.int64)  # [R][L] words
        data, rb = offset + layout.dispatch_data, layout.row_bytes
        if compact:
            owners = torch.div(call.topk_idx, L, rounding_mode="floor")
            sent = [int((owners == dest).any(1).sum()) for dest in range(R)]  # tokens once per destination

        def ranges(dest: int) -> List[Tuple[int, int, int]]:
            counts = (signal_words[dest * L:(dest + 1) * L] & 0x7FFFFFFF).tolist()
            found = []
            if compact:
                row_bytes = call.x.size(1) if call.use_fp8 else rb  # compact FP8 rows are dense at H bytes
                found.append((data + dest * T * rb, data + rank * T * rb, sent[dest] * row_bytes))  # [0][column]
                found.append((data + (R + dest) * T * rb, data + (R + rank) * T * rb, sum(counts) * 4))  # [1][column]
                if call.use_fp8:
                    found.append((offset + layout.dispatch_scales + dest * T * G * 4,
                                  offset + layout.dispatch_scales + rank * T * G * 4, sent[dest] * G * 4))
                return found
            for local, count in enumerate(counts):
                packed, placed = (local * R + dest) * T, (local * R + rank) * T  # [local][column][0]
                found.append((data + packed * rb, data + placed * rb, count * rb))
                found.append((offset + layout.dispatch_src + packed * 4, offset + layout.dispatch_src + placed * 4,
                              count * 4))
                if call.use_fp8:
                    found.append((offset + layout.dispatch_scales + packed * G * 4,
                                  offset + layout.dispatch_scales + placed * G * 4, count * G * 4))
            return found

        def signals(dest: int) -> Tuple[int, int, int]:
            return (offset + layout.dispatch_signals + dest * L * 8, offset + layout.dispatch_signals + rank * L * 8,
                    L * 8)

        self._te_send(targets, ranges, signals, call.active_ranks, self._te_timeout(call.timeout_us), direct)

    # ------------------------------------------------------------------ combine
    def combine(self, call: CombineCall) -> Callable[[], None]:
        """Write expert outputs into their token owners' regions; return the receive phase.

        A failed or timed-out peer is cleared in `call.active_ranks` and appended to `failed_sources`.

        Arguments:
            call: the validated `CombineCall` (`transport_plan` is not used).

        Returns:
            receive: callable with no arguments that waits for every active owner's signal and
                writes the weighted sum `[N, hidden]` torch.bfloat16 into `call.out`.
        """
        tokens, hidden, experts = call.num_max_dispatch_tokens_per_rank, call.hidden, call.num_experts
        layout = self._layouts.fit(tokens, hidden, experts)
        self._layouts.use((tokens, hidden, experts), self.dead_peers)  # refuses before anything is written
        offset = layout.half_offset(call.call)
        tag = signal_tag(call.call)
        args = (call.x.data_ptr(), hidden, experts, self.num_ranks, self.rank, tokens, call.src_info.data_ptr(),
                call.layout_range.data_ptr(), call.active_ranks.data_ptr())

        def direct() -> None:
            _native.combine_send(*args, self._direct_halves(offset), tag)

        if self.te is not None and self._te_targets(call.active_ranks):
            self._combine_te(call, layout, offset, tag, args, direct)  # runs `direct` with its rows in flight
        else:
            direct()

        region = self.region.local  # the receive may run late: its memory stays mapped until it ran
        base = self.base

        def receive() -> None:
            self._check_receive("combine", region, base, call.call)
            newly = _native.combine_recv(base + offset, self.num_ranks, self.rank, tokens, hidden, experts, tag,
                                         call.active_ranks.data_ptr(), call.timeout_us, call.topk_idx.data_ptr(),
                                         call.topk_weights.data_ptr(), call.topk_idx.size(0), call.topk_idx.size(1),
                                         call.out.data_ptr(), self.abort_ptr, self.watch.dead_ptr,
                                         **bias_args(call.bias))
            if newly:
                self._masked(newly, (tokens, hidden, experts))

        return receive

    def _combine_te(self, call: CombineCall, layout: RegionLayout, offset: int, tag: int, args,
                    direct: Callable[[], None]) -> None:
        """Pack every Transfer Engine token owner's rows compactly (only the rows routed to it, behind each
        other in local-expert order) into its own expert block of the staging copy (one native call), then
        write each owner those rows as ONE range into this rank's experts' block of its region, and its
        signals (flagged compact, docs/protocol.md) after them; `direct` (the self and shm writes) runs
        while those rows are on the wire."""
        targets = self._te_targets(call.active_ranks)
        L, block = layout.num_local_experts, layout.num_local_experts * call.num_max_dispatch_tokens_per_rank
        row_bytes = call.hidden * 2
        _native.combine_send(*args, self._staging_bases(offset, targets), tag, by_destination=True, compact=True)
        signal_words = self.staging[offset + layout.combine_signals:].view(torch.int64)  # [R*L] words

        def ranges(dest: int) -> List[Tuple[int, int, int]]:
            rows = int((signal_words[dest * L:(dest + 1) * L] & 0x7FFFFFFF).sum())
            return [(offset + layout.combine_data + dest * block * row_bytes,
                     offset + layout.combine_data + self.rank * block * row_bytes, rows * row_bytes)]

        def signals(dest: int) -> Tuple[int, int, int]:
            return (offset + layout.combine_signals + dest * L * 8, offset + layout.combine_signals + self.rank * L * 8,
                    L * 8)

        self._te_send(targets, ranges, signals, call.active_ranks, self._te_timeout(call.timeout_us), direct)

    def combine_sync(self, call: CombineCall) -> None:
        """`combine` followed at once by its receive phase (a synchronous call), in one native call
        when every peer is written directly (self and shm routes).

        Arguments:
            call: the validated `CombineCall`; the result is written into `call.out`.
        """
        if self.te is not None:
            self.combine(call)()
            return
        tokens, hidden, experts = call.num_max_dispatch_tokens_per_rank, call.hidden, call.num_experts
        layout = self._layouts.get((tokens, hidden, experts)) or self._layouts.fit(tokens, hidden, experts)
        self._layouts.use((tokens, hidden, experts), self.dead_peers)  # refuses before anything is written
        offset = layout.control_bytes + (call.call & 1) * layout.half_bytes
        topk = call.topk_idx
        num_tokens, top_k = topk.shape
        newly = _native.combine_round(
            call.x.data_ptr(), hidden, experts, self.num_ranks, self.rank, tokens, call.src_info.data_ptr(),
            call.layout_range.data_ptr(), call.active_ranks.data_ptr(), self._direct_halves(offset),
            signal_tag(call.call), self.base + offset, call.timeout_us, topk.data_ptr(), call.topk_weights.data_ptr(),
            num_tokens, top_k, call.out.data_ptr(), self.abort_ptr, self.watch.dead_ptr, **bias_args(call.bias))
        if newly:
            self._masked(newly, (tokens, hidden, experts))
