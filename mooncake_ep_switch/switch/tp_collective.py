"""The TP-mode collective: a deterministic, fault-aware all-reduce next to dispatch/combine.

One-sided (`"shm"`): every rank writes its float32 partial `[N, H]` into slot `[me]` of every active
peer's region and then raises that peer's signal `[me]` (tag = call number, count = N), exactly the
protocol of dispatch/combine (docs/protocol.md: data first, then a release-ordered, tagged signal).
Each rank waits for every active source's signal with the call's deadline; a source that misses it
is set to 0 in the caller's `active_ranks` and contributes nothing. The sum runs in float32 in rank
order (rank 0 first, starting from 0.0), then rounds to bf16, so every rank returns the same bits.

Region per rank: two halves (call n uses half n % 2, as dispatch does: a rank reaches call n+2
only after every peer's call n+1 signal, which the peer raises after it finished reading call n),
each `[R][max_tokens][H]` float32, plus signal words `[2][R]`.

Collective (the `"collective"` transport, Mooncake's `_use_fallback`, and the `"mooncake"` transport,
which maps no peer memory): an all-gather of the partials, then the same rank-order sum. It runs on the
current view's group (`switch_group.all_reduce_group`: the constructor's group in epoch 0, after a
membership change a gloo group of the view built through the store on the epoch's first call, or the
fallback's own view group), so after a rank's death and its replacement's admission the members and the
replacement reduce together; ranks outside the view contribute nothing and are set to 0 in
`active_ranks`. A peer that dies or stalls during the call cannot be survived there, but the call ends by
its `timeout_us` (`switch.group_wait`: `MembershipError` naming a member the peer watcher saw end, else
`TimeoutError` at the deadline), not at the group's timeout; that group is then abandoned (the next view's
group, after `update_ep_member()`, or a new rendezvous of the epoch, serves the next call).

CUDA tensors (a Buffer on the `"cuda"` transport): the partials and the sum take the host protocol
above (one device-to-host copy of `x`, one host-to-device copy of the result), so the TP layout keeps
the same bits and the same fault handling as on the host. The rows are few (a TP step's tokens);
NCCL is not used: its all-reduce order is not rank order, and a dead peer hangs it.
"""
import time
import weakref
from typing import Optional

import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer import peer_regions
from mooncake_ep_switch.buffer.membership.store_deadline import store_deadline
from mooncake_ep_switch.buffer.shared_region import SharedRegion
from mooncake_ep_switch.checks import check_int, check_timeout
from mooncake_ep_switch.errors import MembershipError
from mooncake_ep_switch.switch.group_wait import abandoned_reason, wait_work
from mooncake_ep_switch.switch.switch_group import all_reduce_group

_TAG_SPACE = (1 << 32) - 1
_SIGNALS_BYTES = 4096


KIND = "tp_all_reduce"  # participant kind in the Buffer's peer regions


