"""Weight reshard between the EP and TP views of the unified weight memory (Moebius algorithms 1 and 2).

A layer moves as P x P chunks: the chunk from rank s to rank d is what d needs of what s holds.

    EP -> TP: s holds experts [sE/P, (s+1)E/P) whole; d needs slice d of them:
              gate rows [dI', (d+1)I') and up rows [I + dI', I + (d+1)I') of every local expert,
              and down columns [dI', (d+1)I'),   I' = I/P.
    TP -> EP: the reverse: s holds slice s of every expert; d needs slice s of its own experts.

Every chunk is three strided blocks (gate, up, down), described once as int64 `[3, 6]` rows
`(dst, src, rows, row_bytes, dst_stride, src_stride)` for the native `copy_blocks`:

    gate: rows E/P, row_bytes I'*H*2,  TP stride 2I'*H*2, EP stride 2I*H*2
    up:   same, offset by I'*H*2 (TP) and I*H*2 (EP)
    down: rows E/P*H, row_bytes I'*2,  TP stride I'*2,    EP stride I*2

On the one-sided transport the blocks are copied straight from the source's slot into the
destination's free slot ("direct transfer": one read at the source, no staging at the
destination); `switcher.py` sequences the layers and the signals. On the collective fallback a
layer is two `all_to_all_single` calls (gate/up, down) with one packing copy on the side whose
layout is strided (EP->TP: the sender packs, the receiver receives in place; TP->EP: the sender
sends in place, the receiver unpacks).
"""
from typing import List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer import device_region
from mooncake_ep_switch.switch.unified_weights import EP, TP, UnifiedWeights

EP_TO_TP = "ep->tp"
TP_TO_EP = "tp->ep"


def direction(source: str, target: str) -> str:
    """`"ep->tp"` or `"tp->ep"` for a switch from `source` to `target` (distinct layouts).

    Arguments:
        source: layout before the switch, `"ep"` or `"tp"`.
        target: layout after the switch, the other one.

    Returns:
        way: `EP_TO_TP` (`"ep->tp"`) or `TP_TO_EP` (`"tp->ep"`).

    Raises:
        ValueError: the pair is not (`"ep"`, `"tp"`) or (`"tp"`, `"ep"`).
    """
    if (source, target) == (EP, TP):
        return EP_TO_TP
    if (source, target) == (TP, EP):
        return TP_TO_EP
    raise ValueError(f"source, target: expected ('ep', 'tp') or ('tp', 'ep'), got ({source!r}, {target!r})")


def step_order(way: str, num_layers: int) -> List[Tuple[int, int, int]]:
    """The steps of a reshard as (layer, source slot, destination slot), in the order they run.

    EP -> TP moves layer i from slot i+1 to slot i, layers ascending (slot 0 is free first; step t's
    destination is the slot step t-1 read from). TP -> EP moves layer i from slot i to slot i+1,
    layers descending (slot L is free first).

    Arguments:
        way: `"ep->tp"`; any other value is taken as `"tp->ep"` (use `direction` to get it).
        num_layers: `L`, MoE layers.

    Returns:
        steps: list of `L` (layer, source slot, destination slot) int tuples.
    """
    if way == EP_TO_TP:
        return [(layer, layer + 1, layer) for layer in range(num_layers)]
    return [(layer, layer, layer + 1) for layer in reversed(range(num_layers))]


def chunk_blocks(unified: UnifiedWeights, tp_rank: int, tp_gate_up: int, tp_down: int, ep_gate_up: int, ep_down: int,
                 to_tp: bool) -> np.ndarray:
    """The three copy blocks of one chunk, between a TP-side and an EP-side address set.

    Arguments:
        unified: the unified weights (for the shape and the rank count).
        tp_rank: the intermediate slice the chunk carries (the TP rank's index).
        tp_gate_up: address of the first expert's TP gate/up rows `[2I', H]` of the chunk.
        tp_down: address of the first expert's TP down `[H, I']` of the chunk.
        ep_gate_up: address of the first expert's EP gate/up `[2I, H]`.
        ep_down: address of the first expert's EP down `[H, I]`.
        to_tp: copy EP -> TP (else TP -> EP).

    Returns:
        blocks: `[3, 6]` np.int64 for `copy_blocks`.
    """
    experts, hidden, inter = unified.shape
    local = experts // unified.num_ranks
    part = inter // unified.num_ranks
    row = part * hidden * 2
    tp_side = [(tp_gate_up, local, row, 2 * row),
               (tp_gate_up + row, local, row, 2 * row),
               (tp_down, local * hidden, part * 2, part * 2)]
    ep_side = [(ep_gate_up + tp_rank * row, 2 * inter * hidden * 2),
               (ep_gate_up + (inter + tp_rank * part) * hidden * 2, 2 * inter * hidden * 2),
               (ep_down + tp_rank * part * 2, inter * 2)]
    blocks = np.empty((3, 6), dtype=np.int64)
    for i, ((tp_addr, rows, row_bytes, tp_stride), (ep_addr, ep_stride)) in enumerate(zip(tp_side, ep_side)):
        if to_tp:
            blocks[i] = (tp_addr, ep_addr, rows, row_bytes, tp_stride, ep_stride)
        else:
            blocks[i] = (ep_addr, tp_addr, rows, row_bytes, ep_stride, tp_stride)
    return blocks


