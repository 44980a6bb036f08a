"""Growing the EP group with new processes (scale-up): the next Buffer of a larger group, one agreed step.

Resizing is a new generation of the group (docs/recovery.md, "Growing the group"): the `M` members of the
current view and the newcomers build the next Buffer over a new process group of `R'` ranks, while the
members' current Buffer keeps serving, and every rank moves to it at one step the members agree on.

Rank ids of the grown group are dense: the members take ids `0 .. M-1` in the order of their current ids
and the newcomers `[M, R')`. Without a shrink before (`M` = the group's size `R`) every member keeps its
id; after one, the view has holes (the removed ids) and the survivors are renumbered: 5 ranks, rank 2
removed, grown to 6: old ranks 0, 1, 3, 4 are ranks 0, 1, 2, 3 of the grown group, the newcomers 4 and 5.
(The grown Buffer is a fresh group: nothing of the old ids is left in it, no hole, no removed rank.) In order:

1. **Request** (every member, between steps, `GrowOperation`): checks (the size `R'` in `(M, MAX_EP_RANKS]`,
   no other resize of this Buffer in progress: `resize_guard`), then the request is claimed in the store
   (`<group>/grow/request`, compare-and-set from absent): `attempt|M|R'|bytes|transport`, then
   `|view=<ids>` when the view has holes and `|fallback` when the members' calls run on the collective
   fallback (`_use_fallback` set on a Buffer of another transport: every rank of the grown group sets it on
   its new Buffer too). A member whose request differs (another size, buffer size, transport, view or
   fallback: two resizes at once) is refused by name, nothing changed. Attempts are numbered so that a grow
   that failed can be asked again.
2. **Newcomers** (`join_grow`): read the request, check their rank, `num_ranks` and `num_ep_buffer_bytes`
   against it, and record "ready to build" (with the process's pid and a nonce: a second newcomer of one
   rank, or a call again of one that gave up, is refused by name) or their refusal
   (`<group>/grow/<attempt>/newcomer/<rank>`): a refused newcomer raises by name and the grow fails on every
   member (`grow/<attempt>/failed`), whose current Buffer goes on serving. Once every newcomer accepted, the
   members say "go" (`grow/<attempt>/build`).
3. **Build** (a background thread on members, in line on newcomers): a gloo group of the `R'` ranks
   through the store (`grow/<attempt>/pg`), `Buffer(group, bytes, transport=, store=)` keyed under
   `grow/<attempt>/buffer` (generation 1 of a group of its own; `_use_fallback` set as the members' is),
   then the caller's `build(buffer)` (the
   expert slots of the new placement and their weights: `eplb.grow_placement.grow_slots`), then a barrier of
   the `R'` ranks: once it returns on a member, every newcomer is built and loaded (a count in the store,
   `grow/<attempt>/built`: it ends at once on every rank when the grow failed elsewhere or a rank of the new
   Buffer ended, at the build's deadline when one stalls).
4. **Switch-over** (`GrowOperation.poll(step)`, every member at every step boundary): one decision per
   poll in the current Buffer's ballot (`grow/<attempt>`): every member votes GO once its build finished,
   ABORT ("not yet") before; COMMIT when every member voted GO for the same step, FAILED once any rank
   recorded the grow's failure (every member raises at that poll, its current Buffer serving on), a member that
   ended before the switch-over included (seen by a peer's vote: it serves neither Buffer), and a newcomer whose
   deadline passed after its build with no step agreed (it records the failure and leaves). The step is written
   where the newcomers wait for it (`grow/<attempt>/switch`), and every rank serves that step and the
   later ones on the new Buffer and placement: no step is served twice, lost or on a mixed placement.
"""
import os
import threading
import time
import uuid
import zlib
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer.ballot import Ballot
from mooncake_ep_switch.buffer.membership import resize_guard
from mooncake_ep_switch.buffer.membership.group_keys import group_prefix, root_store
from mooncake_ep_switch.buffer.membership.grow_barrier import own_client, store_barrier
from mooncake_ep_switch.buffer.membership.protocol import MembershipError, check_seconds
from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.faults import FaultPoint

__all__ = ["MAX_EP_RANKS", "GrowResult", "GrowOperation", "grow_base", "check_grow_size", "join_grow"]

