"""Misuse of the data plane: never silently wrong, never crashed, never locked out.

* A handle is combined with the dispatch's own `topk_idx` (other top-k values would read rows of
  another round), any number of times until the next dispatch (DeepEP's tests combine each handle
  twice), never after it: refused with an error naming `handle` / `topk_idx`.
* A tensor argument on a non-CPU device (meta here, CUDA on a GPU host) is refused before anything
  changes: the next round on every rank is exact and no rank is masked.
* After `destroy()` (or garbage collection) hooks and events raise RuntimeError, and tensors over
  the Buffer's or the unified weights' shared memory stay valid memory (the cases that crashed run
  in a child process, so a regression cannot take pytest down).
* `destroy()` and `__del__` with a receive still waiting (timeout_us=-1) return within a bound;
  the waiting call's event or hook raises RuntimeError and its thread ends.
"""
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch import Buffer, BufferDestroyed
from mooncake_ep_switch.buffer.handle import DispatchHandle
from tests import harness
from tests.reference import expected_combine, structured_inputs
from tests.test_buffer import TRANSPORTS, Case, _check_dispatch, _complete, _expert_outputs

MODES = ["sync", "hook", "async"]
CASE = Case(hidden=256, tokens=16, experts=8, top_k=3)
TIMEOUT_US = 30_000_000  # generous: a healthy run never reaches it
NUM_TOKENS = 12


def _buffer(ctx, transport):
    size = Buffer.get_ep_buffer_size_hint(CASE.tokens, CASE.hidden, ctx.num_ranks, CASE.experts)
    return Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)


def _flags(mode):
    return dict(async_finish=mode == "async", return_recv_hook=mode == "hook")


def _inputs(ctx, seed):
    mine = structured_inputs(ctx.rank, NUM_TOKENS, CASE.hidden, CASE.experts, CASE.top_k, seed)
    everyone = [None] * ctx.num_ranks
    dist.all_gather_object(everyone, mine, group=ctx.group)
    return mine, everyone


def _dispatch(ctx, buffer, mine, everyone, active, mode):
    """A dispatch checked row by row against the all-gathered routing; returns (handle, y)."""
    result = buffer.dispatch(mine.x, mine.topk_idx, active, CASE.tokens, CASE.experts, TIMEOUT_US, use_fp8=False,
                             **_flags(mode))
    handle = _check_dispatch(ctx, CASE, everyone, active.tolist(), result, False, mode)
    return handle, _expert_outputs(ctx, CASE, result[0], result[1], False)


def _expected(ctx, mine):
    return expected_combine(mine.x, mine.topk_idx, mine.weights, {r: True for r in range(ctx.num_ranks)},
                            CASE.experts // ctx.num_ranks)


def _combine_exact(ctx, buffer, mine, y, active, handle, mode, **kwargs):
    combined, event, hook = buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle,
                                           **_flags(mode), **kwargs)
    _complete(event, hook, mode)
    assert torch.equal(combined, _expected(ctx, mine)), "combine differs from the reference"
    return combined


def _healthy_round(ctx, buffer, seed, mode="sync"):
    """A full round on every rank: exact rows and outputs, nobody masked."""
    mine, everyone = _inputs(ctx, seed)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    handle, y = _dispatch(ctx, buffer, mine, everyone, active, mode)
    _combine_exact(ctx, buffer, mine, y, active, handle, mode)
    assert active.tolist() == [1] * ctx.num_ranks, f"a healthy rank was masked: {active.tolist()}"


# ------------------------------------------------------------------ item: a handle combined again (issue 27)

