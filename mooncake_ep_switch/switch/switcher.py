"""`switch_layout()`: move every MoE layer and the KV cache between the EP and TP layouts, all or nothing.

Called by every rank between two engine steps (nothing in flight: that is the quiesce). Phases:

1. Entry. Each rank checks its arguments, writes a digest of its shapes (control region) and its KV
   page tables (KV region), then publishes `ENTERED`. After every peer's `ENTERED` it reads the
   peers' digests and tables, computes the KV plan (the same on every rank) and its capacity
   check, and publishes a decision, GO or ABORT. Only when every rank said GO does anything move; a
   refusal (capacity, a missing peer, mismatched calls) returns a report and leaves everything as
   it was.
2. Weights, layer by layer (`reshard.step_order`): step t writes this rank's chunk of one layer
   straight into every destination's free slot, then publishes progress `W0 + t + 1`. Step t's
   destination slot is the slot step t-1 read from, so a rank writes step t into a peer only after
   that peer's progress reached `W0 + t`.
3. KV: every move whose source is this rank is written into the destination's free units, then
   progress `KV_SENT`; then wait for every peer's `KV_SENT`.
4. Commit: publish `DONE`, wait for every peer's `DONE` (so that no peer still reads a source that is
   about to be freed), adopt the new layout and page tables, free the sources.

Signals. Progress, decision and dead-declaration words are 64-bit `(seq << 32) | value` words in
each rank's own control region (a `SharedRegion`), read by peers through their mapping; `seq`
numbers the switches, so words of an earlier switch never satisfy a wait. Every wait has the
deadline `timeout_us` and yields (native `wait_words`); no gloo collective runs once a switch
started, so a dead peer cannot hang it.

Failure (one-sided transport). A peer whose progress misses a deadline is declared dead (written
into this rank's declaration words, which other survivors adopt at once). Survivors skip writes to
it and *complete the switch on its behalf*: a dead rank's region stays mapped and readable, and no
rank ever writes into a slot or unit the dead rank still had to send from (writes into a peer's
slot wait for that peer's progress; KV moves only write free units), so every survivor pulls the
dead rank's missing chunks straight from its memory. Every survivor therefore ends in the target
layout with bit-exact weights, whatever step the peer died at; the report names the dead ranks and
what they took with them (EP: the requests assigned to them; TP: their head group and weight slice,
which a replacement must receive before the layout can serve). A failure before every rank said GO
refuses the switch instead (nothing was touched).

Assumption: fail-stop within the deadline. A rank that is merely late and finds itself declared
dead raises `SwitchFenced` (its layout becomes "invalid"); a pull that raced with a late peer's
progress is detected and raises `SwitchError` rather than returning wrong weights.

Collective fallback: entry metadata is exchanged with `group_wait.gather_objects`, weights with two
all-to-alls per layer and KV with one, all on the current view's group (`switch_group`). Each of them
waits at most `timeout_us` and stops early once the peer watcher sees a member end (`group_wait`), not
for the group's timeout; the group is then abandoned (refused by name until `update_ep_member()` gives the
next view its own). A member that died or stalled before the entry exchange completed refuses the switch
(nothing moved; the reason names the dead ranks or the deadline). A peer that dies after it cannot be
survived: the survivors raise `SwitchError` and mark their weights and KV "invalid"; reload from a
checkpoint. Refusals (capacity, mismatched calls) are still all-or-nothing.
"""
import logging
import time
from typing import Callable, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.distributed as dist

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.buffer import register_layout_switch
from mooncake_ep_switch.buffer.device_region import DRAIN_TIMEOUT_S, copy_block_parts, fence
from mooncake_ep_switch.buffer.membership.store_deadline import store_deadline
from mooncake_ep_switch.buffer.peer_words import wait_peer_words
from mooncake_ep_switch.errors import MembershipError, SwitchError, SwitchFenced  # noqa: F401 (re-exported)
from mooncake_ep_switch.switch import reshard
from mooncake_ep_switch.switch.kv_cache import PagedKVCache
from mooncake_ep_switch.switch.kv_plan import KVPlan, moves_by_peer
from mooncake_ep_switch.switch.group_wait import abandoned_reason, gather_objects, wait_work
from mooncake_ep_switch.switch.switch_group import switch_group
from mooncake_ep_switch.switch.unified_weights import EP, INVALID, LAYOUTS, TP, UnifiedWeights
from mooncake_ep_switch.checks import check_timeout

