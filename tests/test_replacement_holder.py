"""Which incarnation a plain `Buffer(group)` replacement takes its rank from (issue 43 item 2, its race).

Two replacement processes of one rank: the first takes the rank (its incarnation counter moves past the one
the members' view binds) and waits to be admitted. Before, the second read the counter, took the rank from
the first by compare-and-set and waited for an admission that never came (the members had sealed the first
in): exactly one admitted, but the other was refused only by its deadline, without naming who holds the
rank. Now the second takes the rank from the incarnation the members' view binds while the first still beats,
so its compare-and-set fails at once naming the first; a first replacement that died before it was admitted
(no beat) is taken over. In-process: the members are records written by this test, no ranks are started.
"""
import threading
import time

import pytest

from mooncake_ep_switch.buffer.membership import replacement
from mooncake_ep_switch.buffer.membership.protocol import MEMBER_BEAT, WAITING_BEAT, Membership, MembershipError
from mooncake_ep_switch.launcher.launch import host_store

RANKS, REPLACED = 3, 2


class _Beats:
    """Threads refreshing `alive/<rank>` records the way waiting members and a waiting joiner do."""

    def __init__(self, store, prefix):
        self.stop = threading.Event()
        self.threads = []
        self.store, self.prefix = store, prefix

    def beat(self, rank, incarnation, kind):
        def run():
            count = 0
            while not self.stop.wait(0.01):
                count += 1
                self.store.set(f"{self.prefix}/alive/{rank}", f"{incarnation}:{kind}:{count}")

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def close(self):
        self.stop.set()
        for thread in self.threads:
            thread.join(5)


@pytest.fixture()
def group():
    """A group of `RANKS` plain Buffers' records in generation 1 (epoch 0 binds incarnation 1 of every rank), the
    dead rank's process gone, and its counter of generations at 1 (a rebuilt Buffer is its second)."""
    store = host_store("127.0.0.1", 0, 1, timeout_s=30)
    base = "grp-test"
    releases = []
    for rank in range(RANKS):
        choice = replacement.choose_generation(store, rank, RANKS, base, None, time.monotonic() + 5)
        releases.append(choice.release)
        assert choice.generation == 1 and not choice.replacing
        members = Membership(store, rank, RANKS, choice.prefix)
        members.bind_incarnation(0, rank, members.incarnation)
    beats = _Beats(store, f"{base}/g1")
    try:
        yield store, base, beats
    finally:
        beats.close()
        for release in releases:
            release()


def _members_update(store, base, beats, sealed_out):
    """Ranks 0 and 1 wait inside update_ep_member(): readiness for the next epoch posted, member beats moving.
    `sealed_out`: they sealed epoch 1 without the dead rank first (its first replacement was not ready in time)."""
    members = [Membership(store, rank, RANKS, f"{base}/g1", take_incarnation=False) for rank in range(RANKS)]
    survivors = [m for m in members if m.rank != REPLACED]
    epoch = 0
    if sealed_out:
        for member in survivors:
            member.incarnation = 1  # the survivors' own incarnations (epoch 0 binds them)
        views, threads = [], [threading.Thread(target=lambda m=m: views.append(
            m.agree_next_view(0, [0, 1], time.monotonic() + 10))) for m in survivors]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert [v.ranks for v in views] == [(0, 1), (0, 1)], views
        epoch = 1
    for member in survivors:
        member._put(f"ready/{epoch + 1}/{member.rank}", {"incarnation": 1, "call": 0})
        beats.beat(member.rank, 1, MEMBER_BEAT)


def _replace(store, base):
    choice = replacement.choose_generation(store, REPLACED, RANKS, base, None, time.monotonic() + 20)
    try:
        assert choice.replacing and choice.generation == 1, choice
        return Membership(store, REPLACED, RANKS, choice.prefix, replaces=choice.holder)
    finally:
        choice.release()


