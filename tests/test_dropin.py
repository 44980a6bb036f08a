"""Drop-in details callers of Mooncake's Buffer rely on (issue 27): its attributes, its `diagnostic=`
keyword, and a zero-copy combine whose `x` is not the combine buffer (DeepEP and Mooncake ignore it);
Mooncake's runtime queries and its `_use_fallback` switch, set on a live Buffer (issue 42).

Each case runs the exact call pattern on real rank processes (tests/harness.py) over shm, the Transfer
Engine and the collective fallback, and checks every row against the references of tests/test_faults.py.
"""
import os
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch import Buffer
from tests import harness
from tests.test_faults import Shape, _check_round, _gather_rounds, _mock_expert, _round_inputs

TIMEOUT_US = harness.FAULT_TIMEOUT_US_TE


def rank_mooncake_caller(ctx, transport):
    """What SGLang's dispatcher and Mooncake's tests read and pass, then a plain and a zero-copy combine
    whose `x` is another tensor (the outputs are in the buffer)."""
    size = Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, ctx.num_ranks, Shape.experts)
    buffer = Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)
    seen = {"group_size": buffer.group_size, "rank": buffer.rank, "num_ranks": buffer.num_ranks,
            "use_fallback": buffer._use_fallback, "backend_is_group": buffer.backend is ctx.group,
            "transport": buffer.transport, "runtime": _runtime_answers(buffer.runtime),
            "buffer_answers": _runtime_answers(buffer)}
    for name in ("group_size", "backend"):
        with pytest.raises(AttributeError):
            setattr(buffer, name, 1)
    if transport == "collective":  # built on the fallback: True changes nothing, False has nowhere to go
        buffer._use_fallback = True
        with pytest.raises(ValueError, match=r"_use_fallback: expected True on a Buffer built on the 'collective'"):
            buffer._use_fallback = False
        assert buffer._use_fallback
    everyone = [1] * ctx.num_ranks
    all_inputs = [_round_inputs(types.SimpleNamespace(rank=r, num_ranks=ctx.num_ranks), 0)
                  for r in range(ctx.num_ranks)]
    mine = all_inputs[ctx.rank]
    for zero_copy in (False, True):
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts,
                                                    TIMEOUT_US, use_fp8=False, diagnostic=object())
        y = _mock_expert(ctx, recv)
        x = y
        if zero_copy:
            buffer.get_next_combine_buffer(handle).copy_(y)
            x = torch.zeros_like(y)  # ignored: the data is in the buffer
        combined, _, _ = buffer.combine(x, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle,
                                        zero_copy=zero_copy, diagnostic=object())
        assert active.tolist() == everyone
        _check_round(ctx, all_inputs, everyone, everyone, recv, count, handle, combined)
    buffer.destroy()
    return seen


def _runtime_answers(runtime) -> dict:
    """Mooncake's diagnostic calls (`buffer.runtime.ibgda_disabled()`, ...) and what they returned."""
    return {name: getattr(runtime, name)() for name in ("ibgda_disabled", "p2p_enabled", "use_fast_path", "is_roce")}


# What each transport truthfully answers (mooncake: built with disable_p2p=True in these tests).
RUNTIME_ANSWERS = {
    "shm": {"ibgda_disabled": True, "p2p_enabled": True, "use_fast_path": True, "is_roce": False},
    "mooncake": {"ibgda_disabled": True, "p2p_enabled": False, "use_fast_path": True, "is_roce": False},
    "collective": {"ibgda_disabled": True, "p2p_enabled": False, "use_fast_path": False, "is_roce": False},
}


@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_mooncake_attributes_diagnostic_and_zero_copy_x_ignored(transport):
    with harness.fresh_cluster(2) as cluster:
        seen = harness.check_outcomes(cluster.run(rank_mooncake_caller, transport, timeout_s=90))
    for rank, value in enumerate(seen):
        assert value["group_size"] == value["num_ranks"] == 2 and value["rank"] == rank, value
        assert value["use_fallback"] == (transport == "collective") and value["backend_is_group"], value
        assert value["runtime"] == value["buffer_answers"] == RUNTIME_ANSWERS[transport], value


