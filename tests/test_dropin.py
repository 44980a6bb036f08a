"""Drop-in details callers of Mooncake's Buffer rely on (issue 27): its attributes, its `diagnostic=`
keyword, and a zero-copy combine whose `x` is not the combine buffer (DeepEP and Mooncake ignore it).

Each case runs the exact call pattern on real rank processes (tests/harness.py) over shm, the Transfer
Engine and the collective fallback, and checks every row against the references of tests/test_faults.py.
"""
import types

import pytest
import torch

from mooncake_ep_switch import Buffer
from tests import harness
from tests.test_faults import Shape, _check_round, _mock_expert, _round_inputs

TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE


def rank_mooncake_caller(ctx, transport):
    """What SGLang's dispatcher and Mooncake's tests read and pass, then a plain and a zero-copy combine
    whose `x` is another tensor (the outputs are in the buffer)."""
    size = Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, ctx.num_ranks, Shape.experts)
    buffer = Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)
    seen = {"group_size": buffer.group_size, "rank": buffer.rank, "num_ranks": buffer.num_ranks,
            "use_fallback": buffer._use_fallback, "backend_is_group": buffer.backend is ctx.group,
            "transport": buffer.transport}
    for name in ("group_size", "_use_fallback", "backend"):
        with pytest.raises(AttributeError):
            setattr(buffer, name, 1)
    everyone = [1] * ctx.num_ranks
    all_inputs = [_round_inputs(types.SimpleNamespace(rank=r, num_ranks=ctx.num_ranks), 0)
                  for r in range(ctx.num_ranks)]
    mine = all_inputs[ctx.rank]
    for zero_copy in (False, True):
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts,
                                                    TIMEOUT_US, use_fp8=False, diagnostic=object())
        y = _mock_expert(ctx, recv)
        x = y
        if zero_copy:
            buffer.get_next_combine_buffer(handle).copy_(y)
            x = torch.zeros_like(y)  # ignored: the data is in the buffer
        combined, _, _ = buffer.combine(x, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle,
                                        zero_copy=zero_copy, diagnostic=object())
        assert active.tolist() == everyone
        _check_round(ctx, all_inputs, everyone, everyone, recv, count, handle, combined)
    buffer.destroy()
    return seen


@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_mooncake_attributes_diagnostic_and_zero_copy_x_ignored(transport):
    with harness.fresh_cluster(2) as cluster:
        seen = harness.check_outcomes(cluster.run(rank_mooncake_caller, transport, timeout_s=90))
    for rank, value in enumerate(seen):
        assert value["group_size"] == value["num_ranks"] == 2 and value["rank"] == rank, value
        assert value["use_fallback"] == (transport == "collective") and value["backend_is_group"], value