# Progress steps (low 32 bits of the progress word).
ENTERED = 1
W0 = 16
# Decision codes (low 32 bits of the decision word): GO, or why a rank refused.
GO = 1
ABORT_BAD_ARGUMENTS = 2
ABORT_KV_DOES_NOT_FIT = 3
ABORT_DIFFERENT_CALLS = 4
ABORT_LATE_RANK = 5
ABORT_DEAD_RANKS = 6
ABORT_NOT_MEMBERS = 7
ABORT_CODES = {ABORT_BAD_ARGUMENTS: "a rank rejected its arguments",
               ABORT_KV_DOES_NOT_FIT: "the KV cache does not fit the target layout",
               ABORT_DIFFERENT_CALLS: "the ranks called switch_layout with different arguments or layouts",
               ABORT_LATE_RANK: "a rank did not enter the switch before the deadline",
               ABORT_DEAD_RANKS: "ranks found dead earlier need recovery",
               ABORT_NOT_MEMBERS: "ranks of the weights are not members of the current view"}

_PROGRESS, _DECISION, _DIGEST, _DIGEST_WORDS, _DECL = 0, 8, 64, 48, 512

COMPLETED = "completed"
REFUSED = "refused"
UNCHANGED = "unchanged"

log = logging.getLogger("mooncake_ep_switch.switch")


class SwitchReport(NamedTuple):
    """What `switch_layout` did on this rank.

    Fields:
        source: layout before the call.
        target: requested layout.
        layout: layout this rank (and every surviving rank) is in now.
        outcome: `"completed"`, `"refused"` (nothing moved) or `"unchanged"` (already in target).
        reason: why it was refused, or what failed and how it was completed; "" otherwise.
        dead_ranks: ranks found dead during this switch (their part was completed from their memory).
        lost_requests: request ids whose KV now lives only on dead ranks.
        weight_bytes: weight bytes this rank wrote into other ranks (plus bytes it pulled for dead ones).
        weight_local_bytes: weight bytes this rank moved inside its own region (its diagonal chunk).
        weight_ms: wall time of the weight phase (including waits for peers).
        kv_bytes: KV bytes this rank wrote into other ranks (plus pulls for dead ones).
        kv_local_bytes: KV bytes moved inside this rank's pool.
        kv_ms: wall time of the KV phase.
        prepare_ms: wall time of the entry (metadata exchange, plan, capacity check, decision).
        commit_ms: wall time of the commit (final signal round, page tables, freeing sources).
        total_ms: wall time of the whole call.
        transport: `"shm"` (one-sided) or the collective fallback's name.
        seq: switch sequence number.
    """

    source: str
    target: str
    layout: str
    outcome: str
    reason: str
    dead_ranks: Tuple[int, ...]
    lost_requests: Tuple[int, ...]
    weight_bytes: int
    weight_local_bytes: int
    weight_ms: float
    kv_bytes: int
    kv_local_bytes: int
    kv_ms: float
    prepare_ms: float
    commit_ms: float
    total_ms: float
    transport: str
    seq: int


# SwitchError and SwitchFenced live in errors.py (one hierarchy), re-exported here.


StepHook = Callable[[str, int], None]


# ------------------------------------------------------------------------------------------------
# Control words
# ------------------------------------------------------------------------------------------------