# ---------------------------------------------------------------- Mooncake's `_use_fallback` switch (issue 42)
DEATH_TIMEOUT_US = 5_000_000  # Mooncake's grid waits 5 s for the rank that exits
# Mooncake's grid points on the fallback: zero_copy x (sync, async_finish, return_recv_hook).
VARIANTS = [(zero_copy, async_finish, hook) for zero_copy in (False, True)
            for async_finish, hook in ((False, False), (True, False), (False, True))]


def _grid_round(ctx, buffer, all_inputs, active, zero_copy=False, async_finish=False, return_recv_hook=False,
                timeout_us=TIMEOUT_US):
    """One of Mooncake's grid rounds (dispatch, mock experts, combine into `out`), every row checked exactly
    against the references for the view `active` reports; returns (who took part in dispatch, in combine)."""
    mine = all_inputs[ctx.rank]
    recv, count, handle, event, hook = buffer.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts,
                                                       timeout_us, use_fp8=False, async_finish=async_finish,
                                                       return_recv_hook=return_recv_hook)
    if hook is not None:
        hook()
    if async_finish:
        event.current_stream_wait()
    in_dispatch = active.tolist()
    y = _mock_expert(ctx, recv)
    x = y
    if zero_copy:
        buffer.get_next_combine_buffer(handle).copy_(y)
        x = torch.zeros_like(y)
    out = torch.zeros_like(mine.x)
    combined, event, hook = buffer.combine(x, mine.topk_idx, mine.weights, active, timeout_us, handle,
                                           zero_copy=zero_copy, async_finish=async_finish,
                                           return_recv_hook=return_recv_hook, out=out)
    if hook is not None:
        hook()
    if async_finish:
        event.current_stream_wait()
    assert combined is out
    _check_round(ctx, all_inputs, in_dispatch, active.tolist(), recv, count, handle, combined)
    return in_dispatch, active.tolist()


def rank_fallback_switch(ctx, transport, fail_rank):
    """Mooncake's tests/test_ep_grid.py pattern: a Buffer on its own transport, `buf._use_fallback = True` set
    on every rank, the grid's rounds on the fallback, then (`fail_rank`) one rank exits and the survivors'
    round is exact without it; then back to the Buffer's own transport, exact again."""
    R = ctx.num_ranks
    size = Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, R, Shape.experts)
    buffer = Buffer(ctx.group, np.int64(size), disable_p2p=np.bool_(transport == "mooncake"), transport=transport)
    rounds = iter(_gather_rounds(ctx, 3 + len(VARIANTS) + 3))
    everyone = [1] * R
    seen = {"routes_own": buffer.peer_routes(), "answers_own": _runtime_answers(buffer.runtime)}
    assert _grid_round(ctx, buffer, next(rounds), torch.ones(R, dtype=torch.int32)) == (everyone, everyone)

    for bad, error in ((2, ValueError), ("yes", TypeError), (1.0, TypeError), (None, TypeError)):
        with pytest.raises(error, match=r"^_use_fallback: expected a bool \(or 0/1\), got"):
            buffer._use_fallback = bad
    assert not buffer._use_fallback and buffer.peer_routes() == seen["routes_own"], "a refused value changed nothing"
    buffer._use_fallback = 1  # as Mooncake's grid sets it: every rank, between the same calls
    seen["on_fallback"] = (buffer._use_fallback, buffer.peer_routes(), _runtime_answers(buffer.runtime))
    for zero_copy, async_finish, hook in VARIANTS:
        assert _grid_round(ctx, buffer, next(rounds), torch.ones(R, dtype=torch.int32), zero_copy, async_finish,
                           hook) == (everyone, everyone)

    # A handle keeps to the side its dispatch ran on: refused by name across a switch, before any state changes.
    mine = next(rounds)[ctx.rank]
    active = torch.ones(R, dtype=torch.int32)
    recv, _, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts, TIMEOUT_US,
                                            use_fp8=False)
    buffer._use_fallback = np.bool_(False)
    for call in (lambda: buffer.get_next_combine_buffer(handle),
                 lambda: buffer.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active, TIMEOUT_US,
                                        handle)):
        with pytest.raises(ValueError, match="handle: its dispatch ran on the 'collective' transport"):
            call()
    assert not buffer._use_fallback and buffer.peer_routes() == seen["routes_own"]
    assert _grid_round(ctx, buffer, next(rounds), torch.ones(R, dtype=torch.int32)) == (everyone, everyone)
    buffer._use_fallback = True
    seen["seconds"] = None
    if fail_rank is not None:
        all_inputs = next(rounds)
        dist.barrier(group=ctx.group)  # Mooncake's cpu_group.barrier() before the rank exits
        if ctx.rank == fail_rank:
            os._exit(0)
        without = [0 if r == fail_rank else 1 for r in range(R)]
        start = time.monotonic()
        took_part = _grid_round(ctx, buffer, all_inputs, torch.ones(R, dtype=torch.int32), timeout_us=DEATH_TIMEOUT_US)
        seen["seconds"] = time.monotonic() - start
        assert took_part == (without, without), took_part
    members = list(buffer.members)
    # Back on the Buffer's own transport, in the view the fallback agreed on.
    buffer._use_fallback = False
    seen["back"] = (buffer._use_fallback, buffer.peer_routes())
    survivors = [1 if r in members else 0 for r in range(R)]
    assert _grid_round(ctx, buffer, next(rounds), buffer.active_mask()) == (survivors, survivors)
    seen["members"] = members
    buffer.destroy()
    return seen


