"""A real network partition over the Transfer Engine: a host's link goes down, then comes back.

The test builds its own network with the shared multi-host fixture (tests/netns.py: one network
namespace per host, each with a veth to a bridge in a hub namespace), 2 hosts x 2 ranks, and
deletes it afterwards. `LocalCluster` starts every rank inside its host's namespace
(`Network.placement`): the rank reaches the launcher's store (listening on the bridge's address in
the hub namespace) and builds its gloo group over its host's veth, names its host (`MEP_HOST_ID`:
shm between the two ranks of a host) and advertises the host's address (`MEP_BIND_HOST`), so the
Transfer Engine, the store traffic and gloo all cross the veths. Downing host 1's veth cuts ranks 2
and 3 off their peers AND the store: a link flap between hosts with real TCP underneath. What that
does to the store: a new connection from host 1 fails at once (no route: the test shows it), while
the ranks' established store connections stay open (TCP only retransmits; nothing is sent on them
during the outage) and carry the rejoin after the link is back. No data-path call touches the store
or gloo, so the outage is seen only as peers that stop answering.
"""
import errno
import socket
import time

import torch

from mooncake_ep_switch import Buffer
from tests import harness
from tests.harness import RANK_STATE, outcome_value, rank_teardown
from tests.netns import make_network  # noqa: F401 - make_network is a fixture
from tests.reference import expected_combine, expected_routing, structured_inputs, token_count
from tests.test_faults import _mock_expert

NUM_HOSTS, RANKS_PER_HOST = 2, 2
NUM_RANKS = NUM_HOSTS * RANKS_PER_HOST  # ranks 0, 1 on host 0; ranks 2, 3 on host 1 (cut off)
CUT = [2, 3]
HIDDEN, TOKENS, EXPERTS, TOP_K = 256, 32, 16, 4  # 16 experts: 4 per rank
TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE
OUTAGE_S = 4.0


# ---------------------------------------------------------------------- rank functions
def _inputs(rank, seed):
    return structured_inputs(rank, token_count(rank, NUM_RANKS, TOKENS), HIDDEN, EXPERTS, TOP_K, seed=seed,
                             random_values=True)


def _round(ctx, buffer, seed, active):
    """One dispatch + combine; checks every row against the references for who took part."""
    all_inputs = [_inputs(r, seed) for r in range(NUM_RANKS)]
    mine = all_inputs[ctx.rank]
    started = time.monotonic()
    recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, TOKENS, EXPERTS, TIMEOUT_US,
                                                use_fp8=False)
    in_dispatch = active.tolist()
    combined, _, _ = buffer.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active, TIMEOUT_US,
                                    handle)
    seconds = time.monotonic() - started
    local = EXPERTS // NUM_RANKS
    routing = expected_routing([inp.topk_idx for inp in all_inputs], in_dispatch, ctx.rank, local)
    assert count.tolist() == [len(pairs) for pairs in routing], "recv_count"
    for l_idx, pairs in enumerate(routing):
        for row, (source, token) in enumerate(pairs):
            assert int(handle[0][l_idx, row]) == token
            assert torch.equal(recv[l_idx, row], all_inputs[source].x[token]), f"row {row} of expert {l_idx}"
    owners = {r: bool(active[r]) for r in range(NUM_RANKS)}
    assert torch.equal(combined, expected_combine(mine.x, mine.topk_idx, mine.weights, owners, local)), "combine"
    return {"mask": active.tolist(), "dispatch_mask": in_dispatch, "seconds": seconds}


def rank_start(ctx):
    size = Buffer.get_ep_buffer_size_hint(TOKENS, HIDDEN, NUM_RANKS, EXPERTS)
    buffer = RANK_STATE["buffer"] = Buffer(ctx.group, size, transport="mooncake")  # shm inside a host
    published = buffer.membership.endpoint(ctx.rank)["te_session"]
    return {"transport": buffer.transport, "session": published, "incarnation": buffer.membership.incarnation,
            "routes": [buffer._transport.routes[r] for r in range(NUM_RANKS) if r != ctx.rank],
            "round": _round(ctx, buffer, 1, torch.ones(NUM_RANKS, dtype=torch.int32))}


def rank_round(ctx, seed, full_mask=False, probe_store=False):
    """One round; with `probe_store`, first try a new connection to the store: "reached", or the errno name."""
    probe = None
    if probe_store:
        try:
            socket.create_connection(ctx.store_addr, timeout=2.0).close()
            probe = "reached"
        except OSError as error:
            probe = errno.errorcode.get(error.errno, str(error))
    buffer = RANK_STATE["buffer"]
    result = _round(ctx, buffer, seed, torch.ones(NUM_RANKS, dtype=torch.int32) if full_mask else buffer.active_mask())
    return dict(result, store=probe)


