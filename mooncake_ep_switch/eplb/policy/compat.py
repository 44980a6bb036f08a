"""EPLB entry points in DeepSeek's and vLLM's call shape: `rebalance_experts(weight, num_replicas,
num_groups, num_nodes, num_gpus[, old_global_expert_indices]) -> (phy2log, log2phy, logcnt)`.

Every argument combination those accept is accepted here with their meaning:

- hierarchical policy when `num_groups % num_nodes == 0` (then `num_groups` must divide the
  logical experts and `num_nodes` the GPUs, as theirs assert), otherwise the global policy, in
  which `num_groups` and `num_nodes` play no part (any values, e.g. 4 groups on 3 nodes);
- `weight` `[L, E]` of any real dtype on any device (read as float32 on the CPU, like theirs);
- the triple of torch.int64 CPU tensors: `phy2log` `[L, num_replicas]`, `log2phy`
  `[L, E, num_replicas - E + 1]` (-1 padded) and `logcnt` `[L, E]`.

`mode` picks the algorithm:

- `"classic"`: DeepSeek's greedy, reproduced exactly (phy2log, logcnt and log2phy in its copy
  order) for loads whose float32 sums are exact (token counts below 2**24 are); with
  `old_global_expert_indices`, vLLM's default policy: that placement with each GPU's slots
  permuted so that experts that stay keep their slots (log2phy then in ascending slot order);
- `"balanced"` (default without `old_global_expert_indices`): our placement (`placement.rebalance_experts`):
  no GPU holds two copies of an expert, swap refinement, redundant copies may leave a group's node;
- `"movement"` (default with `old_global_expert_indices`, vLLM's argument: the deployed phy2log):
  the movement-aware placement: copies move only until each layer is within `balance_tolerance`
  of a fresh placement, and an expert that stays on its GPU keeps its slot there (what vLLM's
  callers expect of a rebalance; `keep_gpu_slots` permutes each GPU's slots to guarantee it).

In every mode `old_global_expert_indices` may hold -1 for slots that hold nothing (vLLM's elastic
scale-up), and an expert that stays on a GPU keeps its slot there.

Our placements never put two copies of one expert on a GPU, so they hold at most `E * num_gpus`
slots; above that (which the classic greedy accepts) the classic greedy is used.
"""
from typing import Optional, Tuple

import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_indices, as_loads, describe
from mooncake_ep_switch.eplb.policy.greedy import hierarchical
from mooncake_ep_switch.eplb.policy.placement import rebalance_experts as _placement

MODES = ("classic", "balanced", "movement")


class EplbArgumentError(ValueError, AssertionError):
    """A combination `rebalance_experts` refuses: a ValueError with a message naming the argument, and an
    AssertionError, which is what DeepSeek's code raises there (vLLM's tests expect that)."""



def _classic(loads: np.ndarray, num_replicas: int, groups: int, nodes: int, num_gpus: int):
    phy2log, slot_rank = hierarchical(loads.astype(np.float32), num_replicas, groups, nodes, num_gpus, with_rank=True)
    num_layers, num_logical = loads.shape
    logcnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.add.at(logcnt, (np.arange(num_layers)[:, None].repeat(num_replicas, 1), phy2log), 1)
    return phy2log, slot_rank, logcnt


