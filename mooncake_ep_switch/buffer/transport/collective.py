"""The PyTorch-collective transport: all_to_all_single of exact records, no all-gather of tokens.

Wire format. Every (token, destination rank) pair travels once, as one fixed-size *record*:

    [payload | int32 token index | L bytes: 1 if local expert l of the destination selected it | pad]

(payload = the bf16 row, or with FP8 the e4m3fn row followed by its float32 scales), padded to a
multiple of 16 bytes. A destination's records are sorted by token, so the receiver packs in one
pass per local expert over the records in arrival order (source rank, then token).

Exchanges per round:

* dispatch, exact mode: a count exchange (`[R, 2]` int64: records to that rank, and whether this
  rank accepts that rank as a source, i.e. sees it active) and then the records, exact sizes;
* dispatch, fixed mode (small calls, where one more collective costs more than the padding): a
  single exchange of fixed blocks of `T + 1` record slots per destination, slot 0 holding the same
  two counts as a header;
* combine: one exchange of the expert outputs back to their token owners. Its sizes are known on
  both sides from the dispatch (the owner returns what it received; the token owner expects what it
  sent to owners that accepted it), so it needs no count exchange; a peer whose view of the mask
  differed returns nothing and that is known in advance.

Runs on any process group with all_to_all_single (gloo here) and honours `active_ranks`: nothing
is sent to, or accepted from, an inactive rank. CPU tensors only: the packing and reduction
kernels are host code reading raw pointers, so `Buffer` rejects a CUDA (or any non-CPU) tensor
argument before the call starts, with an error naming it (buffer/validation.py); a GPU engine
copies to and from the host itself. (Making this path take CUDA tensors would need device packing
kernels or staging through host memory, and an nccl group; none of it exists or was run here.) Routing, record packing and
unpacking, FP8 quantisation and the weighted combine reduction are native (csrc/dataplane/kernels.cpp,
shared with the one-sided transports); the Python here only sizes buffers and runs the exchanges.
"""
import os
import threading
import time
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs, bias_args
from mooncake_ep_switch.buffer.membership.group_keys import view_group
from mooncake_ep_switch.buffer.membership.protocol import MembershipError
from mooncake_ep_switch.buffer.transport.members import published_endpoint
from mooncake_ep_switch.buffer.transport.peer_watch import PeerWatch
from mooncake_ep_switch.buffer.transport.contract import HostMemoryTransport
from mooncake_ep_switch.errors import PeerLost  # noqa: F401 (re-exported)

# Fixed mode (one dispatch exchange instead of two) when a rank's padded send is at most this many
# bytes: below it the extra padding costs less than one more collective round trip.
FIXED_MODE_MAX_BYTES = 2 << 20


class CollectivePlan(NamedTuple):
    """What a dispatch sent and received, kept on the handle so that combine needs no count exchange.

    Fields:
        rows_from_rank: `[R]` list of int, expert-output rows this rank gets back from each owner rank in
            combine (the (token, expert) pairs it sent there), if that owner accepted it.
        accepted_by: `[R]` list of bool, whether each owner accepted this rank as a source.
        row_index: `[N, K]` torch.int64, row of the combine receive buffer holding
            `y(topk_idx[t, k], t)` when every owner returns its rows, -1 where nothing was sent.
        layout_range: `[L, R]` torch.int64 copy of the layout this rank produced as an owner.
        rows_to_rank: `[R]` list of int, rows this rank returns to each source rank.
    """

    rows_from_rank: List[int]
    accepted_by: List[bool]
    row_index: torch.Tensor
    layout_range: torch.Tensor
    rows_to_rank: List[int]


# PeerLost lives in errors.py (one hierarchy), re-exported here.


class _GuardedWork:
    """Wraps a Work so that a failure in wait() surfaces as PeerLost."""


    def __init__(self, work):
        self._work = work

    def wait(self):
        try:
            return self._work.wait()
        except RuntimeError as error:
            raise PeerLost(str(error)) from error


class _Finisher:
    """A Work-like object whose wait() runs a completion function once."""

    def __init__(self, finish):
        self._finish, self._done = finish, False

    def wait(self):
        if not self._done:
            self._done = True
            self._finish()
        return True