@pytest.mark.parametrize("transport, num_ranks, fail_rank", [
    ("shm", 2, None), ("shm", 2, 1), ("shm", 4, 1), ("mooncake", 2, 1)])
def test_use_fallback_set_on_a_live_buffer_is_exact_there_and_back(transport, num_ranks, fail_rank):
    """Issue 42 item 3: Mooncake's grid sets `buf._use_fallback = True` on a live Buffer (24 of its 48 points);
    that raised AttributeError. Now the next calls run on the collective fallback, exact in every grid
    variant, with a rank exiting at R=2 and R=4, and False brings the Buffer back to its own transport."""
    with harness.fresh_cluster(num_ranks) as cluster:
        outcomes = cluster.run(rank_fallback_switch, transport, fail_rank, timeout_s=150, failure_grace_s=40)
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    own_route = "shm" if transport == "shm" else "te"
    for outcome in outcomes:
        if outcome.rank == fail_rank:
            assert not outcome.ok and outcome.exitcode == 0, outcome
            continue
        assert outcome.ok, outcome.error
        seen = outcome.value
        rank = outcome.rank
        mine = ["self" if r == rank else own_route for r in range(num_ranks)]
        assert seen["routes_own"] == mine and seen["answers_own"] == RUNTIME_ANSWERS[transport], seen
        use_fallback, routes, answers = seen["on_fallback"]
        # The switch moves the calls; Mooncake's runtime queries keep describing the Buffer's own transport.
        assert use_fallback and routes == ["self" if r == rank else "collective" for r in range(num_ranks)], seen
        assert answers == RUNTIME_ANSWERS[transport], seen
        survivors = [r for r in range(num_ranks) if r != fail_rank]
        assert seen["members"] == survivors, seen
        assert seen["back"] == (False, [None if r not in survivors else "self" if r == rank else own_route
                                        for r in range(num_ranks)]), seen
        if fail_rank is not None:
            assert seen["seconds"] < DEATH_TIMEOUT_US / 1e6 + harness.FAULT_SLACK_S, seen


# ---------------------------------------------------------------- flags as the peers' callers pass them (issue 42)
REFUSED_FLAGS = ((2, ValueError), ("yes", TypeError), (1.0, TypeError), (None, TypeError))


def _refused(call, name: str, allow_none: bool = False) -> int:
    """Every value of REFUSED_FLAGS (None too unless `allow_none`) makes `call(value)` raise naming `name`."""
    count = 0
    for value, error in REFUSED_FLAGS:
        if value is None and allow_none:
            continue
        with pytest.raises(error, match=rf"^{name}: expected (None, )?a bool \(or 0/1\), got"):
            call(value)
        count += 1
    return count


