"""A late peer's rows never land where a later call of another shape reads (docs/protocol.md, failure semantics).

A region is laid out per call shape `(T, hidden, E)`: the size of a half, hence where half 1 begins,
and every array in a half depend on it. A source masked by a deadline while its process lives
(stalled, slow) can still finish writing the call it had started, in that call's layout, after
the survivors moved on. Were the survivors to go on in another shape, its rows would land in rows
they read: here rank 2's rows of round 3 (shape A, T=8, half 1) fall on rank 0's own rows 96..103
of round 4 (shape B, T=128, half 0). The survivors keep the region's layout until such a peer is
known dead or back, and refuse a call of another shape by name, before any state changes; the same
shape stays exact.

R=3, one expert per rank, every token routed to expert 0 (rank 0). Rank 2 sends round 3 only after
ranks 0 and 1 masked it, and after rank 0 sent (to itself) its round 4.
"""
import datetime

import pytest
import torch

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.buffer.layout import region_layout
from tests import harness
from tests.emulated_device import run_emulated

R, HIDDEN, EXPERTS = 3, 128, 3
SHAPE_A, SHAPE_B = 8, 128  # num_max_dispatch_tokens_per_rank of the first rounds, of the changed shape
LATE = 2
WAIT = datetime.timedelta(seconds=60)


def _late_rows_hit_rank0_rows():
    """Rank 0's rows of a shape-B call in half 0 that rank LATE's shape-A rows of half 1 cover."""
    a, b = region_layout(R, SHAPE_A, HIDDEN, EXPERTS), region_layout(R, SHAPE_B, HIDDEN, EXPERTS)
    late_begin = a.half_offset(1) + a.dispatch_data + LATE * SHAPE_A * a.row_bytes  # dispatch_data[0][LATE][0]
    first = (late_begin - b.half_offset(0) - b.dispatch_data) // b.row_bytes  # dispatch_data[0][0][first]
    return range(first, first + SHAPE_A)


def _tokens(rank: int, round_index: int, count: int):
    generator = torch.Generator().manual_seed(1000 * round_index + rank)
    x = torch.randn((count, HIDDEN), generator=generator).to(torch.bfloat16)
    topk = torch.zeros((count, 1), dtype=torch.int64)  # every token to expert 0 (rank 0)
    return x, topk, torch.ones((count, 1), dtype=torch.float32)


def _round(buffer, rank, round_index, tokens, active, timeout_us, hook=False):
    x, topk, weights = (t.to(active.device) for t in _tokens(rank, round_index, tokens))
    out = buffer.dispatch(x, topk, active, tokens, EXPERTS, timeout_us, use_fp8=False, return_recv_hook=hook)
    return x, topk, weights, out


def _check_rows(recv, count, handle, round_index, tokens, active):
    """Rank 0's received rows: every active source's tokens, in source order, equal to what it sent."""
    recv, count, handle = recv.cpu(), count.cpu(), (handle[0].cpu(),)
    row = 0
    for source in range(R):
        if not active[source]:
            continue
        x, _, _ = _tokens(source, round_index, tokens)
        for t in range(tokens):
            assert int(handle[0][0, row]) == t, f"round {round_index}: source {source} token {t}"
            assert torch.equal(recv[0, row], x[t]), f"round {round_index}: row of source {source} token {t} differs"
            row += 1
    assert int(count[0]) == row


def _finish(buffer, out, topk, weights, active, timeout_us):
    recv, _, handle, _, _ = out
    buffer.combine(recv.clone(), topk, weights, active, timeout_us, handle)


