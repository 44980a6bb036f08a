"""The etcd leader dies in the middle of a decision (issue 38): one decision everywhere, and the next one works.

The ranks' store is the session's 3-member etcd cluster on loopback (`harness.etcd_store`), its leader
moved first to member 0, the endpoint every rank's client tries first. Rank 0 SIGKILLs the leader in the
middle of a group-wide decision while rank 1 waits until it is dead:

* a TP<->EP switch (shared memory, one-sided): at the "decide" step, after the entry's decision slot was
  created and before either rank's GO; both propose their verdict to the decision record while the two
  members left elect a leader;
* an online EPLB commit: between the votes (rank 0's GO is in etcd, rank 1 votes after the kill); both
  then wait for the votes and propose during the election.

Every rank must report the same outcome (completed / committed: nobody was late), hold bit-exact weights,
and the next switch / rebalance must be decided the same way on the two members left. The member is
restarted afterwards.
"""
import os
import signal
import time

import numpy as np
import torch

from tests import harness

R = 2
E, H, I, LAYERS = 4, 128, 64, 2  # switch: E experts per layer, I % R == 0
SLOTS = 3  # EPLB: 2 primaries and one redundant copy per rank
TIMEOUT_US = 15_000_000  # each store step's deadline: the election (~0.5-1 s) fits in it on a loaded box
MARK_WAIT_S = 60.0


def _checkpoint(num_experts=E):
    from mooncake_ep_switch.reference.moe_block import random_weights

    return [random_weights(num_experts, H, I, seed=500 + layer) for layer in range(LAYERS)]


def _kill_or_wait(rank, leader_pid, marker):
    """Rank 0 SIGKILLs the etcd leader, then marks it; every other rank returns once it is marked."""
    if rank == 0:
        os.kill(leader_pid, signal.SIGKILL)
        with open(marker, "w") as flag:
            flag.write("killed")
        return
    deadline = time.monotonic() + MARK_WAIT_S
    while not os.path.exists(marker):
        assert time.monotonic() < deadline, "rank 0 never killed the etcd leader"
        time.sleep(0.005)


def _ep_tp_shard(weights, layout, rank):
    if layout == "ep":
        local = E // R
        return weights.gate_up[rank * local:(rank + 1) * local], weights.down[rank * local:(rank + 1) * local]
    lo, hi = rank * I // R, (rank + 1) * I // R
    return torch.cat([weights.gate_up[:, lo:hi], weights.gate_up[:, I + lo:I + hi]], dim=1), weights.down[:, :, lo:hi]


