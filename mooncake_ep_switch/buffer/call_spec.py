"""Validated call shapes of one Buffer: the full checks run once per shape, later calls look it up.

A `CallSpec` is what a (T, E, hidden, FP8) shape derives (local experts, receive rows, output
shapes); `CallSpecs` keeps those a Buffer has validated, the region capacity included, so the hot
path of dispatch() checks only what can change between calls of one shape.
"""
from typing import Dict, Tuple

import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer import validation
from mooncake_ep_switch.buffer.layout import region_layout
from mooncake_ep_switch.checks import TIMEOUT_RANGE

MAX_SPECS = 64  # shapes kept per Buffer; more distinct shapes start the cache afresh
_Tensor = torch.Tensor
_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64


def _on_device(tensor: torch.Tensor, index: int) -> bool:
    """Whether `tensor` is a CUDA tensor on device `index`."""
    return tensor.is_cuda and tensor.get_device() == index


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
        self.mask_shape = torch.Size((num_ranks,))  # active_ranks' shape
        self.num_ep_buffer_bytes, self.needs_region = num_ep_buffer_bytes, needs_region
        self._specs: Dict[tuple, CallSpec] = {}
        # The hot path's lookup: the spec of a validated shape `(T, E, hidden, use_fp8)`, or None
        # (the dict's own bound method: no extra Python frame per dispatch).
        self.get = self._specs.get

    def match_dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts, timeout_us,
                       use_fp8, device_index=None, host_values=True):
        """The hot path of a dispatch: the spec of a shape validated before when the arguments are
        well-formed tensors of that shape on the Buffer's device, else None (then `validate_dispatch` runs
        the full checks, whose errors name the argument). With `host_values` the values (expert ids, mask
        entries) are checked here too, in one native pass (ValueError).

        Arguments:
            device_index: the Buffer's CUDA device index (the "cuda" transport), or None for CPU tensors.
            host_values: check the values here (CPU tensors of a host transport); the "cuda" transport checks
                them on the device (on the emulated device too, whose tensors are on the CPU).

        Returns:
            spec: `CallSpec`, or None.
        """
        if not (type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int
                and type(timeout_us) is int and timeout_us in TIMEOUT_RANGE and type(use_fp8) is bool
                and isinstance(x, _Tensor) and isinstance(topk_idx, _Tensor) and isinstance(active_ranks, _Tensor)):
            return None
        xs, ks = x.shape, topk_idx.shape
        if len(xs) != 2:
            return None
        spec = self._specs.get((num_max_dispatch_tokens_per_rank, num_experts, xs[1], use_fp8))
        if spec is None or not (
                x.dtype is _BF16 and xs[0] <= spec.tokens and x.is_contiguous()
                and topk_idx.dtype is _I64 and len(ks) == 2 and ks[0] == xs[0] and 1 <= ks[1] <= spec.experts
                and topk_idx.is_contiguous()
                and active_ranks.dtype is _I32 and active_ranks.shape == self.mask_shape
                and active_ranks.is_contiguous()):
            return None
        if device_index is None:
            if not (x.is_cpu and topk_idx.is_cpu and active_ranks.is_cpu):
                return None
        elif not (_on_device(x, device_index) and _on_device(topk_idx, device_index)
                  and _on_device(active_ranks, device_index)):
            return None
        if host_values:
            self.check_values(topk_idx, spec.experts, active_ranks)
        return spec

    def match_combine(self, x, topk_idx, topk_weights, active_ranks, timeout_us, handle, out, handle_type,
                      device_index=None, host_values=True):
        """The hot path of a combine: the spec of `handle` when it is a handle (of `handle_type`) this
        Buffer returned (its fields were validated when it was made) and the tensors are well-formed
        tensors of its shape on the Buffer's device (`device_index` as for `match_dispatch`), else None
        (then the full validation runs). With `host_values` the values are checked here too (ValueError).

        Returns:
            spec: `CallSpec`, or None.
        """
        plan = getattr(handle, "plan", None)
        spec = getattr(plan, "spec", None) if type(handle) is handle_type else None
        if not (spec is not None and spec.owner is self.owner and type(timeout_us) is int and timeout_us in TIMEOUT_RANGE
                and isinstance(x, _Tensor) and isinstance(topk_idx, _Tensor) and isinstance(topk_weights, _Tensor)
                and isinstance(active_ranks, _Tensor)):
            return None
        src_info, layout_range = handle[0], handle[1]
        ks = topk_idx.shape
        tokens, hidden, experts = handle[2], handle[3], handle[4]
        if not (type(tokens) is int and tokens == spec.tokens and type(hidden) is int and hidden == spec.hidden
                and type(experts) is int and experts == spec.experts
                and x.dtype is _BF16 and x.shape == spec.y_shape and x.is_contiguous()
                and src_info.dtype is _I32 and src_info.shape == spec.src_shape and src_info.is_contiguous()
                and layout_range.dtype is _I64 and layout_range.shape == spec.range_shape
                and layout_range.is_contiguous()
                and topk_idx.dtype is _I64 and len(ks) == 2 and ks[0] == plan.num_tokens and ks[1] == plan.top_k
                and ks[0] <= spec.tokens and 1 <= ks[1] <= spec.experts  # also for a plan edited by hand
                and topk_idx.is_contiguous()
                and topk_weights.dtype is _F32 and topk_weights.shape == ks and topk_weights.is_contiguous()
                and active_ranks.dtype is _I32 and active_ranks.shape == self.mask_shape
                and active_ranks.is_contiguous()
                and (out is None or (isinstance(out, _Tensor) and out.dtype is _BF16 and out.dim() == 2
                                     and out.size(0) == ks[0] and out.size(1) == spec.hidden
                                     and out.is_contiguous()))):
            return None
        if device_index is None:
            if not (x.is_cpu and src_info.is_cpu and layout_range.is_cpu and topk_idx.is_cpu and topk_weights.is_cpu
                    and active_ranks.is_cpu and (out is None or out.is_cpu)):
                return None
        elif not (_on_device(x, device_index) and _on_device(src_info, device_index)
                  and _on_device(layout_range, device_index) and _on_device(topk_idx, device_index)
                  and _on_device(topk_weights, device_index) and _on_device(active_ranks, device_index)
                  and (out is None or _on_device(out, device_index))):
            return None
        if host_values:
            self.check_values(topk_idx, spec.experts, active_ranks)
        return spec

    def check_values(self, topk_idx, experts: int, active_ranks) -> None:
        """Expert ids in [-1, experts) and mask entries in {0, 1}, in one native pass (ValueError)."""
        ks = topk_idx.shape
        problem = _native.check_call_values(topk_idx.data_ptr(), ks[0], ks[1], experts, active_ranks.data_ptr(),
                                            self.num_ranks)
        if problem:
            raise ValueError(problem)

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
