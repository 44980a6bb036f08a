"""A rank dies in the middle of a TP<->EP switch; the survivors end in one consistent layout.

On the shm transport the survivors complete the switch from the dead rank's still-mapped memory:
every survivor must report "completed" in the target layout with the dead rank named, hold
bit-exact weights for its own part of the target layout, and serve attention for what it holds.
No collective runs after the fault (it would hang on the dead rank).
"""
import os
import signal

import pytest
import torch

from tests import harness
from tests.test_switch_kv import _all_specs, _attention_here, _check_reference, _check_sharing, _populate, _setup
from tests.test_switch_weights import _expected_shard

NUM_RANKS = 4
DEAD = 2
TIMEOUT_US = harness.FAULT_TIMEOUT_US
MOE_LAYERS = 2


def _die(how):
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def rank_killed_mid_switch(ctx, target, phase, index, how):
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.switcher import switch_layout

    full = [random_weights(8, 128, 64, seed=layer) for layer in range(MOE_LAYERS)]
    buffer, unified, kv = _setup(ctx, "shm", 96)
    _populate(kv, ctx.rank, ctx.num_ranks, "ep")
    if target == "ep":  # get to TP first (no fault), then fail on the way back
        report = switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=20_000_000)
        assert report.outcome == "completed"
    # From here on no collective may run: rank DEAD dies inside the switch.

    def hook(where, at):
        if ctx.rank == DEAD and where == phase and at == index:
            _die(how)

    source = unified.layout
    report = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=TIMEOUT_US, on_step=hook)
    if phase == "enter":  # died before entering: nothing moved anywhere, everyone stays in the source
        assert report.outcome == "refused" and report.layout == source and str(DEAD) in report.reason, report
    else:
        assert report.outcome == "completed" and report.layout == target, report
        assert report.dead_ranks == (DEAD,), report
    layout = report.layout
    assert unified.layout == layout and kv.layout == layout
    for layer, weights in enumerate(full):
        want = _expected_shard(weights, layout, ctx.rank, ctx.num_ranks)
        got = unified.view(layer)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer} weights"
    _check_sharing(kv)
    attention = _attention_here(kv, step=0)
    _check_reference(kv, attention, ctx.num_ranks, step=0)
    result = {"report": report._asdict(), "rids": sorted(kv.requests), "heads": kv.head_groups()}
    kv.destroy()
    unified.destroy()
    buffer.destroy()
    return result


@pytest.mark.parametrize("target, phase, index, how, store", [
    ("tp", "weights", 1, "exit", "tcp"),            # EP -> TP, dies between layers (after sending layer 0)
    ("ep", "weights_partial", 0, "sigkill", "tcp"),  # TP -> EP, killed mid-layer (one peer got its chunk)
    ("tp", "kv", 0, "sigkill", "tcp"),               # EP -> TP, killed after the weights, before its KV moves
    # dies before entering: the switch is refused everywhere; the decision kept by the session's etcd cluster
    ("tp", "enter", 0, "exit", "etcd"),
])
def test_rank_dies_during_switch(target, phase, index, how, store, request):
    with harness.fresh_cluster(NUM_RANKS, store=harness.etcd_store(request, store)) as cluster:
        outcomes = cluster.run(rank_killed_mid_switch, target, phase, index, how, timeout_s=90, failure_grace_s=40)
        processes = list(cluster.processes)
        if store == "etcd":  # the decision went there (the ranks have no other store)
            assert type(cluster.store).__name__ == "EtcdStore" and cluster.store.num_keys() > 0
    dead = outcomes[DEAD]
    assert not dead.ok and dead.exitcode == (3 if how == "exit" else -signal.SIGKILL), dead
    survivors = [o for o in outcomes if o.rank != DEAD]
    for outcome in survivors:
        assert outcome.ok, outcome.error
    reports = [o.value["report"] for o in survivors]
    assert len({(r["layout"], r["outcome"], r["dead_ranks"]) for r in reports}) == 1, reports
    all_rids = {spec[0] for spec in _all_specs(NUM_RANKS)}
    if phase == "enter":
        assert all(r["outcome"] == "refused" and r["layout"] == "ep" for r in reports)
        assert all(o.value["heads"] == [0, 1, 2, 3] for o in survivors)
    elif target == "tp":
        for o in survivors:  # every request survives, each survivor holds its own head group
            assert set(o.value["rids"]) == all_rids and o.value["heads"] == [o.rank]
    else:  # every request is on exactly one survivor, or reported lost with the dead rank
        held = [rid for o in survivors for rid in o.value["rids"]]
        lost = set(reports[0]["lost_requests"])
        assert len(held) == len(set(held)) and set(held) | lost == all_rids and not set(held) & lost
        assert all(set(r["lost_requests"]) == lost for r in reports)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"


