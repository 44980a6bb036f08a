"""Resizing a running EP group across hosts for real (issue 37): the Transfer Engine between network namespaces.

Every rank lives in its host's network namespace from its start (tests/netns.py, `Network.placement`); the
Buffers run `transport="mooncake"`: shared memory inside a host, the Transfer Engine across. The rank functions
and the checks are those of tests/test_shrink.py, tests/test_drain.py and tests/test_grow.py (shm and the
collective fallback there), so each resize is checked for the same things: every served step equals the
single-process reference (before the resize and after it), every survivor ends on one view and one placement,
no dispatch-map entry or slot lies outside the view, and the expert weights come from where they should.

* 4 -> 3, a dead rank (`Buffer.shrink` through `shrink_experts`): DEAD (host 1) is SIGKILLed, the survivors
  of both hosts agree the view without it and cover its sole expert from the loader.
* 4 -> 3, a drained live rank (`begin_drain` / `finish_drain`): LEAVING (host 1) hands its sole expert to
  rank 0 on host 0, which reads it from LEAVING's frame over the Transfer Engine, then leaves.
* 3 -> 5 (`GrowOperation` / `join_grow`): newcomer 3 on host 1 and newcomer 4 on host 0 join the 3-rank group
  of hosts 0 and 1 (after a first attempt refused by name); each newcomer copies its slots from the members'
  memory, from its host mate through the mapping and from the other host over the Transfer Engine (before the
  fix it read the other host's region as if mapped: "rank: peer 1 is not mapped"). On the grown group every rank
  then reads every slot of the other host's ranks over the Transfer Engine (the grown group's region records),
  each exactly its expert's weights.
* 5 -> 4 -> 6 in one job (tests/test_grow_after_shrink.py's rank function and checks): ranks 0, 2, 4 on host 0,
  1, 3 on host 1; rank 2 is SIGKILLed, the four survivors shrink, then grow with newcomer 5 on host 1 and newcomer
  6 on host 0 (ranks 4 and 5 of the grown group, the members renumbered densely); each newcomer reads the slots
  that the first member holding its expert has on the other host over the Transfer Engine.

The shrink and the grow on the emulated CUDA device: the "emulated cuda" cells of test_shrink and test_grow.
"""
import signal

from tests import harness, test_drain, test_grow, test_shrink
from tests.harness import RANK_STATE, outcome_value
from tests.netns import make_network  # noqa: F401 - make_network is a fixture

NUM_HOSTS = 2
HOSTS = [0, 1, 0, 1]  # the 4-rank group: DEAD / LEAVING (rank 3) on host 1 with rank 1
GROW_HOSTS = [0, 1, 0, 1, 0]  # the 3 members on both hosts, newcomer 3 on host 1, newcomer 4 on host 0
TRANSPORT = "mooncake"


def _routes(rank, hosts, gone=None):
    """The peer routes of `rank` on `hosts` (shm inside a host, the Transfer Engine across); None to `gone`."""
    return [None if peer == gone else "self" if peer == rank else "shm" if hosts[peer] == hosts[rank] else "te"
            for peer in range(len(hosts))]


def _where(buffer):
    """What the rank's Buffer runs on: its transport's name and each peer's route."""
    return {"transport": buffer.transport, "routes": list(buffer.peer_routes())}


def rank_shrink_across_hosts(ctx):
    out = test_shrink.rank_shrink(ctx, TRANSPORT)
    out.update(_where(RANK_STATE["buffer"]))
    return out