@pytest.mark.parametrize("sealed_out", [False, True], ids=["member", "sealed_out"])
def test_a_second_replacement_is_refused_by_name_while_the_first_waits(group, sealed_out):
    """`sealed_out`: the view the members hold no longer has the rank; before, the second replacement took the
    rank from the first (the counter) and waited for an admission that never came."""
    store, base, beats = group
    _members_update(store, base, beats, sealed_out)
    first = _replace(store, base)
    assert first.incarnation == 2
    beats.beat(REPLACED, first.incarnation, WAITING_BEAT)  # the first waits to be admitted
    with pytest.raises(MembershipError, match=f"rank {REPLACED} is already taken over: incarnation 2"):
        _replace(store, base)
    assert first.read_counter(f"incarnation/{REPLACED}") == 2  # nothing taken from the first


@pytest.mark.parametrize("sealed_out", [False, True], ids=["member", "sealed_out"])
def test_a_first_replacement_that_died_unadmitted_is_taken_over(group, sealed_out):
    """Before, while the members' view still held the rank, every later replacement was refused for good."""
    store, base, beats = group
    _members_update(store, base, beats, sealed_out)
    first = _replace(store, base)
    assert first.incarnation == 2  # and it dies before it beats: nobody holds the rank but the counter
    second = _replace(store, base)
    assert second.incarnation == 3 and second.read_counter(f"incarnation/{REPLACED}") == 3


def test_a_replacement_that_was_not_admitted_gives_the_rank_back(group):
    store, base, beats = group
    _members_update(store, base, beats, sealed_out=False)
    first = _replace(store, base)
    assert replacement.not_admitted(first) == (True, "")
    assert first.read_counter(f"incarnation/{REPLACED}") == 1  # the members' incarnation is current again
    assert _replace(store, base).incarnation == 2  # the next replacement takes it from there


def test_a_replacement_waiting_while_another_is_admitted_is_refused_at_once(group, monkeypatch):
    """Two replacements of one rank at once, the first admitted before the second saw the members update (they
    are done, they never beat again). Before, the second waited for its whole deadline (the members' view holds
    the rank; nobody updates): 60 s of the Buffer's connect timeout in test_membership_faults' two-replacements
    test. Now it is refused as soon as it reads the view that admitted the other, naming that incarnation."""
    store, base, _ = group
    deadline_s = 15.0
    looked, sealed = threading.Event(), threading.Event()
    last_bound = replacement._last_bound

    def first_look(observer, rank, epoch):  # the second replacement's first look at the members' view
        bound = last_bound(observer, rank, epoch)
        if not looked.is_set():
            looked.set()
            assert sealed.wait(30), "the members never sealed the first replacement in"
        return bound

    monkeypatch.setattr(replacement, "_last_bound", first_look)
    outcome = {}

    def second():
        start = time.monotonic()
        try:
            outcome["value"] = replacement.choose_generation(store, REPLACED, RANKS, base, None, start + deadline_s)
        except MembershipError as error:
            outcome["value"] = error
        outcome["done"] = time.monotonic()

    thread = threading.Thread(target=second)
    thread.start()
    try:
        assert looked.wait(20), "the second replacement never looked at the members' view"
        survivors = [Membership(store, rank, RANKS, f"{base}/g1", take_incarnation=False) for rank in (0, 1)]
        for member in survivors:
            member.incarnation = 1  # epoch 0 binds them
        first = Membership(store, REPLACED, RANKS, f"{base}/g1", replaces=1)
        first.publish_endpoint({"region": [7, 3, 4096], "host_id": "h"})
        views = {}

        def agree(membership, joining):
            views[membership.rank] = membership.agree_next_view(0, [0, 1, 2], time.monotonic() + 10, joining=joining)

        threads = [threading.Thread(target=agree, args=(m, m is first)) for m in survivors + [first]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(views) == [0, 1, 2] and all(v.ranks == (0, 1, 2) for v in views.values()), views
        assert survivors[0].admitted_incarnation(views[0].epoch, REPLACED) == first.incarnation == 2
    finally:
        released = time.monotonic()
        sealed.set()
        thread.join(deadline_s + 10)
    error = outcome["value"]
    assert isinstance(error, MembershipError), error
    assert f"another replacement of rank {REPLACED} was admitted there while it waited: incarnation 2 holds it" \
        in str(error), error
    assert outcome["done"] - released < 3.0, (outcome["done"] - released, error)  # not its deadline
    assert first.read_counter(f"incarnation/{REPLACED}") == 2  # nothing taken from the first