def rank_main(ctx, transport):
    size = max(Buffer.get_ep_buffer_size_hint(t, HIDDEN, R, EXPERTS) for t in (SHAPE_A, SHAPE_B))
    if transport == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(0)
    buffer = Buffer(ctx.group, size, transport=transport, disable_p2p=transport == "mooncake")
    store, rank, result = ctx.store, ctx.rank, {}
    active = torch.ones(R, dtype=torch.int32, device=buffer.device)
    for round_index in (1, 2):  # whole rounds of shape A
        _, topk, weights, out = _round(buffer, rank, round_index, SHAPE_A, active, 30_000_000)
        _finish(buffer, out, topk, weights, active, 30_000_000)
    if rank == LATE:
        # Round 3, late: sent once ranks 0 and 1 masked this rank and rank 0 sent its round 4.
        store.wait(["late/sent4"], WAIT)
        _round(buffer, rank, 3, SHAPE_A, active, 1_000_000, hook=True)  # the send phase only
        store.set("late/done", "1")
        store.wait(["late/finished"], WAIT)
        buffer.destroy()
        return result
    # Round 3 without the late rank: it is masked by the deadline (its process lives on).
    _, topk, weights, out = _round(buffer, rank, 3, SHAPE_A, active, 1_000_000)
    assert active.tolist() == [1, 1, 0], active.tolist()
    _finish(buffer, out, topk, weights, active, 1_000_000)
    if rank == 1:
        store.wait(["late/done"], WAIT)
    # The shape changes: refused by name on every survivor (the late rank may still write in shape A),
    # nothing changed: round 4 then runs in shape A. (Without the guard round 4 runs in shape B.)
    tokens = SHAPE_B
    try:
        _, topk, weights, out = _round(buffer, rank, 4, SHAPE_B, active, 10_000_000, hook=rank == 0)
    except ValueError as error:
        message = str(error)
        assert "num_max_dispatch_tokens_per_rank" in message and f"rank {LATE}" in message, message
        result["refused"] = message
        tokens = SHAPE_A
        _, topk, weights, out = _round(buffer, rank, 4, SHAPE_A, active, 10_000_000, hook=rank == 0)
    if rank == 0:  # rank 0's own rows of round 4 are written; now the late rank's rows land
        store.set("late/sent4", "1")
        store.wait(["late/done"], WAIT)
        out[4]()
        _check_rows(out[0], out[1], out[2], 4, tokens, active.tolist())
    _finish(buffer, out, topk, weights, active, 10_000_000)
    _, topk, weights, out = _round(buffer, rank, 5, tokens, active, 10_000_000)
    if rank == 0:
        _check_rows(out[0], out[1], out[2], 5, tokens, active.tolist())
    _finish(buffer, out, topk, weights, active, 10_000_000)
    assert active.tolist() == [1, 1, 0], active.tolist()
    if rank == 0:
        store.set("late/finished", "1")
    buffer.destroy()
    return result


def test_the_shapes_put_late_rows_on_live_rows():
    """The geometry this test relies on: without the guard, the late rows would cover rank 0's rows."""
    hit = _late_rows_hit_rank0_rows()
    assert 0 <= hit.start and hit.stop <= SHAPE_B, hit


def test_the_hold_follows_the_peers_fate():
    """The hold's rules: a live masked peer holds the masking call's layout (another one is refused by
    name, nothing recorded); a dead one never holds; death or re-admission of the peer releases it."""
    from mooncake_ep_switch.buffer.layout import LayoutHeld, RegionLayouts

    a, b = (SHAPE_A, HIDDEN, EXPERTS), (SHAPE_B, HIDDEN, EXPERTS)
    layouts, dead = RegionLayouts(R, 1 << 20), []
    layouts.use(a, lambda: dead)
    layouts.hold([1], dead=[2])  # rank 1 masked by a deadline; its process lives
    layouts.use(a, lambda: dead)  # the held shape: fine
    with pytest.raises(LayoutHeld, match=r"expected \(8, 128, 3\) while rank 1 masked .* got \(128, 128, 3\)"):
        layouts.use(b, lambda: dead)
    assert layouts.latest == a and layouts.held == a
    dead.append(1)  # its process is seen to end
    layouts.use(b, lambda: dead)
    assert layouts.held is None and layouts.latest == b
    layouts.hold([2], dead=[2])  # masked because it died: nothing can land late
    layouts.use(a, lambda: [])
    layouts.hold([0, 2], dead=[], key=b)  # the masking call's layout, not the latest one
    with pytest.raises(LayoutHeld, match=r"ranks \[0, 2\]"):
        layouts.use(a, lambda: [])
    layouts.settle(0)
    with pytest.raises(LayoutHeld, match="rank 2 masked"):
        layouts.use(a, lambda: [])
    layouts.settle(2)  # admitted again: mapped anew
    layouts.use(a, lambda: [])
    assert layouts.held is None


@pytest.mark.faults
@pytest.mark.parametrize("transport", ["shm", "mooncake", "cuda-emulated"])
def test_late_rows_never_land_in_a_later_shape(transport):
    """shm, the Transfer Engine and the cuda transport on the emulated device (tests/emulated_device.py)."""
    target = (rank_main, "shm" if transport == "shm" else "mooncake") if transport != "cuda-emulated" else \
        (run_emulated, __name__, "rank_main", "cuda")
    with harness.fresh_cluster(R) as cluster:
        outcomes = harness.check_outcomes(cluster.run(*target, timeout_s=120))
    assert all("refused" in outcomes[r] for r in (0, 1)), outcomes