def test_shrink_a_dead_rank_across_hosts(make_network):
    """4 -> 3 after DEAD's death, the survivors on both hosts (test_shrink's checks)."""
    assert test_shrink.R == len(HOSTS) and HOSTS[test_shrink.DEAD] == 1
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(test_shrink.R, network=network.placement(HOSTS)) as cluster:
        outcomes = cluster.run(rank_shrink_across_hosts, timeout_s=180, failure_grace_s=60)
        dead = outcomes[test_shrink.DEAD]
        assert not dead.ok and dead.exitcode == -signal.SIGKILL, dead
        survivors = [outcome_value(o) for o in outcomes if o.rank != test_shrink.DEAD]
        cluster.accept_dead(test_shrink.DEAD)
        harness.check_outcomes(cluster.run(test_shrink.rank_close, ranks=[0, 1, 2], timeout_s=60))
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    for rank, s in enumerate(survivors):
        assert s["transport"] == TRANSPORT, s["transport"]
        assert s["routes"][:test_shrink.DEAD] == _routes(rank, HOSTS)[:test_shrink.DEAD], (rank, s["routes"])
    test_shrink.check_shrink(survivors, "mooncake across namespace hosts")


def rank_drain_across_hosts(ctx):
    out = test_drain.rank_drain(ctx, TRANSPORT)
    if ctx.rank != test_drain.LEAVING:  # the leaving rank's Buffer is destroyed by then
        out.update(_where(RANK_STATE["buffer"]), te_reads=RANK_STATE["slots"].te_reads)
    return out


def test_drain_a_live_rank_across_hosts(make_network):
    """4 -> 3, LEAVING drained out; rank 0 (the other host) takes its sole expert over the Transfer Engine."""
    assert HOSTS[test_drain.LEAVING] != HOSTS[0]
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(test_drain.R, network=network.placement(HOSTS)) as cluster:
        try:
            results = [outcome_value(o) for o in cluster.run(rank_drain_across_hosts, timeout_s=180)]
        finally:
            harness.check_outcomes(cluster.run(test_drain.rank_close, timeout_s=60))
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    for rank, r in enumerate(results):
        if rank == test_drain.LEAVING:
            continue
        assert r["transport"] == TRANSPORT, r["transport"]
        assert r["routes"] == _routes(rank, HOSTS, test_drain.LEAVING), (rank, r["routes"])
        assert r["te_reads"] == (1 if rank == 0 else 0), (rank, r["te_reads"])  # LEAVING's frame, across hosts
    test_drain.check_drain(results, "mooncake across namespace hosts")


def then_where(ctx, new, slots, weights, step):
    """On the grown Buffer: its routes, the slots the rank read over the Transfer Engine in the grow, and whether
    every slot of every rank of the other host (members and newcomers: the grown group's region records), read
    over the Transfer Engine into a free frame, holds exactly its expert's weights."""
    import torch
    import torch.distributed as dist

    out = {**_where(new), "te_reads": slots.te_reads, "read_back": []}
    frame, spr = slots.free_frames[0], test_grow.SPR  # nothing serves from a free frame
    for peer in (p for p in range(new.num_ranks) if not slots.is_mapped(p)):
        for layer in range(test_grow.LAYERS):
            for local in range(spr):
                expert = int(slots.phy2log[layer, peer * spr + local])
                slots.read_remote_frame(frame, peer, layer, local, 30.0)
                gate_up, down = slots.frame_views(frame)
                out["read_back"].append((peer, torch.equal(gate_up, weights[layer].gate_up[expert])
                                         and torch.equal(down, weights[layer].down[expert])))
    dist.barrier(group=new.group)  # no rank destroys its slots while another reads them
    return out


