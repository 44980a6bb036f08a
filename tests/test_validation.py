"""Bad input gets a clear error naming the argument; the Buffer works afterwards."""
import pytest
import torch

from mooncake_ep_switch import Buffer
from tests import harness
from tests.reference import structured_inputs
from tests.test_buffer import TRANSPORTS, Case, rank_round_trip

H, T, E, K = 256, 16, 8, 2


def _good(ctx):
    inputs = structured_inputs(ctx.rank, 8, H, E, K, seed=1)
    return inputs.x, inputs.topk_idx, inputs.weights, torch.ones(ctx.num_ranks, dtype=torch.int32)


def _bad_dispatch_args(case_name, ctx, buffer):
    x, topk, _, active = _good(ctx)
    args = dict(x=x, topk_idx=topk, active_ranks=active, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                timeout_us=-1, use_fp8=False)
    if case_name == "x_dtype":
        args["x"] = x.float()
    elif case_name == "x_dims":
        args["x"] = x.view(1, *x.shape)
    elif case_name == "x_noncontiguous":
        args["x"] = torch.cat([x, x], 1)[:, ::2]
    elif case_name == "x_too_many_tokens":
        args["num_max_dispatch_tokens_per_rank"] = 4
    elif case_name == "hidden_not_multiple_of_128":
        args["x"] = x[:, :200].contiguous()
    elif case_name == "experts_not_multiple_of_ranks":
        args["num_experts"] = E + 1
    elif case_name == "topk_out_of_range":
        bad = topk.clone()
        bad[0, 0] = E
        args["topk_idx"] = bad
    elif case_name == "topk_below_minus_one":
        bad = topk.clone()
        bad[1, 1] = -2
        args["topk_idx"] = bad
    elif case_name == "topk_dtype":
        args["topk_idx"] = topk.int()
    elif case_name == "topk_rows":
        args["topk_idx"] = topk[:-1].contiguous()
    elif case_name == "topk_duplicate_expert":
        bad = topk.clone()
        bad[2] = torch.tensor([3, 3])
        args["topk_idx"] = bad
    elif case_name == "active_shape":
        args["active_ranks"] = torch.ones(ctx.num_ranks + 1, dtype=torch.int32)
    elif case_name == "active_dtype":
        args["active_ranks"] = torch.ones(ctx.num_ranks, dtype=torch.int64)
    elif case_name == "active_values":
        args["active_ranks"] = torch.full((ctx.num_ranks,), 2, dtype=torch.int32)
    elif case_name == "timeout":
        args["timeout_us"] = -5
    elif case_name == "use_fp8_type":
        args["use_fp8"] = "yes"
    elif case_name == "async_and_hook":
        args["async_finish"] = True
        args["return_recv_hook"] = True
    elif case_name == "buffer_too_small":
        args["num_max_dispatch_tokens_per_rank"] = T * 4
    return args


DISPATCH_CASES = {
    "x_dtype": ("x", "torch.bfloat16"),
    "x_dims": ("x", "2 dims"),
    "x_noncontiguous": ("x", "contiguous"),
    "x_too_many_tokens": ("x", "at most num_max_dispatch_tokens_per_rank=4"),
    "hidden_not_multiple_of_128": ("x", "multiple of 128"),
    "experts_not_multiple_of_ranks": ("num_experts", "multiple of the number of ranks"),
    "topk_out_of_range": ("topk_idx", "values in [-1, 8)"),
    "topk_below_minus_one": ("topk_idx", "values in [-1, 8)"),
    "topk_dtype": ("topk_idx", "torch.int64"),
    "topk_rows": ("topk_idx", "shape"),
    "topk_duplicate_expert": ("topk_idx", "distinct experts"),
    "active_shape": ("active_ranks", "shape"),
    "active_dtype": ("active_ranks", "torch.int32"),
    "active_values": ("active_ranks", "only 0"),
    "timeout": ("timeout_us", "-1"),
    "use_fp8_type": ("use_fp8", "bool"),
    "async_and_hook": ("async_finish", "at most one"),
    "buffer_too_small": ("num_ep_buffer_bytes", "get_ep_buffer_size_hint"),
}


def rank_bad_dispatch(ctx, transport, case_name):
    size = Buffer.get_ep_buffer_size_hint(T, H, ctx.num_ranks, E)
    buffer = Buffer(ctx.group, size, transport=transport)
    try:
        args = _bad_dispatch_args(case_name, ctx, buffer)
        try:
            buffer.dispatch(**args)
        except (ValueError, TypeError) as error:
            message = str(error)
        else:
            raise AssertionError(f"{case_name}: no error raised")
        if case_name == "experts_not_multiple_of_ranks" and ctx.num_ranks == 1:
            pass
        return message
    finally:
        buffer.destroy()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case_name", sorted(DISPATCH_CASES))
