"""`EPHandle`: what an `ElasticBuffer.dispatch` returns for its combine and for cached re-dispatches."""
import itertools
from typing import Any, List, Optional

import torch

from mooncake_ep_switch.elastic_buffer import layout as lay


class EPHandle:
    """Communication handle of `ElasticBuffer.dispatch`, with DeepEP V2's attributes.

    Reused as a cached handle by later dispatches (same layout, no routing recomputed) and consumed
    by `ElasticBuffer.combine` to send the partials back.

    Attributes:
        do_expand: whether the expanded layout (one row per token and local expert) is used.
        num_experts: `E`, all experts.
        expert_alignment: each local expert's received rows are padded to a multiple of this.
        num_max_tokens_per_rank: `T`, the same on every rank.
        num_sms: the SM count passed to (or chosen by) dispatch; kept for V2 callers, unused here.
        topk_idx: `[num_tokens, num_topk]` torch.int64, the dispatch's top-k ids (a copy with
            `do_handle_copy`).
        num_recv_tokens: received tokens (each once per source token), exact (this runtime always
            knows the counts on the host).
        num_expanded_tokens: rows of the expanded layout (aligned), 0 when not expanded.
        num_recv_tokens_per_expert_list: list of int, per local expert, received (token, expert)
            pairs padded to `expert_alignment`.
        psum_num_recv_tokens_per_scaleup_rank: `[num_ranks]` torch.int32, inclusive prefix sum of the
            received tokens per source rank (one scale-up domain: every rank is a scale-up rank).
        psum_num_recv_tokens_per_expert: `[num_local_experts]` torch.int32; not expanded, the inclusive
            prefix sum of the aligned counts; expanded, `align(psum[i-1]) + count[i]`, V2's form.
        num_unaligned_recv_tokens_per_expert: `[num_local_experts]` torch.int32 counts (expanded only,
            else None).
        recv_src_metadata: `[num_recv_tokens, 2 + num_topk]` torch.int32: column 0 the source token's
            global index `src_rank * T + token`, column 1 `src_rank * num_topk + k` of the token's first
            top-k entry on this rank, then per top-k entry the row of the expanded layout holding it
            (-1: not on this rank, or not expanded).
        dst_buffer_slot_idx: `[num_tokens, num_ranks]` torch.int32, the row each of this rank's tokens
            takes among the rows this rank sends to each destination (-1: not sent there).
        token_metadata_at_forward, channel_linked_list: None (V2's hybrid mode only).
    """

    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int],
                 psum_num_recv_tokens_per_scaleup_rank: Optional[torch.Tensor],
                 psum_num_recv_tokens_per_expert: Optional[torch.Tensor],
                 num_unaligned_recv_tokens_per_expert: Optional[torch.Tensor], recv_src_metadata: Optional[torch.Tensor],
                 dst_buffer_slot_idx: Optional[torch.Tensor], route: Any, num_ranks: int = 0):
        """Keep the attributes. `psum_num_recv_tokens_per_scaleup_rank`, `recv_src_metadata` and
        `dst_buffer_slot_idx` may be None (and `psum_num_recv_tokens_per_expert`, not expanded: the prefix
        sum of `num_recv_tokens_per_expert_list`): each is then computed from `route` (and `num_ranks`) when
        first read, and kept (a round that never reads them never pays for them). As in V2, a caller may
        assign each (V2's own test trims `recv_src_metadata`); combine reads `route`, never these."""
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self._psum_per_rank = psum_num_recv_tokens_per_scaleup_rank
        self._psum_expert = psum_num_recv_tokens_per_expert
        self._aligned = tuple(num_recv_tokens_per_expert_list)  # psum_num_recv_tokens_per_expert's, when first read
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self._src_metadata = recv_src_metadata
        self._dst_slots = dst_buffer_slot_idx
        self._num_ranks = num_ranks
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.route = route  # this runtime's own part: the inner routing and the receive layout (layout.Route)

    @property
    def psum_num_recv_tokens_per_scaleup_rank(self) -> torch.Tensor:
        """`[num_ranks]` torch.int32 (see the class docstring), computed when first read."""
        if self._psum_per_rank is None:
            src_global, T = self.route.recv_src_global, self.num_max_tokens_per_rank
            per_source = torch.bincount(torch.div(src_global, T, rounding_mode="floor"),
                                        minlength=self._num_ranks)[:self._num_ranks]
            self._psum_per_rank = torch.cumsum(per_source, 0).to(torch.int32)
        return self._psum_per_rank

    @psum_num_recv_tokens_per_scaleup_rank.setter
    def psum_num_recv_tokens_per_scaleup_rank(self, value: torch.Tensor) -> None:
        self._psum_per_rank = value  # a plain attribute to callers, as in V2

    @property
    def psum_num_recv_tokens_per_expert(self) -> torch.Tensor:
        """`[num_local_experts]` torch.int32 (see the class docstring); when not given, the inclusive prefix
        sum of the aligned counts, computed when first read."""
        if self._psum_expert is None:
            self._psum_expert = torch.tensor(list(itertools.accumulate(self._aligned)), dtype=torch.int32,
                                             device=self.route.recv_src_global.device)
        return self._psum_expert

    @psum_num_recv_tokens_per_expert.setter
    def psum_num_recv_tokens_per_expert(self, value: torch.Tensor) -> None:
        self._psum_expert = value

    @property
    def recv_src_metadata(self) -> torch.Tensor:
        """`[num_recv_tokens, 2 + num_topk]` torch.int32 (see the class docstring), computed when first read."""
        if self._src_metadata is None:
            route = self.route
            self._src_metadata = lay.src_metadata(route.recv_src_global, route.recv_local_topk, route.slots,
                                                  self.num_max_tokens_per_rank)
        return self._src_metadata

    @recv_src_metadata.setter
    def recv_src_metadata(self, value: torch.Tensor) -> None:
        self._src_metadata = value  # V2's program trims it in place (`--do-cpu-sync 0`)

    @property
    def dst_buffer_slot_idx(self) -> torch.Tensor:
        """`[num_tokens, num_ranks]` torch.int32 (see the class docstring), computed when first read."""
        if self._dst_slots is None:
            self._dst_slots = lay.dst_slots(self.topk_idx, self.num_experts, self._num_ranks)
        return self._dst_slots

    @dst_buffer_slot_idx.setter
    def dst_buffer_slot_idx(self, value: torch.Tensor) -> None:
        self._dst_slots = value

    def __repr__(self) -> str:
        mode = "expanded" if self.do_expand else "not expanded"
        return (f"EPHandle({mode}, {self.num_recv_tokens} tokens received, E={self.num_experts}, "
                f"T={self.num_max_tokens_per_rank}, alignment={self.expert_alignment})")


