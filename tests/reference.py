"""Independent references for the Buffer tests: structured inputs, routing, FP8, combine.

Written with plain torch loops and torch's own FP8 conversion, sharing no code with the runtime.
"""
from typing import Dict, List, NamedTuple, Sequence

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - cosine-like similarity of (x + 1) and (y + 1), in float64 (DeepEP's test metric)."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def token_count(rank: int, num_ranks: int, tokens_per_rank: int) -> int:
    """Uneven token counts: the last rank of a multi-rank group sends nothing."""
    if num_ranks > 1 and rank == num_ranks - 1:
        return 0
    return max(1, tokens_per_rank - 7 * rank)


class RankInputs(NamedTuple):
    x: torch.Tensor          # [N, H] bf16
    topk_idx: torch.Tensor   # [N, K] int64
    weights: torch.Tensor    # [N, K] float32


def structured_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, top_k: int, seed: int,
                      num_masked: int = 10, random_values: bool = False) -> RankInputs:
    """Tokens whose value is `rank - 128` with the last 128 columns = token index (or random
    values), distinct random experts per row, `num_masked` random top-k slots set to -1."""
    generator = torch.Generator().manual_seed(seed * 7919 + rank)
    if random_values:
        x = torch.randn((num_tokens, hidden), generator=generator).to(torch.bfloat16)
    else:
        x = torch.full((num_tokens, hidden), float(rank - 128), dtype=torch.bfloat16)
        x[:, -128:] = torch.arange(num_tokens, dtype=torch.float32).view(-1, 1).to(torch.bfloat16)
    scores = torch.rand((num_tokens, num_experts), generator=generator)
    topk_idx = scores.topk(top_k, dim=1).indices.to(torch.int64).contiguous()
    if num_tokens and num_masked:
        flat = torch.randperm(num_tokens * top_k, generator=generator)[:num_masked]
        topk_idx.view(-1)[flat] = -1
    weights = torch.rand((num_tokens, top_k), generator=generator, dtype=torch.float32)
    return RankInputs(x, topk_idx, weights)


def expected_routing(all_topk: Sequence[torch.Tensor], active: Sequence[int], rank: int,
                     num_local_experts: int) -> List[List[tuple]]:
    """For each local expert of `rank`: the (source rank, token) pairs it receives, in order."""
    result = []
    for local in range(num_local_experts):
        expert = rank * num_local_experts + local
        pairs = []
        for source, topk in enumerate(all_topk):
            if not active[source]:
                continue
            for token in range(topk.size(0)):
                if expert in topk[token].tolist():
                    pairs.append((source, token))
        result.append(pairs)
    return result


def fp8_reference(rows: torch.Tensor):
    """torch's own e4m3fn quantisation per 128 channels: (data [n, H] fp8, scales [n, H/128] f32)."""
    values = rows.float().view(rows.size(0), rows.size(1) // 128, 128)
    scales = values.abs().amax(-1).clamp(min=1e-4) / 448.0
    data = (values / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(rows.size(0), rows.size(1))
    return data, scales


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 rows `[n, H]` with scales `[n, H/128]` back to float32."""
    return (data.float().view(data.size(0), data.size(1) // 128, 128) * scales.unsqueeze(-1)).view(data.size(0), data.size(1))


def expert_scale(expert: int) -> float:
    """The mock expert multiplies by a power of two (exact in bf16)."""
    return 2.0 ** ((expert % 5) - 2)


def expected_combine(x_values: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                     owner_active: Dict[int, bool], num_local_experts: int) -> torch.Tensor:
    """`out[t] = bf16(sum_k w[t,k] * scale(e_k) * x_values[t])` in fp32, skipping -1 and inactive owners.

    `x_values` is what each expert saw for the token (bf16 values, or FP8 dequantised to bf16).
    """
    out = torch.zeros((topk_idx.size(0), x_values.size(1)), dtype=torch.float32)
    for k in range(topk_idx.size(1)):
        for token in range(topk_idx.size(0)):
            expert = int(topk_idx[token, k])
            if expert < 0 or not owner_active[expert // num_local_experts]:
                continue
            y = (x_values[token].float() * expert_scale(expert)).to(torch.bfloat16).float()
            out[token] = out[token] + weights[token, k] * y
    return out.to(torch.bfloat16)
