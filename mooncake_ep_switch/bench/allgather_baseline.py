"""Baseline for the benchmarks: dispatch/combine with all-gather + all-reduce (Mooncake's fallback design).

Same semantics as `Buffer.dispatch`/`combine` (bf16, packed layout, fp32 weighted combine), but every
rank all-gathers every token with its top-k ids (padded to `T`, one all-gather) and the combine
all-gathers the routing weights and all-reduces a `[R, T, hidden]` float32 buffer. Used only as the
in-run baseline the collective transport is measured against.
"""
import torch
import torch.distributed as dist


def allgather_dispatch(group, rank, num_ranks, x, topk_idx, tokens_per_rank, num_experts):
    """Returns (recv_x [L, R*T, H] bf16, recv_count [L], state for combine).

    One all-gather carries both the tokens and their top-k ids (packed side by side as bytes).
    Collective over `group`.

    Arguments:
        group: the process group.
        rank: this rank.
        num_ranks: `R`.
        x: `[N, H]` torch.bfloat16 CPU tokens, `N <= T`.
        topk_idx: `[N, K]` torch.int64 global expert ids, -1 = none.
        tokens_per_rank: `T`.
        num_experts: `E`, a multiple of `R`.

    Returns:
        recv_x: `[L, R*T, H]` torch.bfloat16, the rows for local expert `l` first (by source rank,
            then token), the rest unspecified.
        recv_count: `[L]` torch.int32, rows received per local expert.
        state: (all_topk `[R*T, K]` torch.int64, list of `L` row-index torch.int64 tensors), for
            `allgather_combine`.
    """
    hidden, top_k = x.size(1), topk_idx.size(1)
    local = num_experts // num_ranks
    row_bytes = 2 * hidden + 8 * top_k
    padded = torch.empty((tokens_per_rank, row_bytes), dtype=torch.uint8)
    padded[:, :2 * hidden].view(torch.bfloat16)[:x.size(0)] = x
    padded_topk = padded[:, 2 * hidden:].view(torch.int64)
    padded_topk[:x.size(0)] = topk_idx
    padded_topk[x.size(0):] = -1
    gathered = torch.empty((num_ranks * tokens_per_rank, row_bytes), dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    all_x = gathered[:, :2 * hidden].view(torch.bfloat16)
    all_topk = gathered[:, 2 * hidden:].view(torch.int64)
    recv_x = torch.empty((local, num_ranks * tokens_per_rank, hidden), dtype=torch.bfloat16)
    recv_count = torch.zeros(local, dtype=torch.int32)
    rows_by_expert = []
    for l_idx in range(local):
        expert = rank * local + l_idx
        rows = (all_topk == expert).any(1).nonzero().view(-1)
        recv_x[l_idx, :rows.numel()] = all_x.index_select(0, rows)
        recv_count[l_idx] = rows.numel()
        rows_by_expert.append(rows)
    return recv_x, recv_count, (all_topk, rows_by_expert)


def allgather_combine(group, rank, num_ranks, y, topk_weights, num_tokens, tokens_per_rank, num_experts, state):
    """Returns combined [num_tokens, H] bf16.

    Collective over `group` (an all-gather of the weights, an all-reduce of `[R*T, H]` float32).

    Arguments:
        group: the process group.
        rank: this rank.
        num_ranks: `R`.
        y: `[L, R*T, H]` torch.bfloat16 expert outputs in `allgather_dispatch`'s layout.
        topk_weights: `[N, K]` torch.float32.
        num_tokens: `N`, this rank's tokens.
        tokens_per_rank: `T`.
        num_experts: `E`.
        state: the state `allgather_dispatch` returned.

    Returns:
        out: `[N, H]` torch.bfloat16, the weighted sum over each token's experts (fp32 accumulation).
    """
    all_topk, rows_by_expert = state
    hidden, top_k = y.size(2), topk_weights.size(1)
    local = num_experts // num_ranks
    padded_w = torch.zeros((tokens_per_rank, top_k), dtype=torch.float32)
    padded_w[:num_tokens] = topk_weights
    all_w = torch.empty((num_ranks * tokens_per_rank, top_k), dtype=torch.float32)
    dist.all_gather_into_tensor(all_w, padded_w, group=group)
    partial = torch.zeros((num_ranks * tokens_per_rank, hidden), dtype=torch.float32)
    for l_idx in range(local):
        expert = rank * local + l_idx
        rows = rows_by_expert[l_idx]
        weight = (all_w[rows] * (all_topk[rows] == expert)).sum(1, keepdim=True)
        partial.index_add_(0, rows, weight * y[l_idx, :rows.numel()].float())
    dist.all_reduce(partial, group=group)
    return partial[rank * tokens_per_rank: rank * tokens_per_rank + num_tokens].to(torch.bfloat16)