def _same_bits(name, got, want):
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def rank_flags_as_callers_pass_them(ctx):
    """Buffer, deep_ep.Buffer and ElasticBuffer built and called with 0/1, NumPy bools and NumPy sizes, as
    DeepEP's and Mooncake's callers pass them: each call gives what the same call with plain bools gives
    (Buffer: checked against the references), and 2, 'yes', 1.0 and None are still refused by name."""
    from mooncake_ep_switch import ElasticBuffer, deep_ep

    R, refused = ctx.num_ranks, 0
    everyone = [1] * R
    all_inputs = _gather_rounds(ctx, 1)[0]
    mine = all_inputs[ctx.rank]
    size = Buffer.get_ep_buffer_size_hint(np.int64(Shape.tokens), np.int32(Shape.hidden), np.int64(R),
                                          np.int64(Shape.experts))
    refused += _refused(lambda v: Buffer(ctx.group, size, disable_p2p=v, transport="shm"), "disable_p2p")
    buffer = Buffer(ctx.group, np.int64(size), np.bool_(False), transport="shm")
    active = torch.ones(R, dtype=torch.int32)
    for use_fp8, async_finish, hook in ((0, np.bool_(False), 0), (np.bool_(False), 1, np.bool_(False)),
                                        (0, 0, 1)):
        recv, count, handle, event, receive = buffer.dispatch(mine.x, mine.topk_idx, active, np.int64(Shape.tokens),
                                                              np.int64(Shape.experts), TIMEOUT_US, use_fp8=use_fp8,
                                                              async_finish=async_finish, return_recv_hook=hook)
        assert isinstance(recv, torch.Tensor), "use_fp8=0 sends bf16 rows"
        receive() if receive is not None else None
        event.current_stream_wait() if async_finish else None
        y = _mock_expert(ctx, recv)
        buffer.get_next_combine_buffer(handle).copy_(y)
        combined, event, receive = buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle,
                                                  zero_copy=np.int64(1), async_finish=async_finish,
                                                  return_recv_hook=hook)
        receive() if receive is not None else None
        event.current_stream_wait() if async_finish else None
        _check_round(ctx, all_inputs, everyone, everyone, recv, count, handle, combined)
    call = (mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts, TIMEOUT_US)
    refused += _refused(lambda v: buffer.dispatch(*call, use_fp8=v), "use_fp8", allow_none=True)
    refused += _refused(lambda v: buffer.dispatch(*call, async_finish=v), "async_finish")
    refused += _refused(lambda v: buffer.dispatch(*call, return_recv_hook=v), "return_recv_hook")
    recv, count, handle, _, _ = buffer.dispatch(*call, use_fp8=False)
    y = _mock_expert(ctx, recv)
    refused += _refused(lambda v: buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle,
                                                 zero_copy=v), "zero_copy")
    combined, _, _ = buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle)
    _check_round(ctx, all_inputs, everyone, everyone, recv, count, handle, combined)  # the refusals moved nothing
    buffer.destroy()

    # DeepEP V1's low-latency Buffer.
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(np.int64(Shape.tokens), np.int64(Shape.hidden),
                                                         np.int64(R), np.int64(Shape.experts))
    refused += _refused(lambda v: deep_ep.Buffer(ctx.group, 0, hint, low_latency_mode=v), "low_latency_mode")
    refused += _refused(lambda v: deep_ep.Buffer(ctx.group, 0, hint, low_latency_mode=True, enable_shrink=v),
                        "enable_shrink")
    v1 = deep_ep.Buffer(ctx.group, np.int64(0), np.int64(hint), low_latency_mode=1, num_qps_per_rank=np.int64(4),
                        allow_nvlink_for_low_latency_mode=np.bool_(True), explicitly_destroy=1, enable_shrink=0,
                        transport="shm")
    results = []
    for flags in (dict(use_fp8=0, round_scale=np.bool_(False), use_ue8m0=0, async_finish=1),
                  dict(use_fp8=False, round_scale=False, use_ue8m0=False, async_finish=True)):
        recv, count, handle, event, _ = v1.low_latency_dispatch(mine.x, mine.topk_idx, np.int64(Shape.tokens),
                                                                np.int64(Shape.experts), **flags)
        event.current_stream_wait()
        y = _mock_expert(ctx, recv)
        combined, _, _ = v1.low_latency_combine(y, mine.topk_idx, mine.weights, handle, use_logfmt=0,
                                                zero_copy=np.bool_(False), return_recv_hook=0)
        rows = torch.cat([recv[e, :n] for e, n in enumerate(count.tolist())])  # rows past recv_count: unspecified
        results.append((rows, count.clone(), combined.clone()))
    for name, got, want in zip(("recv_x", "recv_count", "combined_x"), results[0], results[1]):
        _same_bits(f"deep_ep {name}", got, want)
    refused += _refused(lambda v: v1.low_latency_dispatch(mine.x, mine.topk_idx, Shape.tokens, Shape.experts,
                                                          use_fp8=v), "use_fp8")
    refused += _refused(lambda v: v1.low_latency_dispatch(mine.x, mine.topk_idx, Shape.tokens, Shape.experts,
                                                          return_recv_hook=v), "return_recv_hook")
    v1.destroy()

    # DeepEP V2's ElasticBuffer, as its tests/elastic/test_ep.py builds it (`--allow-hybrid-mode 1`).
    settings = dict(num_max_tokens_per_rank=np.int64(Shape.tokens), hidden=np.int64(Shape.hidden),
                    num_topk=np.int64(Shape.top_k), transport="shm")
    for name in ("allow_hybrid_mode", "allow_multiple_reduction", "use_fp8_dispatch"):
        refused += _refused(lambda v: ElasticBuffer(ctx.group, **settings, **{name: v}), name)
    v2 = ElasticBuffer(ctx.group, **settings, use_fp8_dispatch=0, deterministic=np.bool_(False), allow_hybrid_mode=1,
                       allow_multiple_reduction=1, prefer_overlap_with_compute=np.bool_(True), explicitly_destroy=1)
    topk, weights = mine.topk_idx, mine.weights
    results = []
    for run_async, flag in ((1, np.bool_(True)), (True, True), (0, np.bool_(False)), (False, False)):
        recv_x, _, recv_w, handle, event = v2.dispatch(mine.x, topk_idx=topk, topk_weights=weights,
                                                       num_experts=np.int64(Shape.experts),
                                                       async_with_compute_stream=run_async, do_expand=0,
                                                       allocate_on_comm_stream=flag)
        event.current_stream_wait()
        partial = recv_x.float().mul(0.5).to(torch.bfloat16)
        combined, combined_w, event = v2.combine(partial, handle, topk_weights=recv_w,
                                                 async_with_compute_stream=run_async)
        event.current_stream_wait()
        results.append((recv_x.clone(), recv_w.clone(), combined.clone(), combined_w.clone()))
    for given, plain in ((0, 1), (2, 3)):
        for name, got, want in zip(("recv_x", "recv_w", "combined_x", "combined_w"), results[given], results[plain]):
            _same_bits(f"ElasticBuffer {name}", got, want)
    refused += _refused(lambda v: v2.dispatch(mine.x, topk_idx=topk, topk_weights=weights, num_experts=Shape.experts,
                                              async_with_compute_stream=v), "async_with_compute_stream")
    refused += _refused(lambda v: v2.dispatch(mine.x, topk_idx=topk, topk_weights=weights, num_experts=Shape.experts,
                                              do_expand=v), "do_expand")
    v2.destroy()
    return refused


