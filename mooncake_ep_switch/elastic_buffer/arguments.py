"""The checks of `ElasticBuffer`'s arguments: every error names the argument, what was expected and what
came, before any state changes (the Python layer validates; the inner Buffer moves bytes)."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mooncake_ep_switch.checks import INT64_MAX, check_flag, check_int
from mooncake_ep_switch.elastic_buffer import layout as lay
from mooncake_ep_switch.elastic_buffer import rows as codec
from mooncake_ep_switch.elastic_buffer.handle import EPHandle


def check_bool(name: str, value) -> bool:
    """`value` as a bool by the peers' rule (`checks.check_flag`: a bool, np.bool_ or 0/1), else
    TypeError/ValueError naming `name`."""
    return check_flag(name, value)


def check_tensor(name: str, value, dtype: torch.dtype, shape: Tuple[Optional[int], ...]) -> torch.Tensor:
    """`value` as a tensor of `dtype` and `shape` (None: any size), else TypeError/ValueError naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {value.dtype}")
    got = value.shape
    if len(got) == len(shape):
        for size, want in zip(got, shape):
            if want is not None and size != want:
                break
        else:
            return value
    expected = "[" + ", ".join("*" if want is None else str(want) for want in shape) + "]"
    raise ValueError(f"{name}: expected shape {expected}, got {list(got)}")


def check_flags(names: Tuple[str, ...], values: tuple) -> None:
    """`check_bool` of each value (a bool passes it unchanged, so only the others are looked at)."""
    for name, value in zip(names, values):
        if value is not True and value is not False:
            check_bool(name, value)


def check_small_int(name: str, value, minimum: int, maximum: int = INT64_MAX) -> int:
    """`checks.check_int` (the same errors), a plain int in range taken as it is."""
    if type(value) is int and minimum <= value <= maximum:
        return value
    return check_int(name, value, minimum, maximum)


def group_size(group) -> int:
    """Ranks of a process group or of a replacement's join ticket."""
    size = getattr(group, "size", None)
    if callable(size):
        return int(size())
    ticket_ranks = getattr(group, "num_ranks", None)
    if isinstance(ticket_ranks, int):
        return ticket_ranks
    raise TypeError(f"group: expected a process group or a join ticket, got {type(group).__name__}")


check_expert_ids = codec.check_expert_ids  # kept here too: the checks of the arguments
_DISPATCH_FLAGS = ("async_with_compute_stream", "allocate_on_comm_stream", "do_handle_copy", "do_expand",
                   "do_zero_padding", "use_tma_aligned_col_major_sf")
_COMBINE_FLAGS = ("async_with_compute_stream", "allocate_on_comm_stream")


@dataclass(frozen=True)
class DispatchArguments:
    """A validated dispatch: the token tensor (and FP8 scales), the top-k ids (the handle's when cached),
    and the call's shape."""

    tokens: torch.Tensor
    scales: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    use_fp8: bool
    device: torch.device
    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_max_tokens_per_rank: int
    alignment: int
    num_local: int