class _Control:
    """This switch's view of every rank's control words, its dead set and its fence."""

    def __init__(self, unified: UnifiedWeights, seq: int, timeout_us: int):
        self.unified = unified
        self.rank = unified.rank
        self.num_ranks = unified.num_ranks
        self.seq = seq
        self.timeout_us = timeout_us
        self.bases = unified.control.peer_bases
        self.dead: Set[int] = set()

    def addr(self, rank: int, offset: int) -> int:
        return self.bases[rank] + offset

    def word(self, step: int) -> int:
        return (self.seq << 32) | step

    def publish(self, offset: int, value: int) -> None:
        """Publish this rank's word at `offset`; on device memory only after every copy and write this
        rank queued landed (a peer that sees the word may read or overwrite what it announces)."""
        if self.unified.device is not None:
            fence(self.unified.device, DRAIN_TIMEOUT_S if self.timeout_us < 0 else max(1.0, self.timeout_us / 1e6))
        _native.signal_publish(self.addr(self.rank, offset), self.word(value))

    def progress(self, rank: int) -> int:
        """Progress step of `rank` in this switch (0 if it has not entered it)."""
        value = _native.signal_load(self.addr(rank, _PROGRESS))
        return value & 0xFFFFFFFF if value >> 32 == self.seq else 0

    def write_digest(self, values: List[int]) -> None:
        if len(values) > _DIGEST_WORDS - 1:
            raise ValueError("digest too long")
        view = self.unified.control.local[_DIGEST:_DIGEST + 8 * _DIGEST_WORDS].view(torch.int64)
        view.zero_()
        view[0] = len(values)
        view[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)

    def read_digest(self, rank: int) -> List[int]:
        region = self.unified.control.local if rank == self.rank else self.unified.control.peer(rank)
        view = region[_DIGEST:_DIGEST + 8 * _DIGEST_WORDS].view(torch.int64)
        count = int(view[0])
        return view[1:1 + max(0, min(count, _DIGEST_WORDS - 1))].tolist()

    def declare(self, rank: int) -> None:
        if rank not in self.dead and rank != self.rank:
            self.dead.add(rank)
            _native.signal_publish(self.addr(self.rank, _DECL + 8 * rank), self.word(1))

    def declared_by_peer(self, rank: int) -> bool:
        word = self.word(1)
        return any(_native.signal_load(self.addr(peer, _DECL + 8 * rank)) == word
                   for peer in range(self.num_ranks) if peer != rank and peer not in self.dead)

    def check_fence(self) -> None:
        if self.declared_by_peer(self.rank):
            raise SwitchFenced(f"rank {self.rank} was declared dead by a peer during switch {self.seq} "
                               "(it missed a deadline); it must leave the group and rejoin")

    def live_peers(self) -> List[int]:
        return [p for p in range(self.num_ranks) if p != self.rank and p not in self.dead]

    def wait(self, offset: int, value: int, mode: int, peers: Optional[List[int]] = None,
             declare: bool = True) -> List[int]:
        """Wait until every peer's word at `offset` reaches this switch's `value` (mode 1: progress >=,
        mode 0: same switch). Returns the peers that missed the deadline (declared dead if `declare`)."""
        peers = self.live_peers() if peers is None else [p for p in peers if p not in self.dead]

        def between_slices(pending: List[int]) -> List[int]:
            if declare:
                for peer in list(pending):
                    if self.declared_by_peer(peer):  # another survivor already found it dead
                        self.declare(peer)
                        pending.remove(peer)
            self.check_fence()
            return pending

        pending = wait_peer_words(peers, lambda p: self.addr(p, offset), self.word(value), mode, self.timeout_us,
                                  between_slices)
        if declare:
            for peer in pending:
                self.declare(peer)
        return pending


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------

def _digest(unified: UnifiedWeights, kv: Optional[PagedKVCache], source: str, target: str) -> List[int]:
    codes = {EP: 1, TP: 2}
    values = [codes[source], codes[target], unified.num_layers, *unified.shape, unified.num_ranks]
    if kv is None:
        values.append(0)
    else:
        values += [1, *kv.config[:5]]
    return values


def _check_args(buffer, target, unified, kv, timeout_us) -> None:
    if not isinstance(unified, UnifiedWeights):
        raise TypeError(f"weights: expected a UnifiedWeights, got {type(unified).__name__}")
    if target not in LAYOUTS:
        raise ValueError(f"target: expected one of {LAYOUTS}, got {target!r}")
    check_timeout(timeout_us)
    if (unified.rank, unified.num_ranks) != (buffer.rank, buffer.num_ranks):
        raise ValueError(f"weights: built for rank {unified.rank} of {unified.num_ranks}, the buffer is rank "
                         f"{buffer.rank} of {buffer.num_ranks}")
    if unified.layout not in LAYOUTS:
        raise SwitchError(f"weights: layout is {unified.layout!r} after a failed switch; reload the weights")
    if kv is not None:
        if not isinstance(kv, PagedKVCache):
            raise TypeError(f"kv_cache: expected a PagedKVCache or None, got {type(kv).__name__}")
        if kv.layout != unified.layout:
            raise ValueError(f"kv_cache: expected layout {unified.layout!r} (the weights'), got {kv.layout!r}")
        if (kv.rank, kv.num_ranks, kv.transport) != (unified.rank, unified.num_ranks, unified.transport):
            raise ValueError("kv_cache: built on another group or transport than the weights")