MAX_EP_RANKS = 64  # the largest EP group a grow builds (Mooncake EP / NCCL EP state a maximum of their own)
GO, ABORT, COMMIT, FAILED = 1, 2, 1, 3  # votes; decisions COMMIT, ABORT (not yet), FAILED
_POLL_MAX_S = 0.05
_READY = "ready"  # a newcomer's record that it accepted the request (then its pid and a nonce: `join_grow`)


class GrowResult(NamedTuple):
    """What a finished grow gives a rank.

    Fields:
        buffer: the new `Buffer` of the larger group (serve on it from `step`).
        built: what the caller's `build(buffer)` returned (e.g. the new `ExpertSlots`), or None.
        step: the step the members agreed to serve first on the new Buffer.
    """

    buffer: Any
    built: Any
    step: int


def grow_base(buffer) -> str:
    """The key prefix of `buffer`'s group that its grow records live under (newcomers name it too).

    Arguments:
        buffer: a member's `Buffer` with a store.

    Returns:
        base: str, the group prefix without the generation (`"<prefix>/grp-<hash>"`).
    """
    return buffer.membership.prefix.rsplit("/g", 1)[0]


def check_grow_size(name: str, num_ranks, current: int) -> int:
    """`num_ranks` of a grow: an int in `(current, MAX_EP_RANKS]`, else an error naming `name`.

    Arguments:
        name: the argument name errors name.
        num_ranks: the size asked for.
        current: the group's size now.

    Returns:
        num_ranks: int.

    Raises:
        TypeError: not an int. ValueError: not larger than `current`, or past `MAX_EP_RANKS`.
    """
    num_ranks = check_int(name, num_ranks, 1)
    if num_ranks <= current:
        raise ValueError(f"{name}: a grow needs more ranks than the group's {current}, got {num_ranks} "
                         "(remove ranks with Buffer.shrink())")
    if num_ranks > MAX_EP_RANKS:
        raise ValueError(f"{name}: expected at most MAX_EP_RANKS={MAX_EP_RANKS} ranks in an EP group, got {num_ranks}")
    return num_ranks


def _request_text(attempt: int, old: int, new: int, nbytes: int, transport: str, view: Optional[Sequence[int]] = None,
                  fallback: bool = False) -> str:
    """The request record (step 1): `view` only when it has holes, `fallback` only when set."""
    text = f"{attempt}|{old}|{new}|{nbytes}|{transport}"
    if view is not None:
        text += "|view=" + ",".join(map(str, view))
    return text + ("|fallback" if fallback else "")


def _parse_request(text: str) -> Tuple[int, int, int, int, str]:
    attempt, old, new, nbytes, transport = text.split("|")[:5]
    return int(attempt), int(old), int(new), int(nbytes), transport


def _request_options(text: str) -> Tuple[Optional[Tuple[int, ...]], bool]:
    """The view with holes (None: every rank of the group) and the fallback flag of a request record."""
    options = text.split("|")[5:]
    view = next((tuple(int(r) for r in o[5:].split(",")) for o in options if o.startswith("view=")), None)
    return view, "fallback" in options


def _describe(text: str) -> str:
    _, old, new, nbytes, transport = _parse_request(text)
    view, fallback = _request_options(text)
    return (f"{old} -> {new} ranks, num_ep_buffer_bytes={nbytes}, transport {transport!r}"
            + (f", the view {list(view)}" if view is not None else "")
            + (", on the collective fallback" if fallback else ""))


def _get(store, key: str) -> Optional[str]:
    """The value of `key`, None when absent or empty (a request given up or finished is emptied)."""
    value = store.get(key).decode() if store.check([key]) else ""
    return value or None


def _wait_key(store, keys: Sequence[str], deadline: float, what: str) -> Tuple[str, str]:
    """The first of `keys` that exists and its value; MembershipError naming `what` at the deadline."""
    pause = 0.001
    while True:
        for key in keys:
            value = _get(store, key)
            if value is not None:
                return key, value
        if time.monotonic() >= deadline:
            raise MembershipError(f"grow: {what} did not come before the deadline")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _fail(store, keys: str, reason: str) -> str:
    """Record the grow's failure (the first reason stored wins); returns the stored reason."""
    return store.compare_set(f"{keys}/failed", "", reason).decode()


