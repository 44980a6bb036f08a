"""`switch_layout()` after a resize on the one-sided path (issue 37 item 3, docs/resize.md).

A `UnifiedWeights` spans the `num_ranks` of its Buffer and is not re-sharded over a smaller view. On the
collective path a switch after a shrink is refused at once, naming the ranks (tests/test_switch_group.py);
on shm (one-sided) too: every survivor checks the view before it enters (before, the removed rank never
entered and every survivor refused only at `timeout_us`). R=2 on the shared cluster: a switch EP -> TP
completes, rank 1 is drained out (`shrink([1], drain=True)`, no process ends) and destroys its structures,
then rank 0's switch back to EP is refused at once naming rank 1 (well before its `timeout_us`), and its
weights stay the TP shards of the checkpoint, bit-exact.
"""
from tests import harness
from tests.test_switch_group import rank_switch_after_drain

TIMEOUT_US = 20_000_000  # the refusal comes at once, long before this deadline


def test_a_one_sided_switch_after_a_drain_is_refused_at_once_naming_the_rank_that_left():
    rank0, rank1 = harness.run(2, rank_switch_after_drain, "shm", TIMEOUT_US, timeout_s=120)
    assert rank1 == [(("completed", "tp", ""), True)], rank1
    assert rank0[0] == (("completed", "tp", ""), True), rank0
    (outcome, layout, reason), unchanged, seconds = rank0[1]
    assert (outcome, layout) == ("refused", "tp") and "ranks [1] are not members of the current view" in reason, rank0
    assert unchanged, "a refused switch changed rank 0's weights"
    assert seconds < TIMEOUT_US / 1e6 / 2, f"refused after {seconds:.2f} s, not at once"