def _report(source, target, layout, outcome, reason, start, seq, transport, dead=(), lost=(),
            weights=(0, 0, 0.0), kv=(0, 0, 0.0), prepare_ms=0.0, commit_ms=0.0) -> SwitchReport:
    total = (time.perf_counter() - start) * 1e3
    if outcome != COMPLETED:
        prepare_ms = total
    log.log(logging.WARNING if outcome == REFUSED else logging.INFO,
            "switch #%d %s -> %s: %s in %.1f ms, layout now %s%s%s", seq, source, target, outcome, total, layout,
            f" ({reason})" if reason else "", f", dead ranks {sorted(dead)}" if dead else "")
    return SwitchReport(source, target, layout, outcome, reason, tuple(sorted(dead)), tuple(sorted(lost)),
                        int(weights[0]), int(weights[1]), float(weights[2]), int(kv[0]), int(kv[1]), float(kv[2]),
                        float(prepare_ms), float(commit_ms), total, transport, seq)


def _store_deadline(timeout_us: int) -> Optional[float]:
    """Deadline of one store step of a switch (its decision record), or of one collective on the fallback:
    `timeout_us` from now, None for -1 (then the store's own timeout bounds each call)."""
    return None if timeout_us < 0 else time.monotonic() + timeout_us / 1e6


def _noop(phase: str, index: int) -> None:
    return None


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------

