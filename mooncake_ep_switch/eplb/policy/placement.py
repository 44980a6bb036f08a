"""Expert placement: `rebalance_experts`, with DeepSeek EPLB's contract and a movement-aware mode.

What it guarantees, for every layer:

- every logical expert has at least one physical copy;
- no GPU holds two copies of one logical expert (so an expert has at most `num_gpus` copies);
- every GPU holds `num_replicas // num_gpus` slots; slot `s` is on GPU `s // (num_replicas // num_gpus)`;
- hierarchical mode: each expert group's primary copies sit inside one node (group-limited
  routing); redundant copies may go to any node, so skew between groups does not cap the balance;
- deterministic: the same arguments give the same result.

How (see `construct`): loads are normalised per layer; replica counts by largest load per copy
(capped at `num_gpus`); hierarchical mode packs groups onto nodes and places the redundant copies
on nodes; LPT packing onto GPUs; then swap refinement (heavy/light group sweeps, then steepest
descent on the heaviest GPU). All of it is vectorised over layers.

Movement-aware mode (`previous_phy2log` given): slots whose expert stays are kept, and copies move
only as needed to come within `balance_tolerance` of a fresh placement's balancedness; see
`incremental`.

Balancedness = mean GPU load / max GPU load, a logical expert's load split evenly across its copies.
"""
from typing import Optional

import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_float, as_indices, as_loads, describe
from mooncake_ep_switch.eplb.policy.construct import Topology, fresh_placement
from mooncake_ep_switch.eplb.policy.incremental import movement_aware_placement
from mooncake_ep_switch.eplb.policy.tables import Placement, replica_tables, replica_width
from mooncake_ep_switch.eplb.policy.metrics import balancedness, layer_balancedness, moved_copies

__all__ = ["rebalance_experts", "resolve_topology", "balancedness", "layer_balancedness", "moved_copies", "Placement"]


def resolve_topology(
    num_logical: int,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    hierarchical: Optional[bool] = None,
) -> Topology:
    """Validate the placement arguments and decide the mode.

    Arguments:
        num_logical: E, logical experts per layer.
        num_replicas: physical slots per layer: a multiple of `num_gpus`, in `[E, E * num_gpus]`.
        num_groups: expert groups; must divide E.
        num_nodes: server nodes; must divide `num_gpus`.
        num_gpus: GPUs.
        hierarchical: True or False to choose, None for DeepSeek's default (hierarchical when
            `num_groups % num_nodes == 0` and `num_nodes > 1`).

    Returns:
        topology: the validated problem shape.
    """
    num_replicas = check_int("num_replicas", num_replicas, 1)
    num_groups = check_int("num_groups", num_groups, 1)
    num_nodes = check_int("num_nodes", num_nodes, 1)
    num_gpus = check_int("num_gpus", num_gpus, 1)
    if num_logical < 1:
        raise ValueError(f"weight: expected at least one logical expert, got {num_logical}")
    if num_logical % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {num_logical} logical experts, got {num_groups}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes: expected a divisor of num_gpus={num_gpus}, got {num_nodes}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas: expected a multiple of num_gpus={num_gpus}, got {num_replicas}")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas: expected >= {num_logical} (one slot per logical expert), got {num_replicas}")
    if num_replicas > num_logical * num_gpus:
        raise ValueError(
            f"num_replicas: expected <= {num_logical * num_gpus} (no two copies of an expert on one GPU "
            f"allows at most num_gpus={num_gpus} copies of each of {num_logical} experts), got {num_replicas}"
        )
    if hierarchical is None:
        hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    elif not isinstance(hierarchical, bool):
        raise TypeError(f"hierarchical: expected True, False or None, got {describe(hierarchical)}")
    elif hierarchical and num_groups % num_nodes:
        raise ValueError(f"hierarchical: needs num_groups ({num_groups}) divisible by num_nodes ({num_nodes})")
    return Topology(num_logical, num_replicas, num_groups, num_nodes, num_gpus, bool(hierarchical and num_nodes > 1))


def normalized_loads(loads: np.ndarray) -> np.ndarray:
    """Scale each layer's loads to sum to 1 and round them to multiples of 2**-40.

    Placement depends only on relative loads; rounding away the last bits makes a scaled load
    give exactly the same placement (ties are not decided by rounding noise).

    Arguments:
        loads: `[L, E]` float64, non-negative.

    Returns:
        normalized: `[L, E]` float64; rows with no load stay zero.
    """
    total = loads.sum(axis=1, keepdims=True)
    scaled = loads / np.where(total > 0, total, 1.0)
    return np.round(scaled * 2.0**40) / 2.0**40


def rebalance_experts(
    weight,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    previous_phy2log=None,
    hierarchical: Optional[bool] = None,
    balance_tolerance: float = 0.01,
) -> Placement:
    """Place the physical copies of every layer's logical experts onto GPUs.

    Arguments:
        weight: `[L, E]` torch tensor or numpy array of any real dtype (non-negative, finite), the
            load of each logical expert (e.g. tokens routed in the recent window).
        num_replicas: physical slots per layer: a multiple of `num_gpus`, at least E and at most
            `E * num_gpus`.
        num_groups: expert groups per layer (E // num_groups consecutive experts each); must divide E.
        num_nodes: server nodes; must divide `num_gpus`.
        num_gpus: GPUs (EP ranks); slot s lives on GPU `s // (num_replicas // num_gpus)`.
        previous_phy2log: `[L, num_replicas]` integer torch tensor or numpy array (or a
            `Placement`), the placement currently deployed, or None for a fresh placement. When
            given, slots keep their expert unless moving it is needed to reach, per layer, a
            balancedness of at least (fresh placement's balancedness - `balance_tolerance`).
        hierarchical: True: each group's primary copies in one node; False: global; None:
            hierarchical when `num_groups % num_nodes == 0` and `num_nodes > 1`.
        balance_tolerance: how much absolute balancedness (per layer) the movement-aware mode may
            give up against a fresh placement to move fewer copies; in [0, 1].

    Returns:
        placement: `Placement(phy2log, log2phy, logcnt)` of torch.int64 tensors:
            phy2log `[L, num_replicas]`, log2phy `[L, E, min(num_replicas - E + 1, num_gpus)]`
            (-1 padded), logcnt `[L, E]`.
    """
    loads = normalized_loads(as_loads("weight", weight, 2))
    num_layers, num_logical = loads.shape
    if num_layers == 0:
        raise ValueError(f"weight: expected at least one layer, got shape {list(loads.shape)}")
    topo = resolve_topology(num_logical, num_replicas, num_groups, num_nodes, num_gpus, hierarchical)
    tolerance = as_float("balance_tolerance", balance_tolerance, 0.0, 1.0)
    if previous_phy2log is None:
        phy2log = fresh_placement(loads, topo).experts.reshape(num_layers, topo.num_replicas)
    else:
        if isinstance(previous_phy2log, Placement):
            previous_phy2log = previous_phy2log.phy2log
        previous = as_indices("previous_phy2log", previous_phy2log, 2, upper=num_logical)
        if previous.shape != (num_layers, topo.num_replicas):
            raise ValueError(
                f"previous_phy2log: expected shape [{num_layers}, {topo.num_replicas}], got {list(previous.shape)}"
            )
        phy2log = movement_aware_placement(loads, topo, previous, tolerance)
    log2phy, logcnt = replica_tables(phy2log, num_logical, replica_width(num_logical, topo.num_replicas, topo.num_gpus))
    return Placement(torch.from_numpy(np.ascontiguousarray(phy2log)), torch.from_numpy(log2phy), torch.from_numpy(logcnt))
