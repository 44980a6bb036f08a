"""Elastic orchestration of a `Buffer`: agreeing on views and re-admitting ranks (rules in membership.py).

`Buffer.update_ep_member()` and the collective fallback's failure recovery delegate here. A member
reports the failures it saw, agrees on the next view and reconnects; a joiner (a replacement, or a
member left out of a view) registers as joining, waits to be admitted, connects, and takes over
or rebuilds its shared regions (`peer_regions.PeerRegions`). The functions take the Buffer's
`BufferCore` (core.py), read and update its view state (`epoch`, `members`, `joining`, `rejoin`,
the call counter) and use its transport, membership and peer regions; nothing else of the Buffer.
"""
import logging
import time
from typing import Iterable, Optional

from mooncake_ep_switch.buffer import mooncake_runtime
from mooncake_ep_switch.buffer.core import BufferCore
from mooncake_ep_switch.buffer.membership.protocol import LeftOut, MembershipError, View, check_seconds
from mooncake_ep_switch.buffer.membership.removed import refuse_removed, removed_ranks
from mooncake_ep_switch.buffer.events import RankLeftOut
from mooncake_ep_switch.buffer.membership.store_deadline import store_deadline

# How long survivors of a lost collective wait for a member that is not known dead to meet the failure
# too, before they seal the next view without it (it is then left out and rejoins).
SLOW_SURVIVOR_S = 10.0
# How update_ep_member() shares its deadline (the rest of each step's budget goes to the next step):
JOINER_ADMIT_SHARE = 0.75  # a joiner waits this much of it to be admitted, the rest to connect
MEMBER_AGREE_SHARE = 0.5  # a member waits this much for the others (a dead one cannot eat the connect time)
CONNECT_ATTEMPT_SHARE = 0.5  # one connect attempt takes this much of what is left (a member that died
MIN_CONNECT_ATTEMPT_S = 2.0  # after the seal is found missing in time to agree again), at least this long

log = logging.getLogger("mooncake_ep_switch.buffer.membership")

__all__ = ["left_out", "left_out_by_replacement", "survivors_view", "update_ep_member"]


def update_ep_member(core: BufferCore, timeout_s: Optional[float] = None, exclude: Iterable[int] = (),
                     skip_dead: bool = False) -> View:
    """The work of `Buffer.update_ep_member()` (see its docstring), for the Buffer of `core`; `exclude`: ranks
    not waited for, `skip_dead`: nor ranks seen dead meanwhile (a shrink's view, membership/shrink.py)."""
    core.check_alive()
    core.check_not_drained()  # a drained rank is out for good: named, before the joiner's path would say "removed"
    timeout_s = check_seconds("timeout_s", timeout_s, allow_none=True)
    membership = core.require_membership("update_ep_member")
    deadline = time.monotonic() + (core.settings.connect_timeout_s if timeout_s is None else timeout_s)
    with store_deadline(deadline, "update_ep_member"):  # a stalled store host: StoreUnavailable at the deadline
        return _agree_and_connect(core, membership, deadline, set(exclude), skip_dead)


