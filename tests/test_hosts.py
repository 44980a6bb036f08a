"""Two hosts x two ranks for real: each host a network namespace (tests/netns.py), shm inside a host,
the Transfer Engine across (over the veths only), every row checked against the references.

Ranks 0, 1 live in host 0's namespace and ranks 2, 3 in host 1's from their start
(`Network.placement`): they reach the launcher's store on the hub's bridge and build their gloo group
over the veths, advertise their host's address (MEP_BIND_HOST) and name their host (MEP_HOST_ID), so
`transport="auto"` routes same-host peers over shared memory and the others over the Transfer
Engine, whose sockets live in the namespaces too.
"""
import os
import signal

import pytest
import torch

import torch.distributed as dist

from mooncake_ep_switch.bench import netns
from mooncake_ep_switch.launcher.launch import ClusterNetwork, LocalCluster, RankPlace
from tests import harness, test_buffer, test_faults
from tests.harness import outcome_value
from tests.netns import make_network  # noqa: F401 - make_network is a fixture
from tests.test_launch_security import _listening_on

NUM_HOSTS, RANKS_PER_HOST = 2, 2
NUM_RANKS = NUM_HOSTS * RANKS_PER_HOST
RANK_HOSTS = [r // RANKS_PER_HOST for r in range(NUM_RANKS)]


def rank_buffer_checks(ctx):
    """Where this rank lives (its network namespace, its store, a gloo all_reduce across hosts), then
    the Buffer round trips of test_buffer (exact rows, bf16 and FP8, every completion mode) on the
    2 x 2 network; returns what it saw, its routes and its advertised session."""
    where = {"netns": os.stat(f"/proc/{os.getpid()}/ns/net").st_ino, "store": ctx.store_addr[0]}
    total = torch.tensor([float(1 + ctx.rank)])
    dist.all_reduce(total, group=ctx.group)  # gloo: across the namespaces only over the veths
    where["all_reduce"] = float(total)
    case = test_buffer.Case()
    size = test_buffer.Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    with test_buffer.Buffer(ctx.group, size) as buffer:  # auto: two hosts -> "mooncake", shm inside a host
        routes = list(buffer._transport.routes)
        session = buffer.membership.endpoint(ctx.rank)["te_session"]
        transport = buffer.transport
    for i, (use_fp8, mode) in enumerate([(False, "sync"), (True, "hook"), (False, "async")]):
        test_buffer.rank_round_trip(ctx, "auto", use_fp8, mode, seed=70 + i)
    return {"routes": routes, "session": session, "transport": transport, **where}


def test_buffer_checks_two_hosts_two_ranks(make_network):
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(NUM_RANKS, network=network.placement(RANK_HOSTS)) as cluster:
        port = cluster.store_addr[1]
        assert _listening_on(port) == []  # not in the launcher's namespace ...
        with netns.inside(network.hub):  # ... only on the bridge's address in the hub's
            assert _listening_on(port) == [f"{network.store_address}:{port}"]
        values = [outcome_value(o) for o in cluster.run(rank_buffer_checks, timeout_s=120)]
    for rank, value in enumerate(values):  # every rank ran in its host's namespace, from its start
        assert value["netns"] == os.stat(f"/var/run/netns/{network.names[RANK_HOSTS[rank]]}").st_ino, value
        assert value["store"] == network.store_address and value["all_reduce"] == 10.0, value
    assert values[0]["routes"] == ["self", "shm", "te", "te"]
    assert values[1]["routes"] == ["shm", "self", "te", "te"]
    assert values[2]["routes"] == ["te", "te", "self", "shm"]
    assert values[3]["routes"] == ["te", "te", "shm", "self"]
    for rank, value in enumerate(values):
        assert value["transport"] == "mooncake"
        assert value["session"].startswith(f"{network.addresses[rank // RANKS_PER_HOST]}:"), value


def rank_killed_across_hosts(ctx, kill_point):
    return test_faults.rank_killed(ctx, "auto", kill_point, "sigkill")


@pytest.mark.parametrize("kill_point", ["before_dispatch", "between"])
def test_rank_dies_across_hosts(make_network, kill_point):
    """Rank 2 (host 1) is SIGKILLed before dispatch or between dispatch and combine: its host mate
    (shm) and the other host's ranks (TE) finish within the deadline with exact rows without it."""
    network = make_network(NUM_HOSTS)
    assert test_faults.DEAD == 2 and test_faults.NUM_RANKS == NUM_RANKS
    with harness.fresh_cluster(NUM_RANKS, network=network.placement(RANK_HOSTS)) as cluster:
        outcomes = cluster.run(rank_killed_across_hosts, kill_point, timeout_s=90, failure_grace_s=30)
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
    from mooncake_ep_switch.bench.transport import TransportShape, rank_inputs as _inputs

    network = make_network(2)
    shape = TransportShape(2, 32, 1024, 8, 4)
    with harness.fresh_cluster(2, network=network.placement([0, 1])) as cluster:
        values = [outcome_value(o) for o in cluster.run(hosts.rank_hosts, network.names, network.devices, 5, 4,
                                                         shape, timeout_s=120)]
    topks = [_inputs(rank, shape)[1] for rank in range(2)]
    local = shape.experts // 2
    for rank, value in enumerate(values):
        assert value["routed"] == hosts.routed_bytes(rank, topks, shape) > 0
        peer = 1 - rank
        owners = torch.div(topks[rank], local, rounding_mode="floor")
        floor = (int((owners == peer).any(1).sum()) + int((torch.div(topks[peer], local, rounding_mode="floor")
                                                           == rank).sum())) * shape.hidden * 2
        assert floor <= value["te"]["wire"] <= 1.25 * value["routed"], (rank, floor, value)


def test_cluster_network_bad_input_named(make_network):
    """A malformed ClusterNetwork or placement is refused before anything starts, naming the field."""
    network = make_network(1)
    good = network.placement([0, 0])
    with pytest.raises(ValueError, match=r"network.ranks: expected one RankPlace per rank \(3\), got 2"):
        LocalCluster(3, network=good)
    with pytest.raises(TypeError, match="network: expected a ClusterNetwork"):
        LocalCluster(2, network=tuple(good))
    with pytest.raises(ValueError, match=r"network.ranks\[1\].interface: expected a non-empty str"):
        LocalCluster(2, network=good._replace(ranks=(good.ranks[0], good.ranks[1]._replace(interface=""))))
    with pytest.raises(ValueError, match="network.store_host: expected a non-empty address"):
        LocalCluster(2, network=ClusterNetwork("", None, good.ranks))
    with pytest.raises(TypeError, match=r"network.ranks\[0\]: expected a RankPlace"):
        LocalCluster(1, network=ClusterNetwork("127.0.0.1", None, (tuple(good.ranks[0]),)))
    with pytest.raises(ValueError, match=r"rank_hosts\[1\]: expected a host in \[0, 1\), got 1"):
        network.placement([0, 1])
    assert good.ranks[0] == RankPlace(network.names[0], network.addresses[0], network.devices[0], network.names[0])
