"""Observability (issue 41 item 3): `Buffer.stats()` counts what the calls did, the hot path logs nothing
when nothing happened, a too-short `timeout_us` that masks a live peer logs one warning naming the
unit, and the optional Prometheus exporter reports the counters (docs/observability.md).

The fault case (a rank SIGKILLed: one mask, the epoch moves) is in test_observability_faults.py.
"""
import datetime
import logging
import uuid
from types import SimpleNamespace

import pytest
import torch

from mooncake_ep_switch import Buffer, ElasticBuffer
from mooncake_ep_switch.buffer.events import EventBus
from mooncake_ep_switch.buffer.stats import CallStats
from mooncake_ep_switch.errors import BufferDestroyed
from mooncake_ep_switch.metrics import PrometheusCollector, register_prometheus, stats_samples
from tests import harness
from tests.reference import structured_inputs, token_count

T, HIDDEN, EXPERTS, TOP_K = 16, 256, 8, 2
LIVE_TIMEOUT_US = harness.FAULT_TIMEOUT_US  # a live peer never misses it, even on a loaded box
MODES = ("sync", "hook", "async")


class _Records(logging.Handler):
    """Every record of the package's loggers, from DEBUG up, while it is installed (in a rank process)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []
        self.root = logging.getLogger("mooncake_ep_switch")

    def emit(self, record):
        self.records.append((record.levelname, record.name, record.getMessage()))

    def __enter__(self):
        self.level = self.root.level
        self.root.addHandler(self)
        self.root.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc):
        self.root.removeHandler(self)
        self.root.setLevel(self.level)


def _run_mode(buffer, mode, x, topk, weights, active, timeout_us):
    """One dispatch and its combine in `mode` (sync, hook, async), completed."""
    hook_mode, async_mode = mode == "hook", mode == "async"
    recv, _, handle, event, hook = buffer.dispatch(x, topk, active, T, EXPERTS, timeout_us, use_fp8=False,
                                                   return_recv_hook=hook_mode, async_finish=async_mode)
    if hook_mode:
        hook()
    if async_mode:
        event.current_stream_wait()
    out, event, hook = buffer.combine(recv.clone(), topk, weights, active, timeout_us, handle,
                                      return_recv_hook=hook_mode, async_finish=async_mode)
    if hook_mode:
        hook()
    if async_mode:
        event.current_stream_wait()
    return out


def rank_counts(ctx, transport, rounds):
    """`rounds` rounds in each mode; the stats before, after, and every log record meanwhile."""
    size = Buffer.get_ep_buffer_size_hint(T, HIDDEN, ctx.num_ranks, EXPERTS)
    with Buffer(ctx.group, size, transport=transport) as buffer:
        before = buffer.stats()
        tokens = token_count(ctx.rank, ctx.num_ranks, T)  # the last rank sends none
        with _Records() as log:
            for index in range(rounds):
                for mode in MODES:
                    inputs = structured_inputs(ctx.rank, tokens, HIDDEN, EXPERTS, TOP_K, seed=index)
                    _run_mode(buffer, mode, inputs.x, inputs.topk_idx, inputs.weights, buffer.active_mask(),
                              LIVE_TIMEOUT_US)
        return {"before": before, "after": buffer.stats(), "tokens": tokens, "records": log.records}


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_stats_count_calls_and_bytes_and_nothing_is_logged(transport):
    rounds = 2
    values = harness.run(2, rank_counts, transport, rounds)
    for rank, value in enumerate(values):
        calls = rounds * len(MODES)
        row_bytes = value["tokens"] * HIDDEN * 2  # bf16 rows in (dispatch) and out (combine)
        before, after = value["before"], value["after"]
        assert before["calls"] == 0 and before["wait_s"] == 0.0, before
        assert (after["dispatches"], after["combines"], after["calls"]) == (calls, calls, 2 * calls), after
        assert (after["dispatch_bytes"], after["combine_bytes"]) == (calls * row_bytes, calls * row_bytes), after
        assert after["masks"] == {"deadline": 0, "process_end": 0, "link": 0}, after
        assert (after["rank"], after["num_ranks"], after["transport"]) == (rank, 2, transport)
        assert (after["epoch"], after["members"]) == (0, 2)
        assert after["wait_s"] > 0.0
        assert value["records"] == [], f"rank {rank} logged on the hot path: {value['records']}"


def rank_short_timeout(ctx, key, rounds):
    """Rank 0 runs `rounds` rounds with timeout_us=10 while rank 1, alive, waits for it (a store key) and
    never sends: rank 0 masks rank 1 in every dispatch."""
    size = Buffer.get_ep_buffer_size_hint(T, HIDDEN, ctx.num_ranks, EXPERTS)
    with Buffer(ctx.group, size, transport="shm") as buffer:
        if ctx.rank == 1:
            ctx.store.wait([key], datetime.timedelta(seconds=60))
            return None
        inputs = structured_inputs(0, T, HIDDEN, EXPERTS, TOP_K, seed=7)
        masks = []
        try:
            with _Records() as log:
                for _ in range(rounds):
                    active = buffer.active_mask()
                    _run_mode(buffer, "sync", inputs.x, inputs.topk_idx, inputs.weights, active, 10)
                    masks.append(active.tolist())
        finally:
            ctx.store.set(key, "done")
        return {"masks": masks, "stats": buffer.stats(), "records": log.records}


def test_too_short_timeout_masks_a_live_peer_and_warns_once_naming_the_unit():
    rounds = 3
    value = harness.run(2, rank_short_timeout, f"short-timeout/{uuid.uuid4().hex}", rounds)[0]
    assert value["masks"] == [[1, 0]] * rounds, value["masks"]
    assert value["stats"]["masks"] == {"deadline": rounds, "process_end": 0, "link": 0}, value["stats"]
    records = value["records"]
    hints = [r for r in records if "MICROSECONDS" in r[2]]
    assert len(hints) == 1, records
    assert hints[0][0] == "WARNING" and hints[0][1] == "mooncake_ep_switch.buffer" and "timeout_us=10" in hints[0][2]
    masked = [r for r in records if "masked rank 1" in r[2]]
    assert [r[0] for r in masked] == ["WARNING"] + ["DEBUG"] * (rounds - 1), records
    assert "[cause: deadline]" in masked[0][2]
    assert len(records) == rounds + 1, records


def rank_elastic_stats(ctx):
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=HIDDEN, num_topk=TOP_K, transport="shm")
    same = buffer.stats() == buffer.runtime.stats()
    epoch = buffer.stats()["epoch"]
    buffer.destroy()
    try:
        buffer.stats()
    except BufferDestroyed:
        return {"same": same, "epoch": epoch, "refused_after_destroy": True}
    return {"same": same, "epoch": epoch, "refused_after_destroy": False}


def test_elastic_buffer_stats_are_its_inner_buffers():
    for value in harness.run(2, rank_elastic_stats):
        assert value == {"same": True, "epoch": 0, "refused_after_destroy": True}


# ---------------------------------------------------------------------- in-process: the rules of CallStats


class _Transport:
    """What CallStats reads of a transport: failed_sources, mask_cause(), name."""

    name = "shm"

    def __init__(self, dead=()):
        self.failed_sources = []
        self.dead = set(dead)

    def mask_cause(self, rank):
        return "process_end" if rank in self.dead else "deadline"


def _core(transport):
    # What CallStats reads of a BufferCore, the event bus included (a mask is also a PeerMasked event).
    return SimpleNamespace(transport=transport, rank=0, num_ranks=4, epoch=3, members=(0, 1, 2, 3), stats=CallStats(),
                           events=EventBus())


def _observe(core, rank, timeout_us, seconds=0.0005):
    """One call that took `seconds` and masked `rank`."""
    core.stats.dispatches += 1
    core.stats.wait_s += seconds
    core.transport.failed_sources.append(rank)
    core.stats.observe(core, timeout_us, "dispatch", core.stats.dispatches)


def test_a_plausible_deadline_or_a_dead_process_gets_no_unit_hint(caplog):
    core = _core(_Transport(dead={2}))
    with caplog.at_level(logging.DEBUG, logger="mooncake_ep_switch"):
        _observe(core, 1, 5_000_000)  # a long deadline: the peer was really late
        _observe(core, 2, 10)  # a short one, but the process had ended
    assert not [r for r in caplog.records if "MICROSECONDS" in r.getMessage()]
    assert core.stats.masks == {"deadline": 1, "process_end": 1, "link": 0}
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]


def test_a_deadline_below_the_mean_call_time_gets_the_hint_once(caplog):
    core = _core(_Transport())
    with caplog.at_level(logging.DEBUG, logger="mooncake_ep_switch"):
        _observe(core, 1, 3000, seconds=0.02)  # 3 ms, above the floor but below the 20 ms calls take
        _observe(core, 2, 3000, seconds=0.02)
    hints = [r for r in caplog.records if "MICROSECONDS" in r.getMessage()]
    assert len(hints) == 1 and "masked live rank 1" in hints[0].getMessage()


def test_resync_skips_entries_that_are_no_masks():
    core = _core(_Transport())
    core.transport.failed_sources.extend([1, 2])  # membership evidence, or a list cleared and refilled
    core.stats.resync(core.transport)
    _observe(core, 3, 5_000_000)
    assert core.stats.masks["deadline"] == 1
    core.transport.failed_sources.clear()  # update_ep_member() clears it, then resyncs
    core.stats.resync(core.transport)
    _observe(core, 1, 5_000_000)
    assert core.stats.masks["deadline"] == 2


def test_stats_samples_match_the_snapshot():
    core = _core(_Transport())
    core.stats.dispatches, core.stats.dispatch_bytes, core.stats.wait_s = 3, 3 * 4096, 0.25
    core.stats.masks["link"] = 2
    snapshot = core.stats.snapshot(core)
    got = {(s.name, tuple(sorted(s.labels.items()))): (s.value, s.kind) for s in stats_samples(snapshot)}
    assert got[("calls_total", (("call", "dispatch"), ("rank", "0")))] == (3.0, "counter")
    assert got[("calls_total", (("call", "combine"), ("rank", "0")))] == (0.0, "counter")
    assert got[("bytes_total", (("call", "dispatch"), ("rank", "0")))] == (12288.0, "counter")
    assert got[("wait_seconds_total", (("rank", "0"),))] == (0.25, "counter")
    assert got[("masks_total", (("cause", "link"), ("rank", "0")))] == (2.0, "counter")
    assert got[("epoch", (("rank", "0"),))] == (3.0, "gauge")
    assert got[("members", (("rank", "0"),))] == (4.0, "gauge")
    assert len(got) == 10


class _Stub:
    def __init__(self, snapshot):
        self.snapshot = snapshot

    def stats(self):
        return self.snapshot


def test_prometheus_exporter_reports_the_counters():
    prometheus_client = pytest.importorskip("prometheus_client")
    core = _core(_Transport())
    core.stats.combines, core.stats.combine_bytes = 5, 5 * 512
    core.stats.masks["deadline"] = 1
    stub = _Stub(core.stats.snapshot(core))
    registry = prometheus_client.CollectorRegistry()
    collector = register_prometheus(stub, registry=registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'mooncake_ep_calls_total{call="combine",rank="0"} 5.0' in text, text
    assert 'mooncake_ep_bytes_total{call="combine",rank="0"} 2560.0' in text, text
    assert 'mooncake_ep_masks_total{cause="deadline",rank="0"} 1.0' in text, text
    assert 'mooncake_ep_epoch{rank="0"} 3.0' in text, text
    assert registry.get_sample_value("mooncake_ep_members", {"rank": "0"}) == 4.0
    registry.unregister(collector)
    with pytest.raises(TypeError, match=r"buffers\[0\]: expected a Buffer"):
        PrometheusCollector([object()])
    del stub  # held weakly: a freed Buffer is no longer reported
    collector = register_prometheus(_Stub(core.stats.snapshot(core)), registry=registry)
    assert "mooncake_ep_calls_total{" not in prometheus_client.generate_latest(registry).decode()
    registry.unregister(collector)


def rank_elastic_events(ctx, key):
    """Rank 0's ElasticBuffer dispatches with timeout_us=10 while rank 1, alive, waits for it (a store key) and
    never sends: rank 0's subscription gets PeerMasked(1, "stalled"), as a Buffer's would."""
    from mooncake_ep_switch.buffer.events import PeerMasked

    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=T, hidden=HIDDEN, num_topk=TOP_K, transport="shm")
    try:
        if ctx.rank == 1:
            ctx.store.wait([key], datetime.timedelta(seconds=60))
            return None
        seen = []
        subscription = buffer.subscribe(seen.append)
        queued = buffer.subscribe()
        inputs = structured_inputs(0, T, HIDDEN, EXPERTS, TOP_K, seed=7)
        try:
            buffer.dispatch(inputs.x, inputs.topk_idx, num_experts=EXPERTS, timeout_us=10)
        finally:
            ctx.store.set(key, "done")
        subscription.close()
        polled = list(iter(queued.poll, None))
        return {"seen": [tuple(e) for e in seen if isinstance(e, PeerMasked)],
                "polled": [tuple(e) for e in polled if isinstance(e, PeerMasked)]}
    finally:
        buffer.destroy()


def test_elastic_buffer_subscription_gets_the_inner_buffers_events():
    value = harness.run(2, rank_elastic_events, f"elastic-events/{uuid.uuid4().hex}")[0]
    assert value["seen"] == [(1, "stalled", 0)], value
    assert value["polled"] == value["seen"], value
