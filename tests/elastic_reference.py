"""An independent pure-torch reference of DeepEP V2's dispatch and combine semantics (issue 26).

Every rank's inputs are generated from a seed, so each rank computes what it must receive and what
its combine must return without any communication: the reference shares no code with the runtime.
Semantics follow V2's documented reference (`deep_ep/utils/refs.py`): dispatch sends each token once
per destination rank, rows sorted by `src_rank * T + token`, top-k ids local to the receiver (-1
elsewhere) and the token's full top-k weights; combine reduces each rank's entries (a group per
rank, top-k order, fp32, rounded to bf16), then sums, in fp32 starting from `bias[0] + bias[1]`,
one value per top-k position where each group's value sits at its last member, and rounds to bf16.
"""
from typing import List, NamedTuple, Optional, Sequence

import torch


class Inputs(NamedTuple):
    x: torch.Tensor  # [N, H] bf16
    fp8: Optional[torch.Tensor]  # [N, H] e4m3fn
    sf: Optional[torch.Tensor]  # [N, ceil(H/128)] float32
    topk_idx: torch.Tensor  # [N, K] int64
    topk_weights: torch.Tensor  # [N, K] float32
    bias: List[torch.Tensor]  # two [N, H] bf16


def per_token_cast_to_fp8(x: torch.Tensor):
    """Per-128-channel FP8 cast (V2's test recipe): scale = amax / 448."""
    n, h = x.shape
    groups = (h + 127) // 128
    padded = torch.zeros(n, groups * 128, dtype=torch.float32)
    padded[:, :h] = x.float()
    view = padded.view(n, groups, 128)
    amax = view.abs().amax(dim=2).clamp(min=1e-4)
    scale = amax / 448.0
    data = (view / scale.unsqueeze(2)).view(n, groups * 128)[:, :h].to(torch.float8_e4m3fn)
    return data.contiguous(), scale.contiguous()


def make_inputs(rank: int, num_ranks: int, T: int, H: int, K: int, E: int, seed: int,
                empty_rank: Optional[int] = None) -> Inputs:
    """Rank `rank`'s tokens: `T - rank` of them (V2's test), none on `empty_rank`; ~1 in 8 entries -1."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    n = 0 if rank == empty_rank else max(1, T - rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    scores = torch.rand(n, E, generator=g)
    weights, idx = torch.topk(scores, K, dim=1)
    drop = torch.rand(n, K, generator=g) < 0.125
    idx = idx.masked_fill(drop, -1).to(torch.int64)
    weights = weights.masked_fill(drop, 0.0).to(torch.float32)
    fp8, sf = per_token_cast_to_fp8(x)
    bias = [torch.randn(n, H, generator=g).to(torch.bfloat16) for _ in range(2)]
    return Inputs(x, fp8, sf, idx, weights, bias)


def expected_dispatch(all_inputs: Sequence[Inputs], rank: int, num_ranks: int, T: int, E: int,
                      senders: Sequence[int]):
    """What `rank` receives from the ranks in `senders` (others sent nothing).

    Returns:
        dict of rows in V2's order: src_global `[n]` int64, x `[n, H]` bf16, fp8, sf, local `[n, K]`
        int64, weights `[n, K]` float32.
    """
    L = E // num_ranks
    parts = {key: [] for key in ("src_global", "x", "fp8", "sf", "local", "weights")}
    for source in range(num_ranks):
        inputs = all_inputs[source]
        if source not in senders or inputs.x.size(0) == 0:
            continue
        mine = (inputs.topk_idx >= rank * L) & (inputs.topk_idx < (rank + 1) * L)
        tokens = torch.nonzero(mine.any(dim=1), as_tuple=True)[0]
        parts["src_global"].append(source * T + tokens)
        parts["x"].append(inputs.x[tokens])
        parts["fp8"].append(inputs.fp8[tokens])
        parts["sf"].append(inputs.sf[tokens])
        local = torch.where(mine, inputs.topk_idx - rank * L, torch.full_like(inputs.topk_idx, -1))
        parts["local"].append(local[tokens])
        parts["weights"].append(inputs.topk_weights[tokens])
    K = all_inputs[rank].topk_idx.size(1)
    H = all_inputs[rank].x.size(1)
    empty = {"src_global": torch.empty(0, dtype=torch.int64), "x": torch.empty(0, H, dtype=torch.bfloat16),
             "fp8": torch.empty(0, H, dtype=torch.float8_e4m3fn),
             "sf": torch.empty(0, (H + 127) // 128, dtype=torch.float32),
             "local": torch.empty(0, K, dtype=torch.int64), "weights": torch.empty(0, K, dtype=torch.float32)}
    return {key: torch.cat(value) if value else empty[key] for key, value in parts.items()}


def expert_output(src_global: torch.Tensor, num_topk: int, hidden: int, seed: int) -> torch.Tensor:
    """The expert side's output for each (token, top-k entry): `[n, K, H]` bf16, a function of the token's
    global index (so every rank and the reference agree without communication). Magnitudes spread over
    2^-24..2^24, so that a sum in another order (or a missed rounding step) gives other bits."""
    out = torch.empty(src_global.numel(), num_topk, hidden, dtype=torch.bfloat16)
    for row, key in enumerate(src_global.tolist()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + key)
        scale = torch.pow(2.0, torch.randint(-24, 25, (num_topk, hidden), generator=g).float())
        out[row] = (torch.randn(num_topk, hidden, generator=g) * scale).to(torch.bfloat16)
    return out


def ordered_sum(data: torch.Tensor, initial: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 sum over dim 1 in order, from `initial` (fp32) or zeros; rounded to bf16."""
    result = torch.zeros(data.size(0), data.size(2), dtype=torch.float32) if initial is None else initial.clone()
    for k in range(data.size(1)):
        result += data[:, k].float()
    return result.to(torch.bfloat16)


