"""Online rebalance: move physical experts to a new placement while serving continues.

Every rank calls `begin(new_phy2log, commit_step)` with the same plan (the controller, e.g. rank 0
or the engine's scheduler, computed it from the recorded loads), then `step(step)` once per serving
step. The plan touches only the slots whose logical expert changes. Layers move in chunks whose
changed slots fit the spare frames of every rank (`ExpertSlots.spare_frames`); chunk `c` commits at
step `commit_step + c * steps_per_chunk`.

Staging. Between begin and a chunk's commit step, each `step()` pulls at most `frames_per_step`
changed slots of this rank: the new logical expert's weights are copied from a rank that holds a
copy in the *old* placement into one of this rank's free frames. The holder is this rank if it
has a copy, else the least-used holder of this host (a copy through the shared mapping), else the
least-used holder on another host (one-sided Transfer Engine reads of its frame-table entry and
frame, `ExpertSlots.read_remote_frame`; ranks of several hosts, the `"mooncake"` transport).
Nothing that serves is written: dispatch/combine keep running on the old placement. A holder whose
slots are not loaded yet (`ExpertSlots.load` has not finished there: loading is not collective) is
never read: its move waits for a later step, and at the commit step for the holder, up to half of
`timeout_us` (past it this rank votes ABORT, naming the holder).

Commit (at the chunk's commit step, before the step's forward). A rank finishes its staging (the
only stall, bounded by `frames_per_step` having done most of it), then publishes its vote with the
chunk's plan digest (GO, or ABORT when staging failed or `active_ranks` shows a dead rank). The
outcome is then decided once for every rank by a *decision record* per epoch, set by
compare-and-set from "undecided" (`buffer.ballot`: votes and decisions live in the job's store,
which the launcher hosts and which outlives every rank; one protocol on one host and across
hosts): a rank that voted GO waits for every peer's vote with the deadline `timeout_us` and
proposes COMMIT only if every rank voted GO with the same digest, ABORT otherwise (a vote missing
at its deadline, a peer whose process the Buffer saw end (`Buffer.dead_peers()`, it will never
vote), an ABORT vote, a different digest); a rank that voted ABORT proposes ABORT at once. The
first proposal stored wins; every rank, the proposer included, adopts the stored value, never its
own view of the votes. On COMMIT it points the changed slots' frame-table entries at the staged
frames and frees the old ones (no copy); on ABORT the staged frames are freed, the old placement
stays in force, and the rest of the rebalance is dropped. So all ranks end on the same placement
whatever is slow or dead: a rank frozen past its peers' deadline (before or after voting) adopts,
when it wakes, what they decided without it; a rank that dies before voting makes every survivor
abort, one that dies after voting GO lets the chunk commit everywhere (its slots are lost either
way, as they were in the old placement). No rank holds the decision, so any rank may die. Limits:
a rank that falls 256 epochs behind (its decision slot reused) raises instead of guessing; the
rebalance needs the Buffer's store (`ExpertSlots.ballot`). Ranks that called `begin` with different
arguments abort at the first commit step, told which argument differs, and the next `begin` numbers
every rank's chunks alike again (`eplb.epochs`).
"""
import logging
import time
import weakref
import zlib
from collections import deque
from typing import Deque, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from mooncake_ep_switch.buffer.device_region import copy_blocks, fence
from mooncake_ep_switch.buffer.membership.store_deadline import store_deadline
from mooncake_ep_switch.config import settings
from mooncake_ep_switch.checks import check_int, check_timeout
from mooncake_ep_switch.eplb import epochs
from mooncake_ep_switch.eplb.coverage import check_live_target, load_frame
from mooncake_ep_switch.eplb.live import alive_ranks
from mooncake_ep_switch.eplb.slots import ExpertSlots, check_phy2log
from mooncake_ep_switch.errors import SlotsNotLoaded
from mooncake_ep_switch.faults import FaultPoint