def test_dispatch_rejects(transport, case_name):
    messages = harness.run(2, rank_bad_dispatch, transport, case_name)
    name, fragment = DISPATCH_CASES[case_name]
    for message in messages:
        assert message.startswith(name + ":") or f"{name}," in message, message
        assert fragment in message, message


COMBINE_CASES = {
    "x_shape": ("x", "shape"),
    "weights_dtype": ("topk_weights", "torch.float32"),
    "weights_shape": ("topk_weights", "shape"),
    "handle_type": ("handle", "5-tuple"),
    "handle_src_info": ("handle.src_info", "shape"),
    "handle_fields": ("handle.src_info", "shape"),
    "out_shape": ("out", "shape"),
    "topk_other_shape": ("topk_idx", "the dispatch's shape"),
    "timeout": ("timeout_us", "-1"),
}


def rank_bad_combine(ctx, transport, case_name):
    size = Buffer.get_ep_buffer_size_hint(T, H, ctx.num_ranks, E)
    buffer = Buffer(ctx.group, size, transport=transport)
    try:
        x, topk, weights, active = _good(ctx)
        recv, count, handle, event, _ = buffer.dispatch(x, topk, active, T, E, -1, use_fp8=False)
        y = recv.clone()
        args = dict(x=y, topk_idx=topk, topk_weights=weights, active_ranks=active, timeout_us=-1, handle=handle)
        if case_name == "x_shape":
            args["x"] = y[:, :-1].contiguous()
        elif case_name == "weights_dtype":
            args["topk_weights"] = weights.double()
        elif case_name == "weights_shape":
            args["topk_weights"] = weights[:, :1].contiguous()
        elif case_name == "handle_type":
            args["handle"] = "not a handle"
        elif case_name == "handle_src_info":
            args["handle"] = (handle[0][:, :-1].contiguous(),) + tuple(handle[1:])
        elif case_name == "handle_fields":  # the Buffer's own handle type and plan, altered T
            args["handle"] = type(handle)(handle[0], handle[1], T * 2, handle[3], handle[4], plan=handle.plan)
        elif case_name == "out_shape":
            args["out"] = torch.empty((x.size(0) + 1, H), dtype=torch.bfloat16)
        elif case_name == "topk_other_shape":
            args["topk_idx"] = topk[:-1].contiguous()
            args["topk_weights"] = weights[:-1].contiguous()
        elif case_name == "timeout":
            args["timeout_us"] = -2
        try:
            buffer.combine(**args)
        except (ValueError, TypeError) as error:
            message = str(error)
        else:
            raise AssertionError(f"{case_name}: no error raised")
        # The pending dispatch is still combinable after the rejected call.
        out, _, _ = buffer.combine(y, topk, weights, active, -1, handle)
        assert out.shape == (x.size(0), H)
        return message
    finally:
        buffer.destroy()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case_name", sorted(COMBINE_CASES))
def test_combine_rejects(transport, case_name):
    messages = harness.run(2, rank_bad_combine, transport, case_name)
    name, fragment = COMBINE_CASES[case_name]
    for message in messages:
        assert message.startswith(name + ":"), message
        assert fragment in message, message


def rank_rejections_then_round_trip(ctx, transport):
    """After a burst of rejected calls the same Buffer still runs a correct round trip."""
    size = Buffer.get_ep_buffer_size_hint(Case().tokens, Case().hidden, ctx.num_ranks, Case().experts)
    buffer = Buffer(ctx.group, size, transport=transport)
    try:
        for case_name in sorted(DISPATCH_CASES):
            args = _bad_dispatch_args(case_name, ctx, buffer)
            args["num_max_dispatch_tokens_per_rank"] = min(args["num_max_dispatch_tokens_per_rank"], T)
            if case_name == "buffer_too_small":
                continue
            with pytest.raises((ValueError, TypeError)):
                buffer.dispatch(**args)
    finally:
        buffer.destroy()
    return rank_round_trip(ctx, transport, False, "sync", seed=9)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_buffer_usable_after_rejections(transport):
    harness.run(2, rank_rejections_then_round_trip, transport)


def rank_constructor_errors(ctx):
    errors = []
    for kwargs in ({"num_ep_buffer_bytes": -1}, {"num_ep_buffer_bytes": 1024, "transport": "nvlink"},
                   {"num_ep_buffer_bytes": 1024, "disable_p2p": "no"}):
        try:
            Buffer(ctx.group, **kwargs)
        except (ValueError, TypeError) as error:
            errors.append(str(error))
    return errors


def test_constructor_rejects():
    errors = harness.run(2, rank_constructor_errors)[0]
    assert len(errors) == 3
    assert errors[0].startswith("num_ep_buffer_bytes:")
    assert errors[1].startswith("transport:") and "nvlink" in errors[1]
    assert errors[2].startswith("disable_p2p:")


