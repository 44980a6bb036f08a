"""The per-call region layout (offsets computed once, in native code) and the size hint."""
from functools import lru_cache
from typing import NamedTuple

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