def test_grow_3_to_5_across_hosts(make_network):
    """3 -> 5, newcomers on both hosts (test_grow's checks); their copies cross the hosts over the Transfer Engine."""
    assert test_grow.R1 == len(GROW_HOSTS)
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(test_grow.R1, network=network.placement(GROW_HOSTS)) as cluster:
        outs = harness.check_outcomes(cluster.run(test_grow.rank_grow, TRANSPORT, then_where, timeout_s=180))
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    for rank, out in enumerate(outs):
        assert out["then"]["routes"] == _routes(rank, GROW_HOSTS), (rank, out["then"])
        other = [peer for peer in range(test_grow.R1) if GROW_HOSTS[peer] != GROW_HOSTS[rank]]
        assert out["then"]["read_back"] == [(peer, True) for peer in other for _ in range(test_grow.LAYERS *
                                                                                         test_grow.SPR)], (rank, out)
    # Each newcomer copies its slots from the members holding them: from its host mate through the mapping, from
    # the other host over the Transfer Engine (newcomer 3 reads rank 0's copies, newcomer 4 rank 1's).
    assert [out["then"]["te_reads"] for out in outs] == _across_host_copies(), [out["then"] for out in outs]
    test_grow.check_grow(outs, TRANSPORT)


def _across_host_copies():
    """Per rank of the grown group: how many of its slots `grow_slots` copies from a member on another host."""
    import numpy as np

    from mooncake_ep_switch.eplb.grow_placement import grow_placement

    g, spr = test_grow, test_grow.SPR
    target = grow_placement(np.asarray(g.PLACEMENT), g.R0, g.R1, spr, g.EXPERTS)
    counts = [0] * g.R1
    for layer in range(g.LAYERS):
        for slot in range(g.R0 * spr, g.R1 * spr):
            holder = int(np.nonzero(target[layer, :g.R0 * spr] == target[layer, slot])[0][0]) // spr
            counts[slot // spr] += GROW_HOSTS[holder] != GROW_HOSTS[slot // spr]
    assert counts[g.R0] and counts[g.R0 + 1], counts  # both newcomers read across hosts
    return counts


RESIZE_HOSTS = [0, 1, 0, 1, 0, 1, 0]  # 5 -> 4 -> 6: ranks 0, 2 (the victim), 4 on host 0, 1, 3 on host 1; newcomer
# 5 on host 1, newcomer 6 on host 0 (ranks 4 and 5 of the grown group)


def test_grow_after_a_shrink_5_to_4_to_6_across_hosts(make_network):
    """5 -> 4 -> 6 in one job on 2 hosts (test_grow_after_shrink's rank function and checks): the victim on host 0
    is SIGKILLed, the four survivors of both hosts shrink, then grow by a newcomer on each host, renumbered densely;
    each newcomer copies its slots from the members' memory, over the Transfer Engine from the other host."""
    from tests import test_grow_after_shrink as gas

    assert len(RESIZE_HOSTS) == gas.R0 + 2 and RESIZE_HOSTS[gas.VICTIM] == 0
    network = make_network(NUM_HOSTS)
    with harness.fresh_cluster(gas.R0 + 2, network=network.placement(RESIZE_HOSTS)) as cluster:
        outcomes = cluster.run(gas.rank_5_4_6, TRANSPORT, timeout_s=240, failure_grace_s=60)
        cluster.accept_dead(gas.VICTIM)
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    outs = gas.check_5_4_6(outcomes, TRANSPORT)
    hosts = [RESIZE_HOSTS[world] for world in gas.SURVIVORS + [gas.R0, gas.R0 + 1]]  # by rank of the grown group
    for rank, out in enumerate(outs):
        assert out["routes"] == _routes(rank, hosts), (rank, out["routes"])
    # Each newcomer copies a slot from the first member slot holding its expert: across hosts over the Transfer Engine.
    grown, spr, members = outs[0]["phy2log"], gas.SPR, len(gas.SURVIVORS)
    across = [0] * gas.R1
    for layer in grown:
        for slot in range(members * spr, gas.R1 * spr):
            holder = layer[:members * spr].index(layer[slot]) // spr
            across[slot // spr] += hosts[holder] != hosts[slot // spr]
    assert across[members] and across[members + 1], across  # both newcomers read across hosts
    assert [out["te_reads"] for out in outs] == across, [out["te_reads"] for out in outs]
    print("5 -> 4 -> 6 across hosts: slots read over the Transfer Engine per rank of the grown group", across)