LATE_DELAYS_S = {1: 1.0, 2: 2.5}  # ranks late before their decision (a GC pause, a descheduled rank)
LATE_TIMEOUT_US = 2_000_000


def rank_late_at_the_decision(ctx):
    """Ranks 1 and 2 are late to decide, rank 2 past the deadline of ranks 0 and 3: one outcome everywhere."""
    import time

    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.switcher import switch_layout

    full = [random_weights(8, 128, 64, seed=layer) for layer in range(MOE_LAYERS)]
    buffer, unified, kv = _setup(ctx, "shm", 96)
    _populate(kv, ctx.rank, ctx.num_ranks, "ep")

    def late(where, at):
        if where == "decide":
            time.sleep(LATE_DELAYS_S.get(ctx.rank, 0.0))

    first = switch_layout(buffer, "tp", weights=unified, kv_cache=kv, timeout_us=LATE_TIMEOUT_US, on_step=late)
    assert not first.dead_ranks, first  # nobody died: a late peer is never declared dead at the decision
    after_first = (first.outcome, first.layout, unified.layout, kv.layout)
    # The group is still one: the next switch (nobody late) completes on every rank, exactly.
    target = "ep" if first.layout == "tp" else "tp"
    second = switch_layout(buffer, target, weights=unified, kv_cache=kv, timeout_us=20_000_000)
    assert second.outcome == "completed" and not second.dead_ranks, second
    for layer, weights in enumerate(full):
        want = _expected_shard(weights, target, ctx.rank, ctx.num_ranks)
        got = unified.view(layer)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {layer} weights"
    _check_sharing(kv)
    _check_reference(kv, _attention_here(kv, step=0), ctx.num_ranks, step=0)
    kv.destroy()
    unified.destroy()
    buffer.destroy()
    return after_first


def test_a_late_rank_at_the_decision_leaves_one_layout():
    """One decision per switch: a rank whose wait for a late peer's decision timed out and the ranks
    that saw every GO must end the same way (they used to split: the timed-out rank refused with its
    GO still published, the late ranks completed and declared it dead)."""
    outcomes = harness.run(4, rank_late_at_the_decision, timeout_s=90)
    assert len(set(outcomes)) == 1, outcomes
    outcome, layout, umm_layout, kv_layout = outcomes[0]
    assert layout == umm_layout == kv_layout and (outcome, layout) in {("refused", "ep"), ("completed", "tp")}


# ---------------------------------------------------------------- a collective switch after a replacement