def dispatch_arguments(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                       num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, async_with_compute_stream,
                       allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand, do_zero_padding,
                       use_tma_aligned_col_major_sf, R: int, default_tokens: int) -> DispatchArguments:
    """Check `ElasticBuffer.dispatch`'s arguments (see its docstring); TypeError/ValueError naming the first bad one."""
    use_fp8 = isinstance(x, tuple)
    if use_fp8:
        if len(x) != 2:
            raise ValueError(f"x: expected a tensor or an (x, sf) pair, got a tuple of {len(x)}")
        tokens, scales = x
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError("x: expected an FP8 tensor [num_tokens, hidden] first in the pair")
        check_tensor("x[0]", tokens, torch.float8_e4m3fn, (None, None))
        check_tensor("x[1]", scales, torch.float32, (tokens.size(0), codec.num_scale_groups(tokens.size(1))))
    else:
        tokens, scales = check_tensor("x", x, torch.bfloat16, (None, None)), None
    num_tokens, hidden = tokens.shape
    if hidden < 1:
        raise ValueError(f"x: expected hidden >= 1, got {hidden}")
    device = tokens.device
    check_flags(_DISPATCH_FLAGS, (async_with_compute_stream, allocate_on_comm_stream, do_handle_copy, do_expand,
                                  do_zero_padding, use_tma_aligned_col_major_sf))
    for name, value in (("num_sms", num_sms), ("num_qps", num_qps)):
        if value is not None:  # Mooncake's dispatch defaults num_sms to None, V2's to 0
            check_small_int(name, value, 0)
    if do_zero_padding and not do_expand:
        raise ValueError("do_zero_padding: expected False unless do_expand (padding exists only when expanded)")
    if do_cpu_sync is not None:
        check_bool("do_cpu_sync", do_cpu_sync)
    if handle is not None:
        if not isinstance(handle, EPHandle) or not isinstance(handle.route, lay.Route):
            raise TypeError(f"handle: expected an EPHandle from this ElasticBuffer's dispatch, got "
                            f"{type(handle).__name__}")
        if topk_idx is not None:
            raise ValueError("topk_idx: expected None with a cached handle (the handle's is reused)")
        if do_cpu_sync:
            raise ValueError("do_cpu_sync: expected None or False with a cached handle")
        for name, given, kept in (("num_experts", num_experts, handle.num_experts),
                                  ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                   handle.num_max_tokens_per_rank),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment)):
            if given is not None and given != kept:
                raise ValueError(f"{name}: expected the cached handle's {kept} (or None), got {given!r}")
        num_experts, T, alignment = handle.num_experts, handle.num_max_tokens_per_rank, handle.expert_alignment
        topk_idx = handle.topk_idx
        if num_tokens != handle.route.num_tokens:
            raise ValueError(f"x: expected the cached handle's {handle.route.num_tokens} tokens, got {num_tokens}")
        if do_expand != handle.do_expand:
            raise ValueError(f"do_expand: expected the cached handle's {handle.do_expand}, got {do_expand}")
    else:
        if num_experts is None:
            raise ValueError("num_experts: expected the number of experts (no handle to take it from), got None")
        num_experts = check_small_int("num_experts", num_experts, R)
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of num_ranks={R}, got {num_experts}")
        T = default_tokens if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        T = check_small_int("num_max_tokens_per_rank", T, 1)
        alignment = check_small_int("expert_alignment", 1 if expert_alignment is None else expert_alignment, 1,
                                    1 << 20)
        check_tensor("topk_idx", topk_idx, torch.int64, (num_tokens, None))
        if not 1 <= topk_idx.size(1) <= codec.MAX_TOPK:
            raise ValueError(f"topk_idx: expected 1 to {codec.MAX_TOPK} columns, got {topk_idx.size(1)}")
        if topk_idx.device != device:
            raise ValueError(f"topk_idx: expected a tensor on {device} (as x), got one on {topk_idx.device}")
        # The ids themselves (range, none twice in a row) are checked by the dispatch, with the routing.
    if num_tokens > T:
        raise ValueError(f"x: expected at most num_max_tokens_per_rank={T} tokens, got {num_tokens}")
    num_topk = topk_idx.size(1)
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk))
    L = num_experts // R
    if cumulative_local_expert_recv_stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32, (L,))
    return DispatchArguments(tokens, scales, topk_idx, use_fp8, device, num_tokens, hidden, num_topk, num_experts, T,
                             alignment, L)


def combine_arguments(x, handle, topk_weights, bias, async_with_compute_stream, allocate_on_comm_stream,
                      allow_multiple_reduction: bool, max_num_bias: int):
    """Check `ElasticBuffer.combine`'s arguments (see its docstring); returns the two biases (None where absent)."""
    if not isinstance(handle, EPHandle) or not isinstance(handle.route, lay.Route):
        raise TypeError(f"handle: expected an EPHandle from this ElasticBuffer's dispatch, got "
                        f"{type(handle).__name__}")
    route = handle.route
    rows = route.num_slots if handle.do_expand else route.recv_src_global.numel()
    check_tensor("x", x, torch.bfloat16, (rows, None))
    hidden = x.size(1)
    width = route.inner_handle[3]
    if hidden + lay.align(4 * route.num_topk, 128) > width:
        raise ValueError(f"x: expected hidden <= {width - lay.align(4 * route.num_topk, 128)} (the dispatch's "
                         f"rows are {width} bf16 wide), got {hidden}")
    if topk_weights is not None:
        shape = (rows,) if handle.do_expand else (rows, route.num_topk)
        check_tensor("topk_weights", topk_weights, torch.float32, shape)
    check_flags(_COMBINE_FLAGS, (async_with_compute_stream, allocate_on_comm_stream))
    if bias is None:
        return None, None
    if not (isinstance(bias, torch.Tensor)
            or (isinstance(bias, tuple) and len(bias) == 2 and all(isinstance(b, torch.Tensor) for b in bias))):
        raise TypeError(f"bias: expected None, a tensor or a pair of tensors, got {type(bias).__name__}"
                        + (f" of {len(bias)}" if isinstance(bias, tuple) else ""))
    biases = codec.split_bias(bias)
    given = sum(part is not None for part in biases)
    if handle.do_expand and not allow_multiple_reduction:
        max_num_bias = 2  # one reduction on the owner: its own bias rows are added there, never sent
    if given > max_num_bias:
        raise ValueError(f"bias: expected at most {max_num_bias} bias tensor(s) (the buffer's max_num_bias), "
                         f"got {given}")
    for index, part in enumerate(biases):
        if part is not None:
            check_tensor(f"bias[{index}]" if isinstance(bias, tuple) else "bias", part, torch.bfloat16,
                          (route.num_tokens, hidden))
    return biases