def rank_switch_leader_killed(ctx, leader_pid, marker):
    """EP -> TP with the leader killed at the decision, then TP -> EP; (outcome, layout) of each, weights
    checked against the checkpoint after each."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.switch.switcher import switch_layout
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, R, E), transport="shm")
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), LAYERS)
    full = _checkpoint()
    unified.load_full(full)

    def hook(where, at):
        if where == "decide" and unified.seq == 1:
            _kill_or_wait(ctx.rank, leader_pid, marker)

    reports = []
    try:
        for target in ("tp", "ep"):
            report = switch_layout(buffer, target, weights=unified, timeout_us=TIMEOUT_US, on_step=hook)
            reports.append((report.outcome, report.layout, report.reason))
            print(f"rank {ctx.rank}: switch to {target} {report.outcome}, entry and decision {report.prepare_ms:.0f} ms")
            for layer, weights in enumerate(full):
                want, got = _ep_tp_shard(weights, unified.layout, ctx.rank), unified.view(layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer} in {target}"
    finally:
        unified.destroy()
        buffer.destroy()
    return reports


def _placement(copy_of):
    """[LAYERS, R * SLOTS]: rank r holds experts 2r, 2r + 1 and a copy of expert `copy_of(r)`."""
    return np.asarray([[e for r in range(R) for e in (2 * r, 2 * r + 1, copy_of(r))]] * LAYERS, dtype=np.int64)


def rank_vote_leader_killed(ctx, leader_pid, marker):
    """Rebalance 1 (each rank's copy -> the other rank's second expert) with the leader killed between the
    votes, then rebalance 2 back; per rebalance the reports, whether the placement is the target and the
    frames equal the checkpoint."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape

    experts = R * 2
    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, R, R * SLOTS), transport="shm")
    initial = _placement(lambda r: (2 * r + 2) % experts)
    slots = ExpertSlots(buffer, SlotShape(LAYERS, experts, SLOTS, H, I), initial)
    full = _checkpoint(experts)
    slots.load(full)
    rebalancer = OnlineRebalancer(slots, timeout_us=TIMEOUT_US, frames_per_step=1)
    vote = slots.ballot.vote

    def vote_around_the_kill(epoch, *args, **kwargs):
        if epoch == 1 and ctx.rank != 0:
            _kill_or_wait(ctx.rank, leader_pid, marker)  # rank 1 votes after the kill
        vote(epoch, *args, **kwargs)
        if epoch == 1 and ctx.rank == 0:
            _kill_or_wait(ctx.rank, leader_pid, marker)  # rank 0's vote is in: the leader dies

    slots.ballot.vote = vote_around_the_kill
    active = buffer.active_mask()
    results = []
    try:
        for step, target in ((1, _placement(lambda r: (2 * r + 3) % experts)), (4, initial)):
            rebalancer.begin(target, commit_step=step + 1)
            done = [r for at in (step, step + 1) for r in rebalancer.step(at, active)]
            reports = [(r.epoch, r.outcome, r.reason) for r in done]
            print(f"rank {ctx.rank}: rebalance {step} {[r.outcome for r in done]}, commit step "
                  f"{[round(r.stall_ms) for r in done]} ms")
            frames_ok = all(torch.equal(slots.expert(layer, local)[0], weights.gate_up[expert])
                            and torch.equal(slots.expert(layer, local)[1], weights.down[expert])
                            for layer, weights in enumerate(full)
                            for local, expert in enumerate(slots.local_experts(layer)))
            results.append((reports, slots.phy2log.tolist() == target.tolist(), frames_ok))
    finally:
        slots.destroy()
        buffer.destroy()
    return results


def _run_with_leader_killed(request, tmp_path, function):
    """Run `function(ctx, leader_pid, marker)` on R fresh ranks over the session's etcd cluster whose leader
    is member 0; the killed member is restarted afterwards. Returns (values, old leader, new leader)."""
    etcd = request.getfixturevalue("etcd_cluster")
    url = harness.etcd_store(request)
    etcd.move_leader(0)
    old = etcd.leader()
    marker = str(tmp_path / "leader-killed")
    try:
        with harness.fresh_cluster(R, store=url) as cluster:
            values = harness.check_outcomes(cluster.run(function, etcd.processes[old].pid, marker, timeout_s=120))
            assert os.path.exists(marker)
            new = etcd.leader()
    finally:
        etcd.kill(old)  # reaps the killed member
        etcd.restart(old)
        etcd.wait_healthy(range(len(etcd.processes)), 30.0)
    return values, old, new


def test_etcd_leader_killed_at_a_switch_decision_one_decision_everywhere(request, tmp_path):
    values, old, new = _run_with_leader_killed(request, tmp_path, rank_switch_leader_killed)
    assert new != old
    assert values == [[("completed", "tp", ""), ("completed", "ep", "")]] * R, values


def test_etcd_leader_killed_between_eplb_votes_one_decision_everywhere(request, tmp_path):
    values, old, new = _run_with_leader_killed(request, tmp_path, rank_vote_leader_killed)
    assert new != old
    for rank, results in enumerate(values):
        assert [r[0] for r in results] == [[(1, "committed", "")], [(2, "committed", "")]], (rank, results)
        assert all(placed and frames for _, placed, frames in results), (rank, results)