def rank_combine_again(ctx, transport, mode):
    """DeepEP's and Mooncake's own tests combine each handle twice: a plain combine, then the zero-copy
    buffer filled and combined again. Every combine of a handle is exact (here three, the third through a
    plain 5-tuple of the handle) until the next dispatch; after it, combining the old handle again is
    refused, naming `handle` and why, and the Buffer stays exact."""
    with _buffer(ctx, transport) as buffer:
        for round_ in range(3):
            mine, everyone = _inputs(ctx, 10 + round_)
            active = torch.ones(ctx.num_ranks, dtype=torch.int32)
            handle, y = _dispatch(ctx, buffer, mine, everyone, active, mode)
            _combine_exact(ctx, buffer, mine, y, active, handle, mode)
            buffer.get_next_combine_buffer(handle).copy_(y)
            _combine_exact(ctx, buffer, mine, torch.zeros_like(y), active, handle, mode, zero_copy=True)
            _combine_exact(ctx, buffer, mine, y, active, tuple(handle), mode)
            assert active.tolist() == [1] * ctx.num_ranks
            _healthy_round(ctx, buffer, 20 + round_, mode)  # a later dispatch: the old handle is done
            for again in (handle, tuple(handle)):
                with pytest.raises(ValueError, match=r"^handle: expected the latest dispatch's handle to combine "
                                                     r"again.*combined again only before the next dispatch"):
                    buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, again, **_flags(mode))
            assert active.tolist() == [1] * ctx.num_ranks
            _healthy_round(ctx, buffer, 30 + round_, mode)
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", MODES)
def test_a_handle_is_combined_again_until_the_next_dispatch(transport, mode):
    assert all(harness.run(2, rank_combine_again, transport, mode))


def _other_experts(topk_idx, num_experts):
    """Every selected expert moved to the next one (still distinct per row, -1 kept)."""
    return torch.where(topk_idx >= 0, (topk_idx + 1) % num_experts, topk_idx)


def rank_other_topk(ctx, transport, mode):
    with _buffer(ctx, transport) as buffer:
        for round_ in range(2):
            mine, everyone = _inputs(ctx, 30 + round_)
            active = torch.ones(ctx.num_ranks, dtype=torch.int32)
            handle, y = _dispatch(ctx, buffer, mine, everyone, active, mode)
            other = _other_experts(mine.topk_idx, CASE.experts)
            one_entry = mine.topk_idx.clone()
            one_entry[0, 0] = (int(one_entry[0, 0]) + CASE.top_k) % CASE.experts if one_entry[0, 0] >= 0 else -1
            if torch.equal(one_entry, mine.topk_idx) or len(set(one_entry[0].tolist()) - {-1}) < \
                    len([e for e in one_entry[0].tolist() if e >= 0]):
                one_entry = other
            for bad in (other, one_entry):
                with pytest.raises(ValueError, match=r"^topk_idx: expected the topk_idx given to the matching"):
                    buffer.combine(y, bad, mine.weights, active, TIMEOUT_US, handle, **_flags(mode))
            # The dispatch's own tensor changed in place after the dispatch: refused too.
            saved = mine.topk_idx.clone()
            mine.topk_idx.copy_(other)
            with pytest.raises(ValueError, match=r"^topk_idx:"):
                buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, handle, **_flags(mode))
            mine.topk_idx.copy_(saved)
            # The refused calls used nothing up: the right combine is exact, nobody is masked.
            _combine_exact(ctx, buffer, mine, y, active, handle, mode)
            assert active.tolist() == [1] * ctx.num_ranks
            _healthy_round(ctx, buffer, 40 + round_, mode)
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", MODES)
def test_combine_with_other_topk_idx_is_refused(transport, mode):
    assert all(harness.run(2, rank_other_topk, transport, mode))


def rank_foreign_tuple_handle(ctx, transport):
    with _buffer(ctx, transport) as buffer:
        mine, everyone = _inputs(ctx, 50)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        handle, y = _dispatch(ctx, buffer, mine, everyone, active, "sync")
        copied = (handle[0].clone(),) + tuple(handle[1:])  # a tuple that is no dispatch's
        with pytest.raises(ValueError, match=r"^handle: expected the handle of one of this Buffer's last two"):
            buffer.combine(y, mine.topk_idx, mine.weights, active, TIMEOUT_US, copied)
        _combine_exact(ctx, buffer, mine, y, active, tuple(handle), "sync")  # its own tuple works
        _healthy_round(ctx, buffer, 51)
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_plain_tuple_handle_must_be_a_recent_dispatch(transport):
    assert all(harness.run(2, rank_foreign_tuple_handle, transport))


