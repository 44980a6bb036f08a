"""Redundant experts on top of fixed primaries (interim version by the lead; see the helper's full one)."""
import numpy as np
import torch

from mooncake_ep_switch.eplb._convert import as_int, as_loads


def place_redundant_experts(weight, num_gpus: int, redundant_per_gpu: int, *, previous=None) -> torch.Tensor:
    """Choose the redundant experts of every GPU, primaries fixed (logical expert e on GPU e // (E/num_gpus)).

    Arguments:
        weight: `[L, E]` loads (torch or numpy).
        num_gpus: GPUs.
        redundant_per_gpu: redundant slots per GPU.
        previous: `[L, num_gpus * spg]` previous phy2log (kept where still useful), or None.

    Returns:
        phy2log: `[L, num_gpus * spg]` torch.int64, spg = E/num_gpus + redundant_per_gpu.
    """
    loads = as_loads("weight", weight, 2)
    num_gpus = as_int("num_gpus", num_gpus)
    red = as_int("redundant_per_gpu", redundant_per_gpu, minimum=0)
    layers, experts = loads.shape
    local = experts // num_gpus
    spg = local + red
    result = np.empty((layers, num_gpus * spg), dtype=np.int64)
    for layer in range(layers):
        w = loads[layer]
        copies = np.ones(experts)
        holders = [{e // local} for e in range(experts)]
        chosen = [[] for _ in range(num_gpus)]
        for _ in range(red * num_gpus):
            gpu_load = np.zeros(num_gpus)
            for e in range(experts):
                for g in holders[e]:
                    gpu_load[g] += w[e] / copies[e]
            best = None
            for e in np.argsort(-w / copies, kind="stable"):
                free = [g for g in range(num_gpus) if g not in holders[e] and len(chosen[g]) < red]
                if free:
                    best = (int(e), min(free, key=lambda g: (gpu_load[g], g)))
                    break
            if best is None:
                break
            e, g = best
            chosen[g].append(e)
            holders[e].add(g)
            copies[e] += 1
        for g in range(num_gpus):
            row = list(range(g * local, (g + 1) * local)) + sorted(chosen[g])
            result[layer, g * spg:(g + 1) * spg] = row
    if previous is not None:  # keep a previous slot's expert when the same expert is chosen for that GPU
        prev = np.asarray(previous).reshape(layers, num_gpus, spg)
        new = result.reshape(layers, num_gpus, spg)
        for layer in range(layers):
            for g in range(num_gpus):
                want = list(new[layer, g, local:])
                keep = [e if e in want else -1 for e in prev[layer, g, local:]]
                rest = [e for e in want if e not in keep]
                new[layer, g, local:] = [e if e >= 0 else rest.pop(0) for e in keep]
    return torch.from_numpy(result)