def slot_chunk_blocks(unified: UnifiedWeights, way: str, src_rank: int, dst_rank: int, src_slot_addr: int,
                      dst_slot_addr: int) -> np.ndarray:
    """Blocks moving the chunk `src_rank -> dst_rank` of one layer between two slots.

    Arguments:
        unified: the unified weights.
        way: `"ep->tp"` or `"tp->ep"`.
        src_rank: rank holding the layer in the source layout.
        dst_rank: rank receiving its part in the target layout.
        src_slot_addr: address (as mapped here) of the source rank's source slot.
        dst_slot_addr: address (as mapped here) of the destination rank's destination slot.

    Returns:
        blocks: `[3, 6]` np.int64.
    """
    experts, hidden, inter = unified.shape
    local = experts // unified.num_ranks
    part = inter // unified.num_ranks
    split = unified.gate_up_bytes()
    if way == EP_TO_TP:  # destination TP slice dst_rank, source experts of src_rank
        tp_slot, ep_slot, owner, tp_rank = dst_slot_addr, src_slot_addr, src_rank, dst_rank
    else:                # source TP slice src_rank, destination experts of dst_rank
        tp_slot, ep_slot, owner, tp_rank = src_slot_addr, dst_slot_addr, dst_rank, src_rank
    tp_gate_up = tp_slot + owner * local * 2 * part * hidden * 2
    tp_down = tp_slot + split + owner * local * hidden * part * 2
    return chunk_blocks(unified, tp_rank, tp_gate_up, tp_down, ep_slot, ep_slot + split, way == EP_TO_TP)


def copy(blocks: np.ndarray, dst_range: Tuple[int, int], src_range: Tuple[int, int], device=None) -> int:
    """Copy `blocks` (checked against the regions first); returns the bytes copied.

    Arguments:
        blocks: `[n, 6]` int64 (np or convertible) rows `(dst, src, rows, row_bytes, dst_stride,
            src_stride)`, as from `chunk_blocks`.
        dst_range: (lo, hi) int addresses every destination byte must lie in.
        src_range: (lo, hi) int addresses every source byte must lie in.
        device: the regions' CUDA torch.device (the copies are queued there: `device_region.fence`
            before a peer is told), or None for host memory (copied before this returns).

    Returns:
        nbytes: int, `sum(rows * row_bytes)` over the blocks (0 for no blocks).

    Raises:
        ValueError: (from the native `copy_blocks`) a block with a negative field, an overflow, or
            an extent outside its range; nothing is copied then.
    """
    return device_region.copy_blocks(blocks, dst_range, src_range, device)


def _all_to_all(output: torch.Tensor, input: torch.Tensor, group, wait=None) -> None:
    """Equal blocks of `input` to every rank of `group`, theirs into `output`, with the group's own
    `alltoall_base`: also on the unregistered per-view gloo group the fallback builds after a
    membership change (torch's `all_to_all_single` takes registered groups only). `wait(work)` waits
    for it (the switch's bounded wait), else `work.wait()`."""
    work = group.alltoall_base(output, input, [], [], dist.AllToAllOptions())
    if wait is None:
        work.wait()
    else:
        wait(work)


def collective_layer(unified: UnifiedWeights, way: str, layer: int, staging: torch.Tensor, wait=None) -> int:
    """Reshard one layer with an all-to-all over `unified.group` (the collective fallback).

    Arguments:
        unified: the unified weights (private memory).
        way: `"ep->tp"` or `"tp->ep"`.
        layer: the layer; source and destination slots follow `step_order`.
        staging: `[slot_bytes]` torch.uint8 scratch (the packing side's buffer).
        wait: `wait(work)` waits for each all-to-all (the switch's bounded wait), or None (`work.wait()`).

    Returns:
        bytes_sent: bytes this rank sent to other ranks.
    """
    ranks = unified.num_ranks
    src_slot = unified.slot_of(layer, EP if way == EP_TO_TP else TP)
    dst_slot = unified.slot_of(layer, TP if way == EP_TO_TP else EP)
    base, split, slot = unified.base, unified.gate_up_bytes(), unified.slot_bytes
    gate_up_chunk, down_chunk = split // ranks, (slot - split) // ranks
    region = (base, base + unified.region_bytes)
    stage = staging.data_ptr()
    stage_range = (stage, stage + staging.numel())
    src_gate_up = unified.local[src_slot * slot:src_slot * slot + split]
    src_down = unified.local[src_slot * slot + split:(src_slot + 1) * slot]
    dst_gate_up = unified.local[dst_slot * slot:dst_slot * slot + split]
    dst_down = unified.local[dst_slot * slot + split:(dst_slot + 1) * slot]
    stage_gate_up, stage_down = staging[:split], staging[split:slot]
    if way == EP_TO_TP:
        # Pack: chunk for d = slice d of my experts, laid out as the TP rows of my experts.
        blocks = np.concatenate([
            chunk_blocks(unified, d, stage + d * gate_up_chunk, stage + split + d * down_chunk,
                         base + src_slot * slot, base + src_slot * slot + split, to_tp=True)
            for d in range(ranks)])
        copy(blocks, stage_range, region)
        _all_to_all(dst_gate_up, stage_gate_up, unified.group, wait)
        _all_to_all(dst_down, stage_down, unified.group, wait)
    else:
        # Send in place (chunk for d = my slice of d's experts, contiguous), unpack what arrives.
        _all_to_all(stage_gate_up, src_gate_up, unified.group, wait)
        _all_to_all(stage_down, src_down, unified.group, wait)
        blocks = np.concatenate([
            chunk_blocks(unified, s, stage + s * gate_up_chunk, stage + split + s * down_chunk,
                         base + dst_slot * slot, base + dst_slot * slot + split, to_tp=False)
            for s in range(ranks)])
        copy(blocks, region, stage_range)
    return (ranks - 1) * (gate_up_chunk + down_chunk)