GO, ABORT = 1, 2
DECIDE_COMMIT, DECIDE_ABORT = 1, 2
COMMITTED = "committed"
ABORTED = "aborted"

_NOT_LOADED_POLL_S = 0.01  # the commit step's retry of a source whose slots are still loading

log = logging.getLogger("mooncake_ep_switch.eplb")


class RebalanceChunk(NamedTuple):
    """Layers that commit together.

    Fields:
        epoch: agreement number of this chunk (the same on every rank).
        layers: MoE layers of the chunk.
        commit_step: serving step at whose start the chunk commits.
        moves: `[n, 3]` int64 rows `(layer, local_slot, new_logical_expert)`, this rank's changed slots.
        target: `[len(layers), R * slots_per_rank]` int64, the new placement of the chunk's layers.
        digest: 31-bit checksum of `epoch`, `layers`, `target` and the plan's arguments and base
            epoch (compared between ranks).
    """

    epoch: int
    layers: Tuple[int, ...]
    commit_step: int
    moves: np.ndarray
    target: np.ndarray
    digest: int


class RebalanceReport(NamedTuple):
    """What a chunk's commit step did on this rank.

    Fields:
        epoch: the chunk's epoch.
        layers: its MoE layers.
        outcome: `"committed"` (new placement in force) or `"aborted"` (old placement kept).
        reason: why it aborted ("" when committed).
        moved_slots: slots of this rank that changed their logical expert (staged).
        moved_bytes: weight bytes this rank copied into its frames (from peers or itself).
        remote_bytes: the part of `moved_bytes` read from other ranks.
        te_bytes: the part of `remote_bytes` read over the Transfer Engine (from another host).
        stage_ms: staging time spent in `step()` calls before and at the commit step.
        stall_ms: time of the commit step's own work (finishing staging, vote, wait, commit).
        commit_step: the step at which it committed or aborted.
        loaded_bytes: weight bytes this rank copied from the `loader` (a coverage epoch's experts
            that no live rank held).
    """

    epoch: int
    layers: Tuple[int, ...]
    outcome: str
    reason: str
    moved_slots: int
    moved_bytes: int
    remote_bytes: int
    te_bytes: int
    stage_ms: float
    stall_ms: float
    commit_step: int
    loaded_bytes: int = 0


class _Staging:
    """Progress of the chunk at the head of the queue."""

    def __init__(self, chunk: RebalanceChunk):
        self.chunk = chunk
        self.next_move = 0
        self.frames: List[int] = []  # staged frame of each move done so far
        self.moved_bytes = 0
        self.remote_bytes = 0
        self.te_bytes = 0
        self.loaded_bytes = 0
        self.stage_ms = 0.0
        self.error = ""