def rank_update(ctx, timeout_s, wait_for_joiners=(), wait_s=30.0):
    buffer = RANK_STATE["buffer"]
    deadline = time.monotonic() + wait_s
    while ctx.rank not in wait_for_joiners and not set(wait_for_joiners) <= set(buffer.pending_joiners()):
        assert time.monotonic() < deadline, f"joiners {wait_for_joiners} never showed up"
        time.sleep(0.01)
    started = time.monotonic()
    view = buffer.update_ep_member(timeout_s=timeout_s)
    return {"view": list(view.ranks), "epoch": view.epoch, "seconds": time.monotonic() - started,
            "incarnation": buffer.membership.incarnation}


def rank_refused(ctx):
    """The left-out rank's data plane refuses with a message that says what to do."""
    buffer = RANK_STATE["buffer"]
    mine = _inputs(ctx.rank, 5)
    try:
        buffer.dispatch(mine.x, mine.topk_idx, torch.ones(NUM_RANKS, dtype=torch.int32), TOKENS, EXPERTS,
                        TIMEOUT_US, use_fp8=False)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return str(error)
    return None


def test_left_out_host_rejoins_after_link_outage(make_network):
    """Host 1's link goes down for ~4 s. Ranks 0 and 1 (host 0) mask ranks 2 and 3 within timeout_us
    and keep serving exact rows (shm between them), as do 2 and 3 on their side; 0 and 1 seal a view
    without host 1. Link back up: ranks 2 and 3 rejoin as new incarnations through the joining path,
    the members admit them, and three full rounds are exact again. During the outage host 1 cannot
    reach the store (a new connection fails); its ranks' store connections carry their rejoin after."""
    everyone = list(range(NUM_RANKS))
    network = make_network(NUM_HOSTS)
    placement = network.placement([r // RANKS_PER_HOST for r in everyone])
    with harness.fresh_cluster(NUM_RANKS, network=placement) as cluster:
        assert cluster.store_addr[0] == network.store_address
        started = [outcome_value(o) for o in cluster.run(rank_start, timeout_s=90)]
        for rank, value in enumerate(started):
            # The Transfer Engine advertises the host's namespace address: its puts go over the veth.
            host = rank // RANKS_PER_HOST
            assert value["transport"] == "mooncake" and value["session"].startswith(f"{network.addresses[host]}:")
            assert value["routes"] == [["shm", "te", "te"], ["shm", "te", "te"], ["te", "te", "shm"],
                                       ["te", "te", "shm"]][rank], value
            assert value["round"]["mask"] == [1] * NUM_RANKS
        network.set_link(1, up=False)
        down_at = time.monotonic()
        cut = [outcome_value(o) for o in cluster.run(rank_round, 2, full_mask=True, probe_store=True, timeout_s=60)]
        for rank in everyone:  # each side masks the other within the deadline and serves exact rows
            assert cut[rank]["mask"] == ([1, 1, 0, 0] if rank < 2 else [0, 0, 1, 1]), cut
            assert cut[rank]["seconds"] < TIMEOUT_US / 1e6 + harness.FAULT_SLACK_S, cut
            # The store is reached over the veths: host 1 has no route to it while its link is down.
            assert cut[rank]["store"] == ("reached" if rank < 2 else "ENETUNREACH"), cut
        # Only the members agree (a cut-off rank that also called it could race them for the seal).
        members = [outcome_value(o) for o in cluster.run(rank_update, 20.0, ranks=[0, 1], timeout_s=60)]
        assert [m["view"] for m in members] == [[0, 1]] * 2 and members[0]["epoch"] == 1, members
        masks = [outcome_value(o)["mask"] for o in cluster.run(rank_round, 3, ranks=[0, 1], timeout_s=60)]
        assert masks == [[1, 1, 0, 0]] * 2, masks
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        network.set_link(1, up=True)
        # Ranks 2 and 3 find themselves left out, rejoin as new incarnations; the members admit them.
        back = [outcome_value(o) for o in cluster.run(rank_update, 30.0, wait_for_joiners=tuple(CUT),
                                                       timeout_s=90)]
        assert [b["view"] for b in back] == [everyone] * NUM_RANKS, back
        for rank in CUT:
            assert back[rank]["incarnation"] > started[rank].get("incarnation", 0)
        for seed in (4, 5, 6):
            rounds = [outcome_value(o) for o in cluster.run(rank_round, seed, timeout_s=60)]
            assert [r["mask"] for r in rounds] == [[1] * NUM_RANKS] * NUM_RANKS, rounds
        harness.check_outcomes(cluster.run(rank_teardown))