def _build(store, base: str, attempt: int, rank: int, num_ranks: int, nbytes: int, transport: str,
           make_buffer: Callable, build: Optional[Callable], timeout_s: float,
           fallback: bool = False) -> Tuple[Any, Any]:
    """Step 3 of the module docstring on one rank (`rank` of the grown group): the group, the Buffer (moved onto
    the collective fallback with `fallback`, as the members' is), `build(buffer)`, the barrier."""
    keys, deadline = f"{base}/grow/{attempt}", time.monotonic() + timeout_s
    phase = "the gloo group"
    try:
        # Every rank came first (a count that a failed grow ends at once): gloo's rendezvous would wait for a rank
        # that died before it came until the deadline, whatever the others learnt meanwhile.
        store_barrier(store, keys, "arrived", num_ranks, deadline, "come to the build")
        rendezvous = dist.PrefixStore(f"{keys}/pg", store)
        backend = dist.ProcessGroupGloo(rendezvous, rank, num_ranks, timedelta(seconds=timeout_s))
        group = dist.ProcessGroup(rendezvous, rank, num_ranks)  # a ProcessGroup (not registered with torch's world)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        phase = "the Buffer"
        buffer = make_buffer(group, nbytes, transport=transport, store=dist.PrefixStore(f"{keys}/buffer", store))
    except Exception as error:
        raise MembershipError(f"grow: building {phase} of the {num_ranks}-rank group (attempt {attempt}) failed on "
                              f"rank {rank} ({type(error).__name__}: {error})") from error
    try:
        if fallback:  # every rank of the grown group together (the switch meets in the new Buffer's store)
            phase = "_use_fallback (the members' calls run on the collective fallback)"
            buffer._use_fallback = True
        phase = "build()"
        built = build(buffer) if build is not None else None
        phase = "the closing barrier"
        store_barrier(store, keys, "built", num_ranks, deadline, "been built and loaded", buffer.dead_peers)
    except Exception as error:
        # torch names no gloo error of an unregistered group (its logger raises "not initialized in the world group
        # map" instead): the ranks this Buffer saw end say more.
        dead = buffer.dead_peers()
        buffer.destroy()
        raise MembershipError(f"grow: {phase} on the {num_ranks}-rank group failed on rank {rank}"
                              + (f", ranks {dead} ended" if dead else "")
                              + f" ({type(error).__name__}: {error})") from error
    return buffer, built


def _discard(result: Tuple[Any, Any]) -> None:
    """Destroy a build nobody serves on: `build`'s value if it has `destroy()`, then the new Buffer."""
    buffer, built = result
    if callable(getattr(built, "destroy", None)):
        built.destroy()
    buffer.destroy()


