"""The hot path of dispatch() and combine() (`CallSpecs.match_dispatch` / `match_combine`): a call of a shape
validated before is taken only when every argument is what the full validation would accept, on the Buffer's
device; anything else returns None, so that the full validation runs and names the argument."""
import types

import numpy as np
import pytest
import torch

from mooncake_ep_switch.buffer.call_spec import CallSpecs

R, T, E, H, K, N = 2, 8, 8, 256, 2, 5


class _Handle(tuple):
    """A stand-in of DispatchHandle: the 5-tuple with the dispatch's plan."""

    plan = None


def _specs():
    specs = CallSpecs(object(), R, 1 << 30, True)
    x, topk, active = _dispatch_args()
    spec, _ = specs.validate_dispatch(x, topk, active, T, E, -1, False)
    return specs, spec


def _dispatch_args():
    x = torch.zeros(N, H, dtype=torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [-1, 0]], dtype=torch.int64)
    return x, topk, torch.ones(R, dtype=torch.int32)


def _combine_args(spec):
    x = torch.zeros(E // R, R * T, H, dtype=torch.bfloat16)
    _, topk, active = _dispatch_args()
    handle = _Handle((torch.zeros(E // R, R * T, dtype=torch.int32), torch.zeros(E // R, R, dtype=torch.int64),
                      T, H, E))
    handle.plan = types.SimpleNamespace(spec=spec, num_tokens=N, top_k=K)
    return dict(x=x, topk_idx=topk, topk_weights=torch.ones(N, K), active_ranks=active, timeout_us=-1,
                handle=handle, out=None)


def _bad_dispatch(name, args):
    x, topk = args["x"], args["topk_idx"]
    return {
        "x_dtype": dict(x=x.float()),
        "x_dims": dict(x=x.view(1, N, H)),
        "x_noncontiguous": dict(x=torch.cat([x, x], 1)[:, ::2]),
        "x_too_many_rows": dict(x=torch.zeros(T + 1, H, dtype=torch.bfloat16)),
        "hidden_not_validated": dict(x=torch.zeros(N, 2 * H, dtype=torch.bfloat16)),
        "topk_dtype": dict(topk_idx=topk.int()),
        "topk_rows": dict(topk_idx=topk[:-1].contiguous()),
        "topk_noncontiguous": dict(topk_idx=torch.cat([topk, topk], 1)[:, ::2]),
        "topk_too_wide": dict(topk_idx=torch.zeros(N, E + 1, dtype=torch.int64)),
        "active_shape": dict(active_ranks=torch.ones(R + 1, dtype=torch.int32)),
        "active_dtype": dict(active_ranks=torch.ones(R, dtype=torch.int64)),
        "tokens_numpy": dict(num_max_dispatch_tokens_per_rank=np.int64(T)),
        "tokens_other": dict(num_max_dispatch_tokens_per_rank=T + 1),
        "experts_other": dict(num_experts=2 * E),
        "timeout_float": dict(timeout_us=1.5),
        "fp8_int": dict(use_fp8=0),
        "fp8_other": dict(use_fp8=True),
        "x_not_tensor": dict(x=[[0.0]]),
    }[name]


DISPATCH_CASES = ("x_dtype", "x_dims", "x_noncontiguous", "x_too_many_rows", "hidden_not_validated", "topk_dtype",
                  "topk_rows", "topk_noncontiguous", "topk_too_wide", "active_shape", "active_dtype",
                  "tokens_numpy", "tokens_other", "experts_other", "timeout_float", "fp8_int", "fp8_other",
                  "x_not_tensor")


def _dispatch(specs, **change):
    x, topk, active = _dispatch_args()
    args = dict(x=x, topk_idx=topk, active_ranks=active, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                timeout_us=-1, use_fp8=False)
    args.update(change)
    return args


def test_a_validated_shape_is_matched():
    specs, spec = _specs()
    assert specs.match_dispatch(**_dispatch(specs)) is spec
    assert specs.match_combine(**_combine_args(spec), handle_type=_Handle) is spec


@pytest.mark.parametrize("name", DISPATCH_CASES)
def test_dispatch_anything_else_takes_the_full_validation(name):
    specs, spec = _specs()
    args = _dispatch(specs)
    args.update(_bad_dispatch(name, args))
    assert specs.match_dispatch(**args) is None
    assert specs.match_dispatch(**args, device_index=0, host_values=False) is None


COMBINE_CASES = {
    "x_shape": lambda a: dict(x=a["x"][:, :-1].contiguous()),
    "x_dtype": lambda a: dict(x=a["x"].float()),
    "x_noncontiguous": lambda a: dict(x=torch.cat([a["x"], a["x"]], 2)[:, :, ::2]),
    "topk_rows": lambda a: dict(topk_idx=a["topk_idx"][:-1].contiguous(),
                                topk_weights=a["topk_weights"][:-1].contiguous()),
    "weights_dtype": lambda a: dict(topk_weights=a["topk_weights"].double()),
    "weights_shape": lambda a: dict(topk_weights=torch.ones(N, K + 1)),
    "active_shape": lambda a: dict(active_ranks=torch.ones(R + 1, dtype=torch.int32)),
    "out_rows": lambda a: dict(out=torch.zeros(N + 1, H, dtype=torch.bfloat16)),
    "out_dtype": lambda a: dict(out=torch.zeros(N, H)),
    "timeout_numpy": lambda a: dict(timeout_us=np.int64(5)),
    "plain_tuple": lambda a: dict(handle=tuple(a["handle"])),
    "other_buffer": lambda a: dict(handle=_other_buffer(a["handle"])),
    "src_info_dtype": lambda a: dict(handle=_replace(a["handle"], 0, a["handle"][0].long())),
    "layout_shape": lambda a: dict(handle=_replace(a["handle"], 1, torch.zeros(E // R, R + 1, dtype=torch.int64))),
    "tokens_field": lambda a: dict(handle=_replace(a["handle"], 2, T + 1)),
}


def _replace(handle, index, value):
    fields = list(handle)
    fields[index] = value
    other = _Handle(fields)
    other.plan = handle.plan
    return other


def _other_buffer(handle):
    other = _Handle(handle)
    spec = handle.plan.spec
    foreign = CallSpecs(object(), R, 1 << 30, True)
    x, topk, active = _dispatch_args()
    foreign_spec, _ = foreign.validate_dispatch(x, topk, active, T, E, -1, False)
    assert foreign_spec is not spec
    other.plan = types.SimpleNamespace(spec=foreign_spec, num_tokens=N, top_k=K)
    return other


@pytest.mark.parametrize("name", sorted(COMBINE_CASES))
def test_combine_anything_else_takes_the_full_validation(name):
    specs, spec = _specs()
    args = _combine_args(spec)
    args.update(COMBINE_CASES[name](args))
    assert specs.match_combine(**args, handle_type=_Handle) is None
    assert specs.match_combine(**args, handle_type=_Handle, device_index=0, host_values=False) is None


def test_cpu_tensors_never_pass_for_a_cuda_buffer():
    """A CUDA Buffer's hot path (device_index set) refuses host tensors: the full validation names the device."""
    specs, spec = _specs()
    assert specs.match_dispatch(**_dispatch(specs), device_index=0, host_values=False) is None
    assert specs.match_combine(**_combine_args(spec), handle_type=_Handle, device_index=0, host_values=False) is None


def test_values_are_checked_on_the_host_only_where_asked():
    """A host transport's hot path checks expert ids and mask entries; the cuda transport's leaves them to the device
    (its own check, whose messages differ), also on the emulated device whose tensors are on the CPU."""
    specs, spec = _specs()
    _, topk, active = _dispatch_args()
    bad_topk = topk.clone()
    bad_topk[0, 0] = E
    bad_active = active.clone()
    bad_active[1] = 2
    for change in (dict(topk_idx=bad_topk), dict(active_ranks=bad_active)):
        with pytest.raises(ValueError, match="topk_idx|active_ranks"):
            specs.match_dispatch(**_dispatch(specs, **change))
        assert specs.match_dispatch(**_dispatch(specs, **change), host_values=False) is spec
        args = dict(_combine_args(spec), **change)
        with pytest.raises(ValueError, match="topk_idx|active_ranks"):
            specs.match_combine(**args, handle_type=_Handle)
        assert specs.match_combine(**args, handle_type=_Handle, host_values=False) is spec


@pytest.mark.parametrize("device_index", [None, 0])
@pytest.mark.parametrize("forged", ["rows_beyond_T", "top_k_beyond_E", "float_fields", "tensor_field"])
def test_a_handle_edited_by_hand_takes_the_full_validation(forged, device_index):
    """A plan or handle fields a caller changed: the full validation refuses them before anything moves (a hot
    path that took them would reach the native launch with a shape the region was not validated for)."""
    specs, spec = _specs()
    args = _combine_args(spec)
    handle = args["handle"]
    if forged == "rows_beyond_T":
        rows = 2 * T
        args.update(topk_idx=torch.zeros(rows, K, dtype=torch.int64), topk_weights=torch.ones(rows, K))
        handle.plan = types.SimpleNamespace(spec=spec, num_tokens=rows, top_k=K)
    elif forged == "top_k_beyond_E":
        args.update(topk_idx=torch.full((N, E + 1), -1, dtype=torch.int64), topk_weights=torch.ones(N, E + 1))
        handle.plan = types.SimpleNamespace(spec=spec, num_tokens=N, top_k=E + 1)
    elif forged == "float_fields":
        args["handle"] = _replace(_replace(_replace(handle, 2, float(T)), 3, float(H)), 4, float(E))
    else:
        args["handle"] = _replace(handle, 2, torch.tensor([T, T]))
    assert specs.match_combine(**args, handle_type=_Handle, device_index=device_index,
                               host_values=device_index is None) is None
