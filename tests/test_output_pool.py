"""The Buffer's pooled outputs: a result is never overwritten while anyone holds it, and is reused
(same memory) once nothing does.

Unit tests drive `OutputPool` directly; the multi-rank tests run real dispatch/combine rounds over
every transport and check both halves of the rule on the tensors the Buffer returns.
"""
import gc

import pytest
import torch

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.buffer.output_pool import OutputPool
from tests import harness
from tests.reference import structured_inputs, token_count
from tests.test_buffer import TIMEOUT_US, TRANSPORTS, Case

SHAPE = dict(use_fp8=False, local=2, rows=8, hidden=256, num_ranks=2, device=torch.device("cpu"))


def _fill(outputs, value):
    for tensor in outputs:
        if tensor is not None:
            tensor.view(torch.uint8).fill_(value)


# ------------------------------------------------------------------ OutputPool alone

def test_released_outputs_are_reused():
    pool = OutputPool()
    first = pool.dispatch_outputs(**SHAPE)
    pointers = [t.data_ptr() for t in first if t is not None]
    del first
    second = pool.dispatch_outputs(**SHAPE)
    assert [t.data_ptr() for t in second if t is not None] == pointers
    out = pool.combine_output(5, 256, torch.device("cpu"))
    pointer = out.data_ptr()
    del out
    assert pool.combine_output(5, 256, torch.device("cpu")).data_ptr() == pointer


@pytest.mark.parametrize("keep", ["tensor", "view", "slice", "storage", "set_", "numpy", "small_only"])
def test_held_outputs_are_never_handed_out_again(keep):
    pool = OutputPool()
    first = pool.dispatch_outputs(**SHAPE)
    _fill(first, 7)
    recv_x = first.recv_x
    if keep == "tensor":
        held = recv_x
    elif keep == "view":
        held = recv_x.view(-1)
    elif keep == "slice":
        held = recv_x[1, 3:5]
    elif keep == "storage":
        held = recv_x.untyped_storage()
    elif keep == "set_":
        held = torch.empty(0, dtype=torch.bfloat16).set_(recv_x.untyped_storage(), recv_x.storage_offset(),
                                                          recv_x.shape, recv_x.stride())
    elif keep == "numpy":
        held = recv_x.view(torch.int16).numpy()
    else:  # a handle keeps only src_info / layout_range: their block stays busy
        held = (first.src_info, first.layout_range)
    before = [t.clone() for t in first if t is not None]
    del first, recv_x
    gc.collect()
    for _ in range(5):  # more calls than the pool keeps blocks for one shape
        later = pool.dispatch_outputs(**SHAPE)
        _fill(later, 0xAB)
    # The block of the held part is intact: recv_x's rows, or src_info, layout_range and recv_count.
    del later
    assert held is not None
    kind = "dispatch meta" if keep == "small_only" else "dispatch rows"
    key = next(key for key in pool._slots if key[0] == kind)
    expected = before[1:] if keep == "small_only" else before[:1]
    views = [v for v in pool._slots[key][0].views if v is not None]
    assert len(views) == len(expected)
    for view, want in zip(views, expected):
        assert torch.equal(view, want), f"{keep}: a held output was overwritten"


def test_holding_small_outputs_does_not_pin_the_rows():
    pool = OutputPool()
    first = pool.dispatch_outputs(**SHAPE)
    rows_pointer = first.recv_x.data_ptr()
    kept = (first.recv_count, first.src_info, first.layout_range)  # load statistics, a handle
    del first
    second = pool.dispatch_outputs(**SHAPE)
    assert second.recv_x.data_ptr() == rows_pointer, "recv_x's rows stayed pinned by its small outputs"
    assert second.recv_count.data_ptr() != kept[0].data_ptr()


def _share(tensor):
    tensor.share_memory_()  # what sending it to another process does (its storage moves to shm)


def _shrink(tensor):
    tensor.untyped_storage().resize_(64)


def _free(tensor):
    tensor.untyped_storage().resize_(0)  # FSDP-style freeing of a tensor's memory


@pytest.mark.parametrize("change", [_share, _shrink, _free], ids=["shared", "shrunk", "freed"])
def test_a_block_changed_behind_the_pool_is_retired(change):
    """Holders the reference counts cannot see (another process) or a resized storage: never reused."""
    pool = OutputPool()
    first = pool.dispatch_outputs(**SHAPE)
    change(first.recv_x)
    pointer = first.recv_x.untyped_storage().data_ptr()
    del first
    second = pool.dispatch_outputs(**SHAPE)
    storage = second.recv_x.untyped_storage()
    assert storage.nbytes() >= second.recv_x.numel() * 2 and not storage.is_shared()
    assert storage.data_ptr() != pointer
    second.recv_x.fill_(1.0)  # writable in full
    key = next(key for key in pool._slots if key[0] == "dispatch rows")
    assert all(slot.storage.data_ptr() != pointer for slot in pool._slots[key]), "the changed block is kept"


