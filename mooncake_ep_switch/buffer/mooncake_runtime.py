"""What Mooncake's Buffer offers beyond its calls: the `_use_fallback` switch and the runtime queries.

Mooncake's `Buffer._use_fallback` is a plain attribute its tests set on a live Buffer (every rank at
the same point, `mooncake-ep/tests/test_ep_grid.py`) to force the collective path; its
`buffer.runtime` answers `ibgda_disabled()`, `p2p_enabled()`, `use_fast_path()` and `is_roce()`
(diagnostic scripts print them; DeepEP V2's ElasticBuffer over Mooncake calls them on its own
`runtime`, which here is a `Buffer`). `set_use_fallback` does the switch for a Buffer
(`buffer/transport/fallback.py` runs it); `MooncakeRuntimeQueries` gives the Buffer the queries.
A rank admitted into the members' view (a replacement, a rank left out) takes their switch first
(`take_members_switch`, from the record `publish_switch` writes): its calls run where theirs do and
its next switch meets theirs.
"""
import time
from typing import Callable

import torch.distributed as dist

from mooncake_ep_switch.buffer.core import BufferCore
from mooncake_ep_switch.buffer.membership.protocol import View
from mooncake_ep_switch.buffer.transport.collective import CollectiveTransport
from mooncake_ep_switch.buffer.transport.contract import Transport
from mooncake_ep_switch.buffer.transport.fallback import FallbackSwitch
from mooncake_ep_switch.checks import check_flag
from mooncake_ep_switch.errors import MembershipError

__all__ = ["MooncakeRuntimeQueries", "check_handle_side", "collective_maker", "on_fallback", "publish_switch",
           "set_use_fallback", "take_members_switch"]


def on_fallback(transport: Transport) -> bool:
    """Whether a Buffer on `transport` runs its calls on the collective fallback (built on it, or switched)."""
    return transport.name == "collective"


def check_handle_side(transport: Transport, transport_plan) -> None:
    """Refuse (ValueError naming `handle`) a handle whose dispatch ran on the other side of a `_use_fallback`
    switch; nothing to check on a Buffer that never switched. Runs before a combine changes any state."""
    if type(transport) is FallbackSwitch:
        transport.check_side(transport_plan)


def _backend_name(group) -> str:
    """The backend of `group`, lower case: torch's record of it, or the group's own for one torch never
    registered (a grown group, made through the store: `dist.get_backend` refuses it)."""
    try:
        return str(dist.get_backend(group)).lower()
    except ValueError:  # "... is not initialized in the world group map"
        return str(group.name()).lower()


def _refusal(core: BufferCore, group):
    """Why the Buffer of `core` cannot move to the fallback (an exception naming `_use_fallback`), or None."""
    transport = core.transport
    if transport.device is not None:
        return ValueError(f"_use_fallback: expected False on a {transport.name!r} Buffer, got True (its calls take "
                          f"CUDA tensors on {transport.device}; the collective fallback packs host tensors only)")
    if core.joining:
        return MembershipError(f"_use_fallback: rank {core.rank} is not a member of the current view (a joiner "
                               "not yet admitted, or a rank left out); update_ep_member() admits it first")
    if core.epoch == 0 and group is None:
        return ValueError("_use_fallback: expected False on a Buffer built without a process group (a "
                          "replacement's, before any new view), got True: the fallback runs on the group's collectives")
    if core.epoch > 0 and core.membership is None:
        return ValueError("_use_fallback: expected False on a Buffer without the group's store, got True (the "
                          "fallback of a later view runs on a group built through the store)")
    if group is not None and core.epoch == 0 and _backend_name(group) == str(dist.Backend.NCCL):
        return ValueError("_use_fallback: expected False on a Buffer whose process group is NCCL only, got True "
                          "(the fallback exchanges host tensors: it needs a gloo group, or one with a CPU backend)")
    return None


def set_use_fallback(core: BufferCore, value, group, view_change) -> Transport:
    """Move a Buffer's next calls onto the collective fallback (`value` True) or back (False).

    Every member sets it together, between the same calls (Mooncake's rule); the members meet in the
    group's store first (a rank that does not come by the connect timeout is named). The first switch
    builds the collective transport for the Buffer (on its process group in epoch 0, else on a group
    of the current view built through the store); the Buffer's own transport keeps its region and
    peer mappings, and the Buffer switches back to it with False. A dispatch's handle is combined on
    the transport its dispatch ran on (one dispatched before the switch is refused by name after it).

    Arguments:
        core: the Buffer's `BufferCore` (its transport, view and membership).
        value: a flag (`checks.check_flag`: bool, np.bool_ or 0/1).
        group: the Buffer's process group (None for a replacement's Buffer).
        view_change: the Buffer's survivors-view callback, for the collective's recovery from a lost peer.

    Returns:
        transport: the transport the Buffer runs on from now (its `FallbackSwitch` once switched).

    Raises:
        TypeError, ValueError: `value` is no flag; or True on a Buffer that cannot run the fallback (a
            `"cuda"` Buffer, one without a process group or store to build it on, an NCCL-only
            group), or False on a Buffer built on the `"collective"` transport (it has no other path).
        MembershipError: this rank is no member of the current view, or a member did not switch within
            the connect timeout (`missing` names it; nothing switched).
        BufferDestroyed: the Buffer was destroyed.
    """
    value = check_flag("_use_fallback", value)
    core.check_alive()
    transport = core.transport
    if not isinstance(transport, FallbackSwitch):
        if transport.name == "collective":
            if not value:
                raise ValueError("_use_fallback: expected True on a Buffer built on the 'collective' transport "
                                 "(it has no other path to return to), got False")
            return transport
        if not value:
            return transport
        refusal = _refusal(core, group)
        if refusal is not None:
            raise refusal
        # The Buffer's own maker when it has one (built once, holding the Buffer weakly), as an admission uses.
        transport = FallbackSwitch(transport, core.make_collective or collective_maker(core, group, view_change))
    if value == transport.on_fallback:
        return transport
    deadline = time.monotonic() + core.settings.connect_timeout_s
    view = View(core.epoch, core.members)
    if core.membership is not None:  # every member switches at the same point of its call sequence
        core.membership.barrier(f"use_fallback/{core.epoch}/{core.call}/{transport.switches}/{int(value)}",
                                view.ranks, deadline)
    transport.switch(value, view, core.membership, deadline)
    return transport


