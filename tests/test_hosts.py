"""Two hosts x two ranks for real: each host a network namespace (tests/netns.py), shm inside a host,
the Transfer Engine across (over the veths only), every row checked against the references.

Ranks 0, 1 live in host 0's namespace and ranks 2, 3 in host 1's; each advertises its host's address
(MEP_BIND_HOST) and names its host (MEP_HOST_ID), so `transport="auto"` routes same-host peers over
shared memory and the others over the Transfer Engine, whose sockets live in the namespaces. The
launcher's store and the default gloo group stay on loopback (opened before the ranks enter).
"""
import signal

import pytest
import torch

from tests import harness, test_buffer, test_faults
from tests.harness import outcome_value
from tests.netns import enter_host, make_network  # noqa: F401 - make_network is a fixture

NUM_HOSTS, RANKS_PER_HOST = 2, 2
NUM_RANKS = NUM_HOSTS * RANKS_PER_HOST


def _enter(ctx, names, addresses):
    host = ctx.rank // RANKS_PER_HOST
    enter_host(names[host], addresses[host], host_id=names[host])


def rank_buffer_checks(ctx, names, addresses):
    """The Buffer round trips of test_buffer (exact rows, bf16 and FP8, every completion mode) on the
    2 x 2 network; returns this rank's routes and its advertised session."""
    _enter(ctx, names, addresses)
    case = test_buffer.Case()
    size = test_buffer.Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    with test_buffer.Buffer(ctx.group, size) as buffer:  # auto: two hosts -> "mooncake", shm inside a host
        routes = list(buffer._impl.routes)
        session = buffer.membership.endpoint(ctx.rank)["te_session"]
        transport = buffer.transport
    for i, (use_fp8, mode) in enumerate([(False, "sync"), (True, "hook"), (False, "async")]):
        test_buffer.rank_round_trip(ctx, "auto", use_fp8, mode, seed=70 + i)
    return {"routes": routes, "session": session, "transport": transport}


def test_buffer_checks_two_hosts_two_ranks(make_network):
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        values = [outcome_value(o) for o in cluster.run(rank_buffer_checks, network.names, network.addresses,
                                                         timeout_s=120)]
    assert values[0]["routes"] == ["self", "shm", "te", "te"]
    assert values[1]["routes"] == ["shm", "self", "te", "te"]
    assert values[2]["routes"] == ["te", "te", "self", "shm"]
    assert values[3]["routes"] == ["te", "te", "shm", "self"]
    for rank, value in enumerate(values):
        assert value["transport"] == "mooncake"
        assert value["session"].startswith(f"{network.addresses[rank // RANKS_PER_HOST]}:"), value


def rank_killed_across_hosts(ctx, names, addresses, kill_point):
    _enter(ctx, names, addresses)
    return test_faults.rank_killed(ctx, "auto", kill_point, "sigkill")


@pytest.mark.parametrize("kill_point", ["before_dispatch", "between"])
def test_rank_dies_across_hosts(make_network, kill_point):
    """Rank 2 (host 1) is SIGKILLed before dispatch or between dispatch and combine: its host mate
    (shm) and the other host's ranks (TE) finish within the deadline with exact rows without it."""
    network = make_network(NUM_HOSTS)
    assert test_faults.DEAD == 2 and test_faults.NUM_RANKS == NUM_RANKS
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(rank_killed_across_hosts, network.names, network.addresses, kill_point,
                               timeout_s=90, failure_grace_s=30)
        processes = list(cluster.processes)
    dead = outcomes[test_faults.DEAD]
    assert not dead.ok and dead.exitcode == -signal.SIGKILL, dead
    for outcome in outcomes:
        if outcome.rank == test_faults.DEAD:
            continue
        assert outcome.ok, outcome.error
        budget = test_faults.TIMEOUT_US / 1e6 + test_faults.SLACK_S
        assert outcome.value["dispatch"] + outcome.value["combine"] < budget, outcome.value
    assert not any(process.is_alive() for process in processes), "leftover rank processes"


def test_te_sends_only_routed_bytes_across_hosts(make_network):
    """One rank per host: what a host's veth sends per Transfer Engine round is at most 1.25x the
    bytes its rank owes the other (rows per (token, expert) pair), and at least the compact floor
    (each token once per destination in dispatch, every pair's row in combine): the bytes did cross."""
    from mooncake_ep_switch.bench import hosts
    from mooncake_ep_switch.bench.transport import TransportShape, _inputs

    network = make_network(2)
    shape = TransportShape(2, 32, 1024, 8, 4)
    with harness.fresh_cluster(2) as cluster:
        values = [outcome_value(o) for o in cluster.run(hosts.rank_hosts, network.names, network.devices,
                                                         network.addresses, 5, 4, shape, timeout_s=120)]
    topks = [_inputs(rank, shape)[1] for rank in range(2)]
    local = shape.experts // 2
    for rank, value in enumerate(values):
        assert value["routed"] == hosts.routed_bytes(rank, topks, shape) > 0
        peer = 1 - rank
        owners = torch.div(topks[rank], local, rounding_mode="floor")
        floor = (int((owners == peer).any(1).sum()) + int((torch.div(topks[peer], local, rounding_mode="floor")
                                                           == rank).sum())) * shape.hidden * 2
        assert floor <= value["te"]["wire"] <= 1.25 * value["routed"], (rank, floor, value)