def rank_gloo_weights(ctx):
    """A Buffer on the "mooncake" transport (its UnifiedWeights switch with gloo collectives) and its weights;
    a replacement (no group) joins first and builds its weights once admitted (the members' layout)."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.elastic import join
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache
    from mooncake_ep_switch.switch.tp_collective import TPAllReduce
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape
    from tests.test_switch_kv import D, E, H, H_KV, I, PAGE
    from tests.test_switch_kv import LAYERS as KV_LAYERS

    size = Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E)
    if ctx.group is None:
        buffer = Buffer(join(ctx.store, ctx.rank, ctx.num_ranks), size, transport="mooncake")
        buffer.update_ep_member(timeout_s=60.0)
    else:
        buffer = Buffer(ctx.group, size, transport="mooncake")
    weights = {}
    for name, seed in WEIGHTS.items():  # several structures of weights on one Buffer, as an engine's
        weights[name] = UnifiedWeights(buffer, WeightShape(E, H, I), MOE_LAYERS)
        weights[name].load_full([random_weights(E, H, I, seed=seed + layer) for layer in range(MOE_LAYERS)])
    reduce = TPAllReduce(buffer, REDUCE_ROWS, H)
    kv = PagedKVCache(buffer, KVCacheConfig(KV_LAYERS, H_KV, D, PAGE, 96))
    _populate(kv, ctx.rank, ctx.num_ranks, "ep")  # a replacement starts empty: it prefills its requests again
    harness.RANK_STATE.update(buffer=buffer, weights=weights, reduce=reduce, kv=kv)
    return any(w.one_sided for w in weights.values()) or reduce.region is not None or kv.region is not None


# Seeds of the UnifiedWeights each rank builds, in this order: "unified" (switched with the KV cache) and
# "second" switch in every epoch; "fallback" only on the collective fallback after the admission.
WEIGHTS = {"unified": 0, "second": 100, "fallback": 200}


def rank_gloo_switches(ctx, targets, admit=(), names=("unified", "second")):
    """Members admit `admit` first (once listed); then, for each of `targets`, a switch of each of the weights
    `names` (the first with the KV cache): (outcome, layout, reason) per switch, weights checked against the
    checkpoint after each completed one."""
    import time

    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.switcher import switch_layout
    from tests.test_switch_kv import E, H, I

    buffer, kv = harness.RANK_STATE["buffer"], harness.RANK_STATE["kv"]
    if admit and ctx.rank not in admit:
        deadline = time.monotonic() + 60
        while not set(admit) <= set(buffer.pending_joiners()):
            assert time.monotonic() < deadline, "the replacement never asked to join"
            time.sleep(0.01)
        buffer.update_ep_member(timeout_s=60.0)
    reports = []
    for target in targets:
        for name in names:
            unified = harness.RANK_STATE["weights"][name]
            with_kv = kv if name == "unified" else None
            report = switch_layout(buffer, target, weights=unified, kv_cache=with_kv, timeout_us=30_000_000)
            reports.append((report.outcome, report.layout, report.reason))
            if with_kv is not None:
                assert kv.layout == report.layout, (kv.layout, report)
                _check_sharing(kv)  # the KV cache: every request's attention as the dense reference's, in any layout
                _check_reference(kv, _attention_here(kv, step=0), ctx.num_ranks, step=0)
            if report.outcome == "completed":
                for layer in range(MOE_LAYERS):
                    checkpoint = random_weights(E, H, I, seed=WEIGHTS[name] + layer)
                    want = _expected_shard(checkpoint, target, ctx.rank, ctx.num_ranks)
                    got = unified.view(layer)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), \
                        f"{name} layer {layer} in {target}"
    return reports


REDUCE_ROWS = 5


def _reduce_partial(rank):
    from tests.test_switch_kv import H

    generator = torch.Generator().manual_seed(900 + rank)
    return torch.randn((REDUCE_ROWS, H), generator=generator).to(torch.bfloat16).float()


def rank_gloo_all_reduce(ctx):
    """The TP all-reduce (also gloo collectives on the "mooncake" transport) with every rank marked active:
    (active_ranks after the call, the ranks whose partials the float32 and bf16 results are exactly the
    rank-order sums of, or None)."""
    reduce = harness.RANK_STATE["reduce"]
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    x = _reduce_partial(ctx.rank)
    out32 = reduce.all_reduce(x, active, 30_000_000, float32_result=True)
    out16 = reduce.all_reduce(x, active.clone(), 30_000_000)
    summed = [r for r in range(ctx.num_ranks) if active[r]]
    want = torch.zeros_like(x)
    for r in summed:
        want += _reduce_partial(r)
    exact = torch.equal(out32, want) and torch.equal(out16, want.to(torch.bfloat16))
    return active.tolist(), summed if exact else None


def rank_gloo_dead_member(ctx):
    """Rank 0 once it saw rank 1 end, before sealing it out (as while the store has no quorum): the switch's
    (outcome, layout, reason) and the all-reduce's (error type, missing, message)."""
    import time

    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, unified = harness.RANK_STATE["buffer"], harness.RANK_STATE["weights"]["unified"]
    deadline = time.monotonic() + 30
    while 1 not in buffer.dead_peers():
        assert time.monotonic() < deadline, "rank 0 never saw rank 1 end"
        time.sleep(0.01)
    report = switch_layout(buffer, "tp", weights=unified, kv_cache=harness.RANK_STATE["kv"], timeout_us=30_000_000)
    try:
        rank_gloo_all_reduce(ctx)
        reduced = None
    except Exception as error:  # noqa: BLE001 - the test names the type it expects
        reduced = (type(error).__name__, list(getattr(error, "missing", ())), str(error))
    return (report.outcome, report.layout, report.reason), reduced


