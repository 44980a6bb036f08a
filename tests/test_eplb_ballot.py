"""The online rebalance's votes and decisions in the store (eplb/ballot.py), and the Transfer Engine
addresses a participant publishes with its regions: one decision per epoch, bad records refused."""
import json
import threading

import pytest

from mooncake_ep_switch.buffer.membership.protocol import Membership, MembershipError
from mooncake_ep_switch.buffer.ballot import DECISION_SLOTS, Ballot
from mooncake_ep_switch.launcher.launch import host_store

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture()
def store():
    return host_store("127.0.0.1", 0, 1, timeout_s=30)


def _ballots(store, num_ranks=3, secret=None):
    return [Ballot(Membership(store, r, num_ranks, prefix="p", secret=secret), "eplb/4", r, num_ranks)
            for r in range(num_ranks)]


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "authenticated"])
def test_votes_and_the_first_proposal_win_for_every_rank(store, secret):
    ballots = _ballots(store, secret=secret)
    for ballot in ballots:
        ballot.prepare([1, 2])
    assert ballots[0].read([1, 2], 1) == ({}, None)  # nobody voted on epoch 1 yet
    ballots[1].vote(1, 1, 0x1234)
    ballots[2].vote(1, 2, 0x1234)
    assert ballots[0].read([1, 2], 1) == ({1: (1, 0x1234), 2: (2, 0x1234)}, None)
    # Racing proposals: exactly one value is stored and every proposer gets it back.
    results = {}
    threads = [threading.Thread(target=lambda b=b, v=v: results.__setitem__(b.rank, b.propose(1, v)))
               for b, v in zip(ballots, (1, 2, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(set(results.values())) == 1 and len(results) == 3, results
    assert all(b.decided(1) == results[0] for b in ballots)
    assert ballots[0].decided(2) is None  # the next epoch is its own
    assert ballots[0].propose(2, 2) == 2 and ballots[1].propose(2, 1) == 2
    # A later epoch's vote is no GO on this one; the wait returns at once once decided.
    ballots[1].vote(3, 1, 7)
    assert ballots[0].read([1], 2)[0] == {1: (0, 0)}
    votes, gone, decided = ballots[0].wait_votes([1, 2], 2, 5_000_000)
    assert decided == 2 and gone == []


def test_wait_votes_deadline_stop_and_abort_vote(store):
    ballots = _ballots(store)
    for ballot in ballots:
        ballot.prepare([1])
    votes, gone, decided = ballots[0].wait_votes([1, 2], 1, 50_000)  # nobody votes: deadline
    assert (votes, gone, decided) == ({}, [], None)
    votes, gone, decided = ballots[0].wait_votes([1, 2], 1, -1, stop=lambda pending: [2])  # a dead process
    assert gone == [2] and decided is None
    ballots[1].vote(1, 2, 5)  # an ABORT vote ends the wait without the other rank's
    votes, gone, decided = ballots[0].wait_votes([1, 2], 1, -1)
    assert votes == {1: (2, 5)} and gone == [] and decided is None


def test_behind_by_a_whole_ring_raises_and_garbage_is_not_a_decision(store):
    ballots = _ballots(store, 2)
    ballots[0].prepare([1])
    assert ballots[0].propose(1 + DECISION_SLOTS, 1) == 1  # the ring slot of epoch 1 reused
    with pytest.raises(RuntimeError, match="epochs behind"):
        ballots[1].decided(1)
    with pytest.raises(RuntimeError, match="epochs behind"):
        ballots[1].propose(1, 2)
    store.set("p/eplb/4/decision/2", "not json")  # malformed: undecided, a proposal replaces it
    assert ballots[1].decided(2) is None and ballots[1].propose(2, 2) == 2 and ballots[0].decided(2) == 2
    ballots[1].prepare([3])
    store.set("p/eplb/4/vote/0", json.dumps([3, "go", 1]))  # malformed vote: counts as no GO
    assert ballots[1].read([0], 3)[0] == {0: (0, 0)}


def test_forged_votes_and_decisions_do_not_count_with_a_secret(store):
    ballots = _ballots(store, 2, secret=SECRET)
    ballots[0].prepare([1])
    store.set("p/eplb/4/vote/1", json.dumps([1, 1, 9]))  # untagged GO
    store.set("p/eplb/4/decision/1", json.dumps([1, 1]))  # untagged COMMIT
    assert ballots[0].read([1], 1) == ({1: (0, 0)}, None)
    assert ballots[0].propose(1, 2) == 2 and ballots[1].decided(1) == 2


def test_region_records_with_bad_transfer_engine_addresses_are_refused(store):
    owner, reader = Membership(store, 1, 2, prefix="p"), Membership(store, 0, 2, prefix="p")
    good = {"kind": "expert_slots", "regions": [[123, 4, 8192]], "te_bases": [1 << 40]}
    owner.publish_region_record(0, good)
    assert reader.region_record(0, 1) == good
    for bad in ([0], [1 << 40, 1 << 41], [(1 << 64) - 4096], ["0x10"], 5):
        with pytest.raises(ValueError, match="record"):
            owner.publish_region_record(0, dict(good, te_bases=bad))
        store.set(f"p/regions/0/1/{owner.incarnation}", json.dumps(dict(good, te_bases=bad)))
        with pytest.raises(MembershipError, match="not a valid region record"):
            reader.region_record(0, 1)


def test_plan_records_agree_the_next_base_and_name_a_different_plan(store):
    """Issue 43: the vote records carry their plan; `agreed_base` numbers a rebalance from the
    largest epoch a peer passed (the end of a decided plan, the base of one still voting) and
    `difference` names another begin() argument or another numbering."""
    from mooncake_ep_switch.eplb.epochs import Plan, agreed_base, difference

    ballots = _ballots(store)
    for ballot in ballots:
        ballot.prepare([1, 2, 3, 4])
    other, this = (0xAB, 5, 1), (0xAB, 9, 1)  # the arguments of an earlier rebalance, of this one
    assert agreed_base(ballots[0], 0, this) == 0  # nobody voted yet: the own count
    ballots[1].vote(2, 2, 11, (1, 3, *other))  # epoch 2 of a plan 2..3, undecided: it still votes in it
    assert agreed_base(ballots[0], 0, this) == 1 and agreed_base(ballots[0], 4, this) == 4
    ballots[1].propose(2, 2)  # aborted: that plan is over, its dropped chunk 3 is used too
    assert agreed_base(ballots[0], 0, this) == 3
    assert agreed_base(ballots[0], 0, other) == 1  # this very rebalance, aborted there first: number alike
    ballots[2].vote(4, 1, 12, (3, 4, *this))  # this rebalance begun first there (plan 4..4): its base
    assert agreed_base(ballots[0], 2, this) == 3
    store.set("p/eplb/4/vote/2", json.dumps([4, 1, 12, 9, 4, 0, 0, 0]))  # malformed (epoch not in base+1..end)
    assert agreed_base(ballots[0], 2, this) == 3

    mine = Plan(3, 4, 0xAB, 9, 1)
    assert difference(4, mine, {2: [4, 1, 12, 3, 4, 0xAB, 9, 1]}) == ""
    assert "new_phy2log (digest 0xcd there, digest 0xab here)" in difference(4, mine, {2: [4, 1, 12, 3, 4, 0xCD, 9, 1]})
    assert "another commit_step (7 there, 9 here)" in difference(4, mine, {2: [4, 1, 12, 3, 4, 0xAB, 7, 1]})
    assert "chunk epochs differ: rank 2 numbered its rebalance's chunks 7..7, this rank 4..4" in difference(
        4, mine, {2: [7, 1, 12, 6, 7, 0xAB, 9, 1]})
    assert difference(4, mine, {2: [3, 1, 12, 2, 3, 0xCD, 5, 1]}) == ""  # an older vote: maybe just late
    assert difference(4, mine, {2: None, 1: [0] * 8}) == ""


def test_a_ring_slot_is_reused_over_a_python_store():
    """The 256th epoch's first vote deletes the keys of the epoch its decision slot held before. Over a
    store written in Python (the Buffer's `BoundedStore`, the etcd store) torch's C++ PrefixStore could not
    forward that delete ("Tried to call pure virtual function ::c10d::Store::deleteKey"): the online EPLB
    raised at chunk epoch 256. The ballot's keys are now prefixed in Python (`KeyPrefix`)."""
    from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore

    bounded = BoundedStore(host_store("127.0.0.1", 0, 1, timeout_s=30))
    try:
        ballots = _ballots(bounded, num_ranks=2)
        for epoch in (1, DECISION_SLOTS + 1):
            for ballot in ballots:
                ballot.prepare([epoch])
            for ballot in ballots:
                ballot.vote(epoch, 1, 0x77)
            assert ballots[0].propose(epoch, 1) == 1 and ballots[1].decided(epoch) == 1
        assert not bounded.check(["p/eplb/4/tally/1", "p/eplb/4/done/1"])  # the ring slot's old keys are gone
        assert bounded.check([f"p/eplb/4/tally/{DECISION_SLOTS + 1}"])
    finally:
        bounded.close()
