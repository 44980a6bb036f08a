"""The per-call region layout (offsets computed once, in native code) and the size hint."""
from functools import lru_cache
from typing import Callable, Iterable, List, NamedTuple, Optional, Set, Tuple

import torch

from mooncake_ep_switch import _native


class RegionLayout(NamedTuple):
    """Byte layout of an EP region for one call shape, as in docs/protocol.md.

    Offsets are relative to the start of a half; the half of call number `n` begins at
    `control_bytes + (n % 2) * half_bytes`.
    """

    control_bytes: int
    half_bytes: int
    total_bytes: int
    row_bytes: int
    num_local_experts: int
    num_scale_groups: int
    dispatch_data: int
    dispatch_scales: int
    dispatch_src: int
    combine_data: int
    dispatch_signals: int
    combine_signals: int
    combine_send: int

    def half_offset(self, call: int) -> int:
        """Byte offset of the half used by call number `call`.

        Arguments:
            call: call sequence number, >= 0 (calls alternate between the two halves).

        Returns:
            offset: int, `control_bytes + (call % 2) * half_bytes`, from the start of the region.
        """
        return self.control_bytes + (call % 2) * self.half_bytes


@lru_cache(maxsize=64)
def region_layout(num_ranks: int, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> RegionLayout:
    """Compute the region layout for a call shape.

    Arguments:
        num_ranks: `R`.
        num_max_dispatch_tokens_per_rank: `T`.
        hidden: `H`, a multiple of 128.
        num_experts: `E`, a multiple of `R`.

    Returns:
        layout: a `RegionLayout`.
    """
    fields = _native.region_layout(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts)
    return RegionLayout(**{name: int(fields[name]) for name in RegionLayout._fields})


class LayoutHeld(ValueError):
    """A call's shape needs another region layout while a masked peer may still write in the held one
    (`RegionLayouts.use`); raised before anything is written or numbered."""


class RegionLayouts(dict):
    """The layouts of one rank's region, `(T, hidden, E) -> RegionLayout`, each checked to fit once.

    A dict, so that a hot path looks a known shape up with `dict.get` itself; `fit` computes and
    checks a new one. Shared by the one-sided transports (shm / Transfer Engine, cuda).

    Arguments:
        num_ranks: `R`.
        nbytes: the region's size (`num_ep_buffer_bytes`).
    """

    def __init__(self, num_ranks: int, nbytes: int):
        super().__init__()
        self.num_ranks, self.nbytes = num_ranks, nbytes
        # The late-write guard (docs/protocol.md, failure semantics): a peer masked while its process
        # may live can still finish the call it had started, in that call's layout; in another
        # layout its rows would land in other ranks' rows (half sizes, hence every offset, depend
        # on the shape). So the region keeps the layout it had when such a peer was masked.
        self.latest: Optional[Tuple[int, int, int]] = None  # (T, hidden, E) of the latest call
        self.held: Optional[Tuple[int, int, int]] = None  # the layout kept while `unsettled` is not empty
        self.unsettled: Set[int] = set()  # masked peers whose process may still write into the region

    def hold(self, ranks: Iterable[int], dead: Iterable[int], key: Optional[Tuple[int, int, int]] = None) -> None:
        """Keep the region in the layout of the call that masked `ranks`: those not in `dead` (their
        process was seen to end) may still write into it in that layout.

        Arguments:
            ranks: ranks a call just masked.
            dead: ranks whose process ended (`dead_peers()`).
            key: that call's `(T, hidden, E)` (None: the latest call's).
        """
        live = set(ranks) - set(dead)
        if live:
            self.unsettled |= live
            if self.held is None:
                self.held = key or self.latest

    def settle(self, rank: int) -> None:
        """`rank` writes in the current layout again (it was mapped anew: admitted by a view)."""
        self.unsettled.discard(rank)
        if not self.unsettled:
            self.held = None

    def use(self, key: Tuple[int, int, int], dead_peers: Callable[[], List[int]]) -> None:
        """Record a call's shape `(T, hidden, E)`, refusing a layout other than the held one.

        Arguments:
            key: the call's `(num_max_dispatch_tokens_per_rank, hidden, num_experts)`.
            dead_peers: returns the ranks whose process ended (read only when the shape changes
                while the layout is held).

        Raises:
            LayoutHeld: (a ValueError) the layout is held for a masked peer that may still write in
                it; nothing changed.
        """
        held = self.held
        if held is not None and key != held:
            self.unsettled -= set(dead_peers())
            if self.unsettled:
                ranks = sorted(self.unsettled)
                who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
                raise LayoutHeld(
                    f"num_max_dispatch_tokens_per_rank, hidden, num_experts: expected {held} while {who} masked "
                    f"by a deadline may still write into this Buffer's region in that layout (a stalled or slow "
                    f"process finishing its call; in another layout its rows would land in other ranks' rows), "
                    f"got {key}; keep this shape until that process is seen to end or update_ep_member() "
                    f"admits the rank again")
            self.held = None
        self.latest = key

    def fit(self, tokens: int, hidden: int, experts: int) -> RegionLayout:
        """The layout of a call shape, checked once to fit the region.

        Arguments:
            tokens: `T`.
            hidden: `H`.
            experts: `E`.

        Returns:
            layout: a `RegionLayout`.

        Raises:
            ValueError: the shape needs more than the region has (the Buffer checked already; never
                write past a region).
        """
        layout = self.get((tokens, hidden, experts))
        if layout is None:
            layout = region_layout(self.num_ranks, tokens, hidden, experts)
            if layout.total_bytes > self.nbytes:
                raise ValueError(f"num_ep_buffer_bytes: call needs {layout.total_bytes}, region has {self.nbytes}")
            self[(tokens, hidden, experts)] = layout
        return layout

    def combine_view(self, region: torch.Tensor, call: int, shape: Tuple[int, int, int]) -> torch.Tensor:
        """The zero-copy combine buffer of call number `call`: a view of its half of `region`.

        Arguments:
            region: `[nbytes]` torch.uint8, the whole region (on its device).
            call: call number of the dispatch (selects the half).
            shape: (L, R*T, hidden).

        Returns:
            buffer: `[L, R*T, hidden]` torch.bfloat16 view (every call of the same parity shares it).
        """
        local, rows, hidden = shape
        layout = self.fit(rows // self.num_ranks, hidden, local * self.num_ranks)
        start = layout.half_offset(call) + layout.combine_send
        return region[start:start + local * rows * hidden * 2].view(torch.bfloat16).view(local, rows, hidden)


def check_half_not_reused(what: str, call: int, latest_dispatch: int) -> None:
    """Refuse a receive phase run after the dispatch after next was sent (double buffering, as in
    DeepEP: at most two calls in flight): that dispatch reused this call's region half, so peers
    may already have overwritten its rows (dispatch) or sent the later combine's rows and tags
    into it (combine).

    Arguments:
        what: `"dispatch"` or `"combine"`.
        call: call number of the receive phase.
        latest_dispatch: call number of the latest dispatch sent.

    Raises:
        RuntimeError: the half was reused.
    """
    if latest_dispatch - call >= 2:
        raise RuntimeError(f"{what}: the receive phase of call {call} ran after call {latest_dispatch} "
                           f"reused its region half; complete a {what} (hook or event) before the dispatch "
                           "after next")