def switch_layout(buffer, target: str, *, weights: UnifiedWeights, kv_cache: Optional[PagedKVCache] = None,
                  timeout_us: int = 30_000_000, on_step: Optional[StepHook] = None) -> SwitchReport:
    """Switch the MoE weights (and the KV cache) of every rank to `target`, all or nothing.

    Every rank of the group calls it with the same arguments between two engine steps. After it
    returns, the views `weights.view(layer, target)` hold the target layout (same addresses as
    always) and `kv_cache` holds the requests in the target layout. A rank already in `target`
    returns "unchanged", still advancing the switch sequence number like its peers; on the one-sided
    transport it also refuses in its words, so a peer in another layout (reloaded after a failed
    switch) refuses at once rather than at its deadline, and the next switch finds every rank in step.

    Arguments:
        buffer: the `mooncake_ep_switch.Buffer` of the group (its rank, size and transport are used).
        target: `"ep"` or `"tp"`.
        weights: the `UnifiedWeights` of this rank.
        kv_cache: the `PagedKVCache` of this rank, or None (weights only).
        timeout_us: deadline of every wait for a peer in microseconds (-1 = none); a peer that
            misses it is treated as dead (one-sided transport). Collective fallback: each gloo
            collective waits at most this long and stops once the peer watcher sees a member end (not
            the group's timeout); before the entry exchange completed the switch is refused naming
            the dead ranks or the deadline (nothing moved), after it `SwitchError` (weights invalid).
        on_step: test/tracing hook called as `on_step(phase, index)` at "enter" (before anything is
            published), "decide" (before this rank's decision is published), "weights" (before step
            `index`), "weights_partial" (after the first remote chunk of step `index`), "kv" (before
            the KV moves) and "commit" (before `DONE`).

    Returns:
        report: a `SwitchReport` (bytes and times of the weight and KV phases, outcome, dead ranks).

    Raises:
        StoreUnavailable: the store (its decision record, or the rendezvous of a collective switch's group of
            the current view) did not answer by `timeout_us`; nothing moved, call again once it answers.
        SwitchError: collective fallback, a member died or stalled after the entry exchange (see above).
    """
    start = time.perf_counter()
    unified, kv = weights, kv_cache
    hook = on_step or _noop
    if not isinstance(unified, UnifiedWeights):
        raise TypeError(f"weights: expected a UnifiedWeights, got {type(unified).__name__}")
    source = unified.layout
    transport = buffer.transport
    if target == source and target in LAYOUTS and (kv is None or kv.layout == source):
        check_timeout(timeout_us)
        unified.seq += 1  # every call advances it: a rank already in `target` stays in step with its peers
        if unified.one_sided:
            _refuse_unchanged(unified, kv, target, timeout_us)
        return _report(source, target, source, UNCHANGED, "", start, unified.seq, transport)
    unified.seq += 1
    seq = unified.seq
    if not unified.one_sided:
        return _switch_collective(buffer, target, unified, kv, timeout_us, start, seq)

    control = _Control(unified, seq, timeout_us)
    # ---- phase 1: entry, plan, decision
    hook("enter", 0)
    try:
        _check_args(buffer, target, unified, kv, timeout_us)
        if unified.dead_ranks:
            raise _Refuse(ABORT_DEAD_RANKS,
                          f"ranks {unified.dead_ranks} died in an earlier switch; recover membership first")
        members = tuple(buffer.members)
        missing = [r for r in range(unified.num_ranks) if r not in members]
        if missing:  # after a shrink or drain: the weights are not re-sharded over a smaller view (docs/resize.md)
            raise _Refuse(ABORT_NOT_MEMBERS, f"ranks {missing} are not members of the current view: a switch needs "
                                             "every rank of the weights (admit their replacements first)")
        control.write_digest(_digest(unified, kv, source, target))
        if kv is not None:
            kv.publish_meta()
        if unified.ballot is not None:
            with store_deadline(_store_deadline(timeout_us), "switch_layout"):  # a stalled store: StoreUnavailable
                unified.ballot.prepare([seq], votes=False)  # the decision slot exists before anyone proposes
    except _Refuse as refusal:
        control.write_digest([])
        control.publish(_PROGRESS, ENTERED)
        control.publish(_DECISION, refusal.code)
        return _report(source, target, source, REFUSED, refusal.reason, start, seq, transport)
    except BaseException:
        control.write_digest([])
        control.publish(_PROGRESS, ENTERED)
        control.publish(_DECISION, ABORT_BAD_ARGUMENTS)
        raise
    control.publish(_PROGRESS, ENTERED)

    decision, reason, plan = GO, "", None
    missing = control.wait(_PROGRESS, ENTERED, 1, declare=False)
    if missing:
        decision, reason = ABORT_LATE_RANK, f"ranks {missing} did not enter the switch within timeout_us={timeout_us}"
    else:
        mine = _digest(unified, kv, source, target)
        others = {p: control.read_digest(p) for p in range(unified.num_ranks)}
        differing = [p for p, d in others.items() if d != mine]
        if differing:
            decision, reason = ABORT_DIFFERENT_CALLS, f"ranks {differing} called with other arguments (digest {others[differing[0]]} vs {mine})"
        elif kv is not None:
            try:
                metas = [kv.read_meta(p) for p in range(unified.num_ranks)]
                plan = kv.plan(metas, target)
            except ValueError as error:
                decision, reason = ABORT_DIFFERENT_CALLS, str(error)
            else:
                if plan.refused:
                    decision, reason = ABORT_KV_DOES_NOT_FIT, plan.refused
    hook("decide", 0)
    control.publish(_DECISION, decision)
    undecided = control.wait(_DECISION, 0, 0, declare=False,
                             peers=[p for p in range(unified.num_ranks) if p not in missing and p != unified.rank])
    if decision == GO:
        aborts = [p for p in range(unified.num_ranks) if p != unified.rank and p not in undecided
                  and _native.signal_load(control.addr(p, _DECISION)) & 0xFFFFFFFF != GO]
        if undecided:
            decision, reason = ABORT_LATE_RANK, f"ranks {undecided} did not decide within timeout_us={timeout_us}"
        elif aborts:
            code = _native.signal_load(control.addr(aborts[0], _DECISION)) & 0xFFFFFFFF
            decision, reason = code, f"rank {aborts[0]} refused: {ABORT_CODES.get(code, 'unknown reason')}"
    if unified.ballot is not None:
        # One decision per switch: the first proposal wins and every rank adopts it. GO is proposed
        # only by a rank that saw every rank's GO, so a rank whose wait for a late peer ended can
        # still be told GO (the peer did decide GO), and a late rank that saw every GO is told
        # ABORT when a rank gave up first: live ranks always end in one layout.
        with store_deadline(_store_deadline(timeout_us), "switch_layout"):  # nothing moved yet if it raises
            final = unified.ballot.propose(seq, decision)
        if final != decision:
            decision = final
            reason = "" if final == GO else (f"another rank decided ABORT first: "
                                             f"{ABORT_CODES.get(final, f'code {final}')}")
    if decision != GO:
        return _report(source, target, source, REFUSED, reason, start, seq, transport)

    # ---- phases 2-4 (nothing may fail silently from here: a failure leaves the layout invalid)
    prepare_ms = (time.perf_counter() - start) * 1e3
    try:
        weight_stats = _weights_one_sided(unified, control, source, target, hook)
        kv_stats = _kv_one_sided(kv, plan, control, hook) if kv is not None else (0, 0, 0.0)
        commit_start = time.perf_counter()
        hook("commit", 0)
        control.publish(_PROGRESS, W0 + unified.num_layers + 2)  # DONE
        control.wait(_PROGRESS, W0 + unified.num_layers + 2, 1)
        control.check_fence()
    except BaseException as error:
        unified.layout = INVALID
        if kv is not None:
            kv.layout = INVALID
        if unified.device is not None:  # nothing this rank queued may land in a peer after it gave up
            try:
                fence(unified.device, DRAIN_TIMEOUT_S)
            except Exception:  # a wedged device: the original error says more
                pass
        if isinstance(error, SwitchError) or not isinstance(error, Exception):
            raise
        raise SwitchError(f"switch {seq} failed on rank {unified.rank} after it started moving data ({error!r}); this "
                          "rank's weights and KV are invalid (the peers treat it as dead and complete)") from error
    unified.layout = target
    dead = sorted(control.dead)
    lost: List[int] = []
    if kv is not None:
        kv.commit(plan)
        if target == EP:
            lost = [rid for rid, owner in plan.owner.items() if owner in control.dead]
    reason = ""
    if dead:
        unified.dead_ranks = dead
        what = (f"requests {lost} were assigned to them and are lost" if target == EP
                else "their weight slice and KV head group are lost until a replacement receives them")
        reason = f"ranks {dead} died during the switch; the survivors completed it from their memory; {what}"
    return _report(source, target, target, COMPLETED, reason, start, seq, transport, dead, lost,
                   weight_stats, kv_stats, prepare_ms, (time.perf_counter() - commit_start) * 1e3)


