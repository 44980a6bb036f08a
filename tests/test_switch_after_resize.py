"""`switch_layout()` after a resize on the one-sided path (issue 37 item 3, docs/resize.md).

A `UnifiedWeights` spans the `num_ranks` of its Buffer and is not re-sharded over a smaller view. On the
collective path a switch after a shrink is refused at once, naming the ranks (tests/test_switch_group.py);
on shm (one-sided) too: every survivor checks the view before it enters (before, the removed rank never
entered and every survivor refused only at `timeout_us`). R=2 on the shared cluster: a switch EP -> TP
completes, rank 1 is drained out (`shrink([1], drain=True)`, no process ends) and destroys its structures,
then rank 0's switch back to EP is refused at once naming rank 1 (well before its `timeout_us`), and its
weights stay the TP shards of the checkpoint, bit-exact.
"""
import time

from tests import harness
from tests.test_switch_group import LAYERS, _weights_match
from tests.test_switch_kv import E, H, I

TIMEOUT_US = 20_000_000  # the refusal comes at once, long before this deadline


def rank_shm_switch_after_drain(ctx):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.switcher import switch_layout
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E), transport="shm")
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
            started = time.monotonic()
            report = switch_layout(buffer, "ep", weights=unified, timeout_us=TIMEOUT_US)
            results.append(((report.outcome, report.layout, report.reason),
                            unified.layout == "tp" and _weights_match(unified, "tp", ctx.rank, ctx.num_ranks),
                            time.monotonic() - started))
        return results
    finally:
        unified.destroy()
        buffer.destroy()


def test_a_one_sided_switch_after_a_drain_is_refused_at_once_naming_the_rank_that_left():
    rank0, rank1 = harness.run(2, rank_shm_switch_after_drain, timeout_s=120)
    assert rank1 == [(("completed", "tp", ""), True)], rank1
    assert rank0[0] == (("completed", "tp", ""), True), rank0
    (outcome, layout, reason), unchanged, seconds = rank0[1]
    assert (outcome, layout) == ("refused", "tp") and "ranks [1] are not members of the current view" in reason, rank0
    assert unchanged, "a refused switch changed rank 0's weights"
    assert seconds < TIMEOUT_US / 1e6 / 2, f"refused after {seconds:.2f} s, not at once"
