"""The resize demo's rank side: serve MoE layers on physical experts over a group whose size changes.

`apps/demo_resize.py` (and `apps/resize_bench.py`) drive these functions on every rank process, one call
per step or per event, as an engine's workers would be driven by its scheduler. A rank keeps its state
in this module between calls: its current Buffer, `ExpertSlots`, `OnlineRebalancer`, `active_ranks`
and dispatch map.

- `rank_setup`: a member's Buffer over the launcher's world group and its slots (`initial_placement`).
- `rank_serve`: one step: the rebalancer's step (a shrink's placement commits there), then every layer's
  `physical_ep_forward` (fault-aware) checked against the single-process reference (which leaves out
  exactly the experts without a live copy, none outside the step a rank died in).
- `rank_death_seen` / `rank_shrink`: the survivors see the death (peer watcher) and remove the rank for
  good (`eplb.shrink_experts`: one vote, the view without it, the placement over the remaining ranks).
- `rank_grow_begin` / `rank_grow_poll` (members) and `rank_join_begin` / `rank_join_end` (newcomers):
  `elastic.grow` / `elastic.join_grow` with `eplb.grow_slots` as the build; the members poll at every
  step boundary and switch to the grown Buffer at the agreed step.
"""
import threading
import time
from typing import NamedTuple

import numpy as np
import torch

from mooncake_ep_switch.reference.compare import calc_diff

_STATE = {}


class ResizeConfig(NamedTuple):
    """Settings of the resize demo and bench.

    Fields:
        num_ranks: ranks serving at the start.
        layers, experts, top_k, hidden, intermediate: the MoE layers (logical experts per layer).
        tokens: tokens per rank and step.
        slots_per_rank: physical expert slots per rank (redundant copies included).
        steps_between: steps served between two resize events (and after the last).
        kill_rank: the rank SIGKILLed (no replacement comes): the group shrinks without it.
        grow_by: new processes that join (the group grows by that many ranks).
        shrink_first: True: shrink after the death, then grow (4 -> 3 -> 5); False: grow, then shrink.
        transport: the Buffers' transport ("shm": expert slots move one-sided).
        timeout_s: deadline of each resize (vote, view, build), seconds.
        out_dir: where metrics.json and timeline.png are written.
    """

    num_ranks: int = 4
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 256
    intermediate: int = 128
    tokens: int = 16
    slots_per_rank: int = 3
    steps_between: int = 3
    kill_rank: int = 2
    grow_by: int = 2
    shrink_first: bool = True
    transport: str = "shm"
    timeout_s: float = 60.0
    out_dir: str = "mep_resize_out"

    @property
    def max_ranks(self) -> int:
        """The largest group of the run (the Buffers' size hint is taken for it, the same on every rank)."""
        return self.num_ranks + self.grow_by


def initial_placement(config: ResizeConfig) -> np.ndarray:
    """`[L, R * slots_per_rank]`: layer l holds expert `(s + l) % E` at slot s; every expert at least once."""
    slots = config.num_ranks * config.slots_per_rank
    if slots < config.experts:
        raise ValueError(f"slots_per_rank: {config.num_ranks} x {config.slots_per_rank} slots cannot hold "
                         f"{config.experts} experts")
    return np.array([[(s + layer) % config.experts for s in range(slots)] for layer in range(config.layers)],
                    dtype=np.int64)


def _weights(config: ResizeConfig):
    from mooncake_ep_switch.reference.moe_block import random_weights

    return [random_weights(config.experts, config.hidden, config.intermediate, seed=700 + layer)
            for layer in range(config.layers)]


def _shape(config: ResizeConfig):
    from mooncake_ep_switch.eplb.slots import SlotShape

    return SlotShape(config.layers, config.experts, config.slots_per_rank, config.hidden, config.intermediate)


def buffer_bytes(config: ResizeConfig) -> int:
    """`num_ep_buffer_bytes` of every Buffer of the run (members and newcomers must agree)."""
    from mooncake_ep_switch import Buffer

    return Buffer.get_ep_buffer_size_hint(config.tokens, config.hidden, config.max_ranks,
                                          config.max_ranks * config.slots_per_rank)


