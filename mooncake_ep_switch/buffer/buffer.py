"""`Buffer`: Mooncake EP / DeepEP low-latency compatible dispatch and combine.

The Buffer validates arguments, allocates outputs, numbers calls and keeps handles; a transport
moves the bytes: `"shm"` (one host, native one-sided writes), `"mooncake"` (Transfer Engine) or
`"collective"` (torch.distributed all_to_all_single). The signatures, return values and packed
layouts are Mooncake EP's, so engines written for it work unchanged.
"""
import time
import weakref
from time import perf_counter
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer import device_calls, events, mooncake_runtime, validation
from mooncake_ep_switch.buffer.membership import elastic_view, replacement
from mooncake_ep_switch.buffer.membership import shrink as group_shrink
from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall
from mooncake_ep_switch.buffer.handle import (DispatchHandle, DispatchPlan, EventOverlap, check_combinable_again,
                                               check_half_free, check_same_routing, complete_receive)
from mooncake_ep_switch.buffer.layout import LayoutHeld, region_layout
from mooncake_ep_switch.buffer.call_spec import CallSpecs
from mooncake_ep_switch.buffer.completion import Completions
from mooncake_ep_switch.buffer.core import BufferCore
from mooncake_ep_switch.buffer.lifetime import DESTROY_WAIT_S, with_receipt
from mooncake_ep_switch.buffer.membership.group_keys import generation_of, generation_prefix, resolve_group
from mooncake_ep_switch.buffer.membership.protocol import Membership, MembershipError, View
from mooncake_ep_switch.buffer.membership.store_deadline import bounded, store_deadline
from mooncake_ep_switch.buffer.peer_regions import PeerRegions
from mooncake_ep_switch.buffer.transport.contract import Transport
from mooncake_ep_switch.buffer.transport.select import TRANSPORTS, make_transport
from mooncake_ep_switch.checks import check_flag
from mooncake_ep_switch.config import settings
from mooncake_ep_switch.faults import FaultPoint

# What dispatch/combine return: (recv_x or its FP8 (rows, scales), recv_count, handle, event, hook) and
# (combined_x, event, hook); the event is a StreamEvent (an EventOverlap) on the cuda transport, the hook None
# unless return_recv_hook.
DispatchResult = Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor, DispatchHandle,
                       EventOverlap, Optional[Callable[[], None]]]
CombineResult = Tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]

_LAYOUT_SWITCH: Optional[Callable] = None  # set by mooncake_ep_switch.switch (register_layout_switch)


def register_layout_switch(function: Callable) -> None:
    """Name the function `Buffer.switch_layout` calls (the switch package registers its own on import).

    The buffer package never imports the switch package (which builds on it); the switch package
    registers `switch_layout(buffer, target, **kwargs)` here instead, so neither depends on the other
    both ways.

    Arguments:
        function: callable `(buffer, target, **kwargs) -> SwitchReport`.

    Raises:
        TypeError: `function` is not callable.
    """
    global _LAYOUT_SWITCH
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    _LAYOUT_SWITCH = function


def _weak_view_change(buffer) -> Callable[[float], View]:
    """`buffer._survivors_view` through a weak reference (for the core's `make_collective`); once the Buffer is
    gone it raises `BufferDestroyed`."""
    method = weakref.WeakMethod(buffer._survivors_view)

    def view_change(deadline: float) -> View:
        bound = method()
        if bound is None:
            from mooncake_ep_switch.errors import BufferDestroyed

            raise BufferDestroyed("the Buffer was destroyed: no view of its survivors can be agreed")
        return bound(deadline)

    return view_change