class OnlineRebalancer:
    """Moves this rank's physical experts to a new placement in chunks, committed at agreed steps.

    Arguments:
        slots: this rank's `ExpertSlots`.
        timeout_us: deadline of the vote wait at a commit step, in microseconds (-1: none); a peer
            that has not voted by then makes this rank propose ABORT. Every rank adopts the one
            decision stored for the chunk (see the module docstring), so a rank that is merely late
            follows what the others decided. Also the deadline of each Transfer Engine read while
            staging from a holder on another host (30 s when -1).
        frames_per_step: slots staged per `step()` before the commit step (bounds the per-step work).
        epoch: chunk epochs already used (a replacement rank passes the survivors'
            `rebalancer.epoch`). The count lives on `slots`, shared by every rebalancer of them,
            and never goes back: the larger of this and the slots' count is used.
    """

    def __init__(self, slots: ExpertSlots, *, timeout_us: int = 5_000_000, frames_per_step: int = 2,
                 epoch: int = 0):
        if not isinstance(slots, ExpertSlots):
            raise TypeError(f"slots: expected an ExpertSlots, got {type(slots).__name__}")
        if slots.ballot is None:
            raise ValueError("slots: the online rebalance keeps its votes and decisions in the group's store; "
                             "expected ExpertSlots on a Buffer with a store (pass store= to Buffer, or initialise "
                             "torch.distributed with a store)")
        timeout_us = check_timeout(timeout_us)
        self.slots = slots
        self.timeout_us = timeout_us
        self.frames_per_step = check_int("frames_per_step", frames_per_step, 1)
        slots.chunk_epoch = max(slots.chunk_epoch, check_int("epoch", epoch, 0))
        self._queue: Deque[RebalanceChunk] = deque()
        self._staging: Optional[_Staging] = None
        self._plan: Optional[epochs.Plan] = None  # the plan of the chunks in the queue
        self._live: Optional[np.ndarray] = None  # a coverage epoch's voting ranks ([R] bool), None: all
        self._loader = None
        self._holder_use = np.zeros(slots.num_ranks, dtype=np.int64)
        self._fault = FaultPoint.parse(settings().fault_point)

    @property
    def epoch(self) -> int:
        """Chunk epochs used so far on this rebalancer's slots (by any rebalancer of them).

        Returns:
            epoch: int, the last chunk epoch planned (0 before any).
        """
        return self.slots.chunk_epoch

    @property
    def in_progress(self) -> bool:
        """True while chunks of a rebalance wait to commit.

        Returns:
            busy: bool, True while `pending_chunks()` is non-empty (`begin` then raises).
        """
        return bool(self._queue)

    def pending_chunks(self) -> Tuple[RebalanceChunk, ...]:
        """Chunks not yet committed or aborted, in commit order.

        Returns:
            chunks: tuple of `RebalanceChunk`.
        """
        return tuple(self._queue)

    # ------------------------------------------------------------------ planning
    def begin(self, new_phy2log, commit_step: int, *, steps_per_chunk: int = 1, live=None,
              loader=None) -> Tuple[RebalanceChunk, ...]:
        """Start moving to `new_phy2log`; every rank calls it with the same arguments.

        Arguments:
            new_phy2log: `[L, R * slots_per_rank]` integer torch tensor or numpy array, the target
                placement (a copy of every logical expert, no two copies of one expert on one rank).
            commit_step: serving step at whose start the first chunk commits (staging runs in the
                `step()` calls before it).
            steps_per_chunk: steps between the commits of consecutive chunks, >= 1.
            live: `[R]` 0/1 torch tensor or numpy array, the ranks taking part (a coverage epoch while
                a rank is dead, `eplb.coverage`), or None (every rank). Only they stage and vote; a
                0 rank's slots must stay as they are and every expert needs a copy on a 1 rank.
                Every live rank passes the same mask (it is part of the plan's digest).
            loader: `loader(layer, expert) -> (gate_up [2I, H], down [H, I])` torch.bfloat16, the
                checkpoint's weights of an expert no live rank holds (None: its staging fails).

        Returns:
            chunks: the `RebalanceChunk`s, in commit order (empty when nothing changes). They are
                numbered from the largest chunk epoch this rank or a peer passed (`eplb.epochs`),
                so ranks whose counts diverged number alike again; a peer that planned from other
                arguments makes the first commit step abort on every rank, naming the argument.
        """
        if self._queue:
            raise RuntimeError(f"begin: a rebalance is in progress ({len(self._queue)} chunks left); wait for it")
        slots = self.slots
        other = slots.active_rebalancer() if slots.active_rebalancer is not None else None
        if other is not None and other is not self and other.in_progress:
            raise RuntimeError("begin: another OnlineRebalancer of these slots has a rebalance in progress "
                               f"({len(other.pending_chunks())} chunks left); one rebalance at a time per ExpertSlots")
        shape = slots.shape
        target = check_phy2log("new_phy2log", new_phy2log, shape.num_layers, slots.num_slots,
                               shape.num_logical_experts, shape.slots_per_rank)
        slots.check_primaries("new_phy2log", target)
        if live is not None:
            live = alive_ranks("live", live, slots.num_ranks)
            if not live[slots.rank]:
                raise ValueError(f"live: expected this rank ({slots.rank}) among the live ranks, got {live.astype(int).tolist()}")
            check_live_target(target, slots.phy2log, live, shape.slots_per_rank, shape.num_logical_experts)
        if loader is not None and not callable(loader):
            raise TypeError(f"loader: expected a callable(layer, expert) or None, got {type(loader).__name__}")
        commit_step = check_int("commit_step", commit_step, 0)
        steps_per_chunk = check_int("steps_per_chunk", steps_per_chunk, 1)
        per_rank = shape.slots_per_rank
        changed = target != slots.phy2log  # [L, S]
        per_rank_changes = changed.reshape(shape.num_layers, slots.num_ranks, per_rank).sum(axis=2)  # [L, R]
        too_many = per_rank_changes > slots.spare_frames
        if too_many.any():
            layer, rank = (int(v[0]) for v in np.nonzero(too_many))
            raise ValueError(f"new_phy2log: layer {layer} changes {int(per_rank_changes[layer, rank])} slots of rank "
                             f"{rank}, more than its spare_frames={slots.spare_frames}; build the ExpertSlots "
                             "with more spare frames")
        slots.ballot.prepare((), votes=True)  # the vote keys exist before they are read
        digest_of_target = epochs.target_digest(target)
        if live is not None:  # ranks that disagree on who takes part differ in the plan's digest
            digest_of_target = zlib.crc32(live.tobytes(), digest_of_target) & 0x7FFFFFFF
        slots.chunk_epoch = epochs.agreed_base(slots.ballot, slots.chunk_epoch,
                                               (digest_of_target, commit_step, steps_per_chunk))
        base = self.epoch
        chunks: List[RebalanceChunk] = []
        layers: List[int] = []
        load = np.zeros(slots.num_ranks, dtype=np.int64)

        def close() -> None:
            if not layers:
                return
            epoch = self.epoch + len(chunks) + 1
            rows = [(layer, s - slots.rank * per_rank, int(target[layer, s]))
                    for layer in layers for s in np.nonzero(changed[layer])[0]
                    if s // per_rank == slots.rank]
            moves = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
            header = [epoch, *layers, base, digest_of_target, commit_step, steps_per_chunk]
            digest = zlib.crc32(np.ascontiguousarray(target[layers]).tobytes(),
                                zlib.crc32(np.asarray(header, dtype=np.int64).tobytes())) & 0x7FFFFFFF
            chunks.append(RebalanceChunk(epoch, tuple(layers), commit_step + len(chunks) * steps_per_chunk,
                                         moves, target[layers].copy(), digest))
            layers.clear()
            load[:] = 0

        for layer in range(shape.num_layers):
            if not changed[layer].any():
                continue
            if ((load + per_rank_changes[layer]) > slots.spare_frames).any():
                close()
            layers.append(layer)
            load += per_rank_changes[layer]
        close()
        slots.ballot.prepare((c.epoch for c in chunks), votes=False)  # every key the commit steps read exists
        slots.chunk_epoch += len(chunks)
        self._plan = epochs.Plan(base, slots.chunk_epoch, digest_of_target, commit_step, steps_per_chunk)
        slots.active_rebalancer = weakref.ref(self)
        self._live, self._loader = live, loader
        self._queue.extend(chunks)
        self._staging = None
        return tuple(chunks)

    # ------------------------------------------------------------------ serving-loop hook
    def step(self, step: int, active_ranks: Optional[torch.Tensor] = None) -> List[RebalanceReport]:
        """Do this step's part of the rebalance; call at the start of every serving step, on every rank.

        Arguments:
            step: the serving step about to run (the same numbering on every rank).
            active_ranks: `[R]` torch.int32, the caller's mask (a 0 entry makes this rank vote ABORT),
                or None.

        Returns:
            reports: a `RebalanceReport` for every chunk that committed or aborted at this step
                (after an abort, one for each dropped chunk too).
        """
        reports: List[RebalanceReport] = []
        while self._queue:
            head = self._queue[0]
            if self._staging is None or self._staging.chunk is not head:
                self._staging = _Staging(head)
            if step < head.commit_step:
                self._stage(self._staging, self.frames_per_step)
                break
            report = self._commit(self._staging, step, active_ranks)
            reports.append(report)
            self._queue.popleft()
            self._staging = None
            if report.outcome == ABORTED:
                for dropped in self._queue:
                    reports.append(RebalanceReport(dropped.epoch, dropped.layers, ABORTED,
                                                   f"dropped after epoch {head.epoch} aborted", 0, 0, 0, 0, 0.0, 0.0,
                                                   step))
                self._queue.clear()
                break
            if self._queue and self._queue[0].commit_step > step:
                break
        return reports

    # ------------------------------------------------------------------ internals
    def _source(self, layer: int, expert: int, active: Optional[np.ndarray]) -> Tuple[int, int]:
        """(rank, local slot) holding `expert` of `layer` in the current placement: this rank, else the
        least-used reachable holder of this host (mapped), else the least-used one of another host."""
        slots = self.slots
        per_rank = slots.shape.slots_per_rank
        holders = np.nonzero(slots.phy2log[layer] == expert)[0]
        if self._live is not None:  # a coverage epoch: live holders only, none: the loader
            holders = holders[self._live[holders // per_rank]]
            if not holders.size:
                return -1, -1
        ranks = holders // per_rank
        mine = holders[ranks == slots.rank]
        if mine.size:
            return slots.rank, int(mine[0] % per_rank)
        reachable = [int(s) for s in holders if slots.is_reachable(int(s) // per_rank)]
        if not reachable:
            raise RuntimeError(f"no holder of logical expert {expert} of layer {layer} is reachable (holders: ranks "
                               f"{sorted(set(ranks.tolist()))})")
        if active is not None:
            alive = [s for s in reachable if active[s // per_rank] != 0]
            reachable = alive or reachable
        local = [s for s in reachable if slots.is_mapped(s // per_rank)]
        best = min(local or reachable, key=lambda s: (self._holder_use[s // per_rank], s))
        self._holder_use[best // per_rank] += 1
        return best // per_rank, best % per_rank

    def _store_step(self):
        """Deadline of one store step of a commit (vote, vote wait, decision): `timeout_us` from now; with -1
        none of its own (the store's timeout bounds each call). Raised past it: `StoreUnavailable`, the chunk
        stays queued and the next `step()` commits it with the decision the peers stored."""
        return store_deadline(None if self.timeout_us < 0 else time.monotonic() + self.timeout_us / 1e6,
                              "an online EPLB commit")

    def _read_timeout_s(self) -> float:
        return 30.0 if self.timeout_us < 0 else max(0.05, self.timeout_us / 1e6)

    def _stage(self, staging: _Staging, budget: int, active: Optional[np.ndarray] = None,
               wait_s: Optional[float] = None) -> None:
        """Stage up to `budget` moves of `staging`. A source whose slots are not loaded yet (`SlotsNotLoaded`:
        nothing was read) stops this step's staging (None `wait_s`, a step before the commit) or is tried
        again until it is loaded, up to `wait_s` seconds (the commit step; past it the chunk aborts)."""
        if staging.error:
            return
        slots = self.slots
        started = time.perf_counter()
        deadline = None if wait_s is None else time.monotonic() + wait_s
        moves = staging.chunk.moves
        try:
            while staging.next_move < moves.shape[0] and budget > 0:
                layer, _, expert = (int(v) for v in moves[staging.next_move])
                src_rank, src_slot = self._source(layer, expert, active)
                frame = slots.take_free_frame()
                staging.frames.append(frame)
                try:
                    self._copy(staging, frame, layer, expert, src_rank, src_slot)
                except SlotsNotLoaded as error:  # nothing was read into the frame: it is free again
                    slots.free_frames.append(staging.frames.pop())
                    if 0 <= src_rank != slots.rank:
                        self._holder_use[src_rank] -= 1  # not used: `_source` counted it
                    if deadline is None:
                        break
                    if time.monotonic() >= deadline:
                        raise SlotsNotLoaded(f"{error} within {wait_s:g} s", error.rank) from None
                    time.sleep(_NOT_LOADED_POLL_S)
                    continue
                staging.next_move += 1
                budget -= 1
        except Exception as error:  # a staging failure votes ABORT; nothing that serves was touched
            staging.error = f"staging failed on rank {slots.rank}: {error}"
        staging.stage_ms += (time.perf_counter() - started) * 1e3

    def _copy(self, staging: _Staging, frame: int, layer: int, expert: int, src_rank: int, src_slot: int) -> None:
        """Copy `expert` of `layer` into this rank's `frame` from (`src_rank`, `src_slot`) or the loader (-1)."""
        slots = self.slots
        if src_rank < 0:  # no live copy anywhere: the checkpoint
            load_frame(slots, self._loader, frame, layer, expert)
            staging.loaded_bytes += slots.frame_bytes
        elif slots.is_mapped(src_rank):
            blocks, src_range = slots.source_blocks(frame, src_rank, layer, src_slot)
            copy_blocks(blocks, slots.region_range(slots.rank), src_range, slots.device)
        else:  # a holder on another host: one-sided Transfer Engine reads
            slots.read_remote_frame(frame, src_rank, layer, src_slot, self._read_timeout_s())
            staging.te_bytes += slots.frame_bytes
        staging.moved_bytes += slots.frame_bytes
        if 0 <= src_rank != slots.rank:
            staging.remote_bytes += slots.frame_bytes

    def _commit(self, staging: _Staging, step: int, active_ranks: Optional[torch.Tensor]) -> RebalanceReport:
        slots = self.slots
        chunk = staging.chunk
        started = time.perf_counter()
        active = None
        if active_ranks is not None:
            if (not isinstance(active_ranks, torch.Tensor) or active_ranks.dtype != torch.int32
                    or tuple(active_ranks.shape) != (slots.num_ranks,)):
                raise ValueError(f"active_ranks: expected a [{slots.num_ranks}] torch.int32 tensor, got "
                                 f"{getattr(active_ranks, 'shape', type(active_ranks).__name__)}")
            active = active_ranks.cpu().numpy().copy()
        # A holder still loading is waited for half the vote's deadline: this rank's ABORT naming it then reaches
        # the peers before their own wait for its vote ends (they would abort with "did not vote" instead).
        self._stage(staging, chunk.moves.shape[0], active, wait_s=self._read_timeout_s() / 2)
        if not staging.error:
            try:  # a GO says this rank's frames are complete: device copies must have landed
                fence(slots.device, self._read_timeout_s())
            except TimeoutError as error:
                staging.error = f"staging failed on rank {slots.rank}: {error}"
        reason = staging.error
        inactive = [] if active is None else [r for r in np.nonzero(active == 0)[0].tolist()
                                                if self._live is None or self._live[r]]
        if not reason and inactive:  # a coverage epoch's excluded ranks are no reason
            reason = f"ranks {inactive} are inactive in active_ranks on rank {slots.rank}"
        vote = ABORT if reason else GO
        me = slots.rank
        if self._fault is not None:
            self._fault.hit("eplb_before_vote", me, chunk.epoch)
        with self._store_step():  # each store step ends by timeout_us (a stalled store host: StoreUnavailable)
            voters = [r for r in range(slots.num_ranks) if self._live is None or self._live[r]]  # last GO of all: COMMIT
            slots.ballot.vote(chunk.epoch, vote, chunk.digest, tuple(self._plan), len(voters), voters if vote == GO else None)
        if self._fault is not None:
            self._fault.hit("eplb_after_vote", me, chunk.epoch)
        if vote == GO:
            with self._store_step():
                reason = self._collect_votes(chunk)
        with self._store_step():  # a budget of its own: a rank frozen past the vote wait still adopts the decision
            decision = slots.ballot.propose(chunk.epoch, DECIDE_ABORT if reason else DECIDE_COMMIT)
        if decision == DECIDE_COMMIT and vote != GO:  # impossible: a COMMIT needs this rank's GO
            raise RuntimeError(f"online EPLB: epoch {chunk.epoch} was decided COMMIT although rank {me} voted ABORT")
        if decision == DECIDE_ABORT and not reason:
            reason = f"epoch {chunk.epoch} was aborted by a peer (a vote missed its deadline or a rank voted ABORT)"
        if decision == DECIDE_COMMIT:
            reason = ""
        if reason:
            slots.free_frames.extend(staging.frames)
            outcome = ABORTED
        else:
            for (layer, local_slot, expert), frame in zip(chunk.moves.tolist(), staging.frames):
                slots.free_frames.append(int(slots.frame_of[layer, local_slot]))
                slots.frame_of[layer, local_slot] = frame
            slots.phy2log[list(chunk.layers)] = chunk.target  # every rank's rows: the digests matched
            slots.publish_table()
            slots.version += 1
            outcome = COMMITTED
            if self._live is not None and len(self._queue) == 1:  # the coverage plan's last chunk
                slots.coverage.committed(chunk.epoch, chunk.layers, self._live)
        log.log(logging.WARNING if reason else logging.INFO, "rank %d: rebalance epoch %d of layers %s %s at step %d "
                "(%d experts moved)%s", me, chunk.epoch, list(chunk.layers), outcome, step, int(chunk.moves.shape[0]),
                f": {reason}" if reason else "")
        return RebalanceReport(chunk.epoch, chunk.layers, outcome, reason, int(chunk.moves.shape[0]),
                               staging.moved_bytes, staging.remote_bytes, staging.te_bytes, staging.stage_ms,
                               (time.perf_counter() - started) * 1e3, step, staging.loaded_bytes)

    def _collect_votes(self, chunk: RebalanceChunk) -> str:
        """Wait for every peer's vote on `chunk`; "" when all voted GO with our digest, else why not.

        The wait ends early when the epoch is already decided (it can only be ABORT then), when a
        peer votes ABORT, or when a peer's process is seen to end (`Buffer.dead_peers()`). Unless
        every peer voted GO, the peers' records are read once more to name a plan or numbering of
        the chunks that differs from this rank's (`eplb.epochs`)."""
        slots = self.slots
        peers = [p for p in range(slots.num_ranks) if p != slots.rank and (self._live is None or self._live[p])]

        def ended(pending: List[int]) -> List[int]:
            return sorted(set(pending) & set(slots.dead_peers()))

        votes, gone, decided = slots.ballot.wait_votes(peers, chunk.epoch, self.timeout_us, ended)
        reason = self._vote_reason(chunk, peers, votes, gone, decided)
        if reason:
            records = slots.ballot.records(peers)
            named = epochs.difference(chunk.epoch, self._plan, records)
            hint = "" if named else epochs.behind_hint(self._plan, records, [p for p in peers if p not in votes])
            reason = named or (f"{reason}; {hint}" if hint else reason)
        return reason

    def _vote_reason(self, chunk: RebalanceChunk, peers: List[int], votes, gone: List[int],
                     decided: Optional[int]) -> str:
        for peer in peers:
            if peer in votes and votes[peer][0] != GO:
                return f"rank {peer} voted to abort epoch {chunk.epoch}"
        pending = [p for p in peers if p not in votes]
        if gone:
            return f"ranks {gone} ended (their process is gone) before voting on epoch {chunk.epoch}"
        if decided is not None and pending:
            return f"ranks {pending} did not vote on epoch {chunk.epoch} before a peer decided it (ABORT)"
        if pending:
            return f"ranks {pending} did not vote on epoch {chunk.epoch} within timeout_us={self.timeout_us}"
        for peer in peers:
            digest = votes[peer][1]
            if digest != chunk.digest:
                return f"rank {peer} planned epoch {chunk.epoch} differently (digest {digest:#x} vs {chunk.digest:#x})"
        return ""
