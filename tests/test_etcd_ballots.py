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
restarted afterwards. The checks take a Buffer (`switch_with_leader_killed`, `rebalance_with_leader_killed`):
tests/test_hosts_etcd.py runs them across pretend hosts at its end.
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


def _checkpoint(num_experts=E, inter=I):
    from mooncake_ep_switch.reference.moe_block import random_weights

    return [random_weights(num_experts, H, inter, seed=500 + layer) for layer in range(LAYERS)]


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


def _ep_tp_shard(weights, layout, rank, num_ranks):
    experts, inter = weights.gate_up.shape[0], weights.down.shape[2]
    if layout == "ep":
        local = experts // num_ranks
        return weights.gate_up[rank * local:(rank + 1) * local], weights.down[rank * local:(rank + 1) * local]
    lo, hi = rank * inter // num_ranks, (rank + 1) * inter // num_ranks
    return (torch.cat([weights.gate_up[:, lo:hi], weights.gate_up[:, inter + lo:inter + hi]], dim=1),
            weights.down[:, :, lo:hi])


def switch_with_leader_killed(ctx, buffer, num_experts, inter, leader_pid, marker, timeout_us=TIMEOUT_US):
    """On a new UnifiedWeights of `buffer` (`num_experts` experts of H x `inter`, LAYERS layers): EP -> TP with
    the etcd leader killed in its decision, then TP -> EP; (outcome, layout, reason) of each, the weights checked
    against the checkpoint after each. One-sided ("shm"): killed at the "decide" step (the decision slot created,
    before any GO), every rank proposing during the election. Collective ("mooncake", across hosts: no decision
    record, the switch's group of the view decides who takes part): rank 0 kills it as it enters, the others
    enter once it is dead, so that group meets through etcd (gloo's rendezvous) during the election."""
    from mooncake_ep_switch.switch.switcher import switch_layout
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    unified = UnifiedWeights(buffer, WeightShape(num_experts, H, inter), LAYERS)
    full = _checkpoint(num_experts, inter)
    first = unified.seq + 1

    def hook(where, at):
        if where == "decide" and unified.seq == first:
            _kill_or_wait(ctx.rank, leader_pid, marker)

    reports = []
    try:
        unified.load_full(full)
        if not unified.one_sided:  # no "decide" step: the kill as the switch begins
            _kill_or_wait(ctx.rank, leader_pid, marker)
        for target in ("tp", "ep"):
            report = switch_layout(buffer, target, weights=unified, timeout_us=timeout_us, on_step=hook)
            reports.append((report.outcome, report.layout, report.reason))
            print(f"rank {ctx.rank}: switch to {target} {report.outcome}, entry and decision {report.prepare_ms:.0f} ms")
            for layer, weights in enumerate(full):
                want, got = _ep_tp_shard(weights, unified.layout, ctx.rank, ctx.num_ranks), unified.view(layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer} in {target}"
    finally:
        unified.destroy()
    return reports


def rank_switch_leader_killed(ctx, leader_pid, marker):
    """EP -> TP with the leader killed at the decision, then TP -> EP (`switch_with_leader_killed` on a new
    shm Buffer)."""
    from mooncake_ep_switch import Buffer

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, R, E), transport="shm")
    try:
        return switch_with_leader_killed(ctx, buffer, E, I, leader_pid, marker)
    finally:
        buffer.destroy()


def _placement(copy_of):
    """[LAYERS, R * SLOTS]: rank r holds experts 2r, 2r + 1 and a copy of expert `copy_of(r)`."""
    return np.asarray([[e for r in range(R) for e in (2 * r, 2 * r + 1, copy_of(r))]] * LAYERS, dtype=np.int64)


def rebalance_with_leader_killed(ctx, slots, rebalancer, active, full, targets, first_step, kill_epoch, leader_pid,
                                 marker):
    """Rebalance `slots` (its Buffer's `active` mask) to each placement of `targets` in turn (begun at step
    `first_step`, then 3 steps later, each committed at the step after it begins), the etcd leader killed
    between the votes of ballot epoch `kill_epoch`: rank 0's GO is in, then it kills the leader; every other
    rank votes after the kill. Per rebalance (reports, whether the placement is the target, whether the frames
    equal `full`)."""
    vote = slots.ballot.vote

    def vote_around_the_kill(epoch, *args, **kwargs):
        if epoch == kill_epoch and ctx.rank != 0:
            _kill_or_wait(ctx.rank, leader_pid, marker)  # the others vote after the kill
        vote(epoch, *args, **kwargs)
        if epoch == kill_epoch and ctx.rank == 0:
            _kill_or_wait(ctx.rank, leader_pid, marker)  # rank 0's vote is in: the leader dies

    slots.ballot.vote = vote_around_the_kill
    results = []
    try:
        for step, target in zip(range(first_step, first_step + 3 * len(targets), 3), targets):
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
        del slots.ballot.vote
    return results


def rank_vote_leader_killed(ctx, leader_pid, marker):
    """Rebalance 1 (each rank's copy -> the other rank's second expert) with the leader killed between the
    votes, then rebalance 2 back (`rebalance_with_leader_killed` on a new shm Buffer's slots)."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.online import OnlineRebalancer
    from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape

    experts = R * 2
    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, R, R * SLOTS), transport="shm")
    initial = _placement(lambda r: (2 * r + 2) % experts)
    slots = ExpertSlots(buffer, SlotShape(LAYERS, experts, SLOTS, H, I), initial)
    full = _checkpoint(experts)
    try:
        slots.load(full)
        rebalancer = OnlineRebalancer(slots, timeout_us=TIMEOUT_US, frames_per_step=1)
        return rebalance_with_leader_killed(ctx, slots, rebalancer, buffer.active_mask(), full,
                                            [_placement(lambda r: (2 * r + 3) % experts), initial], first_step=1,
                                            kill_epoch=1, leader_pid=leader_pid, marker=marker)
    finally:
        slots.destroy()
        buffer.destroy()


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
