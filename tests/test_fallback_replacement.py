"""Mooncake's `_use_fallback` switch across a replacement (issue 42 item 3).

The members switch with `_use_fallback`, a rank is SIGKILLed and its replacement is admitted by the
members' `update_ep_member()`: the replacement takes the members' switch at admission (its calls run
on the path theirs do, and its next switch meets theirs), so the group serves exact rounds with it on
the fallback and, once every rank sets `_use_fallback` again, on the Buffer's own transport.
Before, a replacement started on its own transport with no switch made: the members' admission
stalled in the fallback's group rendezvous (the replacement never joined it) and failed with a store
timeout, and after members had switched there and back, the next switch of every rank timed out (the
barrier key carries the switch count, 0 on the replacement).
"""
import os
import signal
import time
import types

import pytest
import torch

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.buffer import mooncake_runtime
from mooncake_ep_switch.buffer.core import BufferCore
from mooncake_ep_switch.buffer.transport.fallback import FallbackSwitch
from mooncake_ep_switch.config import settings
from mooncake_ep_switch.elastic import join
from mooncake_ep_switch.errors import MembershipError
from tests import harness
from tests.harness import RANK_STATE, rank_teardown
from tests.test_membership_faults import _replacement_group, _round2, _size2

REPLACED = 1
ADMIT_TIMEOUT_S = 60.0


def rank_switch_then_die(ctx, switches):
    """A round on the Buffer's own transport, then each of `switches` set on every rank followed by a round;
    then rank `REPLACED` is SIGKILLed."""
    buffer = RANK_STATE["buffer"] = Buffer(ctx.group, _size2(), transport="shm")
    masks = [_round2(ctx, buffer, 1)]
    for index, value in enumerate(switches):
        buffer._use_fallback = value
        masks.append(_round2(ctx, buffer, 2 + index))
    if ctx.rank == REPLACED:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"masks": masks, "use_fallback": buffer._use_fallback}


def rank_admit(ctx, how):
    """The members call update_ep_member(); the replacement builds its Buffer (`how`: "plain", Mooncake's
    recovery, a Buffer(group, bytes) on a recovered group, admitted in its constructor; or "join",
    `elastic.join()` and update_ep_member())."""
    if ctx.group is None:
        source = _replacement_group(ctx, "replacement") if how == "plain" else join(ctx.store, ctx.rank, ctx.num_ranks)
        buffer = RANK_STATE["buffer"] = Buffer(source, _size2(), transport="shm")
        if how == "join":
            buffer.update_ep_member(timeout_s=ADMIT_TIMEOUT_S)
    else:
        buffer = RANK_STATE["buffer"]
        started = time.monotonic()
        buffer.update_ep_member(timeout_s=ADMIT_TIMEOUT_S)
        RANK_STATE["admit_s"] = time.monotonic() - started
    return {"members": list(buffer.members), "use_fallback": buffer._use_fallback, "routes": buffer.peer_routes()}


def rank_rounds(ctx, switches, seed):
    """A round with every rank (an all-ones mask: nobody may be masked, every row exact), then each of
    `switches` set on every rank together, each followed by such a round."""
    buffer = RANK_STATE["buffer"]
    everyone = torch.ones(ctx.num_ranks, dtype=torch.int32)
    seen = [(buffer._use_fallback, buffer.peer_routes(), _round2(ctx, buffer, seed, active=everyone.clone()))]
    for index, value in enumerate(switches):
        buffer._use_fallback = value
        seen.append((buffer._use_fallback, buffer.peer_routes(),
                     _round2(ctx, buffer, seed + 1 + index, active=everyone.clone())))
    return seen


def _routes(rank, route, num_ranks=2):
    return ["self" if r == rank else route for r in range(num_ranks)]


