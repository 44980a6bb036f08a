"""Waits that read what they wait for (issue 40, key_wait.py `read=True`): a waiting member gets the sealed view,
a waiting voter the ballot's summary and decision, in the wait itself (no read after it); and a vote that
completes a unanimous tally proposes COMMIT before it wakes the others (ballot.py `commit_if`), so their
proposals make no store call. Ranks as threads on an in-process TCPStore, each with its own bounded, counted
client (the scale bench's `Group`)."""
import threading

import pytest

from mooncake_ep_switch.bench.membership_bench import Group, agree_after_death
from mooncake_ep_switch.buffer.ballot import Ballot
from mooncake_ep_switch.buffer.membership.key_wait import KeyWait
from mooncake_ep_switch.buffer.membership.protocol import View
from tests import harness

GO, COMMIT = 1, 1
DEADLINE_US = 30_000_000


group = harness.thread_group_fixture(4, "waitreads")


def test_a_reading_wait_returns_the_value_another_client_set_in_one_store_operation(group):
    waiter = KeyWait(group.members[0].store, ["wr/a", "wr/b"], 10.0, read=True)
    assert waiter.background and waiter.poll(0.0) is None
    group.reset()
    group.members[1].store.multi_set(["wr/a", "wr/b"], ["A", "B"])
    assert waiter.poll(10.0) is True
    assert waiter.values() == [b"A", b"B"]
    assert dict(group.counts) == {"multi_set": 1}, group.counts  # the values came with the wait: no read after it


def test_a_reading_wait_ends_false_at_its_seconds_when_the_key_never_comes(group):
    waiter = KeyWait(group.members[0].store, ["wr/never"], 0.2, read=True)
    assert waiter.poll(10.0) is False
    with pytest.raises(RuntimeError, match="not known to be there"):
        waiter.values()


def _vote_all(ballots, epoch, digests, commit_if):
    """Every rank votes GO with its digest and waits for the others; returns rank -> (votes, decided, proposal)."""
    size = len(ballots)
    out, start = {}, threading.Barrier(size)

    def run(rank):
        start.wait(30)
        ballots[rank].vote(epoch, GO, digests[rank], voters=size, commit_if=commit_if)
        votes, gone, decided = ballots[rank].wait_votes([p for p in range(size) if p != rank], epoch, DEADLINE_US)
        out[rank] = (votes, decided)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(out) == size, out
    return out


def test_the_vote_completing_a_unanimous_tally_commits_and_the_others_propose_without_a_store_call(group):
    ballots = [Ballot(m, "eplb/wr1", r, 4) for r, m in enumerate(group.members)]
    for ballot in ballots:
        ballot.prepare([1])
    group.reset()
    out = _vote_all(ballots, 1, [9] * 4, commit_if=range(4))
    assert all(decided == COMMIT for _, decided in out.values()), out  # read with the summary, by the wait
    assert all(len(votes) == 3 and set(votes.values()) == {(GO, 9)} for votes, _ in out.values()), out
    voted = group.operations()
    assert [b.propose(1, COMMIT) for b in ballots] == [COMMIT] * 4
    assert group.operations() == voted, group.counts  # every proposal found the decision it had read
    # per rank: the vote, the tally and the reading wait; the completing vote also its summary read and the CAS
    assert voted <= 3 * 4 + 4, group.counts


def test_a_tally_with_another_digest_is_left_undecided_for_the_ranks_to_abort(group):
    ballots = [Ballot(m, "eplb/wr2", r, 4) for r, m in enumerate(group.members)]
    for ballot in ballots:
        ballot.prepare([1])
    out = _vote_all(ballots, 1, [9, 9, 9, 8], commit_if=range(4))
    assert all(decided is None for _, decided in out.values()), out
    assert out[0][0][3] == (GO, 8)
    assert ballots[0].propose(1, 2) == 2 and ballots[3].propose(1, COMMIT) == 2  # the first proposal stored wins


