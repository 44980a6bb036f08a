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