# ------------------------------------------------------------------ records: checked native calls
# The record packers and the weighted reduction (csrc/dataplane/kernels.cpp) get addresses, sizes and
# byte strides, never torch; these wrappers check the few layout facts the kernels rely on and keep
# the pointer plumbing in one place.

def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def combine_reduce(out: torch.Tensor, row_index: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                   bias: tuple = ()) -> None:
    """`out[t] = bf16(bias0[t] + bias1[t] + sum_k weights[t,k] * rows[row_index[t,k]])` in fp32, top-k
    order, -1 skipped.

    Arguments:
        out: `[N, hidden]` torch.bfloat16 output.
        row_index: `[N, K]` torch.int64 rows of `rows`, -1 = skip.
        weights: `[N, K]` torch.float32.
        rows: `[m, hidden]` torch.bfloat16 expert outputs.
        bias: `CombineCall.bias` (`()`: none).
    """
    hidden = out.size(1)
    if out.size(0) == 0:
        return
    if rows.size(0) == 0:
        if bool((row_index >= 0).any()):
            raise ValueError("row_index: expected only -1 when there are no rows, got a row reference")
        if not bias:
            out.zero_()
            return
        rows = out  # never read (every index is -1); the reduction needs an address
    _native.combine_reduce(_ptr(out), out.size(0), hidden, row_index.size(1), _ptr(row_index), _ptr(weights),
                           _ptr(rows), hidden * 2, **bias_args(bias))


def _checked(what: str, call, *args, **flags) -> int:
    """Run a native record packer; its ValueError / RuntimeError comes back as RuntimeError naming `what`."""
    try:
        return call(*args, **flags)
    except (ValueError, RuntimeError) as error:
        raise RuntimeError(f"{what}: {error}") from None