def _loader(state):
    def loader(layer, expert):  # the checkpoint: only for an expert no live rank holds
        state["loaded"] += 1
        weights = state["weights"][layer]
        return weights.gate_up[expert], weights.down[expert]

    return loader


def _adopt(buffer, slots, config: ResizeConfig) -> None:
    """Serve from now on with `buffer` and `slots` (a fresh rebalancer, mask and dispatch map)."""
    from mooncake_ep_switch.eplb.online import OnlineRebalancer

    _STATE.update(buffer=buffer, slots=slots, active=buffer.active_mask(),
                  rebalancer=OnlineRebalancer(slots, timeout_us=int(config.timeout_s * 1e6), frames_per_step=1))
    _rebuild_map()


def _rebuild_map() -> None:
    from mooncake_ep_switch.eplb.maps import build_dispatch_map

    buffer = _STATE["buffer"]
    _STATE["rows"] = build_dispatch_map(_STATE["slots"].phy2log, buffer.num_ranks, buffer.num_ranks,
                                        active_ranks=_STATE["active"])[buffer.rank]


def rank_setup(ctx, config: ResizeConfig) -> dict:
    """A member's Buffer over the world group, its slots of `initial_placement` loaded from the weights."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.eplb.slots import ExpertSlots

    torch.set_num_threads(1)
    _STATE.clear()
    _STATE.update(config=config, weights=_weights(config), loaded=0)
    buffer = Buffer(ctx.group, buffer_bytes(config), transport=config.transport)
    slots = ExpertSlots(buffer, _shape(config), initial_placement(config), spare_frames=1)
    slots.load(_STATE["weights"])
    _adopt(buffer, slots, config)
    return {"rank": buffer.rank, "num_ranks": buffer.num_ranks, "transport": buffer.transport}


def _inputs(config: ResizeConfig, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn((config.tokens, config.hidden), generator=generator).to(torch.bfloat16)


def rank_serve(ctx, step: int) -> dict:
    """Serve `step` on every layer; the worst diff against the single-process reference and what was lost."""
    from mooncake_ep_switch.eplb.serving import physical_ep_forward
    from mooncake_ep_switch.reference.moe_block import reference_forward

    config, buffer, slots, active = _STATE["config"], _STATE["buffer"], _STATE["slots"], _STATE["active"]
    started = time.perf_counter()
    reports = _STATE["rebalancer"].step(step, active)
    if any(r.outcome == "committed" for r in reports):
        _rebuild_map()
    x = _inputs(config, buffer.rank, step)
    alive = np.repeat(active.numpy().astype(bool), config.slots_per_rank)
    diffs, lost, skipped, received = [], 0, 0, 0
    for layer in range(config.layers):
        before = int(slots.lost_contributions[layer])
        out, recv_count = physical_ep_forward(buffer, x, _STATE["weights"][layer].router, slots, layer, config.top_k,
                                     config.tokens, active, _STATE["rows"][layer],
                                     timeout_us=int(config.timeout_s * 1e6), fault_aware=True)
        lost += int(slots.lost_contributions[layer]) - before
        received += int(recv_count.sum())
        # Exactly the experts without a live copy contribute nothing (fault-aware routing serves the others).
        skip = set(range(config.experts)) - set(slots.phy2log[layer][alive].tolist())
        skipped += len(skip)
        diffs.append(calc_diff(out, reference_forward(x, _STATE["weights"][layer], config.top_k, skip_experts=skip)))
    return {"rank": buffer.rank, "diff": max(diffs), "lost": lost, "skipped": skipped, "received": received,
            "seconds": time.perf_counter() - started, "members": list(buffer.members),
            "num_ranks": buffer.num_ranks, "mask": active.tolist(), "phy2log": slots.phy2log.tolist(),
            "reports": [{"outcome": r.outcome, "moved_bytes": r.moved_bytes, "loaded_bytes": r.loaded_bytes,
                         "stage_ms": r.stage_ms, "stall_ms": r.stall_ms} for r in reports]}


def rank_death_seen(ctx, victim: int, timeout_s: float = 30.0) -> float:
    """Wait until this rank's peer watcher saw `victim` end, mask it (the engine's PeerMasked); seconds waited."""
    started = time.monotonic()
    while victim not in _STATE["buffer"].dead_peers():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"rank {ctx.rank}: the peer watcher did not see rank {victim} end within {timeout_s} s")
        time.sleep(0.005)
    _STATE["active"][victim] = 0
    return time.monotonic() - started


def rank_shrink(ctx, victim: int, commit_step: int) -> dict:
    """Remove the dead `victim` for good and begin the placement over the remaining ranks (commits at
    `commit_step`): `shrink_experts`, timed."""
    from mooncake_ep_switch.eplb.shrink_placement import shrink_experts

    config = _STATE["config"]
    started = time.perf_counter()
    view, chunks = shrink_experts(_STATE["buffer"], _STATE["rebalancer"], [victim], commit_step,
                                  _loader(_STATE), timeout_s=config.timeout_s)
    seconds = time.perf_counter() - started
    _STATE["active"] = _STATE["buffer"].active_mask()
    _rebuild_map()  # the old placement over the view until the commit (fault-aware: the victim's copies unused)
    return {"seconds": seconds, "view": list(view.ranks), "epoch": view.epoch, "chunks": len(chunks)}


def _grow_build(config: ResizeConfig, target, old_num_ranks: int, current, timings: dict):
    """The grow's `build`: `grow_slots`, timed. On a newcomer the copies from the members' memory come after
    grow_slots' last barrier (the members' copies in place); the bench times them from there (`copy_s`) by
    wrapping `torch.distributed.barrier` in this process for the call (nothing else of it runs meanwhile)."""
    import torch.distributed as dist

    from mooncake_ep_switch.eplb.grow_placement import grow_slots

    def build(new):
        timings["build_started"] = time.perf_counter()
        barriers, real = [], dist.barrier

        def barrier(*args, **kwargs):
            value = real(*args, **kwargs)
            barriers.append(time.perf_counter())
            return value

        if current is None:
            dist.barrier = barrier
        try:
            grown = grow_slots(new, _shape(config), target, old_num_ranks, current, spare_frames=1,
                               loader=_loader(_STATE))
        finally:
            dist.barrier = real
        ended = time.perf_counter()
        timings["weights_s"] = ended - timings["build_started"]
        timings["copy_s"] = ended - barriers[-1] if barriers else None
        timings["weight_bytes"] = grown.from_members * grown.slots.frame_bytes
        return grown

    return build


def grown_target(config: ResizeConfig, phy2log, members, num_ranks: int) -> np.ndarray:
    """The grown group's placement: the members' slots (renumbered densely in the order of their ids, the removed
    ranks' columns dropped: the grown group's ranks `0 .. M-1`), then the newcomers' (`eplb.grow_placement`)."""
    from mooncake_ep_switch.eplb.grow_placement import grow_placement, renumber_placement

    dense = renumber_placement(phy2log, members, config.slots_per_rank)
    return grow_placement(dense, len(members), num_ranks, config.slots_per_rank, config.experts)