class TPAllReduce:
    """Sum of every rank's `[N, H]` partial, float32 in rank order, returned as bf16 on every rank.

    Collective at construction (every rank of `buffer.group` builds one with the same arguments).

    Arguments:
        buffer: a `mooncake_ep_switch.Buffer` (group, rank, size and transport are used).
        max_tokens: the most rows `N` any call reduces.
        hidden: `H`, the row length.
    """

    def __init__(self, buffer, max_tokens: int, hidden: int):
        max_tokens = check_int("max_tokens", max_tokens, 1)
        hidden = check_int("hidden", hidden, 1)
        joined = peer_regions.joined_state(buffer, KIND)  # a replacement takes the members' call counter
        self.group = peer_regions.group_of(buffer)
        self.rank = buffer.rank
        self.num_ranks = buffer.num_ranks
        self.transport = buffer.transport
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.call = 0 if joined is None else joined["call"]
        self.slot_bytes = max_tokens * hidden * 4
        self.half_bytes = self.num_ranks * self.slot_bytes
        self.region: Optional[SharedRegion] = None
        if peer_regions.one_sided(buffer):  # host words and partials, also for CUDA tensors (staged)
            nbytes = _SIGNALS_BYTES + ((16 * self.num_ranks + 4095) // 4096) * 4096 + 2 * self.half_bytes
            self.data_offset = nbytes - 2 * self.half_bytes
            self.region = SharedRegion(self.group, self.rank, self.num_ranks, nbytes)
        self._registry = getattr(buffer, "peer_regions", None)
        self._buffer = weakref.ref(buffer)
        self.index = peer_regions.register(buffer, self, KIND)  # the same on every rank and for a replacement

    def _signal_addr(self, rank: int, half: int, source: int) -> int:
        return self.region.peer_bases[rank] + 8 * (half * self.num_ranks + source)

    def _slot(self, rank: int, half: int, source: int, nbytes: int) -> torch.Tensor:
        start = self.data_offset + half * self.half_bytes + source * self.slot_bytes
        region = self.region.local if rank == self.rank else self.region.peer(rank)
        return region[start:start + nbytes]

    def all_reduce(self, x: torch.Tensor, active_ranks: torch.Tensor, timeout_us: int = 30_000_000, *,
                   float32_result: bool = False) -> torch.Tensor:
        """Reduce `x` over the group.

        Arguments:
            x: `[N, H]` torch.float32 (or torch.bfloat16, widened), `N <= max_tokens`; every rank
                passes the same N. A CUDA tensor (a Buffer on the "cuda" transport) is staged through
                host memory; the result comes back on its device.
            active_ranks: `[R]` torch.int32 (1 active, 0 inactive), caller-owned; sources that miss
                the deadline (and, on the collective path, ranks outside the current view) are set to 0
                in place. Inactive ranks are neither sent to nor waited for (the collective path gathers
                every member's partial and leaves the inactive ones out of the sum).
            timeout_us: deadline for the whole receive in microseconds, -1 = none.
            float32_result: return the float32 sum itself (no bf16 rounding): with every rank but
                one passing zeros in a row, that row arrives bit-exact (an all-gather of rows).

        Returns:
            out: `[N, H]` torch.bfloat16 on `x`'s device, `bf16(sum over active ranks in rank order of
                float32 x_r)` (torch.float32 and unrounded with `float32_result`).

        Raises:
            ValueError: `x` or `active_ranks` of another shape or dtype.
            MembershipError: on the collective path, this rank is not a member of the current view (a
                replacement not admitted yet), or members known dead (before or during the call) are not
                sealed out yet (`missing` names them: call `update_ep_member()` first), or the view's group
                was abandoned after such a failure.
            TimeoutError: on the collective path, the gather did not complete by `timeout_us` (a member
                stalled, or ended unseen by the peer watcher); call `update_ep_member()` before the next call.
            StoreUnavailable: on the collective path after a membership change, the store did not answer
                the rendezvous of the new view's group by `timeout_us`; call again once it answers.
        """
        if x.dim() != 2 or x.size(1) != self.hidden or x.size(0) > self.max_tokens or x.dtype not in (
                torch.float32, torch.bfloat16):
            raise ValueError(f"x: expected [N <= {self.max_tokens}, {self.hidden}] torch.float32 or torch.bfloat16, "
                             f"got {list(x.shape)} {x.dtype}")
        if (not isinstance(active_ranks, torch.Tensor) or active_ranks.dtype != torch.int32
                or tuple(active_ranks.shape) != (self.num_ranks,)):
            raise ValueError(f"active_ranks: expected a [{self.num_ranks}] torch.int32 tensor, got "
                             f"{getattr(active_ranks, 'shape', None)} {getattr(active_ranks, 'dtype', type(active_ranks))}")
        timeout_us = check_timeout(timeout_us)
        device = x.device
        x32 = x.float().contiguous().cpu()  # CUDA partials are staged through host memory (see module docstring)
        rows = x32.size(0)
        self.call += 1
        if self.region is None:
            out = self._gathered_sum(x32, active_ranks, timeout_us)
            return (out if float32_result else out.to(torch.bfloat16)).to(device)

        tag = (self.call - 1) % _TAG_SPACE + 1
        half = self.call % 2
        nbytes = rows * self.hidden * 4
        payload = x32.view(-1).view(torch.uint8)
        active = active_ranks.tolist()
        for step in range(1, self.num_ranks):
            dest = (self.rank + step) % self.num_ranks
            if not active[dest]:
                continue
            if nbytes:
                self._slot(dest, half, self.rank, nbytes).copy_(payload)
            _native.signal_publish(self._signal_addr(dest, half, self.rank), (tag << 32) | rows)
        sources = [s for s in range(self.num_ranks) if s != self.rank and active[s]]
        addrs = [self._signal_addr(self.rank, half, s) for s in sources]
        missing = _native.wait_words(addrs, [tag << 32] * len(addrs), 0, timeout_us) if addrs else []
        late = {sources[i] for i in missing}
        for s in sources:
            if s not in late and _native.signal_load(self._signal_addr(self.rank, half, s)) & 0xFFFFFFFF != rows:
                late.add(s)  # protocol error: a peer reduced a different N; treat it as failed
        for s in late:
            active_ranks[s] = 0
        out = torch.zeros_like(x32)
        for s in range(self.num_ranks):
            if s == self.rank:
                out += x32
            elif active[s] and s not in late and rows:
                out += self._slot(self.rank, half, s, nbytes).view(torch.float32).view(rows, self.hidden)
        return (out if float32_result else out.to(torch.bfloat16)).to(device)

    def _gathered_sum(self, x32: torch.Tensor, active_ranks: torch.Tensor, timeout_us: int) -> torch.Tensor:
        """The collective path: all-gather over the current view's group, float32 sum in rank order of the
        active members' partials; ranks outside the view are set to 0 in `active_ranks`."""
        buffer = self._buffer()
        if buffer is None:
            raise RuntimeError("all_reduce: the TPAllReduce's Buffer was destroyed")
        group_timeout_s = timeout_us / 1e6 if timeout_us > 0 else 300.0
        deadline = time.monotonic() + timeout_us / 1e6 if timeout_us > 0 else None
        # A group of a new view is built through the store: by the caller's deadline (StoreUnavailable), not the store's.
        with store_deadline(deadline, "all_reduce"):
            group, members = all_reduce_group(buffer, self, group_timeout_s, f"mep/{KIND}/{self.index}")
        abandoned = abandoned_reason(group)
        if abandoned is not None:  # a collective on it was given up on (group_wait): the next view has a new one
            raise MembershipError(f"all_reduce: the group of the current view (epoch {buffer.epoch}) is not usable "
                                  f"after an earlier failure ({abandoned}); call update_ep_member() first")
        parts = [torch.empty_like(x32) for _ in members]
        # The group's own call (a per-view group is not registered in torch), waited for by the caller's deadline
        # and the peer watcher, not the group's timeout.
        wait_work(group.allgather([parts], [x32]), group, deadline, buffer, members, "all_reduce", self)
        for rank in range(self.num_ranks):
            if rank not in members:
                active_ranks[rank] = 0
        active = active_ranks.tolist()
        out = torch.zeros_like(x32)
        for position, rank in enumerate(members):  # members ascend: rank order
            if rank == self.rank or active[rank]:
                out += parts[position]
        return out

    # ------------------------------------------------------------------ membership (peer_regions.Participant)
    def shared_regions(self) -> list:
        """The region peers write their partials into (none on the collective transport).

        Returns:
            regions: list of `SharedRegion`.
        """
        return [] if self.region is None else [self.region]

    def peer_state(self) -> dict:
        """What a replacement of this rank takes over.

        Returns:
            state: dict with `"call"` (int, the call counter that tags every signal).
        """
        return {"call": self.call}

    def readmitted(self, ranks) -> None:
        """Nothing to forget: signals are tagged by the call counter the replacement takes over."""

    def destroy(self) -> None:
        """Unmap the region; idempotent."""
        if getattr(self, "_registry", None) is not None:
            self._registry.remove(self)
            self._registry = None
        if self.region is not None:
            self.region.destroy()
            self.region = None
