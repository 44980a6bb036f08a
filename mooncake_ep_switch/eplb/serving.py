"""The EP forward of one MoE layer on physical experts (with redundant replicas) over a Buffer.

With `fault_aware=True` a round routes around the ranks this source rank's `active_ranks` masks:
every logical expert with a copy on a live rank is served by live copies from that very dispatch
on (`live.reroute_entries`), and only the entries of experts with no live copy are lost. Every round
adds the entries it lost to `slots.lost_contributions` (docs/eplb.md, "Serving through a death").
"""
import weakref
from typing import Tuple

import numpy as np
import torch

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_indices
from mooncake_ep_switch.eplb.live import alive_ranks, compact_live, lost_entries, reroute_entries, slot_ok
from mooncake_ep_switch.eplb.policy.tables import expert_counts, replica_tables
from mooncake_ep_switch.eplb.slots import ExpertSlots
from mooncake_ep_switch.reference.moe_block import ep_round, route


def physical_ep_forward(buffer, x: torch.Tensor, router: torch.Tensor, slots: ExpertSlots, layer: int, top_k: int,
                        tokens_per_rank: int, active_ranks: torch.Tensor, dispatch_row: torch.Tensor,
                        timeout_us: int = 30_000_000, *, fault_aware: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route to logical experts, map them to physical slots, dispatch, run this rank's slots, combine.

    Arguments:
        buffer: a `Buffer` over the EP group, sized for `slots.num_slots` experts.
        x: `[N, H]` torch.bfloat16 local tokens.
        router: `[E, H]` torch.float32 router of the layer (logical experts).
        slots: this rank's `ExpertSlots` (the current placement is `slots.phy2log`).
        layer: MoE layer index.
        top_k: experts per token.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask.
        dispatch_row: `[E]` torch.int64, `build_dispatch_map(slots.phy2log, ...)[rank, layer]`.
        timeout_us: deadline of dispatch and combine.
        fault_aware: route around the ranks `active_ranks` masks (see `physical_ep_round`).

    Returns:
        out: `[N, H]` torch.bfloat16, the combined output (no renormalisation for skipped experts).
        recv_count: `[slots_per_rank]` torch.int32, tokens each local physical slot served.

    Raises:
        TypeError, ValueError: as `physical_ep_round`.
    """
    topk_idx, topk_weights = route(x, router, top_k)
    return physical_ep_round(buffer, x, topk_idx, topk_weights, slots, layer, tokens_per_rank, active_ranks,
                             dispatch_row, timeout_us, fault_aware=fault_aware)


def physical_ep_round(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      slots: ExpertSlots, layer: int, tokens_per_rank: int, active_ranks: torch.Tensor,
                      dispatch_row: torch.Tensor, timeout_us: int = 30_000_000,
                      expert_fn=None, *, fault_aware: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Map a router's logical top-k to physical slots, dispatch, run this rank's slots, combine.

    Arguments:
        buffer: a `Buffer` over the EP group, sized for `slots.num_slots` experts.
        x: `[N, H]` torch.bfloat16 local tokens.
        topk_idx: `[N, K]` torch.int64 logical expert ids (-1 = none), from any router.
        topk_weights: `[N, K]` torch.float32 routing weights (combine applies them, no renormalisation).
        slots: this rank's `ExpertSlots`.
        layer: MoE layer index.
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`.
        active_ranks: `[R]` torch.int32 caller-owned mask (dispatch and combine set a peer that
            misses the deadline to 0).
        dispatch_row: `[E]` torch.int64, `build_dispatch_map(slots.phy2log, ...)[rank, layer]`,
            with or without `active_ranks=` (-1: an expert without a live copy).
        timeout_us: deadline of dispatch and combine.
        expert_fn: the expert MLP `expert_fn(rows, gate_up, down)` (None: `moe_block.expert_forward`).
        fault_aware: route around masked ranks. Before dispatching, every entry that `dispatch_row`
            sends to a rank `active_ranks` masks (or to -1) goes to a live copy of its expert
            instead: token t's entries to live copy `(rank + t) % live_copies`, so the rerouted load
            is spread evenly over the live copies; an expert without a live copy stays lost. Decided
            from this rank's mask alone (no collective); the tables come from `slots.phy2log`.
            False: entries go where `dispatch_row` says, and those on a masked rank are lost.

    Returns:
        out: `[N, H]` torch.bfloat16, the combined output (no renormalisation for lost entries).
        recv_count: `[slots_per_rank]` torch.int32, tokens each local physical slot served.

    Side effects:
        `slots.lost_contributions[layer]` grows by the entries (token x k, -1 not counted) whose
        expert contributed nothing: mapped to no slot, or to a rank masked after the round (one the
        round found dead included).

    Raises:
        TypeError: `active_ranks` not a torch.int32 tensor, or `topk_idx`/`dispatch_row` not integer.
        ValueError: `active_ranks` not of shape `[R]` or not 0/1, `layer` out of range, a
            `dispatch_row` not of shape `[E]` or an id out of range; nothing is sent or counted.
    """
    alive = alive_ranks("active_ranks", active_ranks, slots.num_ranks, torch_int32=True)
    layer = check_int("layer", layer, 0, slots.shape.num_layers - 1)
    num_logical, per_rank = slots.shape.num_logical_experts, slots.shape.slots_per_rank
    row = as_indices("dispatch_row", dispatch_row, 1, upper=slots.num_slots, allow_negative_one=True)
    if row.shape != (num_logical,):
        raise ValueError(f"dispatch_row: expected shape [{num_logical}], got {list(row.shape)}")
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx: expected an int32 or int64 tensor, got dtype {topk_idx.dtype}")
    logical = as_indices("topk_idx", topk_idx, 2, upper=num_logical, allow_negative_one=True)
    physical = np.where(logical >= 0, row[np.maximum(logical, 0)], -1)
    if fault_aware and not (alive.all() and (row >= 0).all()):
        live, count = _live_tables(slots, layer, alive)
        physical = reroute_entries(logical, physical, row, live, count, slot_ok(alive, per_rank), slots.rank)
    mapped = torch.from_numpy(physical).to(topk_idx.device)
    out, recv_count = ep_round(buffer, x, mapped, topk_weights, slots.num_slots, per_rank,
                               lambda local_slot: slots.expert(layer, local_slot), tokens_per_rank, active_ranks,
                               timeout_us, expert_fn=expert_fn)
    after = alive_ranks("active_ranks", active_ranks, slots.num_ranks) & alive  # a peer found dead meanwhile too
    if not (after.all() and (row >= 0).all()):  # else every entry had a live slot
        slots.lost_contributions[layer] += lost_entries(logical, physical, slot_ok(after, per_rank))
    return out, recv_count.clone()


# Per ExpertSlots and layer: (phy2log row, mask bytes, live copies, live counts) of the last masked round.
_LIVE = weakref.WeakKeyDictionary()


def _live_tables(slots: ExpertSlots, layer: int, alive: np.ndarray):
    """One layer's live copies under `alive` (`live.compact_live`), cached until the row or the mask changes."""
    cache = _LIVE.setdefault(slots, {})
    row = slots.phy2log[layer]
    hit = cache.get(layer)
    if hit is not None and hit[1] == alive.tobytes() and np.array_equal(hit[0], row):
        return hit[2], hit[3]
    table = row[None]
    num_logical = slots.shape.num_logical_experts
    log2phy, _ = replica_tables(table, num_logical, int(expert_counts(table, num_logical).max()))
    live, count = compact_live(log2phy[0], alive, slots.shape.slots_per_rank)
    cache[layer] = (row.copy(), alive.tobytes(), live, count)
    return live, count