def rank_grow_begin(ctx, num_ranks: int) -> dict:
    """A member asks the grow to `num_ranks` (`elastic.grow`, the build in the background); serving goes on."""
    from mooncake_ep_switch import elastic

    config, buffer, slots = _STATE["config"], _STATE["buffer"], _STATE["slots"]
    members = sorted(buffer.members)
    target = grown_target(config, slots.phy2log, members, num_ranks)
    timings = {"requested": time.perf_counter()}
    build = _grow_build(config, target, len(members), slots, timings)
    _STATE.update(grow=elastic.grow(buffer, num_ranks, build=build, timeout_s=config.timeout_s), timings=timings,
                  polls=[])
    return {"target": target.tolist()}


def _grown(result, timings: dict) -> dict:
    timings["switched"] = time.perf_counter()
    old_buffer, old_slots = _STATE.get("buffer"), _STATE.get("slots")
    if old_slots is not None:
        old_slots.destroy()
    if old_buffer is not None:
        old_buffer.destroy()
    _adopt(result.buffer, result.built.slots, _STATE["config"])
    return {"step": result.step, "rank": result.buffer.rank, "num_ranks": result.buffer.num_ranks,
            "agree_s": timings["build_started"] - timings["requested"], "weights_s": timings["weights_s"],
            "weight_bytes": timings["weight_bytes"], "copy_s": timings["copy_s"],
            "switch_s": timings["switched"] - timings["requested"],
            "polls_s": _STATE.pop("polls", [])}


