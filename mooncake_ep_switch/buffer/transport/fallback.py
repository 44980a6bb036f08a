"""A Buffer's transport that can move onto the collective fallback and back (Mooncake's `_use_fallback`).

Mooncake's Buffer keeps a plain `_use_fallback` attribute: while it is True, dispatch and combine take
the collective path, and its tests force that path by setting it on a live Buffer (every rank at the
same point). `FallbackSwitch` gives a Buffer the same: it stands in for the Buffer's own transport
(the one it was built on, which keeps its region, endpoint and peer mappings) and runs the calls on
that transport or on a `CollectiveTransport` built for the Buffer when first needed.

Rules it keeps:

* a dispatch's combine runs where the dispatch ran; a handle whose dispatch ran on the other side of
  a switch is refused by name (its rows are not where that side looks);
* membership follows: while on the fallback, a new view is connected on both transports (the
  Buffer's own one keeps the regions peers map); while on the Buffer's own transport, the
  collective is connected to the current view when the Buffer next switches to it;
* a rank found dead by either transport is reported once (one `failed_sources` list), and
  `dead_peers()` is what either transport's peer watcher saw end.
"""
import logging
from typing import Callable, List, Optional

from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs
from mooncake_ep_switch.buffer.transport.collective import CollectiveTransport
from mooncake_ep_switch.buffer.transport.contract import RuntimeQueries, Transport

__all__ = ["FallbackSwitch"]

log = logging.getLogger("mooncake_ep_switch.buffer.transport")


class _Routed:
    """A dispatch's transport plan with the transport that made it (its combine must run there)."""

    __slots__ = ("transport", "plan")

    def __init__(self, transport, plan):
        self.transport, self.plan = transport, plan