def rank_gloo_leave(ctx):
    """Rank 1 exits; rank 0, before sealing it out, is refused a switch and an all-reduce naming it; then it
    seals it out (update_ep_member): the switch is refused, naming it; the all-reduce runs over the view
    (rank 0 alone)."""
    if ctx.rank == 1:
        os._exit(3)
    unsealed = rank_gloo_dead_member(ctx)
    harness.RANK_STATE["buffer"].update_ep_member(timeout_s=30.0)
    return rank_gloo_switches(ctx, ["tp"]), rank_gloo_all_reduce(ctx), unsealed


def rank_gloo_rejoin(ctx):
    """The replacement joins and builds its weights; rank 0 admits it; then EP -> TP -> EP on both (two
    structures of weights), an all-reduce over both; then both move onto the collective fallback
    (`_use_fallback`) and the weights never switched in this epoch switch to TP there."""
    if ctx.group is None:
        assert rank_gloo_weights(ctx) is False
        switched = rank_gloo_switches(ctx, ["tp", "ep"])
    else:
        switched = rank_gloo_switches(ctx, ["tp", "ep"], admit=(1,))
    reduced = rank_gloo_all_reduce(ctx)
    harness.RANK_STATE["buffer"]._use_fallback = True
    return switched, reduced, rank_gloo_switches(ctx, ["tp"], names=("fallback",))


def rank_gloo_teardown(ctx):
    harness.RANK_STATE.pop("kv").destroy()
    harness.RANK_STATE.pop("reduce").destroy()
    for unified in harness.RANK_STATE.pop("weights").values():
        unified.destroy()
    return harness.rank_teardown(ctx)


def test_a_collective_switch_after_a_replacement_runs_on_the_new_view():
    """Weights that switch with gloo collectives (the "mooncake" transport: nothing one-sided) used to keep
    their constructor's group: with rank 1 dead and sealed out, rank 0's switch raised from inside gloo
    ("Connection closed by peer"), and a replacement, with no group, failed at once ("Default process group
    has not been initialized"). Now a switch runs on a gloo group of the current view, built through the store: with
    rank 1 sealed out the switch is refused naming it (nothing moved); once its replacement is admitted,
    EP -> TP -> EP completes on both ranks, bit-exact.
    Before rank 1 is sealed out (as while the store has no quorum), rank 0 knows it dead: its switch and its
    all-reduce refuse, naming it (before: gloo's "Connection closed by peer"; with R=4 one survivor waited for
    gloo's timeout instead).
    The TP all-reduce (`TPAllReduce`) had the same gap (before: rank 0's all-reduce raised from inside gloo,
    the replacement's at once): with rank 1 sealed out it sums rank 0's partial alone and sets rank 1 to 0
    in active_ranks; after the admission it sums both, exactly (float32 and bf16), on both ranks.
    A KV cache switched with the weights had it too (before: its all-to-all raised on both ranks, from gloo on
    rank 0 and "Default process group has not been initialized" on the replacement); every rank's requests
    (the replacement prefills its own again) keep the dense reference's attention in every layout."""
    with harness.fresh_cluster(2) as cluster:
        assert harness.check_outcomes(cluster.run(rank_gloo_weights, timeout_s=60)) == [False, False]
        outcomes = cluster.run(rank_gloo_leave, timeout_s=60, failure_grace_s=30)
        assert not outcomes[1].ok and outcomes[1].exitcode == 3, outcomes[1]
        switched, reduced, (unsealed_switch, unsealed_reduce) = harness.outcome_value(outcomes[0])
        assert unsealed_switch[:2] == ("refused", "ep") and "ranks [1] are dead" in unsealed_switch[2], unsealed_switch
        assert unsealed_reduce[:2] == ("MembershipError", [1]) and "ranks [1] are dead" in unsealed_reduce[2], \
            unsealed_reduce
        assert [s[:2] for s in switched] == [("refused", "ep")] * 2 and \
            all("ranks [1] are not members" in reason for _, _, reason in switched), switched
        assert reduced == ([1, 0], [0]), reduced
        cluster.respawn(1)
        results = harness.check_outcomes(cluster.run(rank_gloo_rejoin, timeout_s=120))
        reports = [switches for switches, _, _ in results]
        assert reports == [[("completed", "tp", "")] * 2 + [("completed", "ep", "")] * 2] * 2, reports
        assert [reduced for _, reduced, _ in results] == [([1, 1], [0, 1])] * 2, results
        assert [fallback for _, _, fallback in results] == [[("completed", "tp", "")]] * 2, results
        harness.check_outcomes(cluster.run(rank_gloo_teardown, timeout_s=60))