def keep_gpu_slots(old: np.ndarray, new: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder each GPU's slots of `new` so that experts the GPU already held sit in their old slots.

    vLLM's rule (its default policy's `old_global_expert_indices`): each old slot, in order, keeps its
    expert when the GPU's new slots still hold an unclaimed copy of it (so two copies of one expert
    on a GPU keep both their slots); the GPU's other new experts fill its remaining slots in their
    order. A -1 in `old` (a slot that held nothing, e.g. a GPU added by a scale-up) keeps nothing. A
    permutation inside a GPU changes neither the balance nor which copies move between GPUs; it
    spares the copies that vLLM's weight shuffle would otherwise make inside one GPU.

    Arguments:
        old: `[L, S]` int64 numpy array, the deployed phy2log (-1: an empty slot).
        new: `[L, S]` int64 numpy array, the new phy2log.
        num_gpus: GPUs (S // num_gpus slots each).

    Returns:
        phy2log: `[L, S]` int64 numpy array, `new` with each GPU's slots permuted.
    """
    num_layers, num_slots = new.shape
    per_gpu = num_slots // num_gpus
    out = new.copy()
    for layer in range(num_layers):
        for gpu in range(num_gpus):
            span = slice(gpu * per_gpu, (gpu + 1) * per_gpu)
            before, after = old[layer, span].tolist(), new[layer, span].tolist()
            claimed = [False] * per_gpu
            placed = [None] * per_gpu
            for slot, expert in enumerate(before):
                for position, candidate in enumerate(after):
                    if not claimed[position] and candidate == expert:
                        placed[slot], claimed[position] = expert, True
                        break
            rest = [expert for position, expert in enumerate(after) if not claimed[position]]
            free = [slot for slot in range(per_gpu) if placed[slot] is None]
            for slot, expert in zip(free, rest):
                placed[slot] = expert
            out[layer, span] = placed
    return out


def _check(loads: np.ndarray, num_replicas: int, num_groups: Optional[int], num_nodes: int, num_gpus: int,
           hierarchical: Optional[bool] = None) -> Tuple[int, int]:
    """Validate as DeepSeek's code asserts; returns the (groups, nodes) the policy uses.

    `hierarchical` None: DeepSeek's rule (hierarchical when `num_groups % num_nodes == 0`); True/False:
    SGLang's `enable_hierarchical`. `num_groups` None: a model without expert groups (global policy)."""
    num_layers, num_logical = loads.shape
    if num_layers == 0 or num_logical == 0:
        raise EplbArgumentError(f"weight: expected at least one layer and one logical expert, got shape "
                                f"{list(loads.shape)}")
    if num_replicas < num_logical or num_replicas % num_gpus:
        raise EplbArgumentError(f"num_replicas: expected a multiple of num_gpus={num_gpus} that is >= the {num_logical} "
                                f"logical experts, got {num_replicas}")
    if hierarchical is None:
        hierarchical = num_groups is not None and num_groups % num_nodes == 0
    if not hierarchical:  # the global policy: one group, one node
        return 1, 1
    if num_groups is None:
        raise EplbArgumentError("num_groups: enable_hierarchical=True needs the model's expert groups, got None")
    if num_groups % num_nodes:
        raise EplbArgumentError(f"num_groups: enable_hierarchical=True needs a multiple of num_nodes={num_nodes}, "
                                f"got {num_groups}")
    if num_logical % num_groups:
        raise EplbArgumentError(f"num_groups: the hierarchical policy (num_groups % num_nodes == 0) needs a divisor of "
                                f"the {num_logical} logical experts, got {num_groups}")
    if num_gpus % num_nodes:
        raise EplbArgumentError(f"num_nodes: the hierarchical policy needs a divisor of num_gpus={num_gpus}, got "
                                f"{num_nodes}")
    return num_groups, num_nodes


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: Optional[int] = None,
                      old_global_expert_indices=None, *, num_ranks: Optional[int] = None, mode: Optional[str] = None,
                      balance_tolerance: float = 0.01, enable_hierarchical: Optional[bool] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place every layer's logical experts on `num_replicas` physical experts (slots) of `num_gpus` GPUs.

    Arguments:
        weight: `[L, E]` torch tensor (any device) or numpy array of any real dtype, non-negative
            finite loads per logical expert.
        num_replicas: physical experts per layer, a multiple of `num_gpus` and >= E.
        num_groups: expert groups (E // num_groups consecutive experts each) for group-limited routing,
            or None for a model without expert groups (SGLang passes it so; the global policy).
        num_nodes: server nodes; hierarchical policy when `num_groups % num_nodes == 0`.
        num_gpus: GPUs; slot s lives on GPU `s // (num_replicas // num_gpus)`.
        old_global_expert_indices: vLLM's argument, `[L, num_replicas]` integer torch tensor or numpy
            array, the deployed phy2log (-1: a slot that holds nothing yet, as vLLM's scale-up
            passes), or None. Honoured in every mode: an expert that stays on a GPU keeps its slot
            there (`keep_gpu_slots`, vLLM's rule); the `"movement"` mode (its default) also starts
            from it (from a fresh placement when it has -1 slots).
        num_ranks: vLLM's keyword for `num_gpus` (give exactly one of them).
        mode: `"classic"`, `"balanced"` or `"movement"` (module docstring); None: `"movement"` with
            `old_global_expert_indices`, else `"balanced"`.
        balance_tolerance: `"movement"` only: absolute balancedness per layer that may be given up
            against a fresh placement to move fewer copies, in [0, 1].
        enable_hierarchical: SGLang's keyword: True forces the hierarchical policy (its conditions
            are then checked), False the global one; None (default) follows DeepSeek's rule above.

    Returns:
        phy2log: `[L, num_replicas]` torch.int64, the logical expert of each physical expert.
        log2phy: `[L, E, num_replicas - E + 1]` torch.int64, the physical experts of each logical
            expert (classic: in copy order, like DeepSeek's; otherwise ascending), -1 padded.
        logcnt: `[L, E]` torch.int64, physical experts per logical expert.

    Raises:
        EplbArgumentError (a ValueError, and an AssertionError as DeepSeek's asserts): a
            combination DeepSeek's code rejects too (num_replicas not a multiple of
            num_gpus or below E; hierarchical with num_groups not dividing E or num_nodes not
            dividing num_gpus), bad loads, an unknown mode, or `"movement"` without
            `old_global_expert_indices`.
        TypeError: an argument of the wrong type.
    """
    if (num_gpus is None) == (num_ranks is None):
        raise TypeError(f"num_gpus, num_ranks: expected exactly one of them, got {num_gpus!r} and {num_ranks!r}")
    num_gpus = num_ranks if num_gpus is None else num_gpus
    if isinstance(weight, torch.Tensor):
        weight = weight.detach().float().cpu()  # like theirs: float32 on the CPU
    loads = as_loads("weight", weight, 2)
    num_replicas = check_int("num_replicas", num_replicas, 1)
    num_groups = None if num_groups is None else check_int("num_groups", num_groups, 1)
    if enable_hierarchical is not None and not isinstance(enable_hierarchical, bool):
        raise TypeError(f"enable_hierarchical: expected a bool or None, got {type(enable_hierarchical).__name__}")
    num_nodes = check_int("num_nodes", num_nodes, 1)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    if mode is None:
        mode = "balanced" if old_global_expert_indices is None else "movement"
    if mode not in MODES:
        raise EplbArgumentError(f"mode: expected one of {MODES} or None, got {mode!r}")
    if mode == "movement" and old_global_expert_indices is None:
        raise EplbArgumentError("old_global_expert_indices: the 'movement' mode needs the deployed phy2log, got None")
    groups, nodes = _check(loads, num_replicas, num_groups, num_nodes, num_gpus, enable_hierarchical)
    num_layers, num_logical = loads.shape
    width = num_replicas - num_logical + 1
    deployed = None
    if old_global_expert_indices is not None:
        try:
            deployed = as_indices("old_global_expert_indices", old_global_expert_indices, 2, upper=num_logical,
                                  allow_negative_one=True)
        except ValueError as error:
            raise EplbArgumentError(str(error)) from None
        if deployed.shape != (num_layers, num_replicas):
            raise EplbArgumentError(f"old_global_expert_indices: expected shape [{num_layers}, {num_replicas}], got "
                                    f"{describe(old_global_expert_indices)}")
    if mode == "classic" or num_replicas > num_logical * num_gpus:
        phy2log, slot_rank, logcnt = _classic(loads, num_replicas, groups, nodes, num_gpus)
        if deployed is not None:  # vLLM's default policy: DeepSeek's placement, then the kept slots
            phy2log = keep_gpu_slots(deployed, phy2log, num_gpus)
            slot_rank = None
    else:
        # Movement from the deployed table; with empty (-1) slots (vLLM's scale-up) a fresh placement, then
        # the kept slots: the movement-aware search needs an expert in every slot.
        previous = deployed if mode == "movement" and not (deployed < 0).any() else None
        placement = _placement(loads, num_replicas, groups, nodes, num_gpus, previous_phy2log=previous,
                               hierarchical=nodes > 1, balance_tolerance=balance_tolerance)
        phy2log = placement.phy2log.numpy()
        if deployed is not None:
            phy2log = keep_gpu_slots(deployed, phy2log, num_gpus)
        logcnt = placement.logcnt.numpy()
        slot_rank = None
    if slot_rank is None:  # rank of each slot among its expert's copies, ascending slot order
        order = np.argsort(phy2log, axis=1, kind="stable")
        sorted_experts = np.take_along_axis(phy2log, order, axis=1)
        starts = np.cumsum(logcnt, axis=1) - logcnt
        ranks_sorted = np.arange(num_replicas)[None, :] - np.take_along_axis(starts, sorted_experts, axis=1)
        slot_rank = np.empty_like(phy2log)
        np.put_along_axis(slot_rank, order, ranks_sorted, axis=1)
    log2phy = np.full((num_layers, num_logical, width), -1, dtype=np.int64)
    rows = np.arange(num_layers)[:, None].repeat(num_replicas, 1)
    log2phy[rows, phy2log, slot_rank] = np.arange(num_replicas)[None, :].repeat(num_layers, 0)
    return (torch.from_numpy(np.ascontiguousarray(phy2log, dtype=np.int64)), torch.from_numpy(log2phy),
            torch.from_numpy(np.ascontiguousarray(logcnt, dtype=np.int64)))
