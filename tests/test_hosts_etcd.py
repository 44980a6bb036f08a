"""A whole pretend host lost with the etcd store (issue 38 item 3): 3 hosts x 2 ranks, an etcd member per host.

Every host is a network namespace (tests/netns.py); the ranks' store is a 3-member etcd cluster with one
member on each host (`LocalCluster(store="etcd", network=...)`), the leader moved to host 0 first. Every
process of host 0 is SIGKILLed (ranks 0 and 1 and the etcd leader): the four survivors serve the next
round exactly without them (shm inside a host, the Transfer Engine across), replacements started on host
0 join through the two etcd members left and are admitted, and every rank's rounds are exact again.
"""
import os
import signal
import time

import torch

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.elastic import join
from tests import harness
from tests.harness import RANK_STATE, outcome_value
from tests.netns import make_network  # noqa: F401 - make_network is a fixture
from tests.reference import expected_combine, expected_routing, structured_inputs, token_count
from tests.test_faults import _mock_expert

NUM_HOSTS, RANKS_PER_HOST = 3, 2
R = NUM_HOSTS * RANKS_PER_HOST
RANK_HOSTS = [r // RANKS_PER_HOST for r in range(R)]
HOST_A = 0
DEAD = [r for r in range(R) if RANK_HOSTS[r] == HOST_A]
T, H, E, K = 16, 128, 12, 4
TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE  # survivors reach host 0's ranks over the Transfer Engine


def _inputs(rank, round_index):
    return structured_inputs(rank, token_count(rank, R, T), H, E, K, seed=900 + round_index, random_values=True)


def _round(ctx, buffer, round_index, dead=()):
    """One dispatch + combine from a full mask; the dead end masked, rows and outputs exact without them."""
    all_inputs = [_inputs(r, round_index) for r in range(R)]
    mine = all_inputs[ctx.rank]
    active = torch.ones(R, dtype=torch.int32)
    started = time.monotonic()
    recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, T, E, TIMEOUT_US, use_fp8=False)
    combined, _, _ = buffer.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active, TIMEOUT_US,
                                    handle)
    seconds = time.monotonic() - started
    want = [0 if r in dead else 1 for r in range(R)]
    assert active.tolist() == want, f"mask {active.tolist()}, expected {want}"
    routing = expected_routing([inp.topk_idx for inp in all_inputs], want, ctx.rank, E // R)
    assert count.tolist() == [len(pairs) for pairs in routing], "recv_count"
    for local, pairs in enumerate(routing):
        for row, (source, token) in enumerate(pairs):
            assert int(handle[0][local, row]) == token
            assert torch.equal(recv[local, row], all_inputs[source].x[token]), f"row {row} of expert {local}"
    expected = expected_combine(mine.x, mine.topk_idx, mine.weights, {r: bool(want[r]) for r in range(R)}, E // R)
    assert torch.equal(combined, expected), "combined output differs from the reference"
    return seconds


def rank_start(ctx):
    """A Buffer over the etcd store (transport auto: shm inside a host, TE across); one exact round."""
    buffer = RANK_STATE["buffer"] = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(T, H, R, E))
    _round(ctx, buffer, 0)
    return {"store": ctx.store_addr, "transport": buffer.transport, "routes": list(buffer._transport.routes)}


def rank_serve_without(ctx, dead):
    """A round right after host 0's death: the dead masked, exact without them."""
    return _round(ctx, RANK_STATE["buffer"], 1, dead=dead)


def rank_admit(ctx, joiners):
    """Replacements join through the store; survivors admit them once both are waiting."""
    if ctx.group is None:
        ticket = join(ctx.store, ctx.rank, ctx.num_ranks)
        RANK_STATE["buffer"] = Buffer(ticket, Buffer.get_ep_buffer_size_hint(T, H, R, E))
    else:
        deadline = time.monotonic() + 60
        while not set(joiners) <= set(RANK_STATE["buffer"].pending_joiners()):
            assert time.monotonic() < deadline, "the replacements never showed up"
            time.sleep(0.01)
    view = RANK_STATE["buffer"].update_ep_member(timeout_s=60)
    return list(view.ranks), view.epoch


def rank_full_rounds(ctx):
    buffer = RANK_STATE["buffer"]
    for round_index in (10, 11):
        _round(ctx, buffer, round_index)
    return True


def test_a_whole_host_lost_with_rank_0_and_the_etcd_leader(make_network):
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(R, network=network.placement(RANK_HOSTS), store="etcd") as cluster:
        etcd = cluster.etcd
        assert cluster.store is None and etcd.endpoints == [f"{a}:2379" for a in network.addresses]
        started = [outcome_value(o) for o in cluster.run(rank_start, timeout_s=120)]
        url = started[0]["store"][0]
        assert all(s["store"] == (url, None) for s in started) and url.startswith("etcd://"), started
        assert all(s["transport"] == "mooncake" for s in started)
        assert started[2]["routes"] == ["te", "te", "self", "shm", "te", "te"]
        etcd.move_leader(HOST_A)
        assert etcd.leader() == HOST_A
        for rank in DEAD:  # every process of host 0: its ranks and its etcd member, the leader
            os.kill(cluster.processes[rank].pid, signal.SIGKILL)
        etcd.kill(HOST_A)
        for rank in DEAD:
            cluster.processes[rank].join(10)
        survivors = [r for r in range(R) if r not in DEAD]
        seconds = [outcome_value(o) for o in cluster.run(rank_serve_without, DEAD, ranks=survivors, timeout_s=60)]
        assert max(seconds) < TIMEOUT_US / 1e6 + harness.FAULT_SLACK_S, seconds
        for rank in DEAD:  # host 0 back without its etcd member: the replacements use the two left
            cluster.respawn(rank)
        views = [outcome_value(o) for o in cluster.run(rank_admit, DEAD, timeout_s=120)]
        assert all(v == (list(range(R)), views[0][1]) for v in views), views
        assert all(outcome_value(o) for o in cluster.run(rank_full_rounds, timeout_s=120))
        assert all(outcome_value(o) for o in cluster.run(harness.rank_teardown, timeout_s=60))
        assert etcd.leader() != HOST_A
