"""Observability of a fault (issue 41 item 3): a rank SIGKILLed between rounds is masked once, counted in
`stats()` by its cause as the transport saw it, logged at WARNING, one `PeerMasked` on the Buffer's events by
the round that met the death (issue 36 item 4), and `update_ep_member()` moves the epoch in `stats()` with an
INFO line of the new view (docs/observability.md). Also on the "cuda" transport, on the emulated device
(tests/emulated_device.py), whose device calls report the masks the kernels flagged."""
import os
import signal

import pytest
import torch

from mooncake_ep_switch import Buffer
from tests import harness
from tests.test_cuda import on_device
from tests.reference import structured_inputs, token_count
from tests.test_observability import _Records

NUM_RANKS, DEAD = 3, 2
T, HIDDEN, EXPERTS, TOP_K = 16, 256, 6, 2
# What each transport can see: a one-sided wait stops at the pidfd (process end) or at its deadline; a
# collective fails on the lost connection and the peer watcher tells a process end from a link.
# Over the Transfer Engine a write to the dead peer can fail first (a link, as the transport sees it).
CAUSES = {"shm": {"process_end", "deadline"}, "collective": {"process_end", "link"},
          "mooncake": {"process_end", "link", "deadline"}, "cuda": {"process_end", "deadline"}}


def _round(ctx, buffer, seed):
    inputs = structured_inputs(ctx.rank, token_count(ctx.rank, NUM_RANKS, T), HIDDEN, EXPERTS, TOP_K, seed=seed)
    active = torch.ones(NUM_RANKS, dtype=torch.int32)
    timeout_us = harness.FAULT_TIMEOUT_US_TE if buffer.transport == "mooncake" else harness.FAULT_TIMEOUT_US
    recv, _, handle, _, _ = buffer.dispatch(inputs.x, inputs.topk_idx, active, T, EXPERTS, timeout_us, use_fp8=False)
    buffer.combine(recv.clone(), inputs.topk_idx, inputs.weights, active, timeout_us, handle)
    return active.tolist()


def rank_killed(ctx, transport):
    """A whole round; rank DEAD is SIGKILLed; the survivors run a round, then update_ep_member()."""
    size = Buffer.get_ep_buffer_size_hint(T, HIDDEN, NUM_RANKS, EXPERTS)
    buffer = Buffer(ctx.group, size, disable_p2p=transport == "mooncake", transport=transport)
    _round(ctx, buffer, 1)
    whole = buffer.stats()
    events = buffer.subscribe()
    if ctx.rank == DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    with _Records() as log:
        mask = _round(ctx, buffer, 2)
        faulted = buffer.stats()
        masked = [(type(e).__name__, tuple(e)) for e in events]  # by the round that met the death
        view = buffer.update_ep_member(timeout_s=30.0)
        updated = buffer.stats()
    buffer.destroy()
    return {"whole": whole, "mask": mask, "faulted": faulted, "updated": updated, "view": list(view.ranks),
            "records": log.records, "masked": masked}


@pytest.mark.parametrize("transport", ["shm", "collective", "mooncake", "emulated cuda"])
def test_a_killed_rank_is_one_mask_and_the_epoch_moves(transport):
    transport = transport.split()[-1]
    runner = on_device(rank_killed, True) if transport == "cuda" else (rank_killed,)
    with harness.fresh_cluster(NUM_RANKS) as cluster:
        outcomes = cluster.run(*runner, transport, timeout_s=90, failure_grace_s=60)
        processes = list(cluster.processes)
    assert outcomes[DEAD].exitcode == -signal.SIGKILL, outcomes[DEAD]
    for outcome in outcomes[:DEAD]:
        assert outcome.ok, outcome.error
        value = outcome.value
        assert value["whole"]["masks"] == {"deadline": 0, "process_end": 0, "link": 0}
        assert value["mask"] == [1, 1, 0]
        masks = {cause: n for cause, n in value["faulted"]["masks"].items() if n}
        assert sum(masks.values()) == 1 and set(masks) <= CAUSES[transport], value["faulted"]
        assert value["faulted"]["calls"] == value["whole"]["calls"] + 2
        assert value["updated"]["masks"] == value["faulted"]["masks"], "update_ep_member() counted a mask"
        assert value["view"] == [0, 1]
        assert value["updated"]["epoch"] > value["faulted"]["epoch"] >= value["whole"]["epoch"] == 0
        assert value["updated"]["members"] == 2
        cause = next(iter(masks))
        masked = [event for name, event in value["masked"] if name == "PeerMasked"]  # the collective: RankLeftOut too
        assert len(masked) == 1, value["masked"]
        rank, reason, epoch = masked[0]
        assert rank == DEAD and epoch == value["faulted"]["epoch"], value["masked"]
        assert reason == "dead" if cause == "process_end" else reason in ("dead", "stalled", "cut"), value["masked"]
        warned = [r for r in value["records"] if r[0] == "WARNING" and r[1] == "mooncake_ep_switch.buffer"]
        assert len(warned) == 1 and f"masked rank {DEAD}" in warned[0][2] and f"[cause: {cause}]" in warned[0][2]
        assert not [r for r in value["records"] if "MICROSECONDS" in r[2]], "a deadline of seconds is no unit mistake"
        views = [r for r in value["records"] if r[0] == "INFO" and r[1] == "mooncake_ep_switch.buffer.membership"]
        assert views and f"epoch {value['updated']['epoch']}" in views[-1][2] and f"left [{DEAD}]" in " ".join(
            r[2] for r in views), views
    assert not any(process.is_alive() for process in processes)