def test_inference_mode_outputs_stay_in_inference_mode():
    pool = OutputPool()
    with torch.inference_mode():
        first = pool.dispatch_outputs(**SHAPE)
        out = pool.combine_output(5, 256, torch.device("cpu"))
        assert first.recv_x.is_inference() and out.is_inference()
    del first, out
    later = pool.dispatch_outputs(**SHAPE)
    out = pool.combine_output(5, 256, torch.device("cpu"))
    assert not any(t.is_inference() for t in later if t is not None) and not out.is_inference()
    recv_x = later.recv_x.float().requires_grad_()
    (recv_x * 2).sum().backward()  # usable with autograd outside inference mode


def test_in_place_metadata_changes_do_not_leak_into_later_calls():
    pool = OutputPool()
    first = pool.dispatch_outputs(**SHAPE)
    first.recv_x.resize_(1)  # the caller reshapes its tensor in place, then drops it
    first.src_info.t_()
    del first
    again = pool.dispatch_outputs(**SHAPE)
    assert again.recv_x.shape == (2, 8, 256) and again.recv_x.is_contiguous()
    assert again.src_info.shape == (2, 8) and again.src_info.is_contiguous()


def test_busy_pool_allocates_valid_fresh_outputs():
    pool = OutputPool(slots_per_shape=2)
    held = [pool.dispatch_outputs(**SHAPE) for _ in range(5)]
    for index, outputs in enumerate(held):
        _fill(outputs, index + 1)
    pointers = {outputs.recv_x.data_ptr() for outputs in held}
    assert len(pointers) == 5
    for index, outputs in enumerate(held):
        assert bool((outputs.recv_x.view(torch.uint8) == index + 1).all())
    assert pool.pooled_bytes() > 0
    pool.clear()
    assert pool.pooled_bytes() == 0
    assert bool((held[0].recv_x.view(torch.uint8) == 1).all())  # clear() leaves held outputs valid


# ------------------------------------------------------------------ through the Buffer, every transport

def _bits(tensor):
    return tensor.contiguous().view(torch.uint8)


def _snapshot(result):
    recv, recv_count, handle, _, _ = result
    tensors = list(recv) if isinstance(recv, tuple) else [recv]
    return [t.clone() for t in tensors + [recv_count, handle[0], handle[1]]]


def _tensors(result):
    recv, recv_count, handle, _, _ = result
    return (list(recv) if isinstance(recv, tuple) else [recv]) + [recv_count, handle[0], handle[1]]


def _round(ctx, buffer, case, seed, use_fp8, keep_result=False):
    """One dispatch (+ combine unless the result is kept); returns (dispatch result, combine out)."""
    n = token_count(ctx.rank, ctx.num_ranks, case.tokens)
    inputs = structured_inputs(ctx.rank, n, case.hidden, case.experts, case.top_k, seed, random_values=True)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    result = buffer.dispatch(inputs.x, inputs.topk_idx, active, case.tokens, case.experts, TIMEOUT_US,
                             use_fp8=use_fp8)
    if keep_result:
        return result, None
    local = case.experts // ctx.num_ranks
    y = torch.randn((local, ctx.num_ranks * case.tokens, case.hidden)).to(torch.bfloat16)
    out, _, _ = buffer.combine(y, inputs.topk_idx, inputs.weights, active, TIMEOUT_US, result[2])
    return result, out


def rank_pool_semantics(ctx, transport, use_fp8):
    case = Case(tokens=16, hidden=256, experts=8, top_k=3)
    size = Buffer.get_ep_buffer_size_hint(case.tokens, case.hidden, ctx.num_ranks, case.experts)
    with Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport) as buffer:
        # (1) A result the caller holds is never overwritten by later calls, whatever it keeps:
        # the whole result, one view of recv_x, or only the handle.
        for keep in ("all", "view", "handle"):
            kept, _ = _round(ctx, buffer, case, 1, use_fp8, keep_result=True)
            snapshot = _snapshot(kept)
            tensors = _tensors(kept)
            if keep == "view":
                held = [tensors[0].view(-1)[::3]]
                expected = [snapshot[0].view(-1)[::3]]
            elif keep == "handle":
                held = [kept[2][0], kept[2][1]]
                expected = snapshot[-2:]
            else:
                held, expected = tensors, snapshot
            del kept, tensors
            for seed in range(2, 8):
                later, out = _round(ctx, buffer, case, seed, use_fp8)
                later_pointers = {t.data_ptr() for t in _tensors(later)}
                assert not later_pointers & {t.data_ptr() for t in held}, f"{keep}: memory handed out twice"
                del later, out
                for tensor, want in zip(held, expected):
                    assert torch.equal(_bits(tensor), _bits(want)), \
                        f"{keep}: a held output was overwritten by call {seed}"
            del held
        # (2) Once released, the next call of the same shape gets the same memory back.
        first, out = _round(ctx, buffer, case, 10, use_fp8)
        pointer, out_pointer = _tensors(first)[0].data_ptr(), out.data_ptr()
        del first, out
        second, out = _round(ctx, buffer, case, 11, use_fp8)
        reused = (_tensors(second)[0].data_ptr() == pointer, out.data_ptr() == out_pointer)
        return reused


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_buffer_outputs_pooled_safely(transport, use_fp8):
    for reused in harness.run(2, rank_pool_semantics, transport, use_fp8):
        assert reused == (True, True), "released outputs were not reused"