# ------------------------------------------------------------------ item: non-CPU tensors

DISPATCH_TENSORS = ["x", "topk_idx", "active_ranks"]
COMBINE_TENSORS = ["x", "topk_idx", "topk_weights", "active_ranks", "out", "handle.src_info", "handle.layout_range"]


def _meta(tensor):
    return torch.empty_like(tensor, device="meta")


def rank_non_cpu_tensors(ctx, transport, mode):
    """Every tensor argument on the meta device, cold (first call of the shape) and warm (the fast
    path): a clear error naming it, then exact rounds on every rank with nobody masked."""
    seed = 60
    messages = []
    for phase, names in (("dispatch", DISPATCH_TENSORS), ("combine", COMBINE_TENSORS)):
        for name in names:
            with _buffer(ctx, transport) as buffer:
                for warm in (False, True):
                    seed += 1
                    mine, everyone = _inputs(ctx, seed)
                    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
                    if phase == "dispatch":
                        args = dict(x=mine.x, topk_idx=mine.topk_idx, active_ranks=active)
                        args[name] = _meta(args[name])
                        with pytest.raises(ValueError) as error:
                            buffer.dispatch(**args, num_max_dispatch_tokens_per_rank=CASE.tokens,
                                            num_experts=CASE.experts, timeout_us=TIMEOUT_US, use_fp8=False,
                                            **_flags(mode))
                    else:
                        handle, y = _dispatch(ctx, buffer, mine, everyone, active, mode)
                        args = dict(x=y, topk_idx=mine.topk_idx, topk_weights=mine.weights, active_ranks=active,
                                    handle=handle, out=torch.empty((NUM_TOKENS, CASE.hidden), dtype=torch.bfloat16))
                        if name.startswith("handle."):
                            fields = list(handle)
                            index = 0 if name == "handle.src_info" else 1
                            fields[index] = _meta(fields[index])
                            args["handle"] = DispatchHandle(*fields, plan=handle.plan)
                        else:
                            args[name] = _meta(args[name])
                        with pytest.raises(ValueError) as error:
                            buffer.combine(**args, timeout_us=TIMEOUT_US, **_flags(mode))
                        # The refused combine used nothing up: the dispatch combines exactly.
                        _combine_exact(ctx, buffer, mine, y, active, handle, mode)
                    message = str(error.value)
                    assert message.startswith(f"{name}: expected a CPU tensor"), message
                    assert "meta" in message, message
                    messages.append(message)
                    assert active.tolist() == [1] * ctx.num_ranks
                    _healthy_round(ctx, buffer, 100 + seed, mode)
                    _healthy_round(ctx, buffer, 200 + seed, "sync")
    return len(messages)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["sync", "hook"])
def test_non_cpu_tensors_are_refused_before_anything_moves(transport, mode):
    counts = harness.run(2, rank_non_cpu_tensors, transport, mode, timeout_s=300)
    assert counts == [2 * (len(DISPATCH_TENSORS) + len(COMBINE_TENSORS))] * 2


# ------------------------------------------------------------------ item: use after destroy

