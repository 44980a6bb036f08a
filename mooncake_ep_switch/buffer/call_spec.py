"""Validated call shapes of one Buffer: the full checks run once per shape, later calls look it up.

A `CallSpec` is what a (T, E, hidden, FP8) shape derives (local experts, receive rows, output
shapes); `CallSpecs` keeps those a Buffer has validated, the region capacity included, so the hot
path of dispatch() checks only what can change between calls of one shape.
"""
from typing import Dict, Tuple

import torch

from mooncake_ep_switch.buffer import validation
from mooncake_ep_switch.buffer.layout import region_layout

MAX_SPECS = 64  # shapes kept per Buffer; more distinct shapes start the cache afresh


class CallSpec:
    """A validated call shape of one Buffer (T, E, hidden, FP8), with what its calls derive from it.

    Built once per shape after the full validation (capacity included) passed; the hot path of
    dispatch() looks it up, and combine() trusts a handle whose plan carries this Buffer's spec.
    `owner` is the Buffer's token (not the Buffer: a handle must not keep a Buffer alive).
    """

    __slots__ = ("owner", "tokens", "experts", "hidden", "use_fp8", "local", "rows", "y_shape", "src_shape",
                 "range_shape")

    def __init__(self, owner: object, tokens: int, experts: int, hidden: int, use_fp8: bool, num_ranks: int):
        self.owner, self.tokens, self.experts, self.hidden, self.use_fp8 = owner, tokens, experts, hidden, use_fp8
        self.local = experts // num_ranks
        self.rows = num_ranks * tokens
        self.y_shape = torch.Size((self.local, self.rows, hidden))
        self.src_shape = torch.Size((self.local, self.rows))
        self.range_shape = torch.Size((self.local, num_ranks))


def check_capacity(num_ranks: int, tokens: int, hidden: int, experts: int, num_ep_buffer_bytes: int,
                   needs_region: bool) -> None:
    """Raise if a call of this shape does not fit the Buffer's EP region.

    Arguments:
        num_ranks: EP group size.
        tokens: `num_max_dispatch_tokens_per_rank` of the call.
        hidden: hidden size.
        experts: global number of experts.
        num_ep_buffer_bytes: the Buffer's region bytes.
        needs_region: the call runs through the region (any one-sided transport, or a collective
            Buffer that was given a region anyway).

    Raises:
        ValueError: the region is too small, naming `num_ep_buffer_bytes` and the bytes needed.
    """
    needed = region_layout(num_ranks, tokens, hidden, experts).total_bytes
    if needs_region and needed > num_ep_buffer_bytes:
        raise ValueError(
            f"num_ep_buffer_bytes: this call (num_max_dispatch_tokens_per_rank={tokens}, hidden={hidden}, "
            f"num_ranks={num_ranks}, num_experts={experts}) needs {needed} bytes "
            f"(Buffer.get_ep_buffer_size_hint), the buffer has {num_ep_buffer_bytes}")


class CallSpecs:
    """The shapes one Buffer validated: `(T, E, hidden, use_fp8) -> CallSpec`."""

    def __init__(self, owner: object, num_ranks: int, num_ep_buffer_bytes: int, needs_region: bool):
        self.owner, self.num_ranks = owner, num_ranks
        self.num_ep_buffer_bytes, self.needs_region = num_ep_buffer_bytes, needs_region
        self._specs: Dict[tuple, CallSpec] = {}
        # The hot path's lookup: the spec of a validated shape `(T, E, hidden, use_fp8)`, or None
        # (the dict's own bound method: no extra Python frame per dispatch).
        self.get = self._specs.get

    def check_capacity(self, tokens: int, hidden: int, experts: int) -> None:
        """`check_capacity` for this Buffer's region (ValueError naming num_ep_buffer_bytes)."""
        check_capacity(self.num_ranks, tokens, hidden, experts, self.num_ep_buffer_bytes, self.needs_region)

    def validate_dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts,
                          timeout_us, use_fp8, device=None) -> Tuple[CallSpec, int]:
        """Full dispatch validation (every error names its argument; `device`: the Buffer's CUDA
        device, or None for CPU tensors); returns (spec, timeout_us)."""
        tokens, experts, timeout_us, use_fp8 = validation.check_dispatch(
            x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts, timeout_us, use_fp8,
            self.num_ranks, device)
        hidden = x.size(1)
        key = (tokens, experts, hidden, use_fp8)
        spec = self._specs.get(key)
        if spec is None:
            self.check_capacity(tokens, hidden, experts)
            spec = CallSpec(self.owner, tokens, experts, hidden, use_fp8, self.num_ranks)
            if len(self._specs) >= MAX_SPECS:
                self._specs.clear()
            self._specs[key] = spec
        return spec, timeout_us
