"""Elastic orchestration of a `Buffer`: agreeing on views and re-admitting ranks (rules in membership.py).

`Buffer.update_ep_member()` and the collective fallback's failure recovery delegate here. A member
reports the failures it saw, agrees on the next view and reconnects; a joiner (a replacement, or a
member left out of a view) registers as joining, waits to be admitted, connects, and takes over
or rebuilds its shared regions (`peer_regions.PeerRegions`). The functions read and update the
Buffer's view state (`epoch`, `members`, `joining`, the call counter) and nothing else of it.
"""
import time
from typing import Optional

from mooncake_ep_switch.buffer.membership import LeftOut, MembershipError, View, check_seconds

# How long survivors of a lost collective wait for a member that is not known dead to meet the failure
# too, before they seal the next view without it (it is then left out and rejoins).
SLOW_SURVIVOR_S = 10.0

__all__ = ["left_out", "left_out_by_replacement", "survivors_view", "update_ep_member"]


def update_ep_member(buffer, timeout_s: Optional[float] = None) -> View:
    """The work of `Buffer.update_ep_member()` (see its docstring), for `buffer`."""
    buffer._check_alive()
    timeout_s = check_seconds("timeout_s", timeout_s, allow_none=True)
    membership = buffer._require_membership("update_ep_member")
    deadline = time.monotonic() + (buffer.settings.connect_timeout_s if timeout_s is None else timeout_s)
    # Calls that ran without the host (CUDA graph replays) count too: the agreed number is above them.
    # (On the cuda transport this waits for the device, so the failures read next are all there.)
    buffer._call = buffer._impl.latest_call(buffer._call)
    failed = set(buffer._impl.failed_sources)
    while True:
        try:
            if buffer.joining:
                if buffer._rejoin:  # a left-out rank comes back as a new incarnation of itself
                    membership.reincarnate()
                    membership.publish_endpoint(dict(buffer._impl.endpoint(), host_id=buffer.settings.host_id))
                    buffer._rejoin = False
                buffer.epoch = membership.epoch()
                for _ in range(64):  # a view sealed before the epoch counter moved: skip it
                    if not membership.sealed(buffer.epoch + 1):
                        break
                    buffer.epoch += 1
                # Most of the budget to be admitted, the rest to connect once admitted.
                admit_by = time.monotonic() + 0.75 * (deadline - time.monotonic())
                view = membership.agree_next_view(buffer.epoch, (), admit_by, call=buffer._call, joining=True)
            else:
                membership.report_failures(failed)
                expected = set(buffer.members) - failed
                # Half the remaining budget to agree (a dead member is waited for until then), the
                # rest to connect, so a dead expected rank cannot eat the time the live ones need.
                agree_by = time.monotonic() + (deadline - time.monotonic()) / 2
                view = membership.agree_next_view(buffer.epoch, expected, agree_by, call=buffer._call,
                                                  dead=buffer.dead_peers)
        except LeftOut as error:
            left_out(buffer, error)
            if time.monotonic() >= deadline:
                raise
            continue  # sealed without this rank: (re)register as joining within this call's deadline
        if buffer._fault is not None:
            buffer._fault.hit("update_after_ready", buffer.rank)
        # Every member starts its call counter at one agreed value above every tag used so far.
        buffer._call = membership.max_call(view.epoch, view.ranks) + 2
        admitted = buffer.joining
        buffer.epoch, buffer.members, buffer.joining = view.epoch, view.ranks, False
        buffer._impl.failed_sources.clear()
        try:
            # Half the remaining budget per attempt: a member that died after the view was
            # sealed is found missing in time to agree again without it.
            attempt = time.monotonic() + max(2.0, (deadline - time.monotonic()) / 2)
            buffer._impl.connect_members(view, membership, min(attempt, deadline))
        except MembershipError as error:
            if not error.missing or time.monotonic() >= deadline:
                raise
            failed = set(error.missing)  # a member died after the view was sealed: agree again
            continue
        if membership.sealed(view.epoch + 1):
            failed = set()  # the others moved on without this rank meanwhile: it finds out and rejoins
            continue
        if admitted:  # learn what to rebuild (or re-map what this rank still has)
            buffer.peer_regions.admitted(view, deadline)
        else:  # hand the joiners their state and map their regions as they rebuild them
            try:
                buffer.peer_regions.readmit(view, deadline)
            except MembershipError as error:
                buffer._impl.failed_sources.extend(error.missing)  # the next update_ep_member() drops them
                raise
        return view


def left_out(buffer, error: LeftOut) -> None:
    """This rank is no member any more (a view was sealed without it): dispatch and combine
    refuse until `update_ep_member()` admits it again as a new incarnation."""
    if not buffer.joining:
        buffer.joining, buffer._rejoin, buffer.members = True, True, ()


def left_out_by_replacement(buffer) -> None:
    """A newer Buffer of this process was admitted in place of `buffer`'s rank (Mooncake's recovery,
    `replacement.py`): `buffer` is left out for good; its `update_ep_member()` finds the rank taken over."""
    buffer.joining, buffer._rejoin, buffer.members = True, True, ()


def survivors_view(buffer, deadline: float) -> View:
    """Agree with the other survivors on the next view and reconnect (a collective lost a peer).

    Every current member that is still alive posts readiness; the dead never do, so the view
    is sealed at `deadline` without them. A rank left out of it raises `LeftOut` (its message
    says to call `update_ep_member()` to rejoin).
    """
    membership = buffer._require_membership("the collective fallback's failure recovery")
    if buffer.joining:
        raise MembershipError(f"rank {buffer.rank} is not a member of the group (joining or left out); call "
                              "update_ep_member() to be admitted")
    # Never wait for a rank whose process ended (the peer watcher); wait up to SLOW_SURVIVOR_S for one
    # that is alive but has not met the failure yet (descheduled, in a GC pause, computing): a survivor
    # is sealed out only when it is silent that long, never for noticing late.
    stall_deadline = max(deadline, time.monotonic() + SLOW_SURVIVOR_S)
    try:
        view = membership.agree_next_view(buffer.epoch, set(buffer.members), deadline, call=buffer._call,
                                          dead=buffer.dead_peers, stall_deadline=stall_deadline)
    except LeftOut as error:
        left_out(buffer, error)
        raise
    buffer.epoch, buffer.members = view.epoch, view.ranks
    buffer._impl.connect_members(view, membership, max(deadline, time.monotonic() + 5.0))
    return view
