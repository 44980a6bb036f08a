"""`BufferCore`: what a Buffer's own helper modules may use of it, declared in one place.

`Buffer` (buffer.py) validates and numbers calls; the host path runs there, the device path in
`device_calls.py`, and membership changes in `elastic_view.py`. Those two modules used to reach
into the Buffer's private attributes; they now get this object instead, which holds the Buffer's
view state (epoch, members, joining, the call counter), its collaborators (transport, lifetime,
output pool, call specs, membership, fault point) and the plans of its last two dispatches. One
Buffer owns one core; it is mutated only by that Buffer and those modules, from the thread that
runs the Buffer's calls (a Buffer, like DeepEP's, is not thread-safe for concurrent calls).
"""
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import torch

from mooncake_ep_switch.buffer.call_spec import CallSpecs
from mooncake_ep_switch.buffer.events import EventBus
from mooncake_ep_switch.buffer.output_pool import OutputPool
from mooncake_ep_switch.buffer.handle import DispatchPlan
from mooncake_ep_switch.buffer.lifetime import Lifetime
from mooncake_ep_switch.buffer.stats import CallStats
from mooncake_ep_switch.buffer.transport.contract import Transport
from mooncake_ep_switch.errors import BufferDestroyed, MembershipError

__all__ = ["BufferCore"]


@dataclass(eq=False)  # no slots: replacement.py keeps weak references to cores
class BufferCore:
    """A Buffer's state and collaborators, for its helper modules (see the module docstring).

    Fields:
        rank, num_ranks: this rank and the group size.
        settings: the runtime `Settings` the Buffer read at construction.
        transport: the `Transport` that moves the bytes (`buffer/transport/contract.py`).
        life: the Buffer's `Lifetime` (calls enter and leave; destroy() ends it).
        outputs: the `OutputPool` results come from.
        specs: the validated call shapes (`CallSpecs`).
        membership: the group's `Membership` records, or None without a store.
        fault: the test-only `FaultPoint`, or None.
        peer_regions: the `PeerRegions` re-mapped on re-admission.
        token: identifies this Buffer's handles and specs.
        epoch, members, joining: the current view (a joiner has no members yet).
        rejoin: left out of a view: take a new incarnation before registering as joining.
        call: the call counter (the tag of the latest call).
        last_plan, prev_plan: the plans of the last two dispatches (handles of older ones are refused).
        destroyed: destroy() ran.
        drained: why this rank is no member for good (`Buffer.shrink(ranks, drain=True)` drained it out), or
            "" (the message its dispatch, combine, update_ep_member and shrink raise, `check_not_drained`).
        stats: the `CallStats` counters of `Buffer.stats()` (and the log lines of masks).
        events: the `EventBus` of `Buffer.subscribe()` (buffer/events.py).
        make_collective: builds the Buffer's collective fallback (`mooncake_runtime.collective_maker`), for a
            joiner that takes the members' `_use_fallback` switch at admission; None: not given.
    """

    rank: int
    num_ranks: int
    settings: Any
    life: Lifetime = field(default_factory=Lifetime)
    outputs: OutputPool = field(default_factory=OutputPool)
    token: object = field(default_factory=object)
    peer_regions: Optional[Any] = None
    membership: Optional[Any] = None
    fault: Optional[Any] = None
    transport: Optional[Transport] = None
    specs: Optional[CallSpecs] = None
    epoch: int = 0
    members: Tuple[int, ...] = ()
    joining: bool = False
    rejoin: bool = False
    call: int = 0
    last_plan: Optional[DispatchPlan] = None
    prev_plan: Optional[DispatchPlan] = None
    destroyed: bool = False
    drained: str = ""
    stats: CallStats = field(default_factory=CallStats)
    events: EventBus = field(default_factory=EventBus)
    make_collective: Optional[Any] = None

    def check_alive(self) -> None:
        """Raises BufferDestroyed once the Buffer was destroyed."""
        if self.destroyed:
            raise BufferDestroyed("Buffer: this buffer was destroyed")

    def check_not_drained(self) -> None:
        """Raises MembershipError (naming the drain) once a drain took this rank out of the group for good."""
        if self.drained:
            raise MembershipError(self.drained)

    def require_membership(self, what: str):
        """The group's membership records (RuntimeError naming `what` when the Buffer has no store)."""
        if self.membership is None:
            raise RuntimeError(f"{what}: needs the group's store (pass store= to Buffer, or initialise "
                               "torch.distributed with a store)")
        return self.membership

    def check_members(self, active_ranks: torch.Tensor) -> None:
        """This rank is a member of the current view and `active_ranks` masks every rank outside it.

        Raises:
            MembershipError: this rank is not a member (a joiner, or a rank left out).
            ValueError: `active_ranks` has 1 for a rank outside the view.
        """
        if self.rank not in self.members:
            self.check_not_drained()
            raise MembershipError(f"rank {self.rank} is not a member of the current view (a joiner not yet "
                                  "admitted, or a rank that was left out): call update_ep_member() to be admitted "
                                  "before dispatch or combine")
        if len(self.members) < self.num_ranks:
            mask = active_ranks.tolist()  # one read (on a CUDA mask, one synchronisation)
            outside = [r for r in range(self.num_ranks) if r not in self.members and mask[r]]
            if outside:
                raise ValueError(f"active_ranks: expected 0 for ranks outside epoch {self.epoch} (members "
                                 f"{list(self.members)}), got 1 for {outside}; reset it to buffer.active_mask()")

    def record_plan(self, plan: DispatchPlan) -> None:
        """`plan` is the latest dispatch's; the one before it stays combinable."""
        self.prev_plan, self.last_plan = self.last_plan, plan

    def plan_of(self, handle) -> DispatchPlan:
        """The dispatch `handle` stands for: its own plan, or for a plain 5-tuple, the one of the
        last two dispatches whose src_info tensor it carries (ValueError naming `handle` otherwise)."""
        plan = getattr(handle, "plan", None)
        if plan is not None:
            if plan.spec is not None and plan.spec.owner is not self.token:
                raise ValueError("handle: expected a handle returned by this Buffer's dispatch(), got one of "
                                 "another Buffer")
            return plan
        src = handle[0].data_ptr()
        for plan in (self.last_plan, self.prev_plan):
            if plan is not None and plan.src_ptr == src:
                return plan
        raise ValueError("handle: expected the handle of one of this Buffer's last two dispatches (a plain "
                         "5-tuple is recognised by its src_info tensor), got a tuple matching none")
