"""The event bus (buffer/events.py) and the coverage placement (eplb/coverage.py), in one process."""
import numpy as np
import pytest

from mooncake_ep_switch.buffer.events import (CoverageRestored, EventBus, ExpertsUncovered, JoinerAdmitted,
                                              JoinerPending, PeerMasked, RankLeftOut, joiners_seen, view_changed)
from mooncake_ep_switch.eplb.coverage import coverage_placement, uncovered_experts


def test_derived_events_follow_the_event_they_came_from_and_a_raising_callback_is_dropped():
    bus = EventBus()
    seen = []

    def derive(event):  # like CoverageWatch: derives an event while the first is being delivered
        if isinstance(event, PeerMasked):
            watcher.emit(ExpertsUncovered({1: (6,)}, (event.rank,)))

    def boom(event):
        raise RuntimeError("subscriber bug")

    watcher = bus.subscribe(derive)
    bus.subscribe(boom)
    bus.subscribe(seen.append)
    queued = bus.subscribe()
    bus.emit(PeerMasked(3, "dead", 0))
    expected = [PeerMasked(3, "dead", 0), ExpertsUncovered({1: (6,)}, (3,))]
    assert seen == expected
    assert list(queued) == expected and queued.poll() is None
    queued.close()
    bus.emit(CoverageRestored(1, (1,), 0.5))
    assert queued.poll() is None and seen[-1] == CoverageRestored(1, (1,), 0.5)


def test_subscribe_refuses_a_non_callable_and_poll_refuses_a_callback_subscription():
    bus = EventBus()
    with pytest.raises(TypeError, match="callback"):
        bus.subscribe(3)
    with pytest.raises(ValueError, match="poll"):
        bus.subscribe(print).poll()


def test_view_events_announce_each_joiner_once_before_its_admission():
    bus = EventBus()
    queued = bus.subscribe()
    view_changed(bus, 0, (0, 1, 2), False, 1, (0, 2))  # rank 1 left out
    joiners_seen(bus, [1], 1)  # pending_joiners() lists it
    joiners_seen(bus, [1], 1)  # listed again: no second event
    view_changed(bus, 0, (0, 2), False, 2, (0, 1, 2))  # admitted
    view_changed(bus, 0, (0, 1, 2), False, 3, (0, 1, 2, 3))  # admitted without being seen pending first
    assert list(queued) == [RankLeftOut((1,), 1), JoinerPending((1,), 1), JoinerAdmitted((1,), 2),
                            JoinerPending((3,), 2), JoinerAdmitted((3,), 3)]


PLACEMENT = np.asarray([[0, 1, 6, 2, 3, 7, 4, 5, 6, 6, 7, 5],
                        [0, 1, 7, 2, 3, 0, 4, 5, 2, 6, 7, 4]], dtype=np.int64)


def test_coverage_placement_uses_survivors_redundant_slots_and_keeps_the_dead_ranks_slots():
    alive = np.asarray([True, True, True, False])
    assert uncovered_experts(PLACEMENT, alive, 3, 8) == {1: (6,)}
    target = coverage_placement(PLACEMENT, alive, 3, 8, spare_frames=1)
    assert uncovered_experts(target, alive, 3, 8) == {}
    changed = np.argwhere(target != PLACEMENT)
    assert changed.tolist() == [[1, 0]] and target[1, 0] == 6  # expert 0 had two live copies: one gives way
    assert np.array_equal(target[:, 9:], PLACEMENT[:, 9:])
    assert np.array_equal(coverage_placement(PLACEMENT, np.ones(4, bool), 3, 8, 1), PLACEMENT)


def test_coverage_placement_without_a_redundant_slot_is_refused_by_name():
    placement = np.asarray([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=np.int64)  # no redundancy at all
    with pytest.raises(ValueError, match=r"active_ranks: the live ranks \[0, 1, 2\] have no redundant slot"):
        coverage_placement(placement, np.asarray([True, True, True, False]), 2, 8, 1)
    with pytest.raises(ValueError, match="active_ranks: expected at least one live rank"):
        coverage_placement(placement, np.zeros(4, bool), 2, 8, 1)


def test_coverage_placement_keeps_the_fixed_primaries():
    # With ExpertSlots(primaries=unified) a rank's first E/R slots never move (check_primaries refuses a placement
    # that moves one): the coverage copy takes a redundant slot (the demo's coverage epoch failed on this).
    alive = np.asarray([True, True, True, False])
    target = coverage_placement(PLACEMENT, alive, 3, 8, spare_frames=1, fixed_per_rank=2)
    assert uncovered_experts(target, alive, 3, 8) == {}
    changed = np.argwhere(target != PLACEMENT)
    assert len(changed) == 1 and changed[0][0] == 1 and changed[0][1] % 3 == 2, changed
    assert np.array_equal(target[:, [0, 1, 3, 4, 6, 7, 9, 10]], PLACEMENT[:, [0, 1, 3, 4, 6, 7, 9, 10]])