@pytest.mark.parametrize("how, before, after", [
    # On the fallback at the death (Mooncake's recovery builds a plain Buffer): the replacement joins it; all back.
    ("plain", [True], [False]),
    # Switched there and back before the death: the replacement's next switch meets the members' (count 2).
    ("join", [True, False], [True, False]),
])
def test_replacement_takes_the_members_use_fallback_switch(how, before, after):
    with harness.fresh_cluster(2) as cluster:
        outcomes = cluster.run(rank_switch_then_die, before, timeout_s=90, failure_grace_s=20)
        assert not outcomes[REPLACED].ok and outcomes[REPLACED].exitcode == -9, outcomes[REPLACED]
        member = harness.outcome_value(outcomes[0])
        assert member == {"masks": [[1, 1]] * (1 + len(before)), "use_fallback": before[-1]}, member
        cluster.respawn(REPLACED)
        admitted = harness.check_outcomes(cluster.run(rank_admit, how, timeout_s=120))
        on = before[-1]
        for rank, seen in enumerate(admitted):
            assert seen == {"members": [0, 1], "use_fallback": on,
                            "routes": _routes(rank, "collective" if on else "shm")}, (rank, seen)
        rounds = harness.check_outcomes(cluster.run(rank_rounds, after, 20, timeout_s=120))
        for rank, seen in enumerate(rounds):
            expected = [(value, _routes(rank, "collective" if value else "shm"), [1, 1]) for value in [on] + after]
            assert seen == expected, (rank, seen)
        harness.check_outcomes(cluster.run(rank_teardown, timeout_s=60))
        processes = list(cluster.processes)
    assert not any(p.is_alive() for p in processes)


class _Records:
    """The members' `use_fallback/<e>` record as `Membership` serves it (None: not published)."""

    def __init__(self, state):
        self.state = state

    def fallback_state(self, epoch):
        return self.state

    def wait_for(self, predicate, deadline, what):
        value = predicate()
        if value is None:
            raise MembershipError(f"deadline passed while waiting for {what}")
        return value


def test_a_joiner_takes_the_switch_or_says_why_it_cannot():
    """`take_members_switch` on a joiner's core: nothing to take when the members never switched; their
    count and side when they did (the fallback built for the joiner); a "cuda" Buffer, or no record from the
    members, is refused by name with the transport left as it was."""
    built = []
    host = types.SimpleNamespace(name="shm", device=None, failed_sources=[], abort_ptr=7, rank=1)
    core = BufferCore(1, 2, settings(), transport=host, membership=_Records({"on": True, "switches": 0}),
                      make_collective=lambda: built.append(types.SimpleNamespace(name="collective", abort_ptr=0)) or built[-1])
    mooncake_runtime.take_members_switch(core, 3, time.monotonic() + 1)
    assert core.transport is host and not built, "members that never switched: nothing to take"
    core.membership = _Records({"on": True, "switches": 3})
    mooncake_runtime.take_members_switch(core, 3, time.monotonic() + 1)
    switch = core.transport
    assert isinstance(switch, FallbackSwitch) and switch.native is host and switch.on_fallback, switch
    assert switch.switches == 3 and switch.collective is built[0] and built[0].abort_ptr == 7
    assert built[0].failed_sources is host.failed_sources
    core.membership = _Records({"on": False, "switches": 4})  # a rank left out comes back: the members' side
    mooncake_runtime.take_members_switch(core, 4, time.monotonic() + 1)
    assert core.transport is switch and not switch.on_fallback and switch.switches == 4 and len(built) == 1

    cuda_like = types.SimpleNamespace(name="cuda", device=torch.device("cuda", 0))
    core = BufferCore(1, 2, settings(), transport=cuda_like, membership=_Records({"on": True, "switches": 1}),
                      make_collective=lambda: None)
    with pytest.raises(MembershipError, match=r"^_use_fallback: the members of epoch 5 switched their calls \(now on "
                                              r"the collective fallback, 1 switches\), but rank 1's 'cuda' Buffer "
                                              r"cannot switch"):
        mooncake_runtime.take_members_switch(core, 5, time.monotonic() + 1)
    assert core.transport is cuda_like
    core = BufferCore(1, 2, settings(), transport=host, membership=_Records(None), make_collective=lambda: None)
    with pytest.raises(MembershipError, match=r"the members' _use_fallback switch of epoch 6"):
        mooncake_runtime.take_members_switch(core, 6, time.monotonic() + 1)
    assert core.transport is host