def test_size_hint_validates_and_grows():
    small = Buffer.get_ep_buffer_size_hint(16, 256, 2, 8)
    assert Buffer.get_ep_buffer_size_hint(32, 256, 2, 8) > small
    assert Buffer.get_ep_buffer_size_hint(16, 512, 2, 8) > small
    with pytest.raises(ValueError, match="hidden"):
        Buffer.get_ep_buffer_size_hint(16, 200, 2, 8)
    with pytest.raises(ValueError, match="num_experts"):
        Buffer.get_ep_buffer_size_hint(16, 256, 3, 8)


def rank_combine_before_receive(ctx, transport):
    """A hook dispatch combined before its hook ran is rejected (its layout is not there yet) and
    the call works once the hook ran; an async dispatch combined without waiting for its event is
    completed first, so its result equals the synchronous one."""
    size = Buffer.get_ep_buffer_size_hint(T, H, ctx.num_ranks, E)
    with Buffer(ctx.group, size, transport=transport) as buffer:
        x, topk, weights, active = _good(ctx)
        recv, _, handle, _, _ = buffer.dispatch(x, topk, active, T, E, -1, use_fp8=False)
        y = recv * 2
        want, _, _ = buffer.combine(y, topk, weights, active, -1, handle)
        want = want.clone()

        _, _, handle, _, hook = buffer.dispatch(x, topk, active, T, E, -1, use_fp8=False, return_recv_hook=True)
        with pytest.raises(ValueError, match="handle: .*hook"):
            buffer.combine(y, topk, weights, active, -1, handle)
        hook()
        hooked, _, _ = buffer.combine(y, topk, weights, active, -1, handle)
        assert torch.equal(hooked, want)

        _, _, handle, _, _ = buffer.dispatch(x, topk, active, T, E, -1, use_fp8=False, async_finish=True)
        waited, _, _ = buffer.combine(y, topk, weights, active, -1, handle)  # no event wait first
        assert torch.equal(waited, want)
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_combine_needs_the_dispatch_received(transport):
    assert all(harness.run(2, rank_combine_before_receive, transport))


def rank_out_of_native_range(ctx, transport):
    """Integers outside the native types' range are refused before any state changes: the same
    Buffer's next round is exact with nobody masked (a timeout_us of 2**63 once passed the Python
    checks, moved the call counter, then failed at the native boundary, so both ranks' next round
    masked each other)."""
    size = Buffer.get_ep_buffer_size_hint(T, H, ctx.num_ranks, E)
    with Buffer(ctx.group, size, transport=transport) as buffer:
        x, topk, weights, active = _good(ctx)
        messages = []
        for bad in (2 ** 63, 2 ** 64, -2 ** 63):
            with pytest.raises(ValueError, match="^timeout_us: ") as raised:
                buffer.dispatch(x, topk, active, T, E, bad, use_fp8=False)
            messages.append(str(raised.value))
        for name, bad_tokens, bad_experts in (("num_max_dispatch_tokens_per_rank", 2 ** 31, E),
                                              ("num_experts", T, 2 ** 32)):
            with pytest.raises(ValueError, match=f"^{name}: "):
                buffer.dispatch(x, topk, active, bad_tokens, bad_experts, 5_000_000, use_fp8=False)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, T, E, 5_000_000, use_fp8=False)
        y = recv * 2
        with pytest.raises(ValueError, match="^timeout_us: "):
            buffer.combine(y, topk, weights, active, 2 ** 63, handle)
        out, _, _ = buffer.combine(y, topk, weights, active, 5_000_000, handle)
        assert active.tolist() == [1] * ctx.num_ranks, f"a rejected call cost a peer: {active.tolist()}"
        # Every expert doubles its rows: the combine is the fp32 sum over k of w_k * 2x in top-k order, exactly.
        # Summed here in that order, elementwise: torch's .sum(1) adds in an order of the CPU's kernels.
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(topk.size(1)):
            acc += torch.where(topk[:, k:k + 1] >= 0, weights[:, k:k + 1], 0.0) * (2 * x.float())
        want = acc.to(torch.bfloat16)
        assert torch.equal(out, want)
        # A second exact round after it, on the same Buffer.
        recv, _, handle, _, _ = buffer.dispatch(x, topk, active, T, E, 5_000_000, use_fp8=False)
        out, _, _ = buffer.combine(recv * 2, topk, weights, active, 5_000_000, handle)
        assert torch.equal(out, want) and active.tolist() == [1] * ctx.num_ranks
    return messages


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_integers_beyond_the_native_range_are_refused_first(transport):
    for messages in harness.run(2, rank_out_of_native_range, transport):
        assert all("-1 (no deadline) or" in m and str(2 ** 63 - 1) in m for m in messages), messages