class GrowOperation:
    """A grow in progress on one member (steps 1, 3 and 4 of the module docstring).

    Built by every member of the view with the same arguments, between steps, at the same step. The members
    take ranks `0 .. M-1` of the grown group in the order of their ids (renumbered densely after a shrink),
    the newcomers `[M, num_ranks)` (module docstring).

    Arguments:
        buffer: this member's current `Buffer` (serving on until the switch-over; after a shrink too).
        num_ranks: the size of the grown group, in `(M, MAX_EP_RANKS]` (`M`: the members of the view).
        make_buffer: the Buffer class (called as `make_buffer(group, bytes, transport=, store=)`).
        build: optional `build(new_buffer)`, run once the new Buffer exists (on every rank of the grown
            group): place the experts and stage their weights; its value is `GrowResult.built` (its
            `destroy()`, if it has one, is called with the new Buffer's when the grow fails after the build).
        timeout_s: deadline of the build, in seconds (default: the connect timeout setting).

    Raises:
        TypeError, ValueError: `num_ranks` not an int in range (named); nothing changed.
        MembershipError: this rank is no member, or the Buffer has no store.
        RuntimeError: another grow or a shrink of this Buffer is in progress, or the store holds another
            resize request of this group (two resizes at once, named); nothing changed.
    """

    def __init__(self, buffer, num_ranks: int, make_buffer: Callable, build: Optional[Callable] = None,
                 timeout_s: Optional[float] = None):
        num_ranks = check_grow_size("num_ranks", num_ranks, len(buffer.members))
        timeout_s = check_seconds("timeout_s", timeout_s, allow_none=True)
        membership = buffer.membership
        if membership is None:
            raise MembershipError("grow: needs the group's store (pass store= to Buffer, or initialise "
                                  "torch.distributed with a store)")
        if buffer.joining or buffer.rank not in buffer.members:
            raise MembershipError(f"grow: rank {buffer.rank} is not a member of the group (a joiner, left out or "
                                  "drained); only members grow it")
        resize_guard.begin(buffer.membership, "grow")  # a grow or a shrink of this Buffer in progress: refused
        try:
            self._claim(buffer, num_ranks)
        except BaseException:
            resize_guard.end(buffer.membership, "grow")
            raise
        self.buffer, self.num_ranks = buffer, num_ranks
        self._rank = self._members.index(buffer.rank)  # this member's id in the grown group (dense)
        self.timeout_s = buffer.settings.connect_timeout_s if timeout_s is None else timeout_s
        self._polls, self._result, self._error = 0, None, None
        # No switch-over agreed by then (the build's deadline, plus as long again for the vote): FAILED.
        self._give_up = time.monotonic() + 2 * self.timeout_s
        self._ballot = Ballot(membership, f"grow/{self.attempt}", buffer.rank, buffer.num_ranks, what="grow")
        self._guard, self._abandoned = threading.Lock(), False  # a failed grow's build is discarded when it ends
        self._thread = threading.Thread(target=self._run, args=(make_buffer, build), daemon=True,
                                        name=f"mep-grow-{buffer.rank}")
        self._thread.start()

    def _claim(self, buffer, num_ranks: int) -> None:
        store, base = buffer.membership.store.inner, grow_base(buffer)  # the group's store, no generation prefix
        key = f"{base}/grow/request"
        members = tuple(sorted(buffer.members))
        view = None if members == tuple(range(buffer.num_ranks)) else members  # holes (after a shrink): named
        fallback = bool(buffer._use_fallback) and buffer.transport != "collective"  # a collective one is built so
        options = (len(members), num_ranks, buffer.num_ep_buffer_bytes, buffer.transport, view, fallback)
        wanted = _request_text(0, *options)
        current = _get(store, key)
        if current is None:  # absent, or emptied by the grow before this one
            attempt = store.add(f"{base}/grow/attempts", 1)
            current = store.compare_set(key, "", _request_text(attempt, *options)).decode()
        if current.split("|", 1)[1] != wanted.split("|", 1)[1]:
            raise RuntimeError(f"grow: another resize of this group is in progress ({_describe(current)}); this rank "
                               f"asked for {_describe(wanted)}: two resizes at once; every member must ask the same")
        self.attempt, self._members, self._fallback = _parse_request(current)[0], members, fallback
        self._base, self._store, self._request = base, store, current
        self._keys = f"{base}/grow/{self.attempt}"

    def _run(self, make_buffer, build) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            # A store client of its own: the build's waits (the gloo group's rendezvous blocks its client until every
            # rank came) never hold up this member's polls and membership calls, which share the current Buffer's
            # store worker (it would stop serving, and its peers mask it).
            store = own_client(self._store)
            newcomers = range(len(self._members), self.num_ranks)
            for rank in newcomers:
                _, value = _wait_key(store, [f"{self._keys}/newcomer/{rank}", f"{self._keys}/failed"], deadline,
                                     f"newcomer rank {rank} (join_grow)")
                if not value.startswith(_READY):
                    raise MembershipError(f"grow: {value}")
            store.set(f"{self._keys}/build", "go")  # every newcomer accepted the request: build together
            fault = FaultPoint.parse(self.buffer.settings.fault_point)  # test-only (None unless MEP_FAULT_POINT is set)
            if fault is not None:
                fault.hit("grow_build", self.buffer.rank)
            result = _build(store, self._base, self.attempt, self._rank, self.num_ranks,
                            self.buffer.num_ep_buffer_bytes, self.buffer.transport, make_buffer, build,
                            max(1.0, deadline - time.monotonic()), self._fallback)
        except BaseException as error:  # reported by poll() on every member (the failed record)
            self._error = error
            _fail(self._store, self._keys, f"rank {self.buffer.rank}: {error}")
            return
        with self._guard:
            abandoned = self._abandoned
            if not abandoned:
                self._result = result
        if abandoned:  # the grow failed while this build ran: nobody will serve on it
            _discard(result)

    def ready(self) -> bool:
        """Whether this member's part of the build finished (the switch-over may be agreed)."""
        return not self._thread.is_alive()

    def poll(self, step: int) -> Optional[GrowResult]:
        """Step 4 of the module docstring: call at every step boundary, on every member, with the step about
        to be served. Collective over the members (a short wait for their votes).

        Arguments:
            step: the step about to be served (the same on every member).

        Returns:
            result: None (serve `step` on the current Buffer, poll again at the next), or a `GrowResult`:
                serve `step` and the later ones on `result.buffer` (then destroy the current Buffer).

        Raises:
            MembershipError: the grow failed on some rank (named: a newcomer refused, a build error or
                deadline); nothing changed, the current Buffer serves on.
        """
        step = check_int("step", step, 0)
        self._polls += 1  # one ballot epoch per poll (the ballot reuses its decision slots in a ring)
        epoch, members, ballot = self._polls, self.buffer.members, self._ballot
        ballot.prepare([epoch], votes=True)
        failed = _get(self._store, f"{self._keys}/failed")
        mine = GO if self.ready() and self._error is None and failed is None else ABORT
        digest = zlib.crc32(f"{self.attempt}|{step}".encode()) & 0x7FFFFFFF
        fault = FaultPoint.parse(self.buffer.settings.fault_point)  # test-only (None unless MEP_FAULT_POINT is set)
        if fault is not None and mine == GO:
            fault.hit("grow_before_vote", self.buffer.rank)
        ballot.vote(epoch, mine, digest, voters=len(members))
        peers = [r for r in members if r != self.buffer.rank]
        votes, _, decided = ballot.wait_votes(peers, epoch, int(self.timeout_s * 1e6),
                                              lambda pending: sorted(set(pending) & set(self.buffer.dead_peers())))
        go = mine == GO and all(p in votes and votes[p] == (GO, digest) for p in peers)
        failed = None if go else _get(self._store, f"{self._keys}/failed")
        ended = [] if go or failed is not None else sorted(set(peers) & set(self.buffer.dead_peers()))
        if ended:  # a member died before the switch-over: it can serve neither Buffer, the grow fails at once
            failed = _fail(self._store, self._keys, f"rank {self.buffer.rank}: members {ended} ended (their process "
                                                    "is gone) before the switch-over was agreed")
        if not go and failed is None and time.monotonic() > self._give_up:
            failed = _fail(self._store, self._keys, f"rank {self.buffer.rank}: no switch-over agreed within "
                                                    f"2 * timeout_s = {2 * self.timeout_s} s")
        if failed is not None and decided is None:
            self._wait_voted(peers, epoch)
        decision = ballot.propose(epoch, COMMIT if go else ABORT if failed is None else FAILED)
        if decision == COMMIT:
            if fault is not None:
                fault.hit("grow_after_decision", self.buffer.rank)
            self._thread.join()
            self._store.set(f"{self._keys}/switch", str(step))
            self._store.compare_set(f"{self._base}/grow/request", self._request, "")  # every newcomer read it
            resize_guard.end(self.buffer.membership, "grow")
            buffer, built = self._result
            return GrowResult(buffer, built, step)
        if decision == FAILED:  # one decision: every member raises at this poll
            self._finish(_get(self._store, f"{self._keys}/failed") or "a member saw the grow fail")
        return None

    def _wait_voted(self, peers: Sequence[int], epoch: int) -> None:
        """Before a FAILED proposal: wait until every live member voted on `epoch` (or it was decided, or `timeout_s`).

        An ABORT vote ends the ballot's wait at once, but a FAILED decision is every member's, at one poll. A member
        slower to its `GrowOperation` has not voted yet and may not have read the request: decided without it, the
        request is given up under it, it asks a new attempt of its own, and the others join that one at their next
        grow one poll later, so the members' ballot epochs of one step differ and no switch-over is ever agreed
        (seen beside 2 CPU hogs: 448 polls, then the newcomers' deadline). Its vote here means it joined this attempt.
        """
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        while True:
            votes, decided = self._ballot.read(list(peers), epoch)
            pending = set(peers) - set(votes) - set(self.buffer.dead_peers())
            if decided is not None or not pending or time.monotonic() >= deadline:
                return
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _finish(self, reason: str) -> None:
        """The grow failed: give up this member's build (never waited for: one still blocked on a dead peer is
        discarded by its thread when it ends, by the build's deadline), give up the request, raise."""
        _fail(self._store, self._keys, reason)
        with self._guard:
            self._abandoned = True
            result, self._result = self._result, None
        if result is not None:
            _discard(result)
        self._store.compare_set(f"{self._base}/grow/request", self._request, "")  # a later grow may ask again
        resize_guard.end(self.buffer.membership, "grow")
        raise MembershipError(f"grow to {self.num_ranks} ranks failed ({reason}); nothing changed: the current "
                              "Buffer serves on")


