"""How many redundant slots per GPU to spend: expert balance against KV-cache capacity.

Every redundant expert slot on a GPU holds one expert's weights for every MoE layer, bytes taken
from the pool the KV cache would otherwise use. More slots balance the experts better (the EP
step is as slow as its busiest GPU), fewer slots leave room for more cached tokens (a bigger
decode batch). The model used here:

    relative throughput(k) = balancedness(k) * (kv_tokens(k) / kv_tokens(0)) ** kv_weight

where k is the number of extra slots per GPU, balancedness(k) is measured by actually placing the
given load with `rebalance_experts`, and kv_weight says how KV-bound decode is (1: batch size, and
so throughput, is proportional to KV capacity; 0: KV is never the limit). The suggestion is the k
with the highest relative throughput: adding slots stops when the marginal balance gain
(`b(k) / b(k - 1) - 1`) is worth less than the KV capacity it costs
(`1 - (kv(k) / kv(k - 1)) ** kv_weight`).
"""
from typing import NamedTuple, Optional

import numpy as np

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_float, as_loads, to_numpy
from mooncake_ep_switch.eplb.policy.metrics import layer_balancedness
from mooncake_ep_switch.eplb.policy.placement import rebalance_experts


class RedundancyAdvice(NamedTuple):
    """The suggested redundancy and the numbers behind it.

    Arguments:
        redundant_per_gpu: suggested extra slots per GPU (beyond `ceil(E / num_gpus)`).
        num_physical_experts: the resulting physical slots per layer (`num_replicas`).
        candidates: `[K]` int64 numpy array, the extra slots per GPU evaluated (0, 1, ...).
        balancedness: `[K]` float64, mean balancedness of the placed load at each candidate.
        kv_tokens: `[K]` float64, KV-cache tokens per GPU left at each candidate.
        relative_throughput: `[K]` float64, `balancedness * (kv_tokens / kv_tokens[0]) ** kv_weight`.
        marginal_gain: `[K]` float64, `balancedness[k] / balancedness[k - 1] - 1` (0 at k = 0).
        marginal_cost: `[K]` float64, `1 - (kv_tokens[k] / kv_tokens[k - 1]) ** kv_weight` (0 at k = 0).
        reason: one line explaining the choice.
    """

    redundant_per_gpu: int
    num_physical_experts: int
    candidates: np.ndarray
    balancedness: np.ndarray
    kv_tokens: np.ndarray
    relative_throughput: np.ndarray
    marginal_gain: np.ndarray
    marginal_cost: np.ndarray
    reason: str


def suggest_redundancy(
    expert_load,
    num_gpus: int,
    replica_bytes: float,
    free_bytes_per_gpu: float,
    kv_bytes_per_token: float,
    *,
    num_groups: int = 1,
    num_nodes: int = 1,
    kv_weight: float = 1.0,
    min_kv_tokens: float = 0.0,
    max_redundant_per_gpu: Optional[int] = None,
) -> RedundancyAdvice:
    """Suggest how many redundant expert slots per GPU to use, trading balance for KV capacity.

    Arguments:
        expert_load: `[E]` or `[L, E]` torch tensor or numpy array of any real dtype, measured
            load per logical expert (e.g. `ExpertLoadRecorder.logical_load`).
        num_gpus: GPUs (EP ranks).
        replica_bytes: bytes of one physical slot on one GPU: one expert's weights for every MoE
            layer (e.g. 176 MB x 61 layers for DeepSeek-V3 in bf16).
        free_bytes_per_gpu: bytes per GPU left for KV cache and extra slots, after the model's
            weights (with the `ceil(E / num_gpus)` base slots), activations and workspace.
        kv_bytes_per_token: KV-cache bytes one token takes on one GPU.
        num_groups: expert groups, passed to the placement.
        num_nodes: server nodes, passed to the placement.
        kv_weight: how strongly throughput follows KV capacity, in [0, 4] (see module docstring).
        min_kv_tokens: never leave fewer KV tokens per GPU than this.
        max_redundant_per_gpu: the most extra slots per GPU to consider, or None for up to 16
            (and what memory and E allow).

    Returns:
        advice: a `RedundancyAdvice`.
    """
    load = to_numpy("expert_load", expert_load)
    if load.ndim not in (1, 2):
        raise ValueError(f"expert_load: expected [E] or [L, E], got {load.ndim} dimensions")
    load = as_loads("expert_load", load.reshape(-1, load.shape[-1]), 2)
    num_logical = load.shape[1]
    num_gpus = check_int("num_gpus", num_gpus, 1)
    replica_bytes = as_float("replica_bytes", replica_bytes)
    free_bytes = as_float("free_bytes_per_gpu", free_bytes_per_gpu)
    kv_bytes_per_token = as_float("kv_bytes_per_token", kv_bytes_per_token)
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token: expected a positive number, got {kv_bytes_per_token!r}")
    kv_weight = as_float("kv_weight", kv_weight, 0.0, 4.0)
    min_kv_tokens = as_float("min_kv_tokens", min_kv_tokens)
    base = -(-num_logical // num_gpus)
    limit = num_logical - base  # at most num_gpus copies of each expert
    limit = min(limit, 16) if max_redundant_per_gpu is None else min(limit, check_int("max_redundant_per_gpu", max_redundant_per_gpu, 0))
    if replica_bytes > 0:
        limit = min(limit, int(np.floor((free_bytes - min_kv_tokens * kv_bytes_per_token) / replica_bytes)))
    if free_bytes / kv_bytes_per_token < min_kv_tokens or limit < 0:
        raise ValueError(
            f"free_bytes_per_gpu: {free_bytes:.4g} bytes hold {free_bytes / kv_bytes_per_token:.4g} KV tokens, "
            f"fewer than min_kv_tokens={min_kv_tokens:.4g} even with no redundant slot"
        )
    candidates = np.arange(limit + 1, dtype=np.int64)
    balance = np.empty(candidates.size)
    for i, extra in enumerate(candidates):
        slots = (base + int(extra)) * num_gpus
        placement = rebalance_experts(load, slots, num_groups, num_nodes, num_gpus)
        balance[i] = layer_balancedness(load, placement.phy2log, num_gpus).mean()
    kv_tokens = (free_bytes - candidates * replica_bytes) / kv_bytes_per_token
    capacity = (kv_tokens / kv_tokens[0]) ** kv_weight if kv_tokens[0] > 0 else np.ones(candidates.size)
    throughput = balance * capacity
    gain = np.zeros(candidates.size)
    cost = np.zeros(candidates.size)
    gain[1:] = balance[1:] / balance[:-1] - 1.0
    cost[1:] = 1.0 - capacity[1:] / capacity[:-1]
    best = int(np.flatnonzero(throughput >= throughput.max() * (1 - 1e-9))[0])  # first maximum
    if best == candidates[-1] and best < num_logical - base:
        tail = "the largest candidate; more slots may still pay"
    elif best + 1 < candidates.size:
        tail = f"one more slot would gain {gain[best + 1]:+.2%} balance for {cost[best + 1]:.2%} of KV capacity"
    else:
        tail = "no more slots fit"
    reason = (
        f"{best} extra slot(s) per GPU: balancedness {balance[best]:.4f} (vs {balance[0]:.4f} with none), "
        f"{kv_tokens[best]:.4g} KV tokens per GPU (vs {kv_tokens[0]:.4g}); {tail}"
    )
    return RedundancyAdvice(
        best, (base + best) * num_gpus, candidates, balance, kv_tokens, throughput, gain, cost, reason
    )