def _refuse_unchanged(unified: UnifiedWeights, kv: Optional[PagedKVCache], target: str, timeout_us: int) -> None:
    """A rank already in `target` enters the switch in its words and refuses it: a peer that is not
    (it reloaded another layout) refuses at once, naming different calls, instead of at its deadline."""
    control = _Control(unified, unified.seq, timeout_us)
    control.write_digest(_digest(unified, kv, target, target))
    control.publish(_PROGRESS, ENTERED)
    control.publish(_DECISION, ABORT_DIFFERENT_CALLS)


class _Refuse(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


# ------------------------------------------------------------------------------------------------
# One-sided phases
# ------------------------------------------------------------------------------------------------

def _weights_one_sided(unified: UnifiedWeights, control: _Control, source: str, target: str,
                       hook: StepHook) -> Tuple[int, int, float]:
    started = time.perf_counter()
    way = reshard.direction(source, target)
    order = reshard.step_order(way, unified.num_layers)
    me, ranks = unified.rank, unified.num_ranks
    bases = unified.region.peer_bases
    ranges = [(b, b + unified.region_bytes) if b else (0, 0) for b in bases]
    remote = local = 0
    for t, (_, src_slot, dst_slot) in enumerate(order):
        hook("weights", t)
        control.check_fence()

        def push(dest: int) -> int:
            blocks = reshard.slot_chunk_blocks(unified, way, me, dest, unified.peer_slot_base(me, src_slot),
                                               unified.peer_slot_base(dest, dst_slot))
            return reshard.copy(blocks, ranges[dest], ranges[me], unified.device)

        # Our own chunk first: our destination slot is the one we read in step t-1 (no wait).
        local += push(me)
        # Then each peer as soon as its destination slot is free (it sent step t-1), in rotation.
        ready_word = control.word(W0 + t)
        pending = [(me + step) % ranks for step in range(1, ranks)]
        pushed = False
        while True:
            pending = [p for p in pending if p not in control.dead]
            ready = [p for p in pending if t == 0 or _native.signal_load(control.addr(p, _PROGRESS)) >= ready_word]
            for dest in ready:
                remote += push(dest)
                if not pushed:
                    pushed = True
                    hook("weights_partial", t)
            pending = [p for p in pending if p not in ready]
            if not pending:
                break
            control.wait(_PROGRESS, W0 + t, 1, peers=pending[:1])  # declares it dead past the deadline
        control.publish(_PROGRESS, W0 + t + 1)
    control.wait(_PROGRESS, W0 + unified.num_layers, 1)
    control.check_fence()
    # Complete on behalf of dead ranks: their remaining source slots are intact (nobody writes a
    # rank's slot before its progress says it was read), pull our chunk of every step they missed.
    for peer in sorted(control.dead):
        before = control.progress(peer)
        sent = max(0, before - W0)
        for t in range(sent, unified.num_layers):
            _, src_slot, dst_slot = order[t]
            blocks = reshard.slot_chunk_blocks(unified, way, peer, me, unified.peer_slot_base(peer, src_slot),
                                               unified.peer_slot_base(me, dst_slot))
            remote += reshard.copy(blocks, ranges[me], ranges[peer], unified.device)
        if control.progress(peer) != before:
            raise SwitchError(f"rank {peer} was declared dead but kept making progress during the pull of its "
                              f"weights (switch {control.seq}); this rank's weights are inconsistent")
    return remote, local, (time.perf_counter() - started) * 1e3


def _kv_one_sided(kv: PagedKVCache, plan: KVPlan, control: _Control, hook: StepHook) -> Tuple[int, int, float]:
    started = time.perf_counter()
    hook("kv", 0)
    control.check_fence()
    me, ranks = kv.rank, kv.num_ranks
    device = control.unified.device
    # Our own moves first, then each live peer's in rotation: one table for all of them, one part a peer.
    dests = [dest for dest in ((me + step) % ranks for step in range(ranks)) if dest not in control.dead]
    blocks, bounds = kv.peer_blocks(plan.moves, dests, True)
    mine = kv.region_range(me)
    moved = copy_block_parts(blocks, [(bounds[i], bounds[i + 1], kv.region_range(dest), mine)
                                      for i, dest in enumerate(dests)], device)
    local = moved[0] if dests[0] == me else 0
    remote = sum(moved) - local
    kv_sent = W0 + control.unified.num_layers + 1
    control.publish(_PROGRESS, kv_sent)
    control.wait(_PROGRESS, kv_sent, 1)
    control.check_fence()
    # Moves from dead ranks: their source units are never written during a switch; pull them.
    if control.dead:
        sources = sorted(control.dead)
        blocks, bounds = kv.peer_blocks(plan.moves, sources, False)
        remote += sum(copy_block_parts(blocks, [(bounds[i], bounds[i + 1], mine, kv.region_range(peer))
                                                for i, peer in enumerate(sources)], device))
    return remote, local, (time.perf_counter() - started) * 1e3


# ------------------------------------------------------------------------------------------------
# Collective fallback
# ------------------------------------------------------------------------------------------------

def _switch_collective(buffer, target: str, unified: UnifiedWeights, kv: Optional[PagedKVCache], timeout_us: int,
                       start: float, seq: int) -> SwitchReport:
    source = unified.layout
    transport = buffer.transport
    group_timeout_s = timeout_us / 1e6 if isinstance(timeout_us, int) and timeout_us > 0 else 300.0
    with store_deadline(_store_deadline(timeout_us), "switch_layout"):  # a group built through a stalled store:
        group, refusal = switch_group(buffer, unified, group_timeout_s)  # StoreUnavailable by the deadline
    if group is None:  # the same view (and, once seen, the same dead) everywhere: every rank refuses, nothing moved
        return _report(source, target, source, REFUSED, refusal, start, seq, transport)
    abandoned = abandoned_reason(group)
    if abandoned is not None:  # a collective on it was given up on (group_wait): the next view has a new one
        return _report(source, target, source, REFUSED, f"the group of the current view (epoch {buffer.epoch}) is not "
                       f"usable after an earlier failure ({abandoned}); call update_ep_member() first", start, seq,
                       transport)
    if kv is not None:  # the KV cache moves on the same group (its own is the constructor's, or none)
        kv.group = group
    # Every collective below waits at most timeout_us (and stops once the peer watcher sees a member end), not
    # the group's timeout: a member that died unseen or stalled otherwise kept a survivor in gloo for it.
    wait = _bounded_wait(buffer, unified, group, timeout_us)
    try:  # a local argument error still takes part in the exchange, so that the peers refuse too
        _check_args(buffer, target, unified, kv, timeout_us)
        local_error = None
        mine = (_digest(unified, kv, source, target), kv.encode_meta() if kv is not None else None)
    except Exception as error:
        local_error, mine = error, ([], None)
    try:
        gathered = gather_objects(mine, group, _store_deadline(timeout_us), buffer, range(unified.num_ranks),
                                  "switch_layout", unified)
    except (MembershipError, TimeoutError, RuntimeError) as error:  # nothing moved on this rank
        return _report(source, target, source, REFUSED, f"the entry exchange failed: {error}", start, seq, transport)
    if local_error is not None:
        raise local_error
    digests = [g[0] for g in gathered]
    if any(d != digests[0] for d in digests):
        return _report(source, target, source, REFUSED, f"ranks called with other arguments: {digests}", start,
                       seq, transport)
    plan = None
    if kv is not None:
        try:
            plan = kv.plan([kv.decode_meta(g[1]) for g in gathered], target)
        except ValueError as error:  # a rank's corrupt metadata: every rank refuses alike
            return _report(source, target, source, REFUSED, str(error), start, seq, transport)
        if plan.refused:
            return _report(source, target, source, REFUSED, plan.refused, start, seq, transport)
    prepare_ms = (time.perf_counter() - start) * 1e3
    try:
        started = time.perf_counter()
        way = reshard.direction(source, target)
        staging = torch.empty(unified.slot_bytes, dtype=torch.uint8)
        sent = 0
        for layer, _, _ in reshard.step_order(way, unified.num_layers):
            sent += reshard.collective_layer(unified, way, layer, staging, wait)
        weight_stats = (sent, unified.layer_bytes * unified.num_layers // unified.num_ranks,
                        (time.perf_counter() - started) * 1e3)
        kv_stats = _kv_collective(kv, plan, wait) if kv is not None else (0, 0, 0.0)
    except Exception as error:
        unified.layout = INVALID
        if kv is not None:
            kv.layout = INVALID
        raise SwitchError(f"switch {seq} failed on the collective transport ({error}); a peer failure cannot be "
                          "survived there: weights and KV of this rank are invalid, reload them") from error
    commit_start = time.perf_counter()
    unified.layout = target
    if kv is not None:
        kv.commit(plan)
    return _report(source, target, target, COMPLETED, "", start, seq, transport, weights=weight_stats, kv=kv_stats,
                   prepare_ms=prepare_ms, commit_ms=(time.perf_counter() - commit_start) * 1e3)


def _bounded_wait(buffer, unified: UnifiedWeights, group, timeout_us: int) -> Callable[[object], None]:
    """How a collective switch waits for one gloo work on `group`: `group_wait.wait_work` with `timeout_us` from
    the wait's start (each wait of the one-sided path has the same deadline)."""
    members = range(unified.num_ranks)

    def wait(work) -> None:
        wait_work(work, group, _store_deadline(timeout_us), buffer, members, "switch_layout", unified)

    return wait


def _kv_collective(kv: PagedKVCache, plan: KVPlan, wait: Callable[[object], None]) -> Tuple[int, int, float]:
    started = time.perf_counter()
    me, ranks = kv.rank, kv.num_ranks
    moves = plan.moves
    pool = kv.pool_base(me)
    region = kv.region_range(me)
    send_parts, send_sizes, recv_sizes, recv_moves = [], [], [], []
    sends, receives = moves_by_peer(moves, me, True, ranks), moves_by_peer(moves, me, False, ranks)
    for dest in range(ranks):
        out, inc = sends[dest], receives[dest]
        send_parts.append(out)
        recv_moves.append(inc)
        send_sizes.append(kv.packed_blocks(out, pool, 0, True)[1])
        recv_sizes.append(kv.packed_blocks(inc, pool, 0, False)[1])
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    at = 0
    for dest in range(ranks):
        blocks, size = kv.packed_blocks(send_parts[dest], pool, send.data_ptr() + at, True)
        reshard.copy(blocks, (send.data_ptr(), send.data_ptr() + send.numel()), region)
        at += size
    # The group's own call: a per-view group is not registered in torch (all_to_all_single refuses it).
    wait(kv.group.alltoall_base(recv, send, recv_sizes, send_sizes, dist.AllToAllOptions()))
    at = 0
    for src in range(ranks):
        blocks, size = kv.packed_blocks(recv_moves[src], pool, recv.data_ptr() + at, False)
        reshard.copy(blocks, region, (recv.data_ptr(), recv.data_ptr() + recv.numel()))
        at += size
    remote = sum(s for d, s in enumerate(send_sizes) if d != me)
    return remote, send_sizes[me], (time.perf_counter() - started) * 1e3


register_layout_switch(switch_layout)  # Buffer.switch_layout(target, ...) calls switch_layout(buffer, target, ...)
