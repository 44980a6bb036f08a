"""A collective step's records read once per process by the ranks that run as its threads (issue 40,
`buffer/membership/shared_reads.py`): the threads that read one exchange while a read of it is in the air share
the next read (sent after each of them began: linearizable), and each record it returned is checked once. One
reader alone reads as before: one store call per exchange. Faults on this path (a rank that never publishes, a
forged record) are in tests/test_construction_roll_call.py, whose groups are ranks as threads too."""
import sys
import threading
import time

from mooncake_ep_switch.bench.membership_bench import run_all
from mooncake_ep_switch.buffer.membership import batch_reads
from mooncake_ep_switch.buffer.membership.protocol import Membership

from tests import harness

R = 5
group = harness.thread_group_fixture(R, "sharedreads")


def _members(group, prefix):
    stores = [m.store.underlying_store for m in group.members]
    members = [Membership(stores[r], r, R, prefix) for r in range(R)]
    for member in members:
        member.bind_incarnation(0, member.rank, member.incarnation)
    return members


def _endpoint(rank):
    return {"region": [100 + rank, 3, 64], "host_id": f"h{rank}", "te_session": "", "te_base": 1}


def _joined(group, readers: int) -> bool:
    """Whether `readers` threads wait for the read being collected (with shared reads), or, without them, each
    reader made its own read."""
    shared = sys.modules.get("mooncake_ep_switch.buffer.membership.shared_reads")
    if shared is None:  # before shared reads: every reader reads on its own
        return group.counts["multi_get"] >= 1 + readers
    with shared._LOCK:
        return sum(e.collecting.readers for e in shared._EXCHANGES.values() if e.collecting is not None) == readers


def test_threads_that_come_while_a_read_is_in_the_air_share_the_next_read(group):
    members = _members(group, "shared-next")
    for rank in range(R - 1):  # rank 4's endpoint comes last: the first read waits for it
        members[rank].publish_endpoint(_endpoint(rank))
    for member in members[:R - 1]:
        member.incarnations_at(0, range(R))  # the bindings known: each exchange below is the endpoints' read
    group.reset()
    results = {}

    def read(rank):
        peers = [p for p in range(R) if p != rank]
        results[rank] = batch_reads.published_endpoints(members[rank], peers, time.monotonic() + 30, together=0)

    first = threading.Thread(target=read, args=(0,), daemon=True)
    first.start()
    harness.wait_until(lambda: group.counts["multi_get"] == 1)  # rank 0's read is in the air, waiting for rank 4
    later = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(1, R - 1)]
    for thread in later:
        thread.start()
    harness.wait_until(lambda: _joined(group, len(later)))
    members[R - 1].publish_endpoint(_endpoint(R - 1))
    for thread in [first] + later:
        thread.join(30)
    assert not any(thread.is_alive() for thread in [first] + later)
    for rank in range(R - 1):
        assert {p: e["host_id"] for p, e in results[rank].items()} == {p: f"h{p}" for p in range(R) if p != rank}
        assert all(e["incarnation"] == members[p].incarnation for p, e in results[rank].items())
    # Rank 0's read, then one read for the three that came while it was in the air (sent after they began, not
    # rank 0's answer); before shared reads: one each, 4.
    assert group.counts["multi_get"] == 2, group.counts


def test_a_reader_alone_makes_one_read_per_exchange(group):
    members = _members(group, "shared-alone")
    for member in members:
        member.publish_endpoint(_endpoint(member.rank))
        member.publish_region_record(0, {"kind": "k", "regions": [[100 + member.rank, 4, 64]]})
    group.reset()
    peers = list(range(1, R))
    deadline = time.monotonic() + 30
    found = run_all({0: lambda: (batch_reads.published_endpoints(members[0], peers, deadline, together=0),
                                 batch_reads.published_region_records(members[0], 0, peers, deadline, together=0))},
                    60)[0]
    assert sorted(found[0]) == peers and sorted(found[1]) == peers
    assert found[1][3]["regions"] == [[103, 4, 64]]
    # The bindings, the endpoints, the region records: one background read each, as a rank per process makes.
    assert group.counts["multi_get"] == 3 and group.operations() == 3, group.counts