class FallbackSwitch(RuntimeQueries):
    """The Buffer's own transport and the collective fallback, one of them running the calls.

    Arguments:
        native: the transport the Buffer was built on (a host-memory one: `"shm"` or `"mooncake"`).
        make_collective: builds the `CollectiveTransport` for the Buffer (called once, when first needed).
    """

    def __init__(self, native: Transport, make_collective: Callable[[], CollectiveTransport]):
        self.native = native
        self.collective: Optional[CollectiveTransport] = None
        self._make_collective = make_collective
        self._collective_epoch = None  # the view epoch the collective was last connected to
        self.on_fallback = False
        self.switches = 0  # switches made (every member counts the same: they switch together)
        self.failed_sources: List[int] = native.failed_sources
        self.device = native.device

    # ------------------------------------------------------------------ switching
    @property
    def name(self) -> str:
        """The name of the transport that runs the calls now."""
        return self.active.name

    @property
    def active(self) -> Transport:
        """The transport that runs the calls now."""
        return self.collective if self.on_fallback else self.native

    @property
    def group(self):
        """The process group the fallback runs on now (None before it was first built)."""
        return None if self.collective is None else self.collective.group

    @property
    def abort_ptr(self) -> int:
        """The Buffer's abort word (both transports stop their native waits once it is raised)."""
        return self.native.abort_ptr

    @abort_ptr.setter
    def abort_ptr(self, value: int) -> None:
        self.native.abort_ptr = value
        if self.collective is not None:
            self.collective.abort_ptr = value

    def switch(self, on_fallback: bool, view, membership, deadline: float) -> None:
        """Run the next calls on the fallback (`on_fallback`) or on the Buffer's own transport.

        Arguments:
            on_fallback: True: the collective fallback; False: the Buffer's own transport.
            view: the Buffer's current `View` (the transport switched to is connected to it first).
            membership: the group's `Membership` (None: no store; only epoch 0 can then switch).
            deadline: `time.monotonic()` deadline in seconds for that connection.

        Raises:
            MembershipError: a member missed the connection before `deadline` (nothing switched).
        """
        if on_fallback == self.on_fallback:
            return
        if on_fallback:
            if self.collective is None:
                self._build_collective()
            if self._collective_epoch != view.epoch:
                self.collective.connect_members(view, membership, deadline, construction=False)
                self._collective_epoch = view.epoch
        self.on_fallback = on_fallback
        self.switches += 1
        log.info("rank %d: calls now run on %s (_use_fallback=%s, epoch %d)", self.native.rank,
                 self.active.name, on_fallback, view.epoch)

    def _build_collective(self) -> None:
        """Build the fallback (once): it shares the Buffer's abort word and its list of failed sources."""
        collective = self._make_collective()
        collective.abort_ptr = self.native.abort_ptr
        collective.failed_sources = self.failed_sources  # one list: evidence is reported once
        self.collective, self._collective_epoch = collective, 0

    def adopt(self, on_fallback: bool, switches: int) -> None:
        """Take the members' switch as a joiner admitted into their view (before it connects): its calls
        run where theirs do and its next switch meets theirs (`switches`: the count their barrier carries).
        The fallback, when the members run on it, is built here and connected to the view by
        `connect_members`, with the members'.

        Arguments:
            on_fallback: whether the members' calls run on the collective fallback.
            switches: how many switches the members made.
        """
        if on_fallback and self.collective is None:
            self._build_collective()
        if on_fallback:
            self._collective_epoch = None  # connected to the view by connect_members
        self.on_fallback, self.switches = on_fallback, switches
        log.info("rank %d: admitted onto the members' path: calls run on %s (_use_fallback=%s, %d switches)",
                 self.native.rank, self.active.name, on_fallback, switches)

    # ------------------------------------------------------------------ membership (contract.Transport)
    def endpoint(self) -> dict:
        """The Buffer's own transport's endpoint (peers map and watch it; the fallback needs none)."""
        return self.native.endpoint()

    def connect_members(self, view, membership, deadline: float, construction: bool = False) -> None:
        """Connect the Buffer's own transport to `view`, and the fallback too while it runs the calls
        (`construction`: at the Buffer's construction, as every transport's `connect_members` takes it)."""
        self.native.connect_members(view, membership, deadline, construction=construction)
        if self.on_fallback:
            self.collective.connect_members(view, membership, deadline, construction=construction)
            self._collective_epoch = view.epoch

    def dead_peers(self) -> List[int]:
        """Ranks either transport's peer watcher saw end, ascending."""
        found = set(self.native.dead_peers())
        if self.collective is not None:
            found.update(self.collective.dead_peers())
        return sorted(found)

    def mask_cause(self, rank: int) -> str:
        """Why a call masked `rank`, as the transport running the calls now saw it (a process either
        transport's peer watcher saw end: `"process_end"`)."""
        return "process_end" if rank in self.dead_peers() else self.active.mask_cause(rank)

    def peer_routes(self) -> List[Optional[str]]:
        """How the calls reach each rank now (the active transport's routes)."""
        return self.active.peer_routes()

    def latest_call(self, host_call: int) -> int:
        """The Buffer's own count (both transports move host memory)."""
        return self.native.latest_call(host_call)

    def transfer_engine(self):
        """The Buffer's own transport's Transfer Engine endpoint (peer regions are registered there)."""
        return self.native.transfer_engine()

    def te_peer(self, peer: int):
        """How `peer` is reached over the Transfer Engine by the Buffer's own transport."""
        return self.native.te_peer(peer)

    # ------------------------------------------------------------------ runtime queries (Mooncake's)
    def maps_peer_memory(self) -> bool:
        """The Buffer's own transport's answer (Mooncake's queries describe the runtime, not the switch)."""
        return self.native.maps_peer_memory()

    @property
    def fast_path(self) -> bool:
        """The Buffer's own transport's answer."""
        return self.native.fast_path

    # ------------------------------------------------------------------ calls
    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs):
        """Send phase on the active transport; the plan remembers which one ran it."""
        active = self.active
        plan, receive = active.dispatch(call, outputs)
        return _Routed(active, plan), receive

    def dispatch_sync(self, call: DispatchCall, outputs: DispatchOutputs):
        """Both phases on the active transport; the plan remembers which one ran it."""
        active = self.active
        return _Routed(active, active.dispatch_sync(call, outputs))

    def check_side(self, transport_plan) -> object:
        """The plan of a dispatch that ran on the transport active now (ValueError naming `handle` otherwise).

        Arguments:
            transport_plan: the plan this transport's `dispatch` returned (kept on the handle).

        Returns:
            plan: the plan of the transport that ran the dispatch.

        Raises:
            ValueError: the dispatch ran on the other side of a switch since made.
        """
        # A plan without the record was made before the switch existed: by the Buffer's own transport.
        routed = transport_plan
        owner, plan = (routed.transport, routed.plan) if isinstance(routed, _Routed) else (self.native, routed)
        if owner is not self.active:
            raise ValueError(f"handle: its dispatch ran on the {owner.name!r} transport, but `_use_fallback` has "
                             f"moved the Buffer's calls to {self.active.name!r} since; combine a handle before "
                             "switching, or dispatch again")
        return plan

    def _owner(self, call: CombineCall) -> CombineCall:
        return call._replace(transport_plan=self.check_side(call.transport_plan))

    def combine(self, call: CombineCall):
        """Send phase of the combine on the transport its dispatch ran on (ValueError naming `handle` if
        the Buffer switched since)."""
        return self.active.combine(self._owner(call))

    def combine_sync(self, call: CombineCall) -> None:
        """Both phases of the combine, as `combine`."""
        self.active.combine_sync(self._owner(call))

    def combine_buffer(self, call: int, shape, device):
        """The active transport's zero-copy combine buffer of dispatch `call`."""
        return self.active.combine_buffer(call, shape, device)

    def destroy(self) -> None:
        """Release both transports (idempotent)."""
        try:
            if self.collective is not None:
                self.collective.destroy()
        finally:
            self.native.destroy()
