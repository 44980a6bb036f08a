"""vLLM's newest EPLB policy API: `DefaultEplbPolicy.rebalance_experts(...) -> phy2log` and `compute_logical_maps`.

vLLM's `DefaultEplbPolicy` returns the phy2log alone (callers derive log2phy and logcnt with
`compute_logical_maps`) and, given `old_global_expert_indices`, keeps the slots of experts that stay
on a GPU (`preserve_intragpu_slots`). Here both run on `compat.rebalance_experts` in its classic
mode (DeepSeek's greedy, bit for bit, then vLLM's kept-slot rule), so a caller or a test written
against vLLM's classes runs by changing its imports.
"""
from typing import Optional, Tuple

import numpy as np
import torch

from mooncake_ep_switch.eplb._convert import as_indices
from mooncake_ep_switch.eplb.policy.compat import EplbArgumentError, keep_gpu_slots, rebalance_experts
from mooncake_ep_switch.checks import check_int

__all__ = ["DefaultEplbPolicy", "compute_logical_maps"]


class DefaultEplbPolicy:
    """vLLM's default EPLB policy, as class methods (its call shape)."""

    @classmethod
    def rebalance_experts(cls, weight, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int,
                          old_global_expert_indices=None) -> torch.Tensor:
        """Place every layer's logical experts on `num_replicas` physical experts of `num_ranks` GPUs.

        Arguments:
            weight: `[L, E]` torch tensor (any device) or numpy array, load per logical expert.
            num_replicas: physical experts per layer, a multiple of `num_ranks` and >= E.
            num_groups: expert groups; hierarchical policy when `num_groups % num_nodes == 0`, else global.
            num_nodes: server nodes.
            num_ranks: GPUs.
            old_global_expert_indices: `[L, num_replicas]` integer tensor, the deployed phy2log (-1:
                an empty slot), or None. Experts that stay on a GPU keep their slots there.

        Returns:
            phy2log: `[L, num_replicas]` torch.int64 CPU tensor, the logical expert of each physical expert.

        Raises:
            EplbArgumentError (a ValueError and an AssertionError): a combination vLLM asserts against.
        """
        return rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices,
                                 mode="classic")[0]

    @classmethod
    def preserve_intragpu_slots(cls, phy2log, num_ranks: int, old_phy2log) -> np.ndarray:
        """Permute each GPU's slots of `phy2log` so that experts that stay keep their old slots.

        Arguments:
            phy2log: `[L, S]` integer numpy array or tensor, the new placement.
            num_ranks: GPUs (S // num_ranks slots each); when it does not divide S, `phy2log` is
                returned unchanged (vLLM's rule).
            old_phy2log: `[L, S]` integer numpy array or tensor, the deployed one (-1: an empty slot).

        Returns:
            phy2log: `[L, S]` int64 numpy array.
        """
        new = as_indices("phy2log", phy2log, 2)
        old = as_indices("old_phy2log", old_phy2log, 2, allow_negative_one=True)
        if old.shape != new.shape:
            raise EplbArgumentError(f"old_phy2log: expected the shape of phy2log {list(new.shape)}, got {list(old.shape)}")
        num_ranks = check_int("num_ranks", num_ranks, 0)
        if num_ranks == 0 or new.shape[1] % num_ranks:
            return new
        return keep_gpu_slots(old, new, num_ranks)


def compute_logical_maps(phy2log, num_logical_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """log2phy and logcnt of a phy2log, vLLM's `compute_logical_maps` (slots holding -1 are skipped).

    Arguments:
        phy2log: `[L, S]` (or `[S]`, one layer) integer CPU tensor, the logical expert of each slot, -1 unused.
        num_logical_experts: E.

    Returns:
        log2phy: `[L, E, W]` (or `[E, W]`) of phy2log's dtype, each expert's slots ascending, -1 padded;
            W is the largest number of copies of any expert (at least 1).
        logcnt: `[L, E]` (or `[E]`) of phy2log's dtype, copies per logical expert.
    """
    if not isinstance(phy2log, torch.Tensor) or phy2log.device.type != "cpu":
        raise TypeError(f"phy2log: expected a CPU torch tensor, got {type(phy2log).__name__}"
                        + (f" on {phy2log.device}" if isinstance(phy2log, torch.Tensor) else ""))
    num_logical = check_int("num_logical_experts", num_logical_experts, 1)
    single = phy2log.dim() == 1
    table = as_indices("phy2log", phy2log.unsqueeze(0) if single else phy2log, 2, upper=num_logical,
                       allow_negative_one=True)
    num_layers, num_slots = table.shape
    logcnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    used = table >= 0
    rows = np.broadcast_to(np.arange(num_layers)[:, None], table.shape)
    np.add.at(logcnt, (rows[used], table[used]), 1)
    width = max(1, int(logcnt.max()) if logcnt.size else 1)
    log2phy = np.full((num_layers, num_logical, width), -1, dtype=np.int64)
    for layer in range(num_layers):
        filled = np.zeros(num_logical, dtype=np.int64)
        for slot in range(num_slots):
            expert = table[layer, slot]
            if expert >= 0:
                log2phy[layer, expert, filled[expert]] = slot
                filled[expert] += 1
    log2phy_t, logcnt_t = torch.from_numpy(log2phy).to(phy2log.dtype), torch.from_numpy(logcnt).to(phy2log.dtype)
    return (log2phy_t[0], logcnt_t[0]) if single else (log2phy_t, logcnt_t)