@pytest.mark.parametrize("woken_by", ["abort-proposal", "stopped-wait"])
def test_a_voter_woken_after_an_abort_reads_the_proposers_vote_although_it_went_on_to_the_next_epoch(group, woken_by):
    """Rank 0 votes on epoch 1 with another digest, decides ABORT (at once, or after its wait stopped for a dead
    voter, rank 2: the shrink test's case) and votes on epoch 2 (its record replaced) before rank 1's wait reads:
    rank 1 still reads rank 0's vote on epoch 1 (it was woken with the votes), so it can name the other digest
    (a shrink's "two shrinks at once") instead of "went on to a later attempt"."""
    ballots = [Ballot(m, f"eplb/wr3{woken_by}", r, 4, what="shrink") for r, m in enumerate(group.members)]
    for ballot in ballots:
        ballot.prepare([1, 2])
    ballots[1].vote(1, GO, 9, voters=2)
    ballots[0].vote(1, GO, 8, voters=3)  # its tally is not complete: nobody is woken by a vote
    if woken_by == "stopped-wait":
        votes, gone, decided = ballots[0].wait_votes([1, 2], 1, DEADLINE_US, lambda pending: [2] if 2 in pending else [])
        assert (votes, gone, decided) == ({1: (GO, 9)}, [2], None)
    assert ballots[0].propose(1, 2) == 2
    ballots[0].vote(2, GO, 8, voters=3)
    votes, gone, decided = ballots[1].wait_votes([0], 1, DEADLINE_US)
    assert (votes, gone, decided) == ({0: (GO, 8)}, [], 2)


def test_members_waiting_for_a_view_read_it_with_their_wait():
    """R=8, rank 0 dead: each of the 6 waiting members costs its readiness and one reading wait (no get of the
    view after it), the sealer's settling reads nothing after its view."""
    size = 8
    group = Group(size, prefix="waitreads-view")
    try:
        outcome = agree_after_death(group, dead_rank=0, deadline_s=60.0)
        assert all(v == View(1, tuple(range(1, size))) for v in outcome["results"].values()), outcome["results"]
        counts = outcome["counts"]
        assert counts.get("get", 0) == 0 and counts.get("wait", 0) == 0, counts
        assert counts.get("multi_get", 0) <= size - 2 + 3, counts  # the waits; the sealer's ready and non-member reads
        assert group.members[1].state(0) == "inactive" and group.members[1].epoch() == 1
    finally:
        group.close()


def test_shared_reading_waits_of_one_process_make_one_read_and_each_gets_the_value(group):
    """Two ranks' reading waits with `shared=True` on one key make one store read; another key, or a wait without
    `shared`, reads for itself."""
    group.reset()
    first = KeyWait(group.members[0].store, ["wr/shared"], 10.0, read=True, shared=True)
    second = KeyWait(group.members[1].store, ["wr/shared"], 10.0, read=True, shared=True)
    alone = KeyWait(group.members[2].store, ["wr/shared"], 10.0, read=True)
    other = KeyWait(group.members[3].store, ["wr/shared-other"], 10.0, read=True, shared=True)
    assert dict(group.counts) == {"multi_get": 3}, group.counts  # first (second joined it), alone, other
    assert first.background and second.background and second.poll(0.0) is None
    group.members[2].store.multi_set(["wr/shared", "wr/shared-other"], ["V", "W"])
    for waiter, value in ((first, b"V"), (second, b"V"), (alone, b"V"), (other, b"W")):
        assert waiter.poll(10.0) is True
        assert waiter.values() == [value]
    assert dict(group.counts) == {"multi_get": 3, "multi_set": 1}, group.counts  # no read after the waits


def test_a_shared_read_that_ends_without_the_key_ends_its_joiners_waits_and_a_new_wait_reads_anew(group):
    short = KeyWait(group.members[0].store, ["wr/shared-late"], 0.2, read=True, shared=True)
    joined = KeyWait(group.members[1].store, ["wr/shared-late"], 30.0, read=True, shared=True)
    assert short.poll(10.0) is False and joined.poll(10.0) is False  # the read it joined timed out
    group.reset()
    again = KeyWait(group.members[1].store, ["wr/shared-late"], 30.0, read=True, shared=True)
    assert dict(group.counts) == {"multi_get": 1}, group.counts  # a read of its own: the ended one is not joined
    group.members[0].store.set("wr/shared-late", "L")
    assert again.poll(10.0) is True and again.values() == [b"L"]


def test_members_waiting_for_a_view_in_one_process_share_one_read_of_it():
    """R=8, rank 0 dead, ranks as threads: the 6 waiting members' waits for the view are one read (two when the
    view is sealed before the last one starts its wait), not 6; the sealer's reads come on top."""
    size = 8
    group = Group(size, prefix="waitreads-shared-view")
    try:
        outcome = agree_after_death(group, dead_rank=0, deadline_s=60.0)
        assert all(v == View(1, tuple(range(1, size))) for v in outcome["results"].values()), outcome["results"]
        assert outcome["counts"].get("multi_get", 0) <= 2 + 3, outcome["counts"]
    finally:
        group.close()
