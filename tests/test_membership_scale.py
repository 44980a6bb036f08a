"""The membership protocol at R=64 (issue 40): ranks as threads on one TCPStore, each with its own bounded
client, every store call counted. One change costs O(R) store operations in all (at most 4R), not one
poll of every rank's key per rank and round; the fault rules hold at that size (quorum, joiner)."""
import threading
import time

from mooncake_ep_switch.bench.membership_bench import Group, admit_joiner, agree_after_death
from mooncake_ep_switch.buffer.membership.protocol import MembershipError, View

R = 64
OPS_PER_RANK = 4  # the bound: store operations per membership change <= 4R


def _group():
    return Group(R, prefix="scale")


def test_a_view_after_a_death_costs_at_most_4r_store_operations():
    group = _group()
    try:
        outcome = agree_after_death(group, dead_rank=0, deadline_s=60.0)
        survivors = tuple(range(1, R))
        assert all(isinstance(v, View) and v == View(1, survivors) for v in outcome["results"].values()), outcome
        assert len(outcome["results"]) == R - 1
        assert outcome["ops"] <= OPS_PER_RANK * R, outcome["counts"]
        observer = group.members[1]
        assert observer.epoch() == 1 and observer.state(0) == "inactive" and observer.state(R - 1) == "active"
    finally:
        group.close()


def test_a_joiner_is_admitted_at_scale_within_the_bound():
    group = _group()
    try:
        agree_after_death(group, dead_rank=0, deadline_s=60.0)
        outcome = admit_joiner(group, rank=0, deadline_s=60.0)
        everyone = View(2, tuple(range(R)))
        assert all(v == everyone for v in outcome["results"].values()), outcome["results"]
        assert len(outcome["results"]) == R
        assert outcome["ops"] <= OPS_PER_RANK * R, outcome["counts"]
        joiner = group.members[0]
        assert group.members[5].incarnation_of(0) == joiner.incarnation and group.members[5].state(0) == "active"
    finally:
        group.close()


def test_no_view_without_a_quorum_then_one_with_it():
    """31 of 64 ranks (not a majority, and without rank 0) agree while the others are silent, not known dead:
    every one of them raises at its deadline and nothing is sealed. With 33 a view of exactly them is sealed."""
    group = _group()
    try:
        minority = list(range(33, R))
        errors = {}

        def run(rank, ranks, deadline_s, out):
            try:
                out[rank] = group.members[rank].agree_next_view(0, ranks, time.monotonic() + deadline_s)
            except MembershipError as error:
                out[rank] = error

        threads = [threading.Thread(target=run, args=(r, range(R), 1.5, errors)) for r in minority]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(errors) == len(minority) and all(
            isinstance(e, MembershipError) and "not a majority" in str(e) for e in errors.values()), errors
        assert not group.members[0].sealed(1)
        majority, results = list(range(31, R)), {}
        threads = [threading.Thread(target=run, args=(r, majority, 30.0, results)) for r in majority]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(v == View(1, tuple(majority)) for v in results.values()) and len(results) == len(majority), results
    finally:
        group.close()


def test_a_barrier_costs_two_store_operations_per_rank_and_names_the_missing():
    group = _group()
    try:
        def barrier(ranks, name, deadline_s):
            out = {}

            def run(rank):
                try:
                    group.members[rank].barrier(name, range(R), time.monotonic() + deadline_s)
                    out[rank] = None
                except MembershipError as error:
                    out[rank] = error

            threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            return out

        late = barrier(range(1, R), "late", 3.0)  # rank 0 never comes
        assert len(late) == R - 1 and all(
            isinstance(e, MembershipError) and e.missing == (0,) for e in late.values()), late
        group.reset()
        everyone = barrier(range(R), "all", 30.0)
        assert everyone == {r: None for r in range(R)}
        assert group.operations() <= 2 * R + R // 4, group.counts  # a set and one wait each (a slow one: another)
    finally:
        group.close()