def expected_combine(y: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                     biases: Sequence[torch.Tensor], contributing: Sequence[int]) -> torch.Tensor:
    """The owner's combined rows: each rank's entries reduced (top-k order, fp32, bf16) into the slot of
    its last entry, then an ordered fp32 sum from the bias; ranks not in `contributing` add nothing.

    Arguments:
        y: `[N, K, H]` bf16 expert outputs per entry (the -1 entries are ignored).
        topk_idx: `[N, K]` int64. biases: zero, one or two `[N, H]` bf16.
    """
    n, num_topk, hidden = y.shape
    group = torch.where(topk_idx >= 0, torch.div(topk_idx, num_experts // num_ranks, rounding_mode="floor"),
                        torch.full_like(topk_idx, -1))
    slots = torch.zeros(n, num_topk, hidden, dtype=torch.bfloat16)
    for t in range(n):
        for k in range(num_topk):
            owner = int(group[t, k])
            if owner < 0 or owner not in contributing:
                continue
            members = [j for j in range(num_topk) if int(group[t, j]) == owner]
            if members[-1] != k:
                continue
            acc = torch.zeros(hidden, dtype=torch.float32)
            for j in members:
                acc += y[t, j].float()
            slots[t, k] = acc.to(torch.bfloat16)
    initial = None
    if biases:
        initial = biases[0].float()
        for extra in biases[1:]:
            initial = initial + extra.float()
    return ordered_sum(slots, initial)


def expected_weights(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, num_ranks: int,
                     contributing: Sequence[int]) -> torch.Tensor:
    """Combined top-k weights: each entry's weight from the rank owning its expert, 0 for -1 entries
    and for ranks not contributing."""
    owner = torch.div(topk_idx.clamp(min=0), num_experts // num_ranks, rounding_mode="floor")
    keep = (topk_idx >= 0) & torch.isin(owner, torch.tensor(list(contributing), dtype=torch.int64))
    return torch.where(keep, topk_weights, torch.zeros_like(topk_weights))


def expected_combine_entries(y: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                             biases: Sequence[torch.Tensor], contributing: Sequence[int]) -> torch.Tensor:
    """`allow_multiple_reduction=False` with the expanded layout: no reduction before the owner's, which
    sums in fp32 from the bias every entry in top-k order (entries of -1 and of ranks not in
    `contributing` add nothing), rounding to bf16 once.

    Arguments:
        y: `[N, K, H]` bf16 expert outputs per entry. topk_idx: `[N, K]` int64. biases: zero, one or two
            `[N, H]` bf16.
    """
    n, num_topk, hidden = y.shape
    result = torch.zeros(n, hidden, dtype=torch.float32)
    if biases:
        result = biases[0].float()
        for extra in biases[1:]:
            result = result + extra.float()
    for t in range(n):
        for k in range(num_topk):
            expert = int(topk_idx[t, k])
            here = expert >= 0 and expert // (num_experts // num_ranks) in contributing
            result[t] += y[t, k].float() if here else torch.zeros(hidden)  # V2's ref adds the zeroed entries too
    return result.to(torch.bfloat16)
