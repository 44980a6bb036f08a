"""Waits of the control plane without a store operation per round (issue 40, key_wait.py), and records decoded
once per process (records.py). Two ranks as threads on an in-process TCPStore, each with its own bounded,
counted client (the scale bench's `Group`)."""
import threading
import time

from mooncake_ep_switch.buffer.ballot import Ballot
from mooncake_ep_switch.buffer.membership import records
from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from tests import harness

LATE_S = 0.4  # how long the second voter waits before voting


group = harness.thread_group_fixture(2, "keywait")


def test_a_voter_waiting_for_a_late_peer_makes_a_constant_number_of_store_operations(group):
    """Rank 0 votes and waits while rank 1 votes LATE_S later: rank 0's wait costs one wait and one read of the
    completing vote's summary, however long it lasts (before: a check of done/<e> every <= 5 ms, ~80 here), and
    both adopt the one decision."""
    ballots = [Ballot(m, "eplb/kw", r, 2) for r, m in enumerate(group.members)]
    for ballot in ballots:
        ballot.prepare([1])
    ballots[0].vote(1, 1, 77, voters=2)
    group.reset()
    out = {}

    def late():
        time.sleep(LATE_S)
        ballots[1].vote(1, 1, 77, voters=2)

    thread = threading.Thread(target=late)
    thread.start()
    started = time.monotonic()
    votes, gone, decided = ballots[0].wait_votes([1], 1, 30_000_000)
    waited = time.monotonic() - started
    thread.join(30)
    counts = dict(group.counts)
    assert votes == {1: (1, 77)} and gone == [] and decided is None, (votes, gone, decided)
    assert waited >= LATE_S * 0.9
    # rank 1's vote: set, add, its summary (check + multi_get of both vote keys) and the done key; rank 0: one
    # wait, which is the read of done/<e> with the decision slot (a multi_get that blocks until done/<e> is there)
    rank0_ops = counts.get("wait", 0) + counts.get("multi_get", 0) - 1
    assert counts.get("check", 0) <= 1 and rank0_ops == 1, counts
    out[0] = ballots[0].propose(1, 1)
    out[1] = ballots[1].propose(1, 2)
    assert out == {0: 1, 1: 1}


def test_a_voter_that_stops_waiting_ends_its_own_wait_and_wakes_the_others(group):
    """A peer never votes: the voter returns at its deadline (not seconds late) with the peer pending, and sets
    done/<e> so its background wait ends at once (no store worker left blocked)."""
    ballot = Ballot(group.members[0], "eplb/kw2", 0, 2)
    ballot.prepare([1])
    ballot.vote(1, 1, 5, voters=2)
    started = time.monotonic()
    votes, gone, decided = ballot.wait_votes([1], 1, 300_000)
    assert votes == {} and gone == [] and decided is None
    assert time.monotonic() - started < 0.3 + 1.5
    waiter = KeyWait(group.members[1].store, ["eplb/kw2/done/1"], 5.0)
    assert waiter.background and waiter.poll(5.0) is True


def test_a_key_wait_ends_when_another_client_sets_the_key_and_its_polls_cost_nothing(group):
    member = group.members[0]
    waiter = KeyWait(member.store, ["kw/late"], 10.0)
    assert waiter.background
    group.reset()
    for _ in range(50):
        assert waiter.poll(0.001) is None
    assert group.operations() == 0, group.counts
    group.members[1].store.set("kw/late", "1")
    assert waiter.poll(10.0) is True


def test_a_record_read_again_is_parsed_once_and_changing_what_was_read_changes_nothing(group, monkeypatch):
    member = group.members[0]
    member.publish_endpoint({"region": [1234, 3, 4096], "host_id": "h0", "te_session": "", "te_base": 1 << 20})
    parsed = []
    real = records.json.loads
    monkeypatch.setattr(records.json, "loads", lambda text, **kw: parsed.append(text) or real(text, **kw))
    first = member.endpoint(0)
    first["region"][0] = 99
    second = group.members[1].endpoint(0)
    assert second["region"] == [1234, 3, 4096] and second["host_id"] == "h0"
    assert len(parsed) <= 1, parsed
