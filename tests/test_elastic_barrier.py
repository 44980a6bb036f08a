"""`ElasticBuffer.barrier()` keeps a region half's layout: its inner dispatch (no tokens) has the inner
shape of the buffer's latest call (before any call, the constructor's MoE settings'), so a late peer's
rows or signals for an earlier call of the same half land where that call's layout puts them, never in
another source's rows or signals of a barrier's layout (docs/protocol.md, failure semantics)."""
import torch

from mooncake_ep_switch import ElasticBuffer
from mooncake_ep_switch.elastic_buffer import rows as codec
from tests import harness


def rank_barrier_shapes(ctx):
    """The (T, inner hidden, inner experts) of every inner dispatch: a barrier first, a round of one shape,
    a barrier, a round of another, a barrier. The rounds are checked exact against a plain sum."""
    R, rank, T, H, K = ctx.num_ranks, ctx.rank, 6, 256, 2
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, transport="shm",
                           max_num_bias=0)
    shapes = []
    inner = buffer.runtime.dispatch

    def recording_dispatch(x, topk_idx, active_ranks, num_max_tokens_per_rank, num_experts, *args, **kwargs):
        shapes.append((num_max_tokens_per_rank, x.size(1), num_experts))
        return inner(x, topk_idx, active_ranks, num_max_tokens_per_rank, num_experts, *args, **kwargs)

    buffer.runtime.dispatch = recording_dispatch
    try:
        buffer.barrier()
        for tokens, hidden in ((T, H), (2 * T, 128)):
            x = torch.full((tokens, hidden), float(rank + 1), dtype=torch.bfloat16)
            topk = torch.tensor([[(rank + 1) % R, -1]] * tokens, dtype=torch.int64)  # one expert on the next rank
            recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk, num_experts=R,
                                                      num_max_tokens_per_rank=tokens)
            combined, _, _ = buffer.combine(recv_x, handle)
            assert torch.equal(combined, x)  # each token comes back from its one rank unchanged
            buffer.barrier()
        return shapes
    finally:
        buffer.destroy()


def test_the_barrier_keeps_the_latest_inner_shape():
    """Fails with a barrier of its own shape (T=1, 128 wide): its signals would sit inside the data rows of
    the calls' layout in the same region half."""
    T, H, K = 6, 256, 2
    for shapes in harness.run(2, rank_barrier_shapes, timeout_s=120):
        first = (T, codec.inner_hidden(H, K), 6)
        second = (2 * T, codec.inner_hidden(128, K), 6)
        assert shapes == [first, first, first, second, second], shapes
