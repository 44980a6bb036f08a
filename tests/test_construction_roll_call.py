"""The store part of a Buffer's construction at R=64 (issue 40): ranks as threads on one TCPStore, every store
call counted. Each rank publishes its records and reads its peers' bindings, then their records, each in one
background read that waits until all are there (`batch_reads` with `together`): a constant number of store
operations per rank, none while it waits for its peers. The rules hold on that path: a rank that never comes
fails the others' construction by their deadline, naming it; a forged record is refused although it is there."""
import threading
import time


from mooncake_ep_switch.bench import control_plane_steps as steps
from mooncake_ep_switch.bench.membership_bench import Group, run_all
from mooncake_ep_switch.buffer.membership import batch_reads
from mooncake_ep_switch.buffer.membership.protocol import Membership, MembershipError, View
from mooncake_ep_switch.buffer.transport.members import connect_view

R = 64
# Per rank (bench.control_plane_steps.constructor): incarnation 1 (a compare-and-set, no read before it),
# binding 1, epoch 1, two records 2, the peers' bindings, endpoints and region records one background read each
# 3, the barrier 2: 10. With the roll call before (e490939) it was 21: an add and a wait per exchange, then the
# epoch, a check and a multi_get of the bindings and of the records, the incarnation read before its CAS and
# the epoch once more for the incarnations read again.
OPS_PER_RANK = 10
# What the first rank makes before it waits for its peers: incarnation 1, binding 1, epoch 1, two records 2, the
# background read of the peers' bindings 1 (8 with the roll call; about 2R checks before it).
OPS_BEFORE_WAITING = 6


def test_construction_costs_a_constant_number_of_store_operations_per_rank_none_while_waiting():
    group = Group(R, prefix="rollcall")
    try:
        build = steps.constructor(group, "ctor-staged", deadline_s=60.0)
        group.reset()
        first = {}
        alone = threading.Thread(target=lambda: first.update(hosts=build(0)), daemon=True)
        alone.start()
        deadline = time.monotonic() + 30
        while group.counts["wait"] + group.counts["multi_get"] == 0:  # rank 0 alone, until it waits for its peers
            assert alone.is_alive() and time.monotonic() < deadline, (first, group.counts)
            time.sleep(0.002)
        assert group.operations() <= OPS_BEFORE_WAITING, group.counts
        rest = run_all({r: (lambda rank=r: build(rank)) for r in range(1, R)}, 90)
        alone.join(60)
        assert {**rest, 0: first.get("hosts")} == dict(enumerate(steps.expected_hosts(R))), rest
        assert group.operations() <= OPS_PER_RANK * R + 2, group.counts
    finally:
        group.close()


def _four():
    return Group(4, prefix="rollcall4")


def test_a_rank_that_never_comes_fails_the_others_connect_by_their_deadline_naming_it():
    group = _four()
    try:
        prefix, view = "ctor-dead", View(0, (0, 1, 2, 3))
        stores = [m.store.underlying_store for m in group.members]
        members = [Membership(stores[r], r, 4, prefix) for r in range(4)]
        for rank in range(3):  # rank 3 took its incarnation, then died before publishing anything
            members[rank].publish_endpoint({"region": [1, 3, 64], "host_id": "h", "te_session": "", "te_base": 1})

        def connect(rank):
            def run():
                started = time.monotonic()
                try:
                    connect_view(rank, 4, view, members[rank], started + 1.5, route=lambda peer, found: None,
                                 drop=lambda peer: None, unreachable_errors=(), construction=True)
                except MembershipError as error:
                    return error, time.monotonic() - started
                return None, time.monotonic() - started
            return run

        outcome = run_all({r: connect(r) for r in range(3)}, 60)
        for rank, (error, seconds) in outcome.items():
            assert isinstance(error, MembershipError) and "rank 3" in str(error), (rank, error)
            assert seconds < 1.5 + 10, (rank, seconds)  # by the deadline (plus a loaded box's store grace)
    finally:
        group.close()


def test_after_a_membership_change_only_the_member_dead_since_the_seal_is_named_missing():
    """A later view's connect makes no roll call: a member that published its endpoint and died after the seal
    never counts in, and a roll call would hold every survivor until its own connect deadline, leaving the
    barrier none: the survivor whose deadline comes first then names the live peers that are still in the roll
    call (a later deadline: a replacement's) missing too, and the next view leaves them out (a fresh-clone CI
    run: tests/test_elastic.py::test_rank_dies_during_update_ep_member lost its replacement that way)."""
    group = _four()
    try:
        prefix, view = "ctor-later", View(1, (0, 1, 2, 3))
        stores = [m.store.underlying_store for m in group.members]
        members = [Membership(stores[r], r, 4, prefix) for r in range(4)]
        for rank in range(4):  # rank 3 too: it published, was sealed into the view, then died
            members[rank].publish_endpoint({"region": [1, 3, 64], "host_id": "h", "te_session": "", "te_base": 1})

        def connect(rank, seconds):
            def run():
                started = time.monotonic()
                try:
                    connect_view(rank, 4, view, members[rank], started + seconds, route=lambda peer, found: None,
                                 drop=lambda peer: None, unreachable_errors=(), construction=False)
                except MembershipError as error:
                    return error, time.monotonic() - started
                return None, time.monotonic() - started
            return run

        # Rank 2 (a replacement, say) has the later connect deadline.
        outcome = run_all({0: connect(0, 2.0), 1: connect(1, 2.0), 2: connect(2, 4.0)}, 60)
        for rank, (error, seconds) in outcome.items():
            assert isinstance(error, MembershipError) and list(error.missing) == [3], (rank, error)
    finally:
        group.close()


def test_a_forged_record_is_refused_although_its_writer_counted_in():
    group = _four()
    try:
        stores = [m.store.underlying_store for m in group.members]
        honest = [Membership(stores[r], r, 4, "ctor-forged", secret="job") for r in range(3)]
        forger = Membership(stores[3], 3, 4, "ctor-forged", secret="another job")
        for member in honest + [forger]:
            member.publish_endpoint({"region": [1, 3, 64], "host_id": f"h{member.rank}", "te_session": "",
                                     "te_base": 1})

        def read(member):
            def run():
                peers = [p for p in range(4) if p != member.rank]
                started = time.monotonic()
                found = batch_reads.published_endpoints(member, peers, started + 1.0, together=0)
                return sorted(found), time.monotonic() - started
            return run

        outcome = run_all({m.rank: read(m) for m in honest + [forger]}, 60)
        for rank in range(3):
            ranks, seconds = outcome[rank]
            assert ranks == [p for p in range(3) if p != rank], (rank, outcome[rank])  # rank 3's forged one left out
            assert seconds >= 1.0, outcome[rank]  # waited for a valid one until the deadline
    finally:
        group.close()
