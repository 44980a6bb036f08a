"""Argument checks for dispatch() and combine(): clear errors, nothing written on failure.

Every check raises `ValueError` (or `TypeError` for a wrong Python type) whose message names the
argument, what was expected and what came. Checks run before any byte moves (and before the call
counter advances), so a rejected call leaves the Buffer exactly as it was.

Every tensor argument must be on the Buffer's device: the CPU for the host transports (shared
memory, the Transfer Engine, gloo collectives), which move host memory through raw pointers, and
the Buffer's CUDA device for the `"cuda"` transport. A tensor elsewhere (a CPU `active_ranks` with
CUDA `x`, another GPU, meta) is rejected with an error naming the argument and its device. Values
(expert ids, mask entries) are checked here for CPU tensors; the `"cuda"` transport checks them on
the device (`CudaTransport.value_problem`), since reading them here would synchronise.
"""
import torch

from mooncake_ep_switch import _native
from mooncake_ep_switch.checks import INT32_MAX, check_flag, check_int, check_timeout  # noqa: F401  (re-exported)


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_tensor(name: str, tensor, dtype: torch.dtype, dim: int, shape=None, device=None) -> torch.Tensor:
    """Check type, device, dtype, number of dims, contiguity and (where given, -1 = any) the shape.

    Arguments:
        name: argument name used in error messages.
        tensor: the value to check.
        dtype: the required torch dtype.
        dim: the required number of dimensions.
        shape: required size per dimension (-1 = any), or None to skip the shape check.
        device: the required CUDA torch.device, or None for the CPU.

    Returns:
        tensor: `tensor` itself, unchanged.

    Raises:
        TypeError: not a torch.Tensor.
        ValueError: on another device, wrong dtype, dims or shape, or not contiguous.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if device is None and tensor.device.type != "cpu":
        fail(name, "a CPU tensor (this Buffer's transport moves host memory; CUDA tensors need the 'cuda' "
              "transport)", f"a tensor on {tensor.device}")
    if device is not None and tensor.device != device:
        fail(name, f"a tensor on {device} (this Buffer's transport is 'cuda')", f"a tensor on {tensor.device}")
    if tensor.dtype != dtype:
        fail(name, f"dtype {dtype}", tensor.dtype)
    if tensor.dim() != dim:
        fail(name, f"{dim} dims", f"{tensor.dim()} dims (shape {list(tensor.shape)})")
    if shape is not None:
        for axis, (want, have) in enumerate(zip(shape, tensor.shape)):
            if want != -1 and want != have:
                fail(name, f"shape {list(shape)} (-1 = any)", list(tensor.shape))
    if not tensor.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {tensor.stride()}")
    return tensor


def check_active_ranks(active_ranks, num_ranks: int, device=None) -> torch.Tensor:
    """`active_ranks` must be int32 `[num_ranks]` of zeros and ones (never silently replaced).

    Arguments:
        active_ranks: `[num_ranks]` torch.int32 contiguous CPU tensor, 1 = active, 0 = masked.
        num_ranks: `R`, ranks of the group.
        device: the Buffer's CUDA device (values are then checked on the device), or None.

    Returns:
        active_ranks: the tensor itself, unchanged.

    Raises:
        TypeError: not a torch.Tensor.
        ValueError: wrong dtype, shape or device, not contiguous, or a value other than 0 and 1.
    """
    check_tensor("active_ranks", active_ranks, torch.int32, 1, (num_ranks,), device)
    if device is not None:
        return active_ranks
    problem = _native.check_mask_values(active_ranks.data_ptr(), num_ranks)
    if problem:
        raise ValueError(f"active_ranks: expected {problem}")
    return active_ranks


def check_topk_idx(topk_idx, num_tokens: int, num_experts: int, device=None) -> torch.Tensor:
    """`topk_idx` int64 `[num_tokens, K]`, values in [-1, num_experts), no expert twice in a row.

    Arguments:
        topk_idx: `[num_tokens, K]` torch.int64 contiguous CPU tensor, `1 <= K <= num_experts`; -1
            marks an unused entry.
        num_tokens: the required number of rows.
        num_experts: `E`, the exclusive upper bound of the expert ids.
        device: the Buffer's CUDA device (values are then checked on the device), or None.

    Returns:
        topk_idx: the tensor itself, unchanged.

    Raises:
        TypeError: not a torch.Tensor.
        ValueError: wrong dtype, shape or device, not contiguous, a value out of range, or an
            expert repeated within a row.
    """
    check_tensor("topk_idx", topk_idx, torch.int64, 2, (num_tokens, -1), device)
    if topk_idx.size(1) < 1:
        fail("topk_idx", "at least one column (top-k >= 1)", list(topk_idx.shape))
    if topk_idx.size(1) > num_experts:
        fail("topk_idx", f"top-k <= num_experts ({num_experts})", topk_idx.size(1))
    if device is not None:
        return topk_idx
    problem = _native.check_topk_values(topk_idx.data_ptr(), topk_idx.size(0), topk_idx.size(1), num_experts)
    if problem:
        raise ValueError(f"topk_idx: expected {problem}")
    return topk_idx


def check_dispatch(x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank, num_experts,
                   timeout_us, use_fp8, num_ranks: int, device=None):
    """Validate dispatch() arguments; returns (T, E, timeout_us, use_fp8) normalised.

    Arguments:
        x: `[num_tokens, H]` torch.bfloat16 contiguous CPU, `num_tokens <= T`, `H` a positive multiple of 128.
        topk_idx: `[num_tokens, K]` torch.int64 CPU (see `check_topk_idx`).
        active_ranks: `[R]` torch.int32 CPU mask (see `check_active_ranks`).
        num_max_dispatch_tokens_per_rank: `T`, >= 1.
        num_experts: `E`, >= 1 and a multiple of `R`.
        timeout_us: microseconds, or -1 for no deadline.
        use_fp8: a flag (`checks.check_flag`: bool, np.bool_, 0/1), or None for True (Mooncake's default).
        num_ranks: `R`, ranks of the group.
        device: the Buffer's CUDA device, or None for CPU tensors.

    Returns:
        tokens_per_rank: int, `T`.
        num_experts: int, `E`.
        timeout_us: int.
        use_fp8: bool.

    Raises:
        TypeError: a wrong Python type (e.g. a `use_fp8` that is no flag).
        ValueError: any other violation; nothing has been written.
    """
    tokens_per_rank = check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1, INT32_MAX)
    num_experts = check_int("num_experts", num_experts, 1, INT32_MAX)
    if num_experts % num_ranks != 0:
        fail("num_experts", f"a multiple of the number of ranks ({num_ranks})", num_experts)
    check_tensor("x", x, torch.bfloat16, 2, device=device)
    if x.size(0) > tokens_per_rank:
        fail("x", f"at most num_max_dispatch_tokens_per_rank={tokens_per_rank} rows", x.size(0))
    if x.size(1) <= 0 or x.size(1) % 128 != 0:
        fail("x", "a hidden size that is a positive multiple of 128", x.size(1))
    check_topk_idx(topk_idx, x.size(0), num_experts, device)
    check_active_ranks(active_ranks, num_ranks, device)
    timeout_us = check_timeout(timeout_us)
    use_fp8 = check_flag("use_fp8", use_fp8, allow_none=True)
    if use_fp8 is None:
        use_fp8 = True  # Mooncake's default
    return tokens_per_rank, num_experts, timeout_us, use_fp8


def check_handle(handle, num_ranks: int, device=None):
    """Validate a dispatch handle (ours or a plain Mooncake 5-tuple); returns its fields.

    Arguments:
        handle: the 5-tuple (src_info, layout_range, T, H, E) from `dispatch()`.
        num_ranks: `R`, ranks of the group.
        device: the Buffer's CUDA device, or None for CPU tensors.

    Returns:
        src_info: `[E/R, R * T]` torch.int32.
        layout_range: `[E/R, R]` torch.int64.
        tokens_per_rank: int, `T` (>= 1).
        hidden: int, `H` (>= 128).
        num_experts: int, `E` (a multiple of `R`).

    Raises:
        TypeError: not a 5-tuple, or a field of the wrong type.
        ValueError: a field out of range or of the wrong dtype or shape.
    """
    if not isinstance(handle, tuple) or len(handle) != 5:
        raise TypeError("handle: expected the 5-tuple returned by dispatch(), "
                        f"got {type(handle).__name__}{'' if not isinstance(handle, tuple) else f' of length {len(handle)}'}")
    src_info, layout_range, tokens_per_rank, hidden, num_experts = handle
    tokens_per_rank = check_int("handle.num_max_dispatch_tokens_per_rank", tokens_per_rank, 1, INT32_MAX)
    hidden = check_int("handle.hidden", hidden, 128, INT32_MAX)
    num_experts = check_int("handle.num_experts", num_experts, num_ranks, INT32_MAX)
    if num_experts % num_ranks:
        fail("handle.num_experts", f"a multiple of {num_ranks}", num_experts)
    local = num_experts // num_ranks
    check_tensor("handle.src_info", src_info, torch.int32, 2, (local, num_ranks * tokens_per_rank), device)
    check_tensor("handle.layout_range", layout_range, torch.int64, 2, (local, num_ranks), device)
    return src_info, layout_range, tokens_per_rank, hidden, num_experts


def check_combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle, out, num_ranks: int, device=None):
    """Validate combine() arguments; returns (handle fields, timeout_us).

    Arguments:
        x: `[E/R, R * T, H]` torch.bfloat16 contiguous, the expert outputs.
        topk_idx: `[num_tokens, K]` torch.int64 CPU, `num_tokens <= T` (and equal to the dispatch's
            shape when the handle carries a plan).
        topk_weights: `[num_tokens, K]` torch.float32 contiguous.
        active_ranks: `[R]` torch.int32 CPU mask (see `check_active_ranks`).
        timeout_us: microseconds, or -1 for no deadline.
        handle: the 5-tuple from `dispatch()` (see `check_handle`).
        out: `[num_tokens, H]` torch.bfloat16 contiguous, or None.
        num_ranks: `R`, ranks of the group.
        device: the Buffer's CUDA device, or None for CPU tensors.

    Returns:
        fields: the 5 handle fields as returned by `check_handle`.
        timeout_us: int.

    Raises:
        TypeError: a wrong Python type.
        ValueError: any other violation; nothing has been written.
    """
    fields = check_handle(handle, num_ranks, device)
    _, _, tokens_per_rank, hidden, num_experts = fields
    local = num_experts // num_ranks
    check_tensor("x", x, torch.bfloat16, 3, (local, num_ranks * tokens_per_rank, hidden), device)
    check_tensor("topk_idx", topk_idx, torch.int64, 2, device=device)
    if topk_idx.size(0) > tokens_per_rank:
        fail("topk_idx", f"at most {tokens_per_rank} rows (the handle's num_max_dispatch_tokens_per_rank)",
              topk_idx.size(0))
    check_topk_idx(topk_idx, topk_idx.size(0), num_experts, device)
    check_tensor("topk_weights", topk_weights, torch.float32, 2, tuple(topk_idx.shape), device)
    check_active_ranks(active_ranks, num_ranks, device)
    timeout_us = check_timeout(timeout_us)
    if out is not None:
        check_tensor("out", out, torch.bfloat16, 2, (topk_idx.size(0), hidden), device)
    plan = getattr(handle, "plan", None)
    if plan is not None and (plan.num_tokens != topk_idx.size(0) or plan.top_k != topk_idx.size(1)):
        fail("topk_idx", f"the dispatch's shape [{plan.num_tokens}, {plan.top_k}]", list(topk_idx.shape))
    return fields, timeout_us


def check_combine_bias(bias, num_tokens: int, hidden: int, device=None) -> tuple:
    """Check `Buffer.combine`'s `bias`: None, one tensor, or a pair (an entry may be None).

    Arguments:
        bias: the value given.
        num_tokens: `N`, the combine's tokens; hidden: the combine's hidden (a bias may be narrower).
        device: the Buffer's CUDA device, or None for the CPU.

    Returns:
        bias: `()` when there is none, else the pair `(bias0, bias1)`, each None or a contiguous
        `[N, h]` torch.bfloat16 with one `h <= hidden` for both (`CombineCall.bias`).

    Raises:
        TypeError: not None, a tensor or a pair. ValueError: a wrong dtype, device, shape or layout.
    """
    if bias is None:
        return ()
    pair = (bias, None) if isinstance(bias, torch.Tensor) else bias
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"bias: expected None, a torch.Tensor or a pair of them, got {type(bias).__name__}"
                        + (f" of {len(bias)}" if isinstance(bias, (tuple, list)) else ""))
    width = None
    for index, part in enumerate(pair):
        if part is None:
            continue
        name = "bias" if isinstance(bias, torch.Tensor) else f"bias[{index}]"
        check_tensor(name, part, torch.bfloat16, 2, (num_tokens, -1), device)
        if part.size(1) > hidden or (width is not None and part.size(1) != width):
            fail(name, f"[{num_tokens}, h] with h <= {hidden} (the combine's hidden)"
                 + ("" if width is None else f" and h = {width} (the other bias)"), list(part.shape))
        width = part.size(1)
    if width is None or num_tokens == 0:
        return ()
    return tuple(pair)