def _agree_and_connect(core: BufferCore, membership, deadline: float, exclude: set, skip_dead: bool = False) -> View:
    """update_ep_member() until `deadline`: agree on the next view (or be admitted), connect, hand over regions."""
    # Calls that ran without the host (CUDA graph replays) count too: the agreed number is above them.
    # (On the cuda transport this waits for the device, so the failures read next are all there.)
    core.call = core.transport.latest_call(core.call)
    failed = set(core.transport.failed_sources)
    while True:
        try:
            if core.joining:
                refuse_removed(membership, core.rank)  # a removed rank's id is never admitted again (shrink)
                if core.rejoin:  # a left-out rank comes back as a new incarnation of itself
                    membership.reincarnate()
                    membership.publish_endpoint(dict(core.transport.endpoint(), host_id=core.settings.host_id))
                    core.rejoin = False
                core.epoch = membership.epoch()
                for _ in range(64):  # a view sealed before the epoch counter moved: skip it
                    if not membership.sealed(core.epoch + 1):
                        break
                    core.epoch += 1
                # Most of the budget to be admitted, the rest to connect once admitted.
                admit_by = time.monotonic() + JOINER_ADMIT_SHARE * (deadline - time.monotonic())
                view = membership.agree_next_view(core.epoch, (), admit_by, call=core.call, joining=True)
            else:
                membership.report_failures(failed)
                # Removed ranks (a shrink) are never waited for, even when still in this view.
                expected = set(core.members) - failed - exclude - set(removed_ranks(membership))
                # Half the remaining budget to agree (a dead member is waited for until then), the
                # rest to connect, so a dead expected rank cannot eat the time the live ones need.
                agree_by = time.monotonic() + MEMBER_AGREE_SHARE * (deadline - time.monotonic())
                view = membership.agree_next_view(core.epoch, expected, agree_by, call=core.call,
                                                  dead=core.transport.dead_peers,
                                                  stall_deadline=agree_by if skip_dead else None)
        except LeftOut as error:
            left_out(core, error)
            if time.monotonic() >= deadline:
                raise
            continue  # sealed without this rank: (re)register as joining within this call's deadline
        if core.fault is not None:
            core.fault.hit("update_after_ready", core.rank)
        # Every member starts its call counter at one agreed value above every tag used so far.
        core.call = membership.max_call(view.epoch, view.ranks) + 2
        admitted = core.joining
        _log_view(core, view, "admitted into" if admitted else "agreed")
        core.epoch, core.members, core.joining = view.epoch, view.ranks, False
        core.transport.failed_sources.clear()
        core.stats.resync(core.transport)  # masks are counted from the cleared list on
        if admitted:  # run the calls where the members run theirs (Mooncake's `_use_fallback`), then connect
            mooncake_runtime.take_members_switch(core, view.epoch, deadline)
        else:
            mooncake_runtime.publish_switch(core, view.epoch)
        try:
            # Half the remaining budget per attempt: a member that died after the view was
            # sealed is found missing in time to agree again without it.
            attempt = time.monotonic() + max(MIN_CONNECT_ATTEMPT_S, CONNECT_ATTEMPT_SHARE * (deadline - time.monotonic()))
            core.transport.connect_members(view, membership, min(attempt, deadline), construction=False)
        except MembershipError as error:
            if not error.missing or time.monotonic() >= deadline:
                raise
            failed = set(error.missing)  # a member died after the view was sealed: agree again
            continue
        if membership.sealed(view.epoch + 1):
            failed = set()  # the others moved on without this rank meanwhile: it finds out and rejoins
            continue
        if admitted:  # learn what to rebuild (or re-map what this rank still has)
            core.peer_regions.admitted(view, deadline)
        else:  # hand the joiners their state and map their regions as they rebuild them
            try:
                core.peer_regions.readmit(view, deadline)
            except MembershipError as error:
                core.transport.failed_sources.extend(error.missing)  # the next update_ep_member() drops them
                core.stats.resync(core.transport)  # evidence, no mask of a call
                raise
        return view


def left_out(core: BufferCore, error: LeftOut) -> None:
    """This rank is no member any more (a view was sealed without it): dispatch and combine
    refuse until `update_ep_member()` admits it again as a new incarnation."""
    if not core.joining:
        log.warning("rank %d was left out of epoch %d (a view was sealed without it): dispatch and combine refuse "
                    "until update_ep_member() admits it again", core.rank, core.epoch)
        core.joining, core.rejoin, core.members = True, True, ()
        if core.events.active:
            core.events.emit(RankLeftOut((core.rank,), core.epoch + 1))


def _log_view(core: BufferCore, view: View, how: str) -> None:
    """One INFO line per view a Buffer takes: the epoch, its members, who left and who joined."""
    if log.isEnabledFor(logging.INFO):
        before, after = set(core.members), set(view.ranks)
        log.info("rank %d %s epoch %d (was %d): members %s, left %s, joined %s", core.rank, how, view.epoch,
                 core.epoch, list(view.ranks), sorted(before - after), sorted(after - before))


def left_out_by_replacement(core: BufferCore) -> None:
    """A newer Buffer of this process was admitted in place of this rank (Mooncake's recovery,
    `replacement.py`): the Buffer of `core` is left out for good; its `update_ep_member()` finds the rank taken over."""
    log.info("rank %d: a newer Buffer of this process replaced this one (epoch %d); its calls refuse from now on",
             core.rank, core.epoch)
    core.joining, core.rejoin, core.members = True, True, ()


def survivors_view(core: BufferCore, deadline: float) -> View:
    """Agree with the other survivors on the next view and reconnect (a collective lost a peer).

    Every current member that is still alive posts readiness; the dead never do, so the view
    is sealed at `deadline` without them. A rank left out of it raises `LeftOut` (its message
    says to call `update_ep_member()` to rejoin).
    """
    membership = core.require_membership("the collective fallback's failure recovery")
    if core.joining:
        raise MembershipError(f"rank {core.rank} is not a member of the group (joining or left out); call "
                              "update_ep_member() to be admitted")
    # Never wait for a rank whose process ended (the peer watcher); wait up to SLOW_SURVIVOR_S for one
    # that is alive but has not met the failure yet (descheduled, in a GC pause, computing): a survivor
    # is sealed out only when it is silent that long, never for noticing late.
    stall_deadline = max(deadline, time.monotonic() + SLOW_SURVIVOR_S)
    try:
        view = membership.agree_next_view(core.epoch, set(core.members), deadline, call=core.call,
                                          dead=core.transport.dead_peers, stall_deadline=stall_deadline)
    except LeftOut as error:
        left_out(core, error)
        raise
    _log_view(core, view, "agreed (a collective lost a peer)")
    core.epoch, core.members = view.epoch, view.ranks
    mooncake_runtime.publish_switch(core, view.epoch)  # for a joiner the seal may have admitted too
    core.transport.connect_members(view, membership, max(deadline, time.monotonic() + 5.0), construction=False)
    return view