def join_grow(store, rank: int, num_ranks: int, num_ep_buffer_bytes: int, make_buffer: Callable, *,
              old_num_ranks: int, group_ranks: Optional[Sequence[int]] = None, prefix: str = "mep",
              build: Optional[Callable] = None, timeout_s: float = 60.0) -> GrowResult:
    """A newcomer's side of a grow (steps 2-4 of the module docstring): wait for the members' request, build
    the new Buffer with them, and return once they agreed the step to serve first. Its Buffer runs where the
    members' run (`_use_fallback` set when theirs is).

    Arguments:
        store: client of the job's store (the members' Buffers use its server, torch's prefixes removed).
        rank: this newcomer's rank in the grown group, in `[old_num_ranks, num_ranks)`.
        num_ranks: the size of the grown group.
        num_ep_buffer_bytes: this newcomer's buffer size (must equal the members').
        make_buffer: the Buffer class.
        old_num_ranks: the members of the view the group grows from: the group's size, or fewer after a
            shrink (then pass `group_ranks`: the removed ranks keep their place in the group's ranks).
        group_ranks: the members' group's global ranks in group order, the removed ones too (None:
            `range(old_num_ranks)`).
        prefix: the members' key prefix ("mep").
        build: as `GrowOperation`'s (run on the new Buffer; e.g. its slots, weights from the members' memory).
        timeout_s: deadline of the whole join, in seconds.

    Returns:
        result: a `GrowResult` (serve from `result.step` on `result.buffer`).

    Raises:
        TypeError, ValueError: a bad argument, or one that differs from the members' request (`num_ranks`,
            `old_num_ranks`, `rank`, `num_ep_buffer_bytes`: named; the grow fails on every member, which serve
            on).
        MembershipError: no request in time, the grow failed elsewhere (named), this rank of the attempt is taken
            (another process, or an earlier call of this one that gave up: join the members' next request), the
            deadline passed after the build with no switch-over agreed (the attempt is failed on every member,
            which serve on: a later call joins their next request), or this newcomer stalled past the
            switch-over and the members sealed a view without it meanwhile (named: join as a replacement).
    """
    old_num_ranks = check_int("old_num_ranks", old_num_ranks, 1)
    num_ranks = check_grow_size("num_ranks", num_ranks, old_num_ranks)
    rank = check_int("rank", rank, 0)
    nbytes = check_int("num_ep_buffer_bytes", num_ep_buffer_bytes, 0)
    timeout_s = check_seconds("timeout_s", timeout_s)
    if not old_num_ranks <= rank < num_ranks:
        raise ValueError(f"rank: a newcomer takes a new rank id in [{old_num_ranks}, {num_ranks}), got {rank}")
    store = root_store(store)
    base = group_prefix(range(old_num_ranks) if group_ranks is None else group_ranks, prefix)
    deadline = time.monotonic() + timeout_s
    while True:  # the members' request; one of an attempt that failed already is being given up: wait on
        _, text = _wait_key(store, [f"{base}/grow/request"], deadline, "the members' grow request")
        attempt, old, new, wanted, transport = _parse_request(text)
        keys = f"{base}/grow/{attempt}"
        if _get(store, f"{keys}/failed") is None:
            break
        if time.monotonic() >= deadline:
            raise MembershipError("grow: the members' grow request did not come before the deadline (the last one "
                                  f"failed: {_get(store, f'{keys}/failed')})")
        time.sleep(_POLL_MAX_S)
    refusal = None
    if new == num_ranks and old != old_num_ranks:
        refusal = ValueError(f"old_num_ranks: the members grow the group from its {old} members "
                             f"{list(_request_options(text)[0] or range(old))}; this newcomer asked from "
                             f"{old_num_ranks} (after a shrink: the members left in the view)")
    elif (old, new) != (old_num_ranks, num_ranks):
        refusal = ValueError(f"num_ranks: the members grow the group {old} -> {new} ranks; this newcomer asked "
                             f"{old_num_ranks} -> {num_ranks}")
    elif nbytes != wanted:
        refusal = ValueError(f"num_ep_buffer_bytes: expected the members' {wanted} bytes, got {nbytes} (newcomer "
                             f"rank {rank}): every rank of the grown group needs the same buffer size")
    if refusal is not None:
        # The failed record first: a member that reads the refusal from newcomer/<rank> fails the attempt too, and
        # had it come first its wrapped "rank 1: grow: newcomer rank 4 refused: ..." was the reason every rank got
        # (first writer wins; seen once in 21 runs of tests/test_grow.py beside 2 CPU hogs).
        _fail(store, keys, f"newcomer rank {rank} refused: {refusal}")
        store.compare_set(f"{keys}/newcomer/{rank}", "", f"newcomer rank {rank} refused: {refusal}")
        raise refusal
    # This process's own ready record: a second join_grow of this rank in one attempt (a newcomer that gave up and
    # called again, or two processes started for one rank) would otherwise meet a rendezvous nobody else comes to.
    ready = f"{_READY} pid {os.getpid()} {uuid.uuid4().hex[:12]}"
    held = store.compare_set(f"{keys}/newcomer/{rank}", "", ready).decode()
    if held != ready:
        raise MembershipError(f"grow: newcomer rank {rank} of attempt {attempt} is taken ({held!r}): "
                              + ("this process joined that attempt before and gave up"
                                 if held.startswith(f"{_READY} pid {os.getpid()} ") else "by another process")
                              + "; join the members' next grow request")
    key, value = _wait_key(store, [f"{keys}/build", f"{keys}/failed"], deadline,
                           f"the members' go to build (attempt {attempt})")
    if key.endswith("/failed"):
        raise MembershipError(f"grow to {num_ranks} ranks failed: {value}")
    try:
        buffer, built = _build(store, base, attempt, rank, num_ranks, nbytes, transport, make_buffer, build,
                               max(1.0, deadline - time.monotonic()), _request_options(text)[1])
    except BaseException as error:
        _fail(store, keys, f"newcomer rank {rank}: {error}")
        raise
    try:
        fault = FaultPoint.parse(buffer.settings.fault_point)  # test-only (None unless MEP_FAULT_POINT is set)
        if fault is not None:
            fault.hit("grow_before_switch", rank)
        try:
            key, value = _wait_key(store, [f"{keys}/switch", f"{keys}/failed"], deadline,
                                   f"the members' switch-over step (attempt {attempt})")
        except MembershipError as error:  # built, gone by the deadline: the members must not switch to a group
            # without it (they are told at their next poll and serve on), unless they agreed it meanwhile
            _fail(store, keys, f"newcomer rank {rank}: {error}")
            key, value = f"{keys}/switch", _get(store, f"{keys}/switch")
            if value is None:
                raise
        if key.endswith("/failed"):
            raise MembershipError(f"grow to {num_ranks} ranks failed: {value}")
        view = buffer.membership.view()
        if rank not in view.ranks:  # stalled past the switch-over: the members masked it and sealed it out
            raise MembershipError(f"grow: newcomer rank {rank} was left out of the grown group (epoch {view.epoch}, "
                                  f"members {list(view.ranks)}) while it stalled after the switch-over at step "
                                  f"{value}; start it again as a replacement of rank {rank} (elastic.join)")
    except BaseException:
        _discard((buffer, built))
        raise
    return GrowResult(buffer, built, int(value))