def test_flags_given_as_ints_and_numpy_are_taken_everywhere_a_peer_api_is_mirrored():
    """Issue 42 item 1: DeepEP V2's elastic test passed `allow_hybrid_mode=1` and failed in the constructor;
    now 0/1, np.bool_ and NumPy sizes are taken by Buffer, deep_ep.Buffer and ElasticBuffer alike, and every
    other value is still refused by name."""
    refused = harness.run(2, rank_flags_as_callers_pass_them, timeout_s=150)
    # Refusals: Buffer 4 (disable_p2p) + 3 (use_fp8: None is its default) + 3 * 4; deep_ep 4 * 4; ElasticBuffer 5 * 4.
    assert refused == [55, 55], refused


def test_a_buffer_that_cannot_switch_says_why_and_stays_as_it_was():
    """Issue 42 item 3: `_use_fallback = True` on a Buffer that cannot run the fallback names the reason, and
    the Buffer's transport stays what it was (a "cuda" Buffer's calls take CUDA tensors; a replacement's
    Buffer before any new view has no group to build the fallback on; a joiner is no member yet)."""
    from mooncake_ep_switch.buffer import mooncake_runtime
    from mooncake_ep_switch.buffer.core import BufferCore
    from mooncake_ep_switch.config import settings
    from mooncake_ep_switch.errors import MembershipError

    cuda_like = types.SimpleNamespace(name="cuda", device=torch.device("cuda", 0))
    core = BufferCore(0, 2, settings(), transport=cuda_like)
    with pytest.raises(ValueError, match=r"^_use_fallback: expected False on a 'cuda' Buffer, got True \(its calls "
                                         r"take CUDA tensors on cuda:0; the collective fallback packs host tensors"):
        mooncake_runtime.set_use_fallback(core, np.bool_(True), object(), None)
    assert core.transport is cuda_like
    assert mooncake_runtime.set_use_fallback(core, 0, object(), None) is cuda_like  # False: already so
    host_like = types.SimpleNamespace(name="shm", device=None)
    core = BufferCore(0, 2, settings(), transport=host_like)
    with pytest.raises(ValueError, match=r"^_use_fallback: expected False on a Buffer built without a process group"):
        mooncake_runtime.set_use_fallback(core, 1, None, None)
    core.joining = True
    with pytest.raises(MembershipError, match=r"^_use_fallback: rank 0 is not a member of the current view"):
        mooncake_runtime.set_use_fallback(core, True, object(), None)
    with pytest.raises(ValueError, match=r"^_use_fallback: expected a bool \(or 0/1\), got 2$"):
        mooncake_runtime.set_use_fallback(core, 2, object(), None)
    assert core.transport is host_like