def rank_grow_poll(ctx, step: int):
    """A member's step boundary during a grow: None (serve `step` on the current Buffer), or the switch-over
    (the grown Buffer serves `step` on): its timings."""
    started = time.perf_counter()
    result = _STATE["grow"].poll(step)
    _STATE["polls"].append(time.perf_counter() - started)
    if result is None:
        return None
    _STATE.pop("grow")
    return _grown(result, _STATE.pop("timings"))


def rank_join_begin(ctx, config: ResizeConfig, rank: int, num_ranks: int, members, group_size: int,
                    old_phy2log) -> None:
    """A newcomer: `elastic.join_grow` as `rank` of the grown group, in a thread (it returns at the switch-over).

    `members` (the view's ids), `group_size` (the members' group, removed ranks included) and `old_phy2log`
    (their placement) are what the engine tells a newcomer, as it tells it the store's address."""
    from mooncake_ep_switch import elastic

    torch.set_num_threads(1)
    _STATE.clear()
    _STATE.update(config=config, weights=_weights(config), loaded=0)
    target = grown_target(config, old_phy2log, members, num_ranks)
    timings = {"requested": time.perf_counter()}
    build = _grow_build(config, target, len(members), None, timings)
    outcome = {}

    def join():
        try:
            outcome["result"] = elastic.join_grow(ctx.store, rank, num_ranks, buffer_bytes(config),
                                                  old_num_ranks=len(members), group_ranks=list(range(group_size)),
                                                  build=build, timeout_s=config.timeout_s)
        except BaseException as error:  # reported by rank_join_end
            outcome["error"] = error

    thread = threading.Thread(target=join, name=f"mep-join-grow-{rank}", daemon=True)
    thread.start()
    _STATE.update(join=(thread, outcome), timings=timings)


def rank_join_end(ctx) -> dict:
    """A newcomer after the members' switch-over: its join's result (the agreed step) and timings."""
    thread, outcome = _STATE.pop("join")
    thread.join(_STATE["config"].timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"newcomer {ctx.rank}: join_grow did not return")
    if "error" in outcome:
        raise outcome["error"]
    return _grown(outcome["result"], _STATE.pop("timings"))


def rank_placement(ctx) -> list:
    """This rank's current placement (`phy2log`), which the engine hands the newcomers of a grow."""
    return _STATE["slots"].phy2log.tolist()


def rank_memcpy(ctx, nbytes: int) -> float:
    """One core's memcpy seconds for `nbytes` on this rank (the baseline of a move: `bench.transport`'s
    `memcpy_rank_seconds`, the rate of a copy from memory, as every bench here uses)."""
    from mooncake_ep_switch.bench.transport import memcpy_rank_seconds

    return memcpy_rank_seconds(max(1, int(nbytes)))


def rank_teardown(ctx) -> dict:
    """Destroy the slots and the Buffer; what was read from the loader."""
    slots, buffer = _STATE.pop("slots", None), _STATE.pop("buffer", None)
    if slots is not None:
        slots.destroy()
    if buffer is not None:
        buffer.destroy()
    loaded = _STATE.get("loaded", 0)
    _STATE.clear()
    return {"loaded": loaded}
