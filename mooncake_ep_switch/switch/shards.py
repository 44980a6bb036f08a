"""Which part of a full MoE layer a rank holds in each layout: the shard rules of EP and TP.

The unified weight memory loads full weights through these (`UnifiedWeights.load_full`), the
reshard plans move between exactly these shards, and the reference model code uses them too.
"""
import torch


def shard_ep(gate_up: torch.Tensor, down: torch.Tensor, rank: int, num_ranks: int):
    """EP shard of a layer: rank `rank` holds experts `[rE/P, (r+1)E/P)` whole.

    Arguments:
        gate_up: `[E, 2I, H]` torch.bfloat16, gate rows then up rows.
        down: `[E, H, I]` torch.bfloat16.
        rank: the rank whose shard to take.
        num_ranks: `P`, dividing `E`.

    Returns:
        gate_up: `[E/P, 2I, H]` torch.bfloat16 (contiguous copy).
        down: `[E/P, H, I]` torch.bfloat16 (contiguous copy).
    """
    local = gate_up.size(0) // num_ranks
    rows = slice(rank * local, (rank + 1) * local)
    return gate_up[rows].contiguous(), down[rows].contiguous()


def shard_tp(gate_up: torch.Tensor, down: torch.Tensor, rank: int, num_ranks: int):
    """TP shard of a layer: intermediate slice `rank` of every expert, gate and up sliced separately.

    Arguments:
        gate_up: `[E, 2I, H]` torch.bfloat16, gate rows then up rows.
        down: `[E, H, I]` torch.bfloat16.
        rank: the rank whose shard to take.
        num_ranks: `P`, dividing `I`.

    Returns:
        gate_up: `[E, 2I/P, H]` torch.bfloat16: gate rows `[rI/P, (r+1)I/P)` then the same up rows.
        down: `[E, H, I/P]` torch.bfloat16: columns `[rI/P, (r+1)I/P)`.
    """
    inter = down.size(2)
    part = inter // num_ranks
    lo, hi = rank * part, (rank + 1) * part
    tp_gate_up = torch.cat([gate_up[:, lo:hi], gate_up[:, inter + lo:inter + hi]], dim=1).contiguous()
    return tp_gate_up, down[:, :, lo:hi].contiguous()