def rank_switch_after_a_view_change(ctx, fail_rank):
    """A rank exits while the Buffer runs on its own transport; the survivors agree on the next view
    (update_ep_member), and only then switch: the fallback is built for a later view (a group of the
    survivors, made through the store) and is exact there; then back, exact again."""
    R = ctx.num_ranks
    buffer = _buffer_for(ctx, "shm")
    rounds = iter(_gather_rounds(ctx, 4))
    everyone = [1] * R
    assert _grid_round(ctx, buffer, next(rounds), torch.ones(R, dtype=torch.int32)) == (everyone, everyone)
    all_inputs = next(rounds)
    dist.barrier(group=ctx.group)
    if ctx.rank == fail_rank:
        os._exit(0)
    without = [0 if r == fail_rank else 1 for r in range(R)]
    assert _grid_round(ctx, buffer, all_inputs, torch.ones(R, dtype=torch.int32),
                       timeout_us=DEATH_TIMEOUT_US) == (without, without)
    view = buffer.update_ep_member()
    buffer._use_fallback = True
    routes = buffer.peer_routes()
    assert _grid_round(ctx, buffer, next(rounds), buffer.active_mask(), zero_copy=True) == (without, without)
    buffer._use_fallback = False
    assert _grid_round(ctx, buffer, next(rounds), buffer.active_mask()) == (without, without)
    buffer.destroy()
    return {"epoch": view.epoch, "members": list(view.ranks), "routes": routes}


def _buffer_for(ctx, transport):
    size = Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, ctx.num_ranks, Shape.experts)
    return Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)


def test_use_fallback_after_a_view_change_builds_the_fallback_for_that_view():
    """The fallback is built when first needed, also in a later view: on a group of the survivors."""
    fail_rank, num_ranks = 2, 4
    with harness.fresh_cluster(num_ranks) as cluster:
        outcomes = cluster.run(rank_switch_after_a_view_change, fail_rank, timeout_s=150, failure_grace_s=40)
        processes = list(cluster.processes)
    assert not any(process.is_alive() for process in processes), "leftover rank processes"
    assert not outcomes[fail_rank].ok and outcomes[fail_rank].exitcode == 0, outcomes[fail_rank]
    for outcome in outcomes:
        if outcome.rank == fail_rank:
            continue
        assert outcome.ok, outcome.error
        rank = outcome.rank
        assert outcome.value == {"epoch": 1, "members": [0, 1, 3],
                                 "routes": ["self" if r == rank else None if r == fail_rank else "collective"
                                            for r in range(num_ranks)]}, outcome.value