_CHILD = textwrap.dedent("""
    import gc, sys
    import torch, torch.distributed as dist
    from mooncake_ep_switch.launcher.launch import host_store

    store = host_store("127.0.0.1", 0, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    from mooncake_ep_switch import Buffer

    case, transport = sys.argv[1], sys.argv[2]
    T, H, E = 8, 256, 4
    buf = Buffer(dist.group.WORLD, Buffer.get_ep_buffer_size_hint(T, H, 1, E), transport=transport)
    x = (torch.arange(4 * H) % 7).view(4, H).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    weights = torch.ones(4, 2)
    active = torch.ones(1, dtype=torch.int32)

    def expect_destroyed(function):
        try:
            function()
        except RuntimeError as error:
            assert "destroyed" in str(error), error
            print("raised", error)
        else:
            raise AssertionError("no RuntimeError")

    if case == "dispatch_hook":
        result = buf.dispatch(x, topk, active, T, E, -1, use_fp8=False, return_recv_hook=True)
        buf.destroy()
        expect_destroyed(result[4])
        expect_destroyed(result[3].current_stream_wait)
    elif case == "combine_hook":
        recv, _, handle, _, _ = buf.dispatch(x, topk, active, T, E, -1, use_fp8=False)
        _, event, hook = buf.combine(recv, topk, weights, active, -1, handle, return_recv_hook=True)
        buf.destroy()
        expect_destroyed(hook)
        expect_destroyed(event.current_stream_wait)
    elif case == "combine_buffer_after_destroy":
        recv, _, handle, _, _ = buf.dispatch(x, topk, active, T, E, -1, use_fp8=False)
        target = buf.get_next_combine_buffer(handle)
        buf.destroy()
        target.fill_(1.5)
        assert float(target.float().sum()) == 1.5 * target.numel()
        expect_destroyed(lambda: buf.get_next_combine_buffer(handle))
        print("ok")
    elif case == "combine_buffer_after_gc":
        recv, _, handle, _, _ = buf.dispatch(x, topk, active, T, E, -1, use_fp8=False)
        target = buf.get_next_combine_buffer(handle)
        target.fill_(2.0)
        del buf, recv, handle
        gc.collect()
        assert float(target.float().sum()) == 2.0 * target.numel()
        target.fill_(3.0)
        print("ok")
    elif case == "umm_view_after_destroy":
        from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

        unified = UnifiedWeights(buf, WeightShape(4, 128, 64), 2)
        gate_up, down = unified.view(1)
        gate_up.fill_(0.25)
        unified.destroy()
        buf.destroy()
        del unified
        gc.collect()
        assert float(gate_up.float().sum()) == 0.25 * gate_up.numel()
        down.fill_(1.0)
        assert float(down.float().sum()) == down.numel()
        print("ok")
    dist.destroy_process_group()
    # Tear torch down in order before the interpreter does (once in a CI run under load, the exit of a
    # child that had passed every check aborted with "terminate called without an active exception":
    # a C++ thread of the process group or of the store's server still joinable at finalisation).
    globals().pop("buf", None)
    gc.collect()
    del store
    gc.collect()
""")

CHILD_CASES = ["dispatch_hook", "combine_hook", "combine_buffer_after_destroy", "combine_buffer_after_gc",
               "umm_view_after_destroy"]


@pytest.mark.parametrize("transport", ["shm", "collective"])
@pytest.mark.parametrize("case", CHILD_CASES)
def test_use_after_destroy_never_crashes(case, transport):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _CHILD, case, transport], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert ("raised" in done.stdout) if "hook" in case else ("ok" in done.stdout), done.stdout


# ------------------------------------------------------------------ item: destroy with a call in flight

def _receive_threads():
    return [t for t in threading.enumerate() if t.name.startswith("mep-recv") and t.is_alive()]


