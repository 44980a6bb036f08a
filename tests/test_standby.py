"""A warm standby (`standby.WarmStandby`, issue 36 item 3): told to replace a live rank, it refuses by name and
changes nothing in the store. The standby that replaces a dead rank runs in the demo (tests/test_demo.py)."""
import datetime
import uuid

import pytest

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.buffer.membership.group_keys import generation_of
from mooncake_ep_switch.standby import WarmStandby, rank_process_alive
from tests import harness

T, HIDDEN, EXPERTS = 8, 128, 4


def _state(buffer):
    """What a replacement of rank 1 would change: its incarnation, the joiners the members list."""
    return {"incarnation": buffer.membership.incarnation_of(1), "pending": buffer.pending_joiners(),
            "epoch": buffer.membership.epoch()}


def rank_standby_told_a_live_rank(ctx, key):
    """Rank 1 holds its Buffer and waits; rank 0 builds a standby in its own process and tells it to replace
    rank 1 (alive: its pid runs on this host), itself, and ranks that are none of the group's."""
    size = Buffer.get_ep_buffer_size_hint(T, HIDDEN, ctx.num_ranks, EXPERTS)
    with Buffer(ctx.group, size, transport="shm") as buffer:
        if ctx.rank == 1:
            ctx.store.wait([key], datetime.timedelta(seconds=60))
            return None
        try:
            standby = WarmStandby(ctx.store, ctx.num_ranks, size, transport="shm", prepare=lambda: "weights",
                                  buffer_index=generation_of(buffer.membership.prefix))
            before = _state(buffer)
            errors = {}
            for rank in (1, 0, 2, -1, "1"):
                try:
                    standby.replace(rank)
                    errors[repr(rank)] = None
                except (TypeError, ValueError) as error:
                    errors[repr(rank)] = f"{type(error).__name__}: {error}"
            return {"errors": errors, "before": before, "after": _state(buffer), "buffer": standby.buffer is None,
                    "prepared": standby.prepared}
        finally:
            ctx.store.set(key, "done")


def test_a_standby_told_to_replace_a_live_rank_refuses_by_name_and_changes_nothing():
    value = harness.run(2, rank_standby_told_a_live_rank, f"standby-live/{uuid.uuid4().hex}")[0]
    errors = value["errors"]
    for rank in ("1", "0"):
        assert errors[rank] is not None and errors[rank].startswith("ValueError: rank:"), errors
        assert f"got rank {rank}, which is alive" in errors[rank] and "on this host" in errors[rank], errors
    assert errors["2"].startswith("ValueError: rank:") and "num_ranks=2" in errors["2"], errors
    assert errors["-1"].startswith("ValueError: rank:"), errors
    assert errors["'1'"].startswith("TypeError: rank:"), errors
    assert value["after"] == value["before"] and value["before"]["pending"] == [], value
    assert value["buffer"] and value["prepared"] == "weights"


def test_process_liveness_from_an_endpoint():
    import os

    here = "host-a"
    assert rank_process_alive({"region": [os.getpid(), 3, 64], "host_id": here}, here) is True
    assert rank_process_alive({"pid": 2 ** 22 + 12345, "host_id": here}, here) is False  # no such process
    assert rank_process_alive({"region": [os.getpid(), 3, 64], "host_id": "host-b"}, here) is None  # cannot tell


def test_a_standby_refuses_a_bad_prepare_by_name():
    with pytest.raises(TypeError, match="prepare: expected a callable"):
        WarmStandby(object(), 2, 0, prepare="weights")


def _rank_of(ctx):
    return ctx.rank


def test_the_launcher_refuses_to_assign_its_standby_to_a_live_rank():
    from mooncake_ep_switch.launcher.launch import STANDBY, LocalCluster

    with LocalCluster(2, preload=True) as cluster:
        cluster.start_standby()
        assert cluster.run_standby(_rank_of) == STANDBY
        process = cluster.processes[1]
        with pytest.raises(RuntimeError, match=r"rank: 1 is still alive \(pid \d+\)"):
            cluster.assign_standby(1)
        with pytest.raises(ValueError, match=r"rank: expected a rank in \[0, 2\), got 2"):
            cluster.assign_standby(2)
        # Nothing changed: the standby is still held and answers as one, rank 1 is the same process.
        assert cluster.standby is not None and cluster.run_standby(_rank_of) == STANDBY
        assert cluster.processes[1] is process and [o.value for o in cluster.run(_rank_of)] == [0, 1]