def new_handle(route: lay.Route, do_expand: bool, num_experts: int, alignment: int, T: int, num_sms: int,
               topk_idx: torch.Tensor, do_handle_copy: bool, counts, R: int, src_global: torch.Tensor) -> EPHandle:
    """The handle of a new (not cached) dispatch: V2's attributes from its route and receive counts."""
    device = src_global.device
    aligned = [lay.align(c, alignment) for c in counts]
    if do_expand:
        starts = [sum(aligned[:j]) for j in range(len(counts))]
        psum_expert = torch.tensor([s + c for s, c in zip(starts, counts)], dtype=torch.int32, device=device)
        unaligned = torch.tensor(counts, dtype=torch.int32, device=device)
    else:
        psum_expert = unaligned = None  # the prefix sum of `aligned`, computed when first read
    # The source metadata, the destination slots and the per-rank prefix sum are computed when first read.
    return EPHandle(do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
                    num_max_tokens_per_rank=T, num_sms=num_sms, topk_idx=topk_idx.clone() if do_handle_copy
                    else topk_idx, num_recv_tokens=src_global.numel(), num_expanded_tokens=route.num_slots,
                    num_recv_tokens_per_expert_list=aligned, psum_num_recv_tokens_per_scaleup_rank=None,
                    psum_num_recv_tokens_per_expert=psum_expert, num_unaligned_recv_tokens_per_expert=unaligned,
                    recv_src_metadata=None, dst_buffer_slot_idx=None, route=route, num_ranks=R)


def check_usable(handle: EPHandle, owner: object, generation: int, runtime) -> None:
    """Refuse a handle that its buffer no longer serves: another buffer's, one from before an
    `update_ep_member()`, or one from before a view that admitted a rank (a new process without it).

    An epoch that only lost members keeps the handle usable, the lost ranks masked: the collective
    fallback agrees on a view without a dead rank inside the call that met the death, where shared
    memory and the Transfer Engine only mask it; the transports agree on the handle either way.

    Arguments:
        handle: the `EPHandle` given to a dispatch or combine.
        owner: the buffer's token (`route.owner` of its handles).
        generation: the buffer's count of `update_ep_member()` calls.
        runtime: the buffer's inner `Buffer` (its `epoch`, and its `membership` for the views since).

    Raises:
        ValueError: naming `handle`, the expectation and what came.
    """
    route = handle.route
    if route.owner is not owner:
        raise ValueError("handle: expected an EPHandle returned by this ElasticBuffer's dispatch, got one of "
                         "another buffer")
    epoch = runtime.epoch
    if route.generation != generation:
        raise ValueError(f"handle: expected a handle of membership epoch {epoch}, got one of epoch "
                         f"{route.epoch} (update_ep_member() ran since its dispatch: dispatch again)")
    if route.epoch != epoch:
        admitted = admitted_since(runtime.membership, route.epoch, epoch)
        if admitted:
            raise ValueError(f"handle: expected a handle whose dispatch saw every member, got one of epoch "
                             f"{route.epoch}; ranks {admitted} were admitted since (epoch {epoch}): dispatch again")
        route.epoch = epoch  # checked once: the views since its dispatch only lost ranks


def admitted_since(membership, epoch: int, current: int) -> List[int]:
    """Ranks that a view after `epoch` (up to `current`) holds and the view before it did not: admitted
    replacements, or ranks left out and let back in (each a new process without the handle).

    Arguments:
        membership: the inner Buffer's `Membership` (None: no store, so no view ever changes).
        epoch, current: membership epochs, `epoch <= current`.

    Returns:
        admitted: sorted list of int ranks.
    """
    if membership is None:
        return []
    admitted, before = set(), set(membership.view(epoch).ranks)
    for later in range(epoch + 1, current + 1):
        ranks = set(membership.view(later).ranks)
        admitted |= ranks - before
        before = ranks
    return sorted(admitted)