# A waiting rank polls one key per round (`check`), with a backoff: how many rounds a wait takes depends on
# how long the others take, i.e. on the machine's load (under 2 CPU hogs an EPLB begin polled ~5 times per
# rank, its other operations stayed the same). The work of a step is bounded exactly; the polls only by rounds.
POLL_ROUNDS_PER_RANK = 40


def _within(counts: dict, work_per_rank: int) -> bool:
    """True when the step's non-polling operations are <= work_per_rank * R and its polls <= the rounds bound."""
    work = sum(n for op, n in counts.items() if op != "check")
    return work <= work_per_rank * R and counts.get("check", 0) <= POLL_ROUNDS_PER_RANK * R


def test_ballots_joiner_listing_and_construction_cost_o_r_store_operations():
    """At R=64 (one group for all, its clients cost seconds to connect): a switch decision (half the ranks
    propose ABORT: one decision, every rank adopts it), an EPLB commit step (every rank COMMITs; with a silent
    rank that a stop callback names dead, every other rank ends its wait and the epoch is ABORTed), every
    member listing a pending joiner once, and the store part of a Buffer's construction (every rank publishes
    its endpoint and a region record, reads every peer's host id, regions and incarnation, then a barrier),
    each in O(R) store operations. Before issue 40's ballot, joiner and construction work: an EPLB begin and
    vote ~75R at R=64, the listing ~70R, construction ~1200R."""
    from mooncake_ep_switch.bench import control_plane_steps as steps
    from mooncake_ep_switch.bench.membership_bench import run_all
    from mooncake_ep_switch.buffer.ballot import Ballot

    group = _group()
    try:
        ballots = [Ballot(m, "switch/9", r, R, what="switch_layout") for r, m in enumerate(group.members)]

        def propose(rank):
            def run():
                ballots[rank].prepare([1], votes=False)
                return ballots[rank].propose(1, 1 + rank % 2)
            return run

        group.reset()
        decided = run_all({r: propose(r) for r in range(R)}, 60)
        assert len(set(decided.values())) == 1 and set(decided.values()) <= {1, 2}, decided
        # Each rank: the slot's compare-and-set (`prepare`), then at most one proposal from what it answered.
        assert group.operations() <= 2 * R, group.counts
        vote = steps.eplb_vote(group)  # everyone votes GO: COMMIT everywhere
        assert vote["results"] == {r: (1, R - 1, []) for r in range(R)}, vote["results"]
        assert _within(vote["counts"], 12) and _within(vote["begin"]["counts"], 8), (vote["counts"],
                                                                                     vote["begin"]["counts"])
        silent = [Ballot(m, "eplb/silent", r, R) for r, m in enumerate(group.members)]
        for ballot in silent:
            ballot.prepare([1])

        def commit(rank):
            def run():
                silent[rank].vote(1, 1, 5, voters=R)
                votes, gone, _ = silent[rank].wait_votes([p for p in range(R) if p != rank], 1, 30_000_000,
                                                         stop=lambda pending: [p for p in pending if p == 0])
                return silent[rank].propose(1, 1 if not gone and len(votes) == R - 1 else 2), gone
            return run

        outcome = run_all({r: commit(r) for r in range(1, R)}, 60)
        # Each wait ends by the stop callback or by the first ABORT proposal (the same decision either way).
        assert len(outcome) == R - 1 and all(v[0] == 2 and v[1] in ([0], []) for v in outcome.values()), outcome
        assert any(v[1] == [0] for v in outcome.values()), outcome
        listed = steps.pending_joiners(group)
        assert listed["results"] == {r: [0] for r in range(1, R)}, listed["results"]
        assert _within(listed["counts"], 12), listed["counts"]
        # The store part of construction, under a fresh prefix: every rank reads every peer's host id right.
        built = steps.construction(group)
        assert built["results"] == dict(enumerate(steps.expected_hosts(R))), built["results"]
        assert _within(built["counts"], 40), built["counts"]
    finally:
        group.close()

