"""Reference decode attention over the paged KV cache, in either layout.

In EP a rank attends with all heads over the requests it owns; in TP a rank attends with its head
group (`H_kv/P` KV heads and their `G = H_q/H_kv` query heads each) over every request, and the
engine's output projection all-reduces. The computation is done per head group with the same
shapes in both layouts (the EP page is made of the TP units), so a request's output for a head is
bit-identical before and after a switch.
"""
import math
from typing import List, Sequence

import torch

from mooncake_ep_switch.switch.kv_cache import PagedKVCache


def attend_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one head group, float32.

    Arguments:
        q: `[Hg, G, D]` queries (G query heads per KV head).
        k: `[Hg, n, D]` torch.bfloat16 keys.
        v: `[Hg, n, D]` torch.bfloat16 values.

    Returns:
        out: `[Hg, G, D]` torch.float32.
    """
    scale = 1.0 / math.sqrt(q.size(-1))
    scores = torch.bmm(q.float(), k.float().transpose(1, 2)) * scale  # [Hg, G, n]
    return torch.bmm(torch.softmax(scores, dim=-1), v.float())


def decode_attention(kv_cache: PagedKVCache, layer: int, rids: Sequence[int], q: torch.Tensor) -> torch.Tensor:
    """One decode step of attention for requests stored on this rank.

    Arguments:
        kv_cache: the `PagedKVCache` (its current layout decides which heads are here).
        layer: attention layer.
        rids: `B` request ids present on this rank.
        q: `[B, H_q_here, D]` query of each request's next token, torch.bfloat16 or torch.float32;
            `H_q_here = G * kv_cache.num_heads_here()` (the query heads of the KV heads stored here,
            ascending).

    Returns:
        out: `[B, H_q_here, D]` torch.float32, attention over each request's `num_tokens` tokens.
    """
    heads_here = kv_cache.num_heads_here()
    if q.dim() != 3 or q.size(0) != len(rids) or q.size(1) % heads_here or q.size(2) != kv_cache.config.head_dim:
        raise ValueError(f"q: expected [{len(rids)}, G * {heads_here}, {kv_cache.config.head_dim}], got {list(q.shape)}")
    group_size = q.size(1) // heads_here
    hg = kv_cache.heads_per_unit
    outputs: List[torch.Tensor] = []
    for index, rid in enumerate(rids):
        parts = []
        for slot, group in enumerate(kv_cache.head_groups()):
            k, v = kv_cache.gather(rid, layer, group)
            qg = q[index, slot * hg * group_size:(slot + 1) * hg * group_size].reshape(hg, group_size, -1)
            parts.append(attend_group(qg, k, v).reshape(hg * group_size, -1))
        outputs.append(torch.cat(parts, dim=0))
    if not outputs:
        return torch.zeros((0, q.size(1), q.size(2)), dtype=torch.float32)
    return torch.stack(outputs)