def rank_destroy_in_flight(ctx, transport, mode, how):
    """Rank 0 starts a dispatch with no deadline that rank 1 never answers (yet), then destroys its
    Buffer (or drops it): bounded, the call raises RuntimeError, and its thread ends."""
    key = f"test_misuse/destroy_in_flight/{transport}/{mode}/{how}"
    buffer = _buffer(ctx, transport)
    mine, _ = _inputs(ctx, 70)
    active = torch.ones(ctx.num_ranks, dtype=torch.int32)
    found = None
    if ctx.rank == 0:
        result = buffer.dispatch(mine.x, mine.topk_idx, active, CASE.tokens, CASE.experts, -1, use_fp8=False,
                                 **_flags("hook" if mode == "hook_thread" else "async"))
        errors = []
        waiter = None
        if mode == "hook_thread":  # the hook runs (and waits, no deadline) on another thread
            def run_hook():
                try:
                    result[4]()
                except RuntimeError as error:
                    errors.append(str(error))

            waiter = threading.Thread(target=run_hook, daemon=True)
            waiter.start()
        time.sleep(0.3)  # the receive is waiting now
        event = result[3]
        del result
        start = time.monotonic()
        if how == "destroy":
            buffer.destroy()
        else:
            del buffer
            gc.collect()
        took = time.monotonic() - start
        # shm / TE: the native wait was told to stop; collective: destroy() waits its bound (5 s).
        assert took < (7.0 if transport == "collective" else 2.0), f"{how} took {took:.2f} s"
        with pytest.raises(RuntimeError, match="destroyed") as caught:
            event.current_stream_wait()
        assert isinstance(caught.value, BufferDestroyed), type(caught.value)  # one hierarchy (issue 24)
        if waiter is not None:
            waiter.join(2.0)
            assert not waiter.is_alive() and errors and "destroyed" in errors[0], errors
        found = took
        ctx.store.set(key, "destroyed")
    else:
        ctx.store.get(key)  # waits until rank 0 is done (no group collective: rank 0 has one posted)
        if transport == "collective":
            # Rank 0's exchange is still posted in the process group: meet it, so that it ends
            # (and with it rank 0's receive thread) and the group stays usable.
            buffer.dispatch(mine.x, mine.topk_idx, active, CASE.tokens, CASE.experts, TIMEOUT_US, use_fp8=False)
        buffer.destroy()
    deadline = time.monotonic() + 10.0
    while _receive_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _receive_threads(), "a receive thread outlived destroy()"
    dist.barrier(group=ctx.group)
    return found


# Not run on the collective transport, by design (a documented limit, not a skip): a collective hook
# waits inside the process group, which destroy() cannot interrupt, and an in-flight collective call
# holds its Buffer (for failure recovery), so dropping the last reference destroys it only once the
# call ended. Its ("async", "destroy") case runs: destroy() returns within its bound there too.
_IN_FLIGHT_CASES = [(transport, mode, how) for transport in TRANSPORTS
                    for mode, how in [("async", "destroy"), ("async", "del"), ("hook_thread", "destroy")]
                    if transport != "collective" or (mode, how) == ("async", "destroy")]


@pytest.mark.parametrize("transport,mode,how", _IN_FLIGHT_CASES)
def test_destroy_with_a_call_in_flight_is_bounded(transport, mode, how):
    took = harness.run(2, rank_destroy_in_flight, transport, mode, how)[0]
    assert took is not None


# ------------------------------------------------------------------ double buffering

def rank_late_dispatch_hook(ctx, transport):
    """A dispatch hook run after the dispatch after next (which reuses its region half) is refused,
    never read from rows a peer may have overwritten; the Buffer works on afterwards."""
    with _buffer(ctx, transport) as buffer:
        mine, everyone = _inputs(ctx, 80)
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        hooks = []
        for _ in range(3):
            result = buffer.dispatch(mine.x, mine.topk_idx, active, CASE.tokens, CASE.experts, TIMEOUT_US,
                                     use_fp8=False, return_recv_hook=True)
            hooks.append(result)
        with pytest.raises(RuntimeError, match="reused its region half"):
            hooks[0][4]()
        for result in hooks[1:]:  # the two latest are fine, exact
            _check_dispatch(ctx, CASE, everyone, active.tolist(), result, False, "hook")
        assert active.tolist() == [1] * ctx.num_ranks
        handle = hooks[2][2]
        y = _expert_outputs(ctx, CASE, hooks[2][0], hooks[2][1], False)
        del hooks
        _combine_exact(ctx, buffer, mine, y, active, handle, "sync")
        _healthy_round(ctx, buffer, 81, "hook")
    return True


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_dispatch_hook_after_its_half_was_reused_is_refused(transport):
    assert all(harness.run(2, rank_late_dispatch_hook, transport))