class Buffer(mooncake_runtime.MooncakeRuntimeQueries):
    """Expert-parallel communication buffer for MoE dispatch and combine.

    Arguments:
        group: the torch.distributed process group of the EP ranks.
        num_ep_buffer_bytes: bytes of the EP region per rank (see `get_ep_buffer_size_hint`).
            0 is accepted by the `"collective"` transport only (it allocates per call).
        disable_p2p: never use shared memory between ranks of one host (Mooncake's meaning:
            peers are reached through the inter-host path). Flags here (`disable_p2p`, `use_fp8`,
            `async_finish`, `return_recv_hook`, `zero_copy`, `_use_fallback`) are taken as the peers'
            bindings take them: a bool, np.bool_ or 0/1 (`checks.check_flag`).
        transport: `"auto"` (every rank on this host: device kernels over CUDA IPC when a CUDA
            device is usable, else shared memory; else the Transfer Engine when installed, else
            collectives), `"host"` (the same choice without `"cuda"`: CPU tensors on a GPU machine),
            `"cuda"`, `"shm"`, `"mooncake"` or `"collective"`. A `"cuda"` Buffer takes
            CUDA tensors on the current device (`buffer.device`), never synchronises the host inside
            a call and can be captured in a CUDA graph; the others take CPU tensors.
        store: the group's torch.distributed store, which must outlive every rank (default: the
            default group's store, torch's own key prefixes removed). Membership (epochs,
            endpoints, joiners) lives there, keyed by the group's identity (its global ranks) under
            the prefixes of the store passed: several groups of one job never share keys.

    A replacement rank passes the ticket of `mooncake_ep_switch.elastic.join()` as `group` (naming
    the same group and store); it is no member until its `update_ep_member()` is admitted by the
    members' `update_ep_member()`. Or, as in Mooncake's recovery, it builds a plain `Buffer(group)`
    while the members call `update_ep_member()`: the constructor blocks until they admitted it (up
    to the connect timeout; `MembershipError` otherwise), and a Buffer of this process it replaces
    is left out (`buffer/membership/replacement.py` says which Buffers are replacements). With
    `MEP_JOB_SECRET` set, every membership record is authenticated (see `buffer/membership/protocol.py`).

    Output memory: the tensors `dispatch` and `combine` return (recv_x, FP8 scales, recv_count, the
    handle's src_info and layout_range, the combined output) come from a pool kept by the Buffer
    (`output_pool.OutputPool`), so that steady-state calls neither allocate nor page-fault tens of MB.
    As in Mooncake EP and DeepEP, a returned tensor stays valid, and is never written again, for
    as long as the caller holds it or anything made from it (a view or slice, its storage, the
    handle, the call's event or hook). Only when nothing outside the pool references a result any
    more (torch's storage use count and the storage object's reference count say so) may a later
    call of the same shape return the same memory. The rows (recv_x, scales) and the small
    tensors (src_info, layout_range, recv_count) are separate blocks, so keeping a handle or
    recv_count does not keep tens of MB of rows busy; memory that was shared with another process
    or whose storage a caller resized is never reused. Rows of recv_x past `recv_count` are
    unspecified (they may hold an earlier call's rows); src_info past `recv_count` is 0. The "cuda"
    transport's outputs are not pooled: they are fresh tensors from torch's caching allocator, as DeepEP's are, since
    kernels write them on streams a reference count cannot follow (`output_pool.fresh_dispatch_outputs`).

    Hot path: the first call of a shape (T, E, hidden, FP8) runs the full validation and records
    the shape; later calls of that shape check the tensors' properties in one expression and the
    top-k and mask values in one native pass, and fall back to the full validation (whose errors
    name the argument) whenever anything differs. A synchronous call on
    the shm route runs its send and receive phases in one native call.

    CUDA tensors (`transport="cuda"`, `buffer.device`): a call launches device kernels and returns
    without waiting for the device. Synchronous: send and receive kernels on the current stream
    (results ready in stream order); `return_recv_hook=True`: the receive kernels are launched by
    the hook, on its dispatch's stream; `async_finish=True`: everything on the Buffer's
    communication stream, and the event (`StreamEvent`) makes the current stream wait. Timeouts
    are measured on the GPU and written into `active_ranks` (a CUDA int32 tensor) by the kernels.
    Values of `topk_idx`/`active_ranks` are checked on the device in eager calls
    (`MEP_CUDA_CHECK_VALUES`, one synchronisation; never during CUDA graph capture). A
    dispatch/combine pair can be captured in a CUDA graph; destroy graphs before their Buffer.
    """

    def __init__(self, group, num_ep_buffer_bytes: int = 0, disable_p2p: bool = False, *, transport: str = "auto",
                 store=None):
        # Every store call of the construction (a replacement's too) ends by the connect timeout: a stalled
        # store host raises StoreUnavailable then (membership/store_deadline.py).
        with store_deadline(time.monotonic() + settings().connect_timeout_s, "Buffer construction"):
            self._construct(group, num_ep_buffer_bytes, disable_p2p, transport, store)

    def _construct(self, group, num_ep_buffer_bytes, disable_p2p, transport, store) -> None:
        num_ep_buffer_bytes = validation.check_int("num_ep_buffer_bytes", num_ep_buffer_bytes, 0)
        disable_p2p = check_flag("disable_p2p", disable_p2p)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
        identity = resolve_group(group, store)
        self.settings = settings()
        # The view state and collaborators the helper modules (elastic_view, device_calls) use: core.py.
        core = self._core = BufferCore(identity.rank, identity.num_ranks, self.settings, joining=identity.joining,
                                       fault=FaultPoint.parse(self.settings.fault_point))
        self.group, self.rank, self.num_ranks = identity.group, identity.rank, identity.num_ranks
        prefix, store = identity.prefix, bounded(identity.store)  # calls that end by the operation's deadline
        self._store = store
        self.num_ep_buffer_bytes = num_ep_buffer_bytes
        self.disable_p2p = disable_p2p
        self.membership = None
        choice = None  # built from a process group: a new Buffer of the group, or a replacement of this rank
        base, generation = prefix, None
        deadline = time.monotonic() + self.settings.connect_timeout_s  # the constructor's one deadline
        if store is not None:
            if self.joining:
                prefix, release = generation_prefix(store, self.rank, self.num_ranks, prefix, True,
                                                    identity.buffer_index)
            else:
                choice = replacement.choose_generation(store, self.rank, self.num_ranks, base, self.settings.job_secret,
                                                       deadline)
                prefix, release = choice.prefix, choice.release
                if choice.replacing:  # admitted by the others' update_ep_member(), like elastic.join()
                    self.joining, self.group = True, None
            generation = generation_of(prefix)
            self._release_generation = weakref.finalize(self, release)
            # A plain Buffer(group) that replaces the rank takes it from the incarnation the members hold, by
            # CAS: of two replacements of one rank, the second raises here, naming the one that holds it.
            self.membership = core.membership = Membership(
                store, self.rank, self.num_ranks, prefix, secret=self.settings.job_secret,
                replaces=choice.holder if choice is not None and choice.replacing else None)
            if not self.joining:  # epoch 0 holds this incarnation of the rank (a replacement takes it from this one)
                self.membership.bind_incarnation(0, self.rank, self.membership.incarnation)
        self.epoch = self.membership.epoch() if self.joining else 0
        # A joiner is no member until admitted (dispatch and combine refuse until then).
        self.members = () if self.joining else tuple(range(self.num_ranks))
        self._outputs = core.outputs
        self._life = core.life
        # Every region peers map beyond the EP region (switch, KV, EPLB): re-mapped on re-admission.
        self.peer_regions = core.peer_regions = PeerRegions(self)
        core.transport = make_transport(
            transport, group=self.group, rank=self.rank, num_ranks=self.num_ranks,
            num_ep_buffer_bytes=num_ep_buffer_bytes, settings=self.settings, disable_p2p=disable_p2p,
            host_ids=self._host_ids, view_change=self._survivors_view)
        # Weakly: the core outlives the Buffer while a call is in flight, and must not keep a Buffer its caller
        # dropped alive (its finalizer is what stops that call's wait).
        core.make_collective = mooncake_runtime.collective_maker(core, self.group, _weak_view_change(self))
        self._transport.abort_ptr = self._life.abort_ptr  # native waits stop once destroy() raises it
        self.transport = self._transport.name
        self.device = self._transport.device  # the CUDA device of a "cuda" Buffer's tensors; None: CPU tensors
        self._specs = core.specs = CallSpecs(core.token, self.num_ranks, num_ep_buffer_bytes,  # validated call shapes
                                             needs_region=bool(num_ep_buffer_bytes) or self.transport != "collective")
        self._completions = Completions(self._life)
        if self.membership is not None:
            self.membership.publish_endpoint(dict(self._transport.endpoint(), host_id=self.settings.host_id))
        if not self.joining:  # a joiner registers as joining in update_ep_member(), when it waits
            self._connect(construction=True)
            self.peer_regions.snapshot(self.members, self.epoch)  # whose regions participants map (a later one joins)
        elif choice is not None:  # a plain Buffer(group) that replaces this rank: admitted before it returns
            self._admit_replacement(base, choice, deadline)
        if generation is not None:
            replacement.register_member(core, base, generation)

    def _admit_replacement(self, base: str, choice, deadline: float) -> None:
        """Wait, until the constructor's deadline, for the members' `update_ep_member()` to admit this Buffer
        (Mooncake's recovery: a replacement builds a plain Buffer(group) while the others update theirs).
        Not admitted: the Buffer is destroyed (no longer listed as pending) and, while no sealed view binds this
        incarnation, the rank's earlier incarnation is current again (a Buffer of it in this process goes on); the
        error names the incarnation the newest view admitted instead, if any."""
        try:
            elastic_view.update_ep_member(self._core, max(1.0, deadline - time.monotonic()))
        except BaseException as error:
            gave_back, holder = replacement.not_admitted(self.membership)
            self.destroy()
            if not isinstance(error, MembershipError):
                raise
            raise MembershipError(
                f"Buffer: rank {self.rank} builds a Buffer that replaces it in Buffer #{choice.generation} of its "
                f"group, and no member admitted it within the connect timeout ({self.settings.connect_timeout_s} s): "
                f"{error}. The other ranks admit it with update_ep_member() while it is being built"
                + (" (the rank's earlier incarnation is current again)" if gave_back else "") + holder) from error
        if choice.superseding:  # the Buffer this process held before is left out (its calls refuse)
            replacement.supersede(self._core, base, choice.generation)

    # ------------------------------------------------------------------ construction
    def _host_ids(self):
        if self.joining:  # no group yet: the members' published endpoints say where they run
            found = [self.settings.host_id]
            for peer in self.membership.view().ranks:
                if peer != self.rank:
                    try:
                        found.append(self.membership.endpoint(peer)["host_id"])
                    except MembershipError:
                        pass  # not (yet) published, e.g. another replacement: checked at connect
            return found
        host_ids = [None] * self.num_ranks
        dist.all_gather_object(host_ids, self.settings.host_id, group=self.group)
        return host_ids

    # ------------------------------------------------------------------ view state (kept in the core)
    @property
    def epoch(self) -> int:
        """The current membership epoch."""
        return self._core.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._core.epoch = value

    @property
    def members(self) -> tuple:
        """The member ranks of the current epoch (empty for a joiner not yet admitted)."""
        return self._core.members

    @members.setter
    def members(self, value) -> None:
        self._core.members = tuple(value)

    @property
    def joining(self) -> bool:
        """Whether this rank waits to be admitted (a replacement, or a rank left out of a view)."""
        return self._core.joining

    @joining.setter
    def joining(self, value: bool) -> None:
        self._core.joining = value

    @property
    def _fault(self):
        """The test-only fault point (tests set it on a live Buffer)."""
        return self._core.fault

    @_fault.setter
    def _fault(self, value) -> None:
        self._core.fault = value

    def _require_membership(self, what: str):
        return self._core.require_membership(what)

    def connect(self) -> None:
        """Exchange peer metadata and map peers (Mooncake's `connect`); idempotent.

        Returns:
            None.

        Raises:
            MembershipError: this rank is not a member (a joiner connects when `update_ep_member()`
                admits it).
        """
        self._check_alive()
        if self.joining:
            raise MembershipError(f"connect: rank {self.rank} is not a member yet; update_ep_member() admits and "
                                  "connects it")
        self._connect(construction=False)

    def _connect(self, construction: bool) -> None:
        """`connect()`; `construction`: at the constructor (every member connects at once: `members.connect_view`)."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        self._transport.connect_members(View(self.epoch, self.members), self.membership, deadline,
                                        construction=construction)

    def update_ep_member(self, timeout_s: Optional[float] = None) -> View:
        """Agree on the next membership epoch and refresh peers (Mooncake's meaning, elastic).

        Collective over the ranks that continue and any rank waiting to join: every one of them
        calls it. Members: ranks this Buffer saw fail (data-plane timeouts) are reported as
        evidence and not waited for; joiners already waiting are admitted; one member seals the
        next view (joiners never do). Joiners (a replacement built from a `JoinTicket`, or a rank
        that was left out of a view): register as joining (listed by the members'
        `pending_joiners()`) and wait for a member's `update_ep_member()` to admit them; a
        left-out rank first takes a new incarnation (refused if another process took its rank
        over). Peers' memory or endpoints are mapped anew, call tags restart above every tag used
        before, the collective fallback gets a group for the new view, and every buffer stays at
        its address.

        Arguments:
            timeout_s: deadline in seconds for the agreement and the re-connection, a finite
                number > 0 (default: the connect timeout setting). A member waits at most half of
                it for the other members; a joiner waits at most three quarters of it to be admitted.

        Returns:
            view: the new `View` (epoch, member ranks). Reset your `active_ranks` to
                `buffer.active_mask()`.

        Raises:
            TypeError, ValueError: `timeout_s` is not a finite number of seconds > 0.
            MembershipError: a joiner was not admitted before the deadline (it stays listed as
                pending; call it again to be admitted), a member had no quorum to seal the next view
                (the other side of a split seals; call it again), this rank was taken over by another
                process, members could not be reached before the deadline, or a store record is
                malformed or forged.
        """
        core = self._core
        if not core.destroyed and len(core.transport.failed_sources) != core.stats.seen:
            # masks not counted yet (the "cuda" transport's, flagged by the device): before the list is cleared
            core.stats.observe(core, -1, "dispatch/combine", core.call)
        before, was_joining = core.members, core.joining
        view = elastic_view.update_ep_member(core, timeout_s)
        events.view_changed(core.events, core.rank, before, was_joining, view.epoch, view.ranks)
        return view

    def shrink(self, ranks, timeout_s: Optional[float] = None, drain: bool = False) -> View:
        """Remove ranks from the group for good (scale-down): dead ranks, or live ones drained out.

        Collective, between steps, every caller passing the same `ranks` and `drain`. Dead ranks: every
        surviving member calls it. A drain (`drain=True`, vLLM's and SGLang's scale-down of live ranks):
        every member of the view calls it, the drained ranks too, once no token of theirs is in flight and
        no expert is served only by them (`eplb.drain.begin_drain` moves those first). They agree in one
        decision (the store's ballot: a voter that dies or stalls before its vote aborts it everywhere,
        nothing changed), record the ranks as removed and the survivors agree on the next view without
        them. A drained rank's Buffer then refuses dispatch, combine, `update_ep_member()` and `shrink()`
        by name; `destroy()` it. Rank ids stay sparse: `num_ranks` is kept and the removed ranks stay 0
        in `active_mask()`; `update_ep_member()` never waits for them again and a replacement under
        their id is refused by name (buffer/membership/shrink.py; docs/recovery.md, "Shrinking the
        group" and "Draining a live rank").

        Arguments:
            ranks: the ranks to remove. Dead: ranks whose process this rank saw end (`dead_peers()`), or
                ranks already sealed out of the view. Drain: live members of the view (this rank may be one).
            timeout_s: deadline for the vote, the view and the re-connection, a finite number > 0
                (default: the connect timeout setting); half of it for the vote.
            drain: the ranks are live members that leave (every member votes), not dead ones.

        Returns:
            view: the new `View` without `ranks` (on a drained rank too: the survivors' view, sealed).
                Reset your `active_ranks` to `buffer.active_mask()` and place the experts over the view
                (`eplb.shrink_placement.shrink_experts` after a death).

        Raises:
            TypeError, ValueError: `ranks` is not a non-empty list of distinct ranks of the group, holds a
                rank removed already, or would leave no rank; without a drain it holds this rank or a live
                rank, with one a rank outside the view or seen dead; `timeout_s` or `drain` is not valid.
                Nothing changed.
            MembershipError: the shrink aborted on every rank (a voter died or stalled before voting,
                another shrink's ranks); nothing changed, call it again. Or the view after the decision
                could not be agreed (as `update_ep_member()`; the ranks stay removed, call that; a drained
                rank: the survivors did not seal it in time, it is out all the same). Or this rank is no
                member (drained already: named).
            RuntimeError: another shrink or a grow of this Buffer is in progress (named; nothing changed).
        """
        core = self._core
        before = core.members
        view = group_shrink.shrink(core, ranks, timeout_s, drain)
        events.view_changed(core.events, core.rank, before, False, view.epoch, view.ranks)
        return view

    def _survivors_view(self, deadline: float) -> View:
        """The collective fallback's recovery from a lost peer (`elastic_view.survivors_view`)."""
        core = self._core
        before = core.members
        view = elastic_view.survivors_view(core, deadline)
        events.view_changed(core.events, core.rank, before, False, view.epoch, view.ranks)
        return view

    def subscribe(self, callback=None) -> events.Subscription:
        """Subscribe to this Buffer's typed events (buffer/events.py; docs/recovery.md, "Events").

        Arguments:
            callback: called with each event on the thread that found it (quick; it must not call
                the Buffer), or None: the events queue up for `Subscription.poll()` / iteration.

        Returns:
            subscription: a `Subscription`; `close()` ends it.

        Raises:
            TypeError: `callback` is neither None nor callable.
        """
        return self._core.events.subscribe(callback)

    @property
    def _transport(self) -> Transport:
        """The transport running the calls: the core's (`_use_fallback` and a joiner's admission may switch it)."""
        return self._core.transport

    @property
    def runtime(self) -> Transport:
        """The transport that moves this Buffer's bytes (DeepEP's name for its native runtime): what the
        runtime's own modules and benchmarks may use of it is declared in `buffer/transport/contract.py`
        (`Transport`: `peer_routes()`, `transfer_engine()`, `te_peer()`, ...), and it answers Mooncake's
        runtime queries (`ibgda_disabled()`, `p2p_enabled()`, `use_fast_path()`, `is_roce()`:
        `contract.RuntimeQueries`, for the transport the Buffer was built on)."""
        return self._transport

    def output_pool_bytes(self) -> int:
        """Bytes the output pool holds (results returned, and blocks kept for reuse; class docstring).

        Returns:
            nbytes: int.
        """
        return self._outputs.pooled_bytes()

    def stats(self) -> dict:
        """A snapshot of this Buffer's counters, for an engine to export (docs/observability.md;
        `mooncake_ep_switch.metrics` exports it to Prometheus). Reading it costs nothing on the calls'
        path and never blocks; it may be called from another thread (a scrape).

        Returns:
            stats: dict with
                `rank`, `num_ranks`, `transport` (the name of the transport running the calls now),
                `epoch` (the membership epoch: it moves with every `update_ep_member()` and every view
                the collective fallback's recovery agrees), `members` (ranks in that view),
                `calls` (`dispatches + combines`), `dispatches`, `combines` (calls issued, hook and
                async ones included), `dispatch_bytes` (bytes of bf16 token rows given to dispatch:
                num_tokens * hidden * 2 per call), `combine_bytes` (bytes of bf16 rows combine
                returned: num_tokens * hidden * 2 per call), `wait_s` (seconds spent in the transport
                sending and waiting for rows; 0 on `"cuda"`, whose calls return before the device ran),
                `masks` ({`"deadline"`, `"process_end"`, `"link"`: count}: ranks the calls masked in
                `active_ranks`, by cause as the transport saw it; on `"cuda"` counted when a call
                or `update_ep_member()` reads the device's flags: on a GPU the call after the kernels
                flagged the mask, on the emulated device the call that masked).
        """
        return self._core.stats.snapshot(self._core)

    def peer_routes(self) -> list:
        """How this rank reaches each rank now.

        Returns:
            routes: list of `num_ranks` entries: "self", "shm" (shared memory), "te" (Transfer
                Engine), "cuda" (CUDA IPC), "collective" (process-group collectives), or None (not
                reached: a rank outside the current view).
        """
        return self._transport.peer_routes()

    @property
    def process_group(self):
        """The process group of the current view, for structures that run collectives on it.

        Returns:
            group: on the `"collective"` transport (or switched onto it by `_use_fallback`), the group
                the transport runs on now (a per-epoch gloo group after a membership change);
                otherwise the constructor's group
                (None for a replacement: its shared regions are mapped through the store).
        """
        return self._transport.group if self._use_fallback else self.group

    def active_mask(self) -> torch.Tensor:
        """A fresh `active_ranks` tensor for the current view.

        Returns:
            active_ranks: `[num_ranks]` torch.int32, 1 for members of the current epoch (on the
                Buffer's CUDA device for the `"cuda"` transport, else on the CPU).
        """
        mask = torch.zeros(self.num_ranks, dtype=torch.int32)
        mask[list(self.members)] = 1
        return mask if self.device is None else mask.to(self.device)

    def dead_peers(self) -> list:
        """Ranks whose process is known to have ended (seen by the one-sided transports' peer watcher:
        a pidfd on this host, the watch connection across hosts); a stalled or cut-off rank is never
        listed. Cleared for a rank when it is re-admitted. Waits of the caller's own (votes, barriers)
        can stop early for these ranks instead of running to their deadline.

        Returns:
            ranks: list of int, ascending ([] on the collective transport).
        """
        return self._transport.dead_peers()

    def pending_joiners(self) -> list:
        """Ranks registered to be admitted into the next epoch (replacements, left-out ranks).

        When it is non-empty, every member calls `update_ep_member()` to admit them. A joiner is
        listed from the moment it first waits inside its `update_ep_member()` until it is admitted,
        gives up (its Buffer is destroyed) or dies: one whose own call timed out stays registered
        (pending) and is admitted by the members' next `update_ep_member()` once it waits again; a
        dead one is listed until the next view is sealed without it.

        Returns:
            ranks: list of int, ascending.
        """
        membership = self._require_membership("pending_joiners")
        ranks = membership.joining(None if self.joining else self.epoch + 1)
        events.joiners_seen(self._core.events, ranks, self.epoch)
        return ranks

    def switch_layout(self, target: str, **kwargs):
        """Switch the MoE layers between tensor- and expert-parallel layouts (after Moebius).

        Quiesce between steps, reshard the weights layer by layer into peers' free slots, move the
        KV cache, commit; all-or-nothing (see `mooncake_ep_switch.switch.switcher.switch_layout`).

        Arguments:
            target: `"tp"` or `"ep"`.
            weights: the `UnifiedWeights` of this rank (keyword).
            kv_cache: optional `PagedKVCache` (keyword).
            timeout_us: deadline for each wait during the switch (keyword).

        Returns:
            report: a `SwitchReport` (outcome, bytes and milliseconds for weights and KV, total).
        """
        self._check_alive()
        if _LAYOUT_SWITCH is None:
            raise RuntimeError("switch_layout: no layout switch is registered; import mooncake_ep_switch.switch "
                               "(it registers one, and makes the UnifiedWeights this call needs)")
        return _LAYOUT_SWITCH(self, target, **kwargs)

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        """Bytes of EP region a rank needs for calls of this shape.

        Arguments:
            num_max_dispatch_tokens_per_rank: `T`, the most tokens any rank dispatches in one call.
            hidden: hidden size, a positive multiple of 128.
            num_ranks: EP group size `R`.
            num_experts: global number of experts, a multiple of `num_ranks`.

        Returns:
            num_bytes: the size to pass as `num_ep_buffer_bytes`.
        """
        tokens = validation.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        hidden = validation.check_int("hidden", hidden, 1)
        ranks = validation.check_int("num_ranks", num_ranks, 1)
        experts = validation.check_int("num_experts", num_experts, 1)
        return region_layout(ranks, tokens, hidden, experts).total_bytes

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Release the region, peer mappings, endpoints and threads; the Buffer is unusable after.

        Idempotent, and bounded: a receive phase still waiting (an `async_finish` call in the
        background, a hook running on another thread, even with `timeout_us=-1`) is told to stop
        and its event/hook raises RuntimeError; destroy() waits at most `DESTROY_WAIT_S` seconds
        for such calls and their thread, and if one is still running then (a collective the process
        group has not finished), the memory it uses is released when it ends. Later hooks, events
        and calls of this Buffer raise RuntimeError. Tensors over the Buffer's region that the
        caller still holds (`get_next_combine_buffer()`) stay valid memory until they go.
        `__del__` does the same without waiting at all.

        Returns:
            None.
        """
        self._shutdown(DESTROY_WAIT_S)

    def _shutdown(self, wait_s: float) -> None:
        """destroy() with at most `wait_s` seconds spent on running calls (0: never blocks)."""
        core = getattr(self, "_core", None)
        if core is None or core.destroyed or getattr(self, "_transport", None) is None:
            if core is not None:  # the constructor failed before the transport existed
                core.destroyed = True
            return
        core.destroyed = True
        life = core.life
        release_generation = getattr(self, "_release_generation", None)
        if release_generation is not None:
            release_generation()
        if self.membership is not None:  # a joiner that gave up waiting gives up joining now
            try:
                with store_deadline(time.monotonic() + wait_s, "destroy"):  # a stalled store: give up then
                    self.membership.stop_pending(withdraw=wait_s > 0, wait_s=min(wait_s, 1.0))
                    if wait_s > 0:  # a replacement's plain Buffer(group) no longer waits for this generation
                        self.membership.close()
            except Exception:  # noqa: BLE001 - the store is gone: nothing to withdraw from
                pass
        if getattr(self, "_store", None) is not None:
            # Its worker threads end (one still waiting for a stalled store: when it answers; not waited for past 1 s).
            self._store.close(join_s=min(wait_s, 1.0))
        self.peer_regions.clear()
        impl, outputs = self._transport, self._outputs

        def release() -> None:
            outputs.clear()
            impl.destroy()

        deadline = time.monotonic() + wait_s
        life.end(release, wait_s)
        completions = getattr(self, "_completions", None)
        if completions is not None:
            completions.shutdown(deadline)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.destroy()
        return False

    def __del__(self):
        try:
            self._shutdown(0.0)  # never blocks: running calls are told to stop and release the memory
        except Exception:
            pass

    def _check_alive(self) -> None:
        self._core.check_alive()

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, active_ranks: torch.Tensor,
                 num_max_dispatch_tokens_per_rank: int, num_experts: int, timeout_us: int,
                 use_fp8: Optional[bool] = None, async_finish: bool = False, return_recv_hook: bool = False,
                 diagnostic=None) -> DispatchResult:
        """Send every token to the ranks owning its selected experts, packed per local expert.

        Arguments:
            x: `[num_tokens, hidden]` torch.bfloat16, `num_tokens <= num_max_dispatch_tokens_per_rank`,
                `hidden` a multiple of 128.
            topk_idx: `[num_tokens, num_topk]` torch.int64 global expert ids, -1 = no expert.
            active_ranks: `[num_ranks]` torch.int32 (1 active, 0 inactive); sources that miss the
                deadline are set to 0 in place. Inactive ranks are neither sent to nor waited for.
            num_max_dispatch_tokens_per_rank: `T`, the receive capacity per source rank.
            num_experts: global number of experts `E`, a multiple of `num_ranks`.
            timeout_us: per-call deadline for each source in microseconds, -1 = wait forever.
            use_fp8: send FP8 e4m3fn rows with per-128-channel float32 scales (None = True).
            async_finish: return at once; `event.current_stream_wait()` completes the call.
            return_recv_hook: return after the send phase; results are valid after `hook()`.
            diagnostic: Mooncake's newer keyword, accepted and ignored (nothing is filled: per-source
                timeouts are reported in `active_ranks`, membership evidence in `dead_peers()`).

        Returns:
            recv_x: `[E_local, num_ranks * T, hidden]` torch.bfloat16, or with FP8 a tuple
                (`[E_local, num_ranks * T, hidden]` torch.float8_e4m3fn,
                `[E_local, num_ranks * T, hidden // 128]` torch.float32 scales, token axis contiguous).
                Rows of each local expert: by source rank ascending, then source token index.
                Every returned tensor stays valid while held (class docstring: pooled on the host transports).
            recv_count: `[E_local]` torch.int32, valid rows per local expert.
            handle: `DispatchHandle`, Mooncake's 5-tuple (src_info, layout_range, T, hidden, num_experts).
            event: `EventOverlap`.
            hook: the receive-phase callable when `return_recv_hook`, else None.
        """
        if self._core.destroyed:
            self._core.check_alive()
        if type(async_finish) is not bool or type(return_recv_hook) is not bool:
            async_finish = check_flag("async_finish", async_finish)
            return_recv_hook = check_flag("return_recv_hook", return_recv_hook)
        if self.device is not None:
            result = device_calls.dispatch(self._core, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                                           num_experts, timeout_us, use_fp8, async_finish, return_recv_hook)
            stats = self._core.stats
            stats.dispatches += 1
            stats.dispatch_bytes += x.numel() * 2
            return result
        if async_finish and return_recv_hook:
            raise ValueError("async_finish, return_recv_hook: expected at most one of them True, got both")
        if use_fp8 is None:
            use_fp8 = True  # Mooncake's default
        # Hot path: a shape seen before (validated then, capacity included) and well-formed tensors
        # need only the value checks; anything else takes the full validation, which raises the
        # precise error naming the argument.
        spec = self._specs.match_dispatch(x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts,
                                          timeout_us, use_fp8)
        if spec is None:
            spec, timeout_us = self._specs.validate_dispatch(x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                                                        num_experts, timeout_us, use_fp8)
            use_fp8 = spec.use_fp8  # a flag given as np.bool_ or 0/1, as a bool
        if len(self._core.members) < self.num_ranks:
            self._core.check_members(active_ranks)

        outputs = self._outputs.dispatch_outputs(use_fp8, spec.local, spec.rows, spec.hidden, self.num_ranks,
                                                 x.device)
        life = self._life
        life.enter()  # refuses after destroy(); keeps the memory mapped while the send phase runs
        try:
            core = self._core
            core.call += 1
            call = DispatchCall(x, topk_idx, active_ranks, spec.tokens, spec.experts, timeout_us, use_fp8, core.call,
                                core.epoch)
            receipt = None
            stats, transport = core.stats, self._transport
            try:
                if not (async_finish or return_recv_hook):
                    start = perf_counter()
                    transport_plan = transport.dispatch_sync(call, outputs)  # send and receive in one native call
                    stats.wait_s += perf_counter() - start
                    receive = None
                else:
                    transport_plan, receive = transport.dispatch(call, outputs)
                    receive, receipt = with_receipt(stats.timed(receive, core, timeout_us, "dispatch", core.call))
            except LayoutHeld:
                core.call -= 1  # refused before anything was written: the call was not made
                raise
            stats.dispatches += 1
            stats.dispatch_bytes += spec.hidden * x.size(0) * 2
            if len(transport.failed_sources) != stats.seen:  # a peer was masked: count and log it
                stats.observe(core, timeout_us, "dispatch", core.call)
            # combine() checks its topk_idx against this copy: rows exist only for dispatched pairs.
            plan = DispatchPlan(core.call, x.size(0), topk_idx.size(1), use_fp8, core.epoch, transport_plan, spec, receipt,
                                topk_idx.clone(), outputs.src_info.data_ptr())
            core.record_plan(plan)
            handle = DispatchHandle(outputs.src_info, outputs.layout_range, spec.tokens, spec.hidden, spec.experts,
                                    plan=plan)
            if receive is None:
                event, hook = EventOverlap(None, (x, topk_idx, outputs)), None
            else:
                event, hook = self._completions.complete(receive, async_finish, return_recv_hook, (x, topk_idx, outputs))
                if async_finish:
                    receipt.wait = event.current_stream_wait
        finally:
            life.leave()
        packed = (outputs.recv_x, outputs.recv_scales.transpose(1, 2)) if use_fp8 else outputs.recv_x
        return packed, outputs.recv_count, handle, event, hook

    @property
    def latest_call(self) -> int:
        """The call number of the latest call that took one (a dispatch, or a combine of a handle combined
        already): the signal tag sequence; a dispatch's first combine uses the dispatch's number."""
        return self._core.call

    @property
    def group_size(self) -> int:
        """The EP group size, Mooncake's name (SGLang's dispatcher reads it); the same as `num_ranks`."""
        return self.num_ranks

    @property
    def backend(self):
        """The process group the Buffer was built on, Mooncake's name (None for a replacement's Buffer)."""
        return self.group

    @property
    def _use_fallback(self) -> bool:
        """Whether the Buffer's calls run on the collective fallback, Mooncake's name: built on the
        `"collective"` transport, or switched there by setting it. Mooncake's tests set it on every
        rank together, between the same calls (`mooncake_runtime.set_use_fallback`: True moves the
        next calls onto the fallback, exact, False back; a Buffer that cannot switch says why). The
        switch outlives `update_ep_member()`: a replacement or a rank left out takes the members' switch
        when they admit it (its calls run where theirs do; Mooncake re-derives the flag from its
        runtime there instead)."""
        return mooncake_runtime.on_fallback(self._transport)

    @_use_fallback.setter
    def _use_fallback(self, value) -> None:
        self._core.transport = mooncake_runtime.set_use_fallback(
            self._core, value, self.group, self._survivors_view)

    def get_next_combine_buffer(self, handle) -> torch.Tensor:
        """The buffer to write expert outputs into for a zero-copy `combine` of this handle.

        Arguments:
            handle: the handle returned by `dispatch`.

        Returns:
            buffer: `[E_local, num_ranks * T, hidden]` torch.bfloat16; write expert outputs here and
                call `combine(buffer, ..., handle, zero_copy=True)`. It views the region half of the
                handle's call (dispatches of the same parity share it) and keeps that memory mapped
                while it lives, also after `destroy()`.

        Raises:
            RuntimeError: the Buffer was destroyed.
            TypeError, ValueError: `handle` is not a handle of this Buffer's last two dispatches, or a call after
                next (a dispatch, or a combine of a handle combined already) reused its region half.
        """
        self._check_alive()
        _, _, tokens, hidden, experts = validation.check_handle(handle, self.num_ranks, self.device)
        plan = self._core.plan_of(handle)
        mooncake_runtime.check_handle_side(self._transport, plan.transport_plan)
        check_half_free(plan, self._core.call)  # a later call reused the half: writing there clobbers its rows
        shape = (experts // self.num_ranks, self.num_ranks * tokens, hidden)
        self._specs.check_capacity(tokens, hidden, experts)
        return self._transport.combine_buffer(plan.call, shape, handle[0].device)

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                active_ranks: torch.Tensor, timeout_us: int, handle, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                diagnostic=None, *, bias=None) -> CombineResult:
        """Return expert outputs to their token owners and reduce them with the routing weights.

        `combined[t] = bf16(sum_k topk_weights[t, k] * y(topk_idx[t, k], t))`, in float32 and in top-k
        order; entries with `topk_idx == -1` or an inactive owner are skipped (no renormalisation).

        Arguments:
            x: `[E_local, num_ranks * T, hidden]` torch.bfloat16 expert outputs in the dispatch's
                packed layout (with `zero_copy`, the tensor from `get_next_combine_buffer`).
            topk_idx: `[num_tokens, num_topk]` torch.int64, as given to the matching dispatch.
            topk_weights: `[num_tokens, num_topk]` torch.float32.
            active_ranks: `[num_ranks]` torch.int32; owners that miss the deadline are set to 0.
            timeout_us: deadline in microseconds, -1 = wait forever.
            handle: the handle returned by the matching `dispatch` (with `return_recv_hook`, after its
                hook ran; an `async_finish` dispatch is completed first if its event was not waited).
            zero_copy: the expert outputs were written in place into `get_next_combine_buffer(handle)`;
                `x` is then ignored (as in DeepEP and Mooncake: the data is already in the buffer).
            async_finish: return at once; `event.current_stream_wait()` completes the call.
            return_recv_hook: return after the send phase; `out` is valid after `hook()`.
            out: optional `[num_tokens, hidden]` torch.bfloat16 output tensor.
            diagnostic: Mooncake's newer keyword, accepted and ignored (see `dispatch`).
            bias: this runtime's keyword (every transport): None, or one or a pair of `[num_tokens, h]`
                torch.bfloat16 (`h <= hidden`, the same for both; CUDA tensors on the 'cuda' transport)
                that each token's float32 sum starts from: `bf16(bias0 + bias1 + sum_k ...)` on the first
                `h` channels, read where they are by the reduction (never copied or sent).

        Returns:
            combined_x: `[num_tokens, hidden]` torch.bfloat16 (`out` if given, else memory that stays valid
                while held, pooled on the host transports, see the class docstring).
            event: `EventOverlap`.
            hook: the receive-phase callable when `return_recv_hook`, else None.
        """
        if self._core.destroyed:
            self._core.check_alive()
        if type(zero_copy) is not bool or type(async_finish) is not bool or type(return_recv_hook) is not bool:
            zero_copy = check_flag("zero_copy", zero_copy)
            async_finish = check_flag("async_finish", async_finish)
            return_recv_hook = check_flag("return_recv_hook", return_recv_hook)
        if zero_copy:  # the outputs are in the handle's combine buffer already: whatever `x` is, use that
            x = self.get_next_combine_buffer(handle)
        if self.device is not None:
            result = device_calls.combine(self._core, x, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                                          async_finish, return_recv_hook, out, bias)
            stats = self._core.stats
            stats.combines += 1
            stats.combine_bytes += result[0].numel() * 2
            return result
        if async_finish and return_recv_hook:
            raise ValueError("async_finish, return_recv_hook: expected at most one of them True, got both")
        # Hot path: a handle this Buffer returned (its fields were validated when it was made) and
        # well-formed tensors need only the value checks; otherwise the full validation runs.
        spec = self._specs.match_combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle, out,
                                         DispatchHandle)
        if spec is not None:
            plan, src_info, layout_range = handle.plan, handle[0], handle[1]
            tokens, hidden, experts = spec.tokens, spec.hidden, spec.experts
        else:
            fields, timeout_us = validation.check_combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                                                          out, self.num_ranks)
            src_info, layout_range, tokens, hidden, experts = fields
            plan = self._core.plan_of(handle)
        if bias is not None:
            bias = validation.check_combine_bias(bias, topk_idx.size(0), hidden)
        again = plan.combined
        if again:
            check_combinable_again(plan, self._core.last_plan)
        else:
            check_half_free(plan, self._core.call)
        check_same_routing(plan, topk_idx)
        mooncake_runtime.check_handle_side(self._transport, plan.transport_plan)  # the side it was dispatched on
        complete_receive(plan)  # async_finish: the layout is complete once the dispatch's event is
        if len(self._core.members) < self.num_ranks:
            self._core.check_members(active_ranks)
        if out is None:
            out = self._outputs.combine_output(topk_idx.size(0), hidden, x.device)
        life = self._life
        life.enter()  # refuses after destroy(); keeps the memory mapped while the send phase runs
        try:
            # The first combine of a dispatch is its call (its tag, its region half). Every later one is a
            # call of its own, numbered as every rank numbers it (the same sequence of calls everywhere):
            # its own tag and the other half, so no peer still reading the previous combine's rows or
            # signals sees this one's (DeepEP's tests combine each handle twice; its buffer flips halves).
            if again:
                self._core.call += 1
            call = CombineCall(x, topk_idx, topk_weights, active_ranks, timeout_us, src_info, layout_range, tokens,
                               hidden, experts, self._core.call if again else plan.call, plan.transport_plan, out,
                               bias or ())
            plan.mark_combined()
            core, transport = self._core, self._transport
            stats = core.stats
            if not (async_finish or return_recv_hook):
                start = perf_counter()
                transport.combine_sync(call)  # send and receive in one native call
                stats.wait_s += perf_counter() - start
                stats.combines += 1
                stats.combine_bytes += out.size(0) * hidden * 2
                if len(transport.failed_sources) != stats.seen:  # an owner was masked: count and log it
                    stats.observe(core, timeout_us, "combine", call.call)
                return out, EventOverlap(None, (x, topk_idx, topk_weights)), None
            receive = stats.timed(transport.combine(call), core, timeout_us, "combine", call.call)
            stats.combines += 1
            stats.combine_bytes += out.size(0) * hidden * 2
            event, hook = self._completions.complete(receive, async_finish, return_recv_hook, (x, topk_idx, topk_weights))
        finally:
            life.leave()
        return out, event, hook