def collective_maker(core: BufferCore, group, view_change) -> Callable[[], CollectiveTransport]:
    """How the Buffer of `core` builds its collective fallback when first needed (`core.make_collective`).

    Arguments:
        core: the Buffer's `BufferCore`.
        group: the Buffer's process group (the fallback's in epoch 0; None for a replacement's Buffer,
            whose fallback runs on a group of a later view made through the store).
        view_change: the Buffer's survivors-view callback, for the collective's recovery from a lost peer.

    Returns:
        make: a function of no arguments returning a new `CollectiveTransport`.
    """
    return lambda: CollectiveTransport(group, core.rank, core.num_ranks, view_change=view_change,
                                       settings=core.settings)


def publish_switch(core: BufferCore, epoch: int) -> None:
    """A member's half of an admission: record its `_use_fallback` switch for the joiners of `epoch`
    (before it connects to the view; every member writes the same, they switched together).

    Arguments:
        core: the member Buffer's `BufferCore` (with the group's store).
        epoch: the epoch just agreed.
    """
    transport = core.transport
    if isinstance(transport, FallbackSwitch):
        core.membership.publish_fallback_state(epoch, transport.on_fallback, transport.switches)
    else:
        core.membership.publish_fallback_state(epoch, on_fallback(transport), 0)


def take_members_switch(core: BufferCore, epoch: int, deadline: float) -> None:
    """A joiner's half of an admission into `epoch`, before it connects: take the members' switch (their
    `publish_switch` record), so that its calls run on the path theirs do (the fallback's group of the
    view is then built with theirs) and its next `_use_fallback` meets theirs. A Buffer built on the
    collective transport, like members that never switched, has nothing to take.

    Arguments:
        core: the joiner Buffer's `BufferCore`; its `transport` becomes a `FallbackSwitch` when the
            members switched.
        epoch: the epoch that admitted it.
        deadline: `time.monotonic()` deadline in seconds for the members' record.

    Raises:
        MembershipError: the members published no record before `deadline`, or they switched and this
            rank's Buffer cannot (a `"cuda"` one, or one without a fallback to build).
    """
    membership = core.membership
    state = membership.wait_for(lambda: membership.fallback_state(epoch), deadline,
                                f"the members' _use_fallback switch of epoch {epoch}")
    transport = core.transport
    if not isinstance(transport, FallbackSwitch):
        if state["switches"] == 0 or transport.name == "collective":
            return
        if transport.device is not None or core.make_collective is None:
            raise MembershipError(f"_use_fallback: the members of epoch {epoch} switched their calls (now on "
                                  f"{'the collective fallback' if state['on'] else 'their own transport'}, "
                                  f"{state['switches']} switches), but rank {core.rank}'s {transport.name!r} Buffer "
                                  "cannot switch (the collective fallback packs host tensors; build the "
                                  "replacement's Buffer as the members built theirs)")
        transport = core.transport = FallbackSwitch(transport, core.make_collective)
    transport.adopt(state["on"], state["switches"])


class MooncakeRuntimeQueries:
    """Mooncake's runtime queries on a Buffer, answered by its transport (`buffer.runtime`): DeepEP V2's
    ElasticBuffer over Mooncake calls them on its own `runtime`, which here is a Buffer. They describe
    the transport the Buffer was built on, as Mooncake's describe its native runtime (the
    `_use_fallback` switch does not change them)."""

    def ibgda_disabled(self) -> bool:
        """True: no transport here posts RDMA from GPU kernels (see `contract.RuntimeQueries`).

        Returns:
            disabled: bool.
        """
        return self.runtime.ibgda_disabled()

    def p2p_enabled(self) -> bool:
        """Whether same-host peers may be reached through peer-to-peer memory (see `contract.RuntimeQueries`).

        Returns:
            enabled: bool.
        """
        return self.runtime.p2p_enabled()

    def use_fast_path(self) -> bool:
        """Whether the Buffer's own transport is a one-sided one rather than the collective fallback.

        Returns:
            fast: bool.
        """
        return self.runtime.use_fast_path()

    def is_roce(self) -> bool:
        """False: no IBGDA NIC is in use (see `contract.RuntimeQueries`).

        Returns:
            roce: bool.
        """
        return self.runtime.is_roce()
