"""Online EPLB across hosts for real: 2 hosts x 2 ranks in network namespaces (tests/netns.py).

Ranks 0, 1 live on host 0 and ranks 2, 3 on host 1 (`transport="auto"` -> "mooncake": shared memory
inside a host, the Transfer Engine across). Every rank's redundant copy moves (the chunk of
tests/test_eplb_online.py `rank_fault_at_commit`): ranks 0 and 2 stage their new expert from their
host mate (shared memory), ranks 1 and 3 from the other host, read one-sided over the Transfer
Engine. Votes and the decision live in the launcher's store. Every step's rows are checked against
the single-process reference and the moved frames against the checkpoint, bit for bit.
"""
import signal
import time

import pytest

from tests import harness, test_eplb_online
from tests.harness import outcome_value
from tests.netns import enter_host, make_network  # noqa: F401 - make_network is a fixture

NUM_HOSTS, RANKS_PER_HOST = 2, 2
NUM_RANKS = NUM_HOSTS * RANKS_PER_HOST
TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE  # dispatch/combine and the vote over the Transfer Engine
ACROSS = (1, 3)  # ranks whose new expert is held only on the other host


def rank_rebalance_across_hosts(ctx, names, addresses, faulty, how, corrupt_table):
    host = ctx.rank // RANKS_PER_HOST
    enter_host(names[host], addresses[host], host_id=names[host])
    return test_eplb_online.rank_fault_at_commit(ctx, faulty, how, transport="auto", timeout_us=TIMEOUT_US,
                                                 corrupt_table=corrupt_table)


def _run(network, env=None, corrupt_table=None):
    assert test_eplb_online.R == NUM_RANKS
    with harness.fresh_cluster(NUM_RANKS, env=env) as cluster:
        outcomes = cluster.run(rank_rebalance_across_hosts, network.names, network.addresses,
                               *((-1, "none") if env is None else (2, "kill")), corrupt_table, timeout_s=120,
                               failure_grace_s=30)
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    return outcomes


def _check_common(result, rank, expected):
    assert result["transport"] == "mooncake", result["transport"]
    assert [(r[0], r[1], r[3]) for r in result["reports"]] == [(1, expected, 3)], (rank, result["reports"])
    assert result["phy2log"] == (result["target"] if expected == "committed" else result["old"]), f"rank {rank}"
    assert result["frames_ok"] and result["free_frames"] == test_eplb_online.SLOTS_PER_RANK, f"rank {rank}"
    assert not result["in_progress"]
    assert all(result["exact"]), f"rank {rank}: rows differ from the reference {result['exact']}"


def test_online_rebalance_stages_across_hosts_and_commits(make_network):
    network = make_network(NUM_HOSTS)
    values = [outcome_value(o) for o in _run(network)]
    frame_bytes = 2 * (3 * test_eplb_online.INTER * test_eplb_online.HIDDEN)  # gate/up + down, bf16
    layers = test_eplb_online.LAYERS
    for rank, result in enumerate(values):
        _check_common(result, rank, "committed")
        assert result["remote_bytes"] == layers * frame_bytes, (rank, result)  # one slot per layer, from a peer
        # The copies came over the Transfer Engine exactly where no host mate held the expert.
        assert result["te_reads"] == (layers if rank in ACROSS else 0), (rank, result)
        assert result["te_bytes"] == (layers * frame_bytes if rank in ACROSS else 0), (rank, result)


def test_rank_killed_before_voting_across_hosts_aborts_everywhere(make_network):
    """Rank 2 (host 1) is SIGKILLed at the commit step before voting: ranks 0, 1 (the other host)
    and 3 (its host mate) all abort within the deadline, keep the old placement and serve exact rows."""
    network = make_network(NUM_HOSTS)
    began = time.monotonic()
    outcomes = _run(network, env={"MEP_FAULT_POINT": "eplb_before_vote:2:1:kill"})
    assert not outcomes[2].ok and outcomes[2].exitcode == -signal.SIGKILL, outcomes[2]
    for outcome in outcomes:
        if outcome.rank == 2:
            continue
        result = outcome_value(outcome)
        _check_common(result, outcome.rank, "aborted")
        reason = result["reports"][0][2]
        assert "process is gone" in reason or "before a peer decided it" in reason, reason
        assert result["stall_ms"][0] < TIMEOUT_US / 1e3, result["stall_ms"]
    assert time.monotonic() - began < 120


def test_bad_frame_id_from_another_host_aborts_with_a_clear_reason(make_network):
    """Rank 2 publishes frame 10**6 for the slot rank 1 stages from (over the Transfer Engine): rank 1
    refuses it before it becomes an address (a clear staging error, its vote ABORT), every rank aborts
    and keeps serving the old placement with exact rows."""
    network = make_network(NUM_HOSTS)
    values = [outcome_value(o) for o in _run(network, corrupt_table=(2, 0, 1, 10 ** 6))]
    for rank, result in enumerate(values):
        _check_common(result, rank, "aborted")
    reason = values[1]["reports"][0][2]
    assert "staging failed on rank 1: rank 2's frame table names frame 1000000 for layer 0 slot 1" in reason, reason
