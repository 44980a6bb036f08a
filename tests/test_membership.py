"""Membership agreement in the store: one sealed view per epoch, adopted by every member."""
import threading
import time

import pytest

from mooncake_ep_switch.buffer.membership.protocol import JOINING, Membership, MembershipError
from mooncake_ep_switch.launcher.launch import host_store


@pytest.fixture()
def store(request):
    if getattr(request, "param", "tcp") == "etcd":  # the runtime unchanged on an etcd cluster (issue 38)
        import uuid

        from mooncake_ep_switch.elastic import connect_store

        url = request.getfixturevalue("etcd_cluster").url(f"mem-{uuid.uuid4().hex[:10]}")
        yield connect_store(url, timeout_s=30, job="test-membership")  # one client for every thread, as below
        return
    yield host_store("127.0.0.1", 0, 1, timeout_s=30)


def _agree_all(members, expected, deadline_s, late=(), joiners=()):
    results, errors = {}, {}

    def run(member):
        if member.rank in late:
            time.sleep(deadline_s + 0.5)
        try:
            results[member.rank] = member.agree_next_view(0, expected[member.rank], time.monotonic() + deadline_s,
                                                          joining=member.rank in joiners)
        except MembershipError as error:
            errors[member.rank] = str(error)

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results, errors


@pytest.mark.parametrize("store", ["tcp", "etcd"], indirect=True)
def test_survivors_and_a_joiner_agree_on_one_view(store):
    members = [Membership(store, r, 4) for r in range(4)]
    assert members[0].epoch() == 0 and members[0].view().ranks == (0, 1, 2, 3)
    members[1].report_failures([2])
    assert members[0].evidence() == {1: [2]}
    replacement = Membership(store, 2, 4)  # the same rank id, a new incarnation
    assert replacement.incarnation == members[2].incarnation + 1
    assert members[0].joining() == [], "a replacement is listed only while it waits to be admitted"
    survivors = [members[0], members[1], members[3]]
    expected = {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3], 2: []}
    results, errors = {}, {}
    joiner = threading.Thread(target=lambda: results.setdefault(2, replacement.agree_next_view(
        0, [], time.monotonic() + 10, joining=True)))
    joiner.start()
    deadline = time.monotonic() + 10
    while members[0].joining() != [2]:
        assert time.monotonic() < deadline, "the waiting joiner was never listed"
        time.sleep(0.01)
    assert members[0].state(2) == JOINING
    survivor_results, errors = _agree_all(survivors, expected, deadline_s=5)
    joiner.join(15)
    results.update(survivor_results)
    assert not errors and set(results) == {0, 1, 2, 3}
    assert {view.ranks for view in results.values()} == {(0, 1, 2, 3)}
    assert {view.epoch for view in results.values()} == {1}
    assert members[0].epoch() == 1 and members[0].state(2) == "active"


def test_dead_rank_without_replacement_is_left_out(store):
    members = [Membership(store, r, 4) for r in range(4)]  # nobody reads the epoch before agreeing
    survivors = [m for m in members if m.rank != 2]
    expected = {r: [0, 1, 3] for r in (0, 1, 3)}
    results, errors = _agree_all(survivors, expected, deadline_s=5)
    assert not errors and {v.ranks for v in results.values()} == {(0, 1, 3)}
    assert members[0].epoch() == 1, "the store's epoch must advance even if nobody read it before"


def test_a_late_rank_is_told_it_was_left_out(store):
    members = [Membership(store, r, 3) for r in range(3)]
    expected = {0: [0, 1], 1: [0, 1], 2: [0, 1, 2]}
    results, errors = _agree_all(members, expected, deadline_s=1.0, late=(2,))
    assert set(results) == {0, 1} and results[0].ranks == (0, 1)
    assert "left out of epoch 1" in errors[2]


def test_endpoints_are_per_incarnation(store):
    first = Membership(store, 1, 2)
    first.publish_endpoint({"pid": 10, "fd": 3})
    reader = Membership(store, 0, 2)
    assert reader.endpoint(1)["pid"] == 10
    second = Membership(store, 1, 2)  # a replacement before it publishes
    with pytest.raises(MembershipError, match="no endpoint"):
        reader.endpoint(1)
    second.publish_endpoint({"pid": 11, "fd": 4})
    assert reader.endpoint(1) == {"pid": 11, "fd": 4, "incarnation": 2}
    with pytest.raises(ValueError, match="state"):
        reader.set_state("dead")
