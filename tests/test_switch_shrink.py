"""A collective TP<->EP switch after the group shrank: refused, naming the ranks that left, nothing moved.

On the collective transport (and Mooncake's `_use_fallback`) a switch runs on the fallback's group of the
current view; after `Buffer.shrink` that group holds the survivors only, while every rank's shard is
needed. R=2 on the shared cluster: a switch EP -> TP completes; rank 1 is drained out
(`shrink([1], drain=True)`, no process ends); rank 0's switch back to EP is refused naming rank 1, and its
weights stay the TP shards of the checkpoint, bit-exact.
"""
import torch

from tests import harness
from tests.test_switch_kv import E, H, I
from tests.test_switch_weights import _expected_shard

LAYERS = 2


def _weights_match(unified, layout, rank, num_ranks):
    """Whether every layer of `unified` holds `rank`'s shard of the checkpoint in `layout`, bit-exact."""
    from mooncake_ep_switch.reference.moe_block import random_weights

    for layer in range(LAYERS):
        want = _expected_shard(random_weights(E, H, I, seed=layer), layout, rank, num_ranks)
        got = unified.view(layer)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return False
    return True


def rank_switch_after_drain(ctx):
    """Switch EP -> TP, drain rank 1 out, then rank 0 switches back to EP: ((outcome, layout, reason) of
    each switch, weights exact after each) on rank 0, the first switch's on rank 1."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.switcher import switch_layout
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E), transport="collective")
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), LAYERS)
    try:
        unified.load_full([random_weights(E, H, I, seed=layer) for layer in range(LAYERS)])
        results = []
        report = switch_layout(buffer, "tp", weights=unified, timeout_us=30_000_000)
        results.append(((report.outcome, report.layout, report.reason),
                        _weights_match(unified, "tp", ctx.rank, ctx.num_ranks)))
        view = buffer.shrink([1], timeout_s=60, drain=True)
        assert list(view.ranks) == [0], view
        if ctx.rank == 0:
            report = switch_layout(buffer, "ep", weights=unified, timeout_us=30_000_000)
            results.append(((report.outcome, report.layout, report.reason),
                            unified.layout == "tp" and _weights_match(unified, "tp", ctx.rank, ctx.num_ranks)))
        return results
    finally:
        unified.destroy()
        buffer.destroy()


def test_a_collective_switch_after_a_shrink_is_refused_naming_the_ranks_that_left():
    """Before, the fallback branch took the weights' group without checking the view: rank 0's switch
    after the drain ran on a group of the survivors alone and failed inside the switch (see the commit)."""
    rank0, rank1 = harness.run(2, rank_switch_after_drain, timeout_s=120)
    assert rank1 == [(("completed", "tp", ""), True)], rank1
    assert rank0[0] == (("completed", "tp", ""), True), rank0
    (outcome, layout, reason), unchanged = rank0[1]
    assert (outcome, layout) == ("refused", "tp") and "ranks [1] are not members" in reason, rank0
    assert unchanged, "a refused switch changed rank 0's weights"