def record_layout(hidden: int, num_local_experts: int, use_fp8: bool):
    """(payload bytes, byte offset of the int32 token index, record bytes) of a collective record.

    Arguments:
        hidden: `H`, a multiple of 128.
        num_local_experts: `L`, local experts per rank (one flag byte each).
        use_fp8: payload is the e4m3fn row plus `H/128` float32 scales (else the bf16 row).

    Returns:
        payload: int bytes, `H + 4 * H/128` with FP8 else `2 * H`.
        meta: int byte offset of the token index (equal to `payload`).
        size: int record bytes, `payload + 4 + L` rounded up to a multiple of 16.
    """
    payload = hidden + 4 * (hidden // 128) if use_fp8 else 2 * hidden
    return payload, payload, (payload + 4 + num_local_experts + 15) // 16 * 16


def coll_dispatch_pack(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                       max_tokens: int, active: torch.Tensor, use_fp8: bool, fixed: bool, record: tuple,
                       send: torch.Tensor, tokens_to: torch.Tensor, pairs_to: torch.Tensor,
                       row_index: torch.Tensor) -> int:
    """Write this rank's dispatch records into `send`; returns the number of records.

    Arguments:
        x: `[N, hidden]` torch.bfloat16 CPU tokens.
        topk_idx: `[N, K]` torch.int64 global expert ids, -1 = none.
        num_experts: `E`, a multiple of `R`.
        num_ranks: `R`.
        max_tokens: `T`, num_max_dispatch_tokens_per_rank.
        active: `[R]` torch.int32, the destinations this rank sends to (1 = active).
        use_fp8: quantise the payload to FP8 with per-128-channel scales.
        fixed: fixed slots of `T + 1` records per destination (slot 0 a header).
        record: `record_layout(...)`.
        send: torch.uint8 buffer (fixed: `R * (T + 1)` records; exact: enough for every record).
        tokens_to: `[R]` torch.int64 output, records per destination rank.
        pairs_to: `[R]` torch.int64 output, (token, expert) pairs per destination rank.
        row_index: `[N, K]` torch.int64 output, combine receive row of every pair (-1 = not sent).

    Returns:
        records: int, data records written over all destinations (fixed-mode headers not counted).

    Raises:
        RuntimeError: the native packer refused (the message says why).
    """
    _, meta, size = record
    return _checked("collective dispatch", _native.coll_dispatch_pack,
                    x.data_ptr(), x.size(0), x.size(1), topk_idx.data_ptr(), topk_idx.size(1), num_experts, num_ranks,
                    max_tokens, active.data_ptr(), use_fp8=bool(use_fp8), fixed=bool(fixed), rec_size=size,
                    meta=meta, send=send.data_ptr(), send_bytes=send.numel(), tokens_to=tokens_to.data_ptr(),
                    pairs_to=pairs_to.data_ptr(), row_index=row_index.data_ptr())


def coll_dispatch_unpack(recv: torch.Tensor, num_ranks: int, max_tokens: int, hidden: int, num_local: int,
                         record: tuple, fixed: bool, recv_tokens: torch.Tensor, accepted_by: torch.Tensor,
                         accept: torch.Tensor, use_fp8: bool, outputs, rows_to_rank: torch.Tensor) -> int:
    """Validate received records and pack them into the dispatch outputs; returns the rows packed.

    Arguments:
        recv: torch.uint8 records as received.
        num_ranks: `R`.
        max_tokens: `T`, num_max_dispatch_tokens_per_rank.
        hidden: `H`.
        num_local: `L`, local experts per rank.
        record: `record_layout(...)`.
        fixed: the records came in fixed slots of `T + 1` per source.
        recv_tokens: `[R]` torch.int64 records per source (input in exact mode, output in fixed
            mode, read from the headers).
        accepted_by: `[R]` torch.int64 output (fixed mode): whether each source accepts this rank.
        accept: `[R]` torch.int32, the sources this rank accepts.
        use_fp8: the payload is FP8 with scales.
        outputs: the `DispatchOutputs`, filled here.
        rows_to_rank: `[R]` torch.int64 output, rows each source will get back in combine.

    Returns:
        rows: int, rows packed into `outputs` over all local experts.

    Raises:
        RuntimeError: malformed records (the message says why).
    """
    _, meta, size = record
    scales = outputs.recv_scales.data_ptr() if outputs.recv_scales is not None else 0
    return _checked("collective dispatch", _native.coll_dispatch_unpack,
                    recv.data_ptr(), recv.numel(), num_ranks, max_tokens, hidden, num_local, size, meta,
                    fixed=bool(fixed), recv_tokens=recv_tokens.data_ptr(), accepted_by=accepted_by.data_ptr(),
                    accept=accept.data_ptr(), use_fp8=bool(use_fp8), recv_x=outputs.recv_x.data_ptr(),
                    recv_scales=scales, src_info=outputs.src_info.data_ptr(),
                    layout_range=outputs.layout_range.data_ptr(), recv_count=outputs.recv_count.data_ptr(),
                    rows_to_rank=rows_to_rank.data_ptr())


def coll_combine_pack(x: torch.Tensor, layout_range: torch.Tensor, max_tokens: int, send: torch.Tensor) -> int:
    """Copy the expert outputs each source gets back into `send` `[P, hidden]`: by source, local expert, token.

    Arguments:
        x: `[L, R*T, hidden]` torch.bfloat16 expert outputs in the dispatch's packed layout.
        layout_range: `[L, R]` torch.int64, the layout this rank produced as an owner.
        max_tokens: `T`, num_max_dispatch_tokens_per_rank.
        send: `[P, hidden]` torch.bfloat16, `P` the rows returned to all sources.

    Returns:
        rows: int, rows written into `send`.

    Raises:
        RuntimeError: the layout does not fit `send` (the message says why).
    """
    num_local, num_ranks = layout_range.shape
    return _checked("collective combine", _native.coll_combine_pack, x.data_ptr(), x.size(2), num_local, num_ranks,
                    max_tokens, layout_range.data_ptr(), send.data_ptr(), send.size(0))


def packed_prefix(x: torch.Tensor, layout_range: torch.Tensor, max_tokens: int, rows: int) -> Optional[torch.Tensor]:
    """The rows `coll_combine_pack` would write, as a view of `x` itself, when they already lie there in
    send order: the non-empty `(l, s)` blocks, taken by source rank then local expert, follow each other
    from `x`'s first row (the ElasticBuffer's inner combine: one local expert holds every row, its
    sources' blocks one after another). The exchange then reads `x` in place; no copy.

    Arguments:
        x: `[L, R*T, hidden]` torch.bfloat16 expert outputs; layout_range: `[L, R]` torch.int64;
        max_tokens: `T`; rows: the rows sent in all (the plan's `rows_to_rank` summed).

    Returns:
        send: `[rows, hidden]` torch.bfloat16 view of `x`, or None (the blocks are elsewhere, out of
        range or of another total, or `x` is not contiguous on the host: `coll_combine_pack` copies
        them, and names a bad layout).
    """
    if x.device.type != "cpu" or x.dim() != 3 or not x.is_contiguous() or layout_range.dim() != 2:
        return None
    num_local, num_ranks = layout_range.shape
    RT, offset = num_ranks * max_tokens, 0
    if x.size(0) != num_local or x.size(1) != RT:
        return None
    words = layout_range.tolist()
    for s in range(num_ranks):
        for l in range(num_local):
            word = words[l][s]
            begin, count = word >> 32, word & 0xFFFFFFFF
            if count == 0:
                continue
            if word < 0 or count > max_tokens or begin + count > RT or l * RT + begin != offset:
                return None
            offset += count
    if offset != rows:
        return None
    return x.view(-1, x.size(-1))[:rows]


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


class CollectiveTransport(HostMemoryTransport):
    """Dispatch/combine over `torch.distributed.all_to_all_single`.

    Arguments:
        group: the process group (any backend with all_to_all_single).
        rank: this process's rank in `group`.
        num_ranks: the group size.
    """

    name = "collective"
    fast_path = False  # Mooncake's runtime queries (contract.RuntimeQueries): the fallback itself

    def maps_peer_memory(self) -> bool:
        """False: the collectives never map a peer's memory (Mooncake's `p2p_enabled()` is False)."""
        return False

    def __init__(self, group, rank: int, num_ranks: int, view_change=None, settings=None):
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.settings = settings
        # Tells a dead peer from a slow one when the survivors agree on a view (`dead_peers`): a
        # pidfd on this host, a connection to its watch listener across hosts. None without settings.
        self.watch = None if settings is None else PeerWatch(num_ranks, rank, settings.bind_host)
        self._combine_buffers = {}
        self._staging = _StagingPool()
        self.failed_sources = []  # evidence for membership (ranks a call found dead)
        self.members = tuple(range(num_ranks))  # EP ranks in the group, in group-rank order
        # The Buffer's: agrees on a survivors' view (and rebuilds our group) before a deadline.
        self.view_change = view_change

    def peer_routes(self) -> List[Optional[str]]:
        """Every other member of the current view is reached through the process group's collectives; a rank
        outside it is not reached (None; see `contract.Transport`)."""
        return ["self" if peer == self.rank else "collective" if peer in self.members else None
                for peer in range(self.num_ranks)]

    def endpoint(self) -> dict:
        """What peers need to watch this rank (collectives themselves need no peer metadata).

        Returns:
            endpoint: dict with `"pid"` (int, this process) and `"watch_host"`/`"watch_port"` (its
                peer watcher's listener), or an empty dict without a watcher.
        """
        if self.watch is None:
            return {}
        return {"pid": os.getpid(), "watch_host": self.settings.bind_host, "watch_port": self.watch.port}

    def connect_members(self, view, membership, deadline: float, construction: bool = False) -> None:
        """Run on the group of `view`: the constructor's group in epoch 0, else one built from the
        store with the epoch in its prefix (a gloo group cannot lose or regain a member).

        Arguments:
            view: the membership `View` (epoch, ranks) to run on.
            membership: the `Membership` whose store builds the group; may be None only in epoch 0
                with a constructor group.
            deadline: `time.monotonic()` deadline in seconds.
            construction: whether the Buffer is being constructed (the group's own collectives need no store
                exchange either way: accepted as every transport's `connect_members` takes it).

        Raises:
            RuntimeError: a new view but no `membership` (no store).
            MembershipError: a member missed the store barrier before `deadline`.
        """
        self._watch_members(view, membership, deadline)
        if view.epoch == 0 and self.group is not None:
            return
        if membership is None:
            raise RuntimeError("connect: a new view needs the group's store; pass store= to Buffer")
        # Meet in the store first: a member that died after the view was sealed is named (and the
        # Buffer agrees again without it) instead of stalling the group's rendezvous.
        membership.barrier(f"connect/{view.epoch}", view.ranks, deadline)
        self.group = view_group(membership.store, view, self.rank, max(1.0, deadline - time.monotonic()))
        self.members = tuple(view.ranks)
        self._staging.clear()

    def _watch_members(self, view, membership, deadline: float) -> None:
        """Watch every other member of `view` at its published endpoint, forget the rest. Best effort:
        a member not watched (no endpoint in time, listener unreachable) is only waited for longer
        when survivors agree on a view."""
        if self.watch is None or membership is None:
            return
        for peer in range(self.num_ranks):
            if peer == self.rank:
                continue
            if peer not in view.ranks:
                self.watch.forget(peer)
                continue
            try:
                found = published_endpoint(membership, peer, deadline)
                pid, host, port = found.get("pid"), found.get("watch_host"), found.get("watch_port")
                if found.get("host_id") == self.settings.host_id and isinstance(pid, int) and pid > 0:
                    self.watch.watch_process(peer, pid)
                elif isinstance(host, str) and isinstance(port, int) and 0 < port < 65536:
                    self.watch.watch_address(peer, host, port,
                                             timeout_s=max(0.1, min(10.0, deadline - time.monotonic())))
                else:
                    self.watch.forget(peer)
            except (MembershipError, OSError, ValueError):
                self.watch.forget(peer)

    def dead_peers(self) -> List[int]:
        """Ranks whose process the peer watcher saw end since they were last connected.

        Returns:
            ranks: list of int, ascending ([] without a watcher).
        """
        if self.watch is None:
            return []
        return self.watch.dead_ranks()

    def mask_cause(self, rank: int) -> str:
        """Why a call masked `rank`: a collective failed and the survivors agreed on a view without it;
        `"process_end"` when the peer watcher saw its process end, else `"link"`.

        Arguments:
            rank: a rank this transport appended to `failed_sources`.

        Returns:
            cause: `"process_end"` or `"link"`.
        """
        return "process_end" if rank in self.dead_peers() else "link"

    def destroy(self) -> None:
        """Stop the peer watcher; drop cached buffers."""
        if self.watch is not None:
            self.watch.close()
        self._combine_buffers.clear()
        self._staging.clear()

    # ------------------------------------------------------------------ helpers
    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits, input_splits, async_op=False):
        """all_to_all_single with blocks in EP-rank order, on the current view's group.

        The group's own `alltoall_base` is used, so it also works for the unregistered per-epoch
        groups membership builds. When the view lacks some ranks, their (empty, never accepted)
        blocks are left out of the exchange and arrive as zeros.
        """
        R = self.num_ranks
        if len(self.members) == R:
            try:
                work = _GuardedWork(self.group.alltoall_base(output, input, list(output_splits or []),
                                                             list(input_splits or []), dist.AllToAllOptions()))
            except RuntimeError as error:
                raise PeerLost(str(error)) from error
            return work if async_op else work.wait()
        in_splits = list(input_splits) if input_splits else [input.size(0) // R] * R
        out_splits = list(output_splits) if output_splits else [output.size(0) // R] * R
        in_offsets = [sum(in_splits[:r]) for r in range(R)]
        out_offsets = [sum(out_splits[:r]) for r in range(R)]
        compact_in = torch.cat([input.narrow(0, in_offsets[r], in_splits[r]) for r in self.members])
        compact_out = output.new_empty((sum(out_splits[r] for r in self.members),) + tuple(output.shape[1:]))
        try:
            work = _GuardedWork(self.group.alltoall_base(compact_out, compact_in, [out_splits[r] for r in self.members],
                                                         [in_splits[r] for r in self.members], dist.AllToAllOptions()))
        except RuntimeError as error:
            raise PeerLost(str(error)) from error

        def finish():
            work.wait()
            output.zero_()
            start = 0
            for r in self.members:
                output.narrow(0, out_offsets[r], out_splits[r]).copy_(compact_out.narrow(0, start, out_splits[r]))
                start += out_splits[r]
            return True

        if async_op:
            return _Finisher(finish)
        return finish()

    def combine_buffer(self, call: int, shape, device) -> torch.Tensor:
        """Persistent zero-copy combine buffer for the half of `call` and this shape.

        Arguments:
            call: call number of the dispatch (its parity selects one of two buffers).
            shape: (L, R*T, hidden).
            device: torch device of the buffer.

        Returns:
            buffer: `[L, R*T, hidden]` torch.bfloat16, allocated once per (parity, shape, device)
                and reused (contents unspecified).
        """
        key = (call % 2, tuple(shape), str(device))
        buffer = self._combine_buffers.get(key)
        if buffer is None:
            buffer = torch.empty(shape, dtype=torch.bfloat16, device=device)
            self._combine_buffers[key] = buffer
        return buffer

    # ------------------------------------------------------------------ failures
    def _recover(self, active_ranks: torch.Tensor, timeout_us: int, error: PeerLost) -> None:
        """A peer died during a collective: move to the survivors' view within the call's deadline.

        The survivors agree on the next epoch through the store (the dead never answer), get a group
        over themselves, and the caller's `active_ranks` loses the ranks that are gone.
        """
        if self.view_change is None:
            raise error
        import time

        before = set(self.members)
        budget = timeout_us / 1e6 if timeout_us >= 0 else 30.0
        view = self.view_change(time.monotonic() + max(0.5, budget))
        gone = sorted(before - set(view.ranks))
        for rank in range(self.num_ranks):
            if rank not in view.ranks:
                active_ranks[rank] = 0
        self.failed_sources.extend(gone)

    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple["_LazyPlan", Callable[[], None]]:
        """Run the send phase; return (the plan for combine, the receive phase that fills `outputs`).

        If a peer dies during the exchange, the survivors move to a group over themselves (within
        the call's deadline) and the dispatch runs again there, without the dead.

        Arguments:
            call: the validated `DispatchCall` (`x` must be on the CPU).
            outputs: the `DispatchOutputs` the receive phase fills.

        Returns:
            plan: the dispatch's plan (resolves to a `CollectivePlan` once the receive phase ran),
                kept on the handle for combine.
            receive: callable with no arguments that waits for the exchange and fills `outputs`.

        Raises:
            ValueError: `x` is not a CPU tensor (the Buffer has checked it already).
            RuntimeError: a source announced a token count outside `[0, T]`.
            PeerLost: a peer died and no view change is configured.
        """
        try:
            plan, receive = self._dispatch_once(call, outputs)
        except PeerLost as error:
            self._recover(call.active_ranks, call.timeout_us, error)
            plan, receive = self._dispatch_once(call, outputs)

        def guarded() -> None:
            try:
                receive()
            except PeerLost as error:
                self._recover(call.active_ranks, call.timeout_us, error)
                again, receive_again = self._dispatch_once(call, outputs)
                receive_again()
                plan.rows_from_rank, plan.row_index, plan.state = again.rows_from_rank, again.row_index, again.state

        return plan, guarded

    def dispatch_sync(self, call: DispatchCall, outputs: DispatchOutputs) -> "_LazyPlan":
        """`dispatch` followed at once by its receive phase (a synchronous call).

        Arguments:
            call: the validated `DispatchCall`.
            outputs: the `DispatchOutputs`, filled here.

        Returns:
            plan: as `dispatch`.
        """
        plan, receive = self.dispatch(call, outputs)
        receive()
        return plan

    def _dispatch_once(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple["_LazyPlan", Callable[[], None]]:
        x, topk = call.x, call.topk_idx
        if x.device.type != "cpu":
            raise ValueError(f"x: the collective transport packs on the CPU, expected a CPU tensor, got {x.device}")
        R, E, T = self.num_ranks, call.num_experts, call.num_max_dispatch_tokens_per_rank
        L = E // R
        N, K = topk.shape
        hidden = x.size(1)
        device = x.device
        record = record_layout(hidden, L, call.use_fp8)
        size = record[2]
        accept = call.active_ranks.clone()  # the sources this rank accepts: its view at dispatch time
        info = torch.empty((5, R), dtype=torch.int64)
        tokens_to, pairs_to, recv_tokens, accepted_by_t, rows_to_rank = info.unbind(0)
        row_index = torch.empty((N, K), dtype=torch.int64, device=device)
        fixed = R * (T + 1) * size <= FIXED_MODE_MAX_BYTES
        lease = self._staging.lease(("dispatch", call.call % 2), device)
        send = lease.get(0, R * (T + 1) * size if fixed else N * min(R, K) * size)
        records = coll_dispatch_pack(x, topk, E, R, T, accept, call.use_fp8, fixed, record, send,
                                                        tokens_to, pairs_to, row_index)
        if fixed:
            recv = lease.get(1, send.numel())
            work = self._all_to_all(recv, send, None, None, async_op=True)
            accepted_by = None
        else:
            counts_send = torch.stack([tokens_to, accept.to(torch.int64)], 1)
            counts_recv = torch.empty_like(counts_send)
            self._all_to_all(counts_recv, counts_send, None, None)
            recv_tokens.copy_(counts_recv[:, 0])
            recv_list, accepted = counts_recv.t().tolist()
            accepted_by = [bool(a) for a in accepted]
            for src, count in enumerate(recv_list):
                if count < 0 or count > T:
                    raise RuntimeError(f"collective dispatch: rank {src} announced {count} tokens, outside [0, {T}]")
            recv = lease.get(1, sum(recv_list) * size)
            send = send[:records * size]
            work = self._all_to_all(recv, send, [c * size for c in recv_list],
                                    [c * size for c in tokens_to.tolist()], async_op=True)

        state = {}

        def receive() -> None:
            try:
                work.wait()
                coll_dispatch_unpack(recv, R, T, hidden, L, record, fixed, recv_tokens,
                                                        accepted_by_t, accept, call.use_fp8, outputs, rows_to_rank)
            finally:
                lease.release()
            state["accepted_by"] = [bool(a) for a in accepted_by_t.tolist()] if fixed else accepted_by
            state["owner"] = (outputs.layout_range.clone(), rows_to_rank.tolist())

        return _LazyPlan(pairs_to.tolist(), row_index, state), receive

    # ------------------------------------------------------------------ combine
    def combine(self, call: CombineCall, in_place: bool = False) -> Callable[[], None]:
        """Run the send phase of combine; return the receive phase, which fills `call.out`.

        A peer that dies during the exchange: survivors move to their own group and run the
        combine again there; the dead owner's experts are skipped (no renormalisation).

        Arguments:
            call: the validated `CombineCall`; `transport_plan` must be the plan `dispatch` returned.
            in_place: the exchange may read `call.x` itself where its rows already lie in send order
                (`packed_prefix`): only when the receive phase runs before the caller gets `x` back
                (`combine_sync`); otherwise they are copied first, as the caller may write `x` again.

        Returns:
            receive: callable with no arguments that waits for the exchange and writes the
                weighted sum `[N, hidden]` torch.bfloat16 into `call.out`.

        Raises:
            ValueError: the handle carries no plan (a rebuilt tuple).
            RuntimeError: the dispatch's receive phase has not run, or the handle's layout_range
                is not the one its dispatch produced.
            PeerLost: a peer died and no view change is configured.
        """
        try:
            receive = self._combine_once(call, in_place)
        except PeerLost as error:
            self._recover(call.active_ranks, call.timeout_us, error)
            receive = self._combine_once(call, in_place)

        def guarded() -> None:
            try:
                receive()
            except PeerLost as error:
                self._recover(call.active_ranks, call.timeout_us, error)
                self._combine_once(call, in_place)()

        return guarded

    def combine_sync(self, call: CombineCall) -> None:
        """`combine` followed at once by its receive phase (a synchronous call).

        Arguments:
            call: the validated `CombineCall`; `call.out` is filled here.
        """
        self.combine(call, in_place=True)()

    def _combine_once(self, call: CombineCall, in_place: bool = False) -> Callable[[], None]:
        R = self.num_ranks
        L = call.num_experts // R
        hidden = call.hidden
        device = call.x.device
        plan = call.transport_plan
        if plan is None:
            raise ValueError("handle: the collective transport needs the handle returned by dispatch() "
                             "(a rebuilt tuple carries no record of what was sent)")
        plan = plan.resolve()
        if not torch.equal(call.layout_range, plan.layout_range):
            raise RuntimeError("collective combine: the handle's layout_range is not the one its dispatch produced "
                               "(mismatched handle or dispatch)")

        # Send back exactly what each source sent us, by source, local expert, token.
        lease = self._staging.lease(("combine", call.call % 2), device)
        row = 2 * hidden
        send = None
        if in_place:
            send = packed_prefix(call.x, call.layout_range, call.num_max_dispatch_tokens_per_rank,
                                 sum(plan.rows_to_rank))
        if send is None:
            send = lease.get(0, sum(plan.rows_to_rank) * row).view(torch.bfloat16).view(-1, hidden)
            coll_combine_pack(call.x, call.layout_range, call.num_max_dispatch_tokens_per_rank, send)
        # Receive what we sent to every owner that accepted us (one that did not returns nothing).
        output_splits = [n if ok else 0 for n, ok in zip(plan.rows_from_rank, plan.accepted_by)]
        recv = lease.get(1, sum(output_splits) * row).view(torch.bfloat16).view(-1, hidden)
        try:
            work = self._all_to_all(recv, send, output_splits, plan.rows_to_rank, async_op=True)
        except BaseException:
            lease.release()
            raise
        active_now = [bool(v) for v in call.active_ranks.tolist()]

        def receive() -> None:
            try:
                work.wait()
                self._reduce(call, plan, recv, output_splits, active_now, L)
            finally:
                lease.release()

        return receive

    @staticmethod
    def _reduce(call: CombineCall, plan: CollectivePlan, recv: torch.Tensor, output_splits, active_now, L) -> None:
        """Weighted top-k reduction of the returned rows into `call.out`."""
        device = recv.device
        keep = [a and b for a, b in zip(active_now, plan.accepted_by)]
        row_index = plan.row_index
        if not all(keep) or output_splits != plan.rows_from_rank:
            # Owners that returned nothing or went inactive: skip their pairs, shift the rest.
            shift = (_exclusive_cumsum(torch.tensor(output_splits)) -
                     _exclusive_cumsum(torch.tensor(plan.rows_from_rank))).to(device)
            keep_t = torch.tensor(keep, dtype=torch.bool, device=device)
            owner = torch.div(call.topk_idx, L, rounding_mode="floor").clamp_(min=0)
            row_index = torch.where(keep_t[owner] & (row_index >= 0), row_index + shift[owner], -1).contiguous()
        combine_reduce(call.out, row_index, call.topk_weights, recv, call.bias)


class _Lease:
    """Byte buffers of one call, reused from the pool when free, fresh otherwise.

    A lease that is never released (its call failed before the exchange) just drops its buffers.
    """

    __slots__ = ("pool", "key", "buffers", "pooled", "device")

    def __init__(self, pool: "_StagingPool", key, buffers, pooled: bool, device):
        self.pool, self.key, self.buffers, self.pooled, self.device = pool, key, buffers, pooled, device

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """A torch.uint8 view of `nbytes` bytes of buffer `index`."""
        buffer = self.buffers.get(index)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self.buffers[index] = buffer
        return buffer[:nbytes]

    def release(self) -> None:
        """The call is done with its buffers (idempotent)."""
        if self.pooled:
            self.pooled = False
            self.pool.give_back(self.key, self.buffers)


class _StagingPool:
    """Send/receive staging buffers kept across calls, one set per (phase, call parity).

    Allocating them per call costs a page fault per 4 KiB touched (glibc returns large blocks to
    the kernel). A set is lent to one call at a time; a call that finds its set still lent (a
    previous call's receive phase has not run yet) gets fresh buffers instead.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._free = {}

    def lease(self, key, device) -> _Lease:
        """The free set for `key` (or a new, empty one), lent until `_Lease.release()`."""
        key = (key, str(device))
        with self._lock:
            buffers = self._free.pop(key, None)
        return _Lease(self, key, {} if buffers is None else buffers, True, device)

    def give_back(self, key, buffers) -> None:
        with self._lock:
            self._free[key] = buffers

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class _LazyPlan:
    """The dispatch's `CollectivePlan`, completed by its receive phase (which must have run)."""

    __slots__ = ("rows_from_rank", "row_index", "state")

    def __init__(self, rows_from_rank, row_index, state):
        self.rows_from_rank = rows_from_rank
        self.row_index = row_index
        self.state = state

    def resolve(self) -> CollectivePlan:
        owner = self.state.get("owner")
        if owner is None:
            raise RuntimeError("combine: the dispatch's receive phase has not completed (call its hook or wait "
                               "for its event first)")
        layout_range, rows_to_rank = owner
        return CollectivePlan(self.rows_from_rank, self.state["accepted_by"], self.row_index, layout_range,
                              rows_to_rank)