def rank_late_combine_hook(ctx, transport):
    """A combine hook run after the dispatch after next (whose combine reuses its region half and
    its signal slots) is refused at once: never a wait for replaced tags, never a masked healthy
    peer, never rows of a later round; the Buffer works on afterwards."""
    with _buffer(ctx, transport) as buffer:
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        mine0, everyone0 = _inputs(ctx, 90)
        handle0, y0 = _dispatch(ctx, buffer, mine0, everyone0, active, "sync")
        late_out, _, late_hook = buffer.combine(y0, mine0.topk_idx, mine0.weights, active, TIMEOUT_US, handle0,
                                                return_recv_hook=True)
        for seed in (91, 92):  # dispatch 1 and 2, combine 1 and 2: call 2 reuses call 0's half
            _healthy_round(ctx, buffer, seed)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="reused its region half"):
            late_hook()
        assert time.monotonic() - start < 1.0, "the late hook waited instead of refusing"
        assert active.tolist() == [1] * ctx.num_ranks
        assert not buffer._transport.failed_sources, f"healthy peers reported failed: {buffer._transport.failed_sources}"
        del late_out
        _healthy_round(ctx, buffer, 93, "hook")
    return True


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_combine_hook_after_its_half_was_reused_is_refused(transport):
    assert all(harness.run(2, rank_late_combine_hook, transport))


# ------------------------------------------------------------------ a first combine after its half was reused

def rank_first_combine_after_reuse(ctx, transport):
    """dispatch A, dispatch B, combine B, combine B again (a call of its own, on A's region half), then
    combine A: refused, naming `handle`, before anything moves (a fast rank's rows would land in the half
    a slow peer still reads B's second combine from), and so is A's zero-copy combine buffer; a handle three
    dispatches old likewise. Every
    other combine exact, the Buffer exact after."""
    with _buffer(ctx, transport) as buffer:
        active = torch.ones(ctx.num_ranks, dtype=torch.int32)
        first, first_all = _inputs(ctx, 50)
        handle_a, y_a = _dispatch(ctx, buffer, first, first_all, active, "sync")
        second, second_all = _inputs(ctx, 51)
        handle_b, y_b = _dispatch(ctx, buffer, second, second_all, active, "sync")
        _combine_exact(ctx, buffer, second, y_b, active, handle_b, "sync")
        _combine_exact(ctx, buffer, second, y_b, active, handle_b, "sync")
        calls = buffer.latest_call
        with pytest.raises(ValueError, match=r"^handle: expected the handle of one of the last two calls.*reused"):
            buffer.combine(y_a, first.topk_idx, first.weights, active, TIMEOUT_US, handle_a)
        with pytest.raises(ValueError, match=r"^handle: expected the handle of one of the last two calls.*reused"):
            buffer.get_next_combine_buffer(handle_a)  # its zero-copy buffer is the half B's second combine uses
        assert buffer.latest_call == calls and active.tolist() == [1] * ctx.num_ranks
        _healthy_round(ctx, buffer, 52)
        old, old_all = _inputs(ctx, 53)
        handle_old, y_old = _dispatch(ctx, buffer, old, old_all, active, "sync")
        for seed in (54, 55):
            _healthy_round(ctx, buffer, seed)
        with pytest.raises(ValueError, match=r"^handle: expected the handle of one of the last two calls"):
            buffer.combine(y_old, old.topk_idx, old.weights, active, TIMEOUT_US, handle_old)
        with pytest.raises(ValueError, match=r"^handle: expected the handle of one of the last two calls"):
            buffer.get_next_combine_buffer(handle_old)
        _healthy_round(ctx, buffer, 56)
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_first_combine_after_its_half_was_reused_is_refused(transport):
    assert all(harness.run(2, rank_first_combine_after_reuse, transport))
