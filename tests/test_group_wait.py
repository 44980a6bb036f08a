"""A collective switch or TP all-reduce on the collective transport ends by its caller's deadline (switch/group_wait.py).

Before, their gloo collectives ended at the group's timeout (the world group's 120 s, a view group's what
remained of the `update_ep_member` that built it), not at the caller's `timeout_us`, when a member stalled
or ended unseen by the peer watcher while the call was in gloo; or they raised gloo's own error.

R=3 on the "collective" transport (fresh cluster: ranks are stopped and killed):

1. Rank 2 is stopped; the switch EP -> TP of ranks 0 and 1 (DEADLINE_S) is refused naming the deadline
   within DEADLINE_S + SLACK_S, nothing moved (before: both waited in gloo past the run's 40 s, for the
   world group's 120 s). The group is then refused by name (an all-reduce raises `MembershipError` at once).
2. Rank 2 killed, ranks 0 and 1 seal it out (`update_ep_member`): the all-reduce over the new view's group
   sums both partials exactly and sets rank 2 to 0 in `active_ranks`.
3. Rank 1 is stopped; rank 0 enters an all-reduce (60 s deadline) and rank 1 is killed: it raises
   `MembershipError` naming rank 1 within a few seconds (before: gloo's "Connection reset by peer").
"""
import os
import signal
import threading
import time

import torch

from tests import harness

E, H, I, LAYERS = 6, 128, 48, 2  # R=3 divides E and I
ROWS = 3
DEADLINE_S = 2.0  # the stalled switch's timeout_us
SLACK_S = 3.0  # a loaded 2-core box; the group's own timeout is the world group's 120 s
IN_CALL_BOUND_S = 8.0  # an all-reduce whose peer is killed during it (60 s deadline) ends this soon
UPDATE_S = 6.0  # update_ep_member's timeout: a member waits half of it for the killed rank, then connects


def _partial(rank):
    return torch.full((ROWS, H), float(rank + 1))


def _reduce(ctx, timeout_s):
    """All-reduce of a known partial: (active_ranks after, whether the float32 sum is the exact sum of the
    active ranks' partials)."""
    reduce = harness.RANK_STATE["reduce"]
    active = harness.RANK_STATE["buffer"].active_mask()
    out = reduce.all_reduce(_partial(ctx.rank), active, int(timeout_s * 1e6), float32_result=True)
    want = sum((_partial(r) for r in range(ctx.num_ranks) if active[r]), torch.zeros(ROWS, H))
    return active.tolist(), torch.equal(out, want)


def _kill(pid):
    """SIGKILL `pid` (a stopped rank); gone already (the run killed every rank at its deadline) is fine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _error(call):
    started = time.monotonic()
    try:
        call()
        return None, time.monotonic() - started
    except Exception as error:  # noqa: BLE001 - the test checks the type
        return (type(error).__name__, list(getattr(error, "missing", ())), str(error)), time.monotonic() - started


def rank_start(ctx):
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.tp_collective import TPAllReduce
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E), transport="collective")
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), LAYERS)
    unified.load_full([random_weights(E, H, I, seed=layer) for layer in range(LAYERS)])
    harness.RANK_STATE.update(buffer=buffer, unified=unified, reduce=TPAllReduce(buffer, ROWS, H))
    return os.getpid()


def rank_switch_stalled(ctx):
    """A switch EP -> TP with rank 2 stopped: (outcome, layout, reason, seconds, weights as before the call),
    then an all-reduce's error on the abandoned group and its seconds."""
    from mooncake_ep_switch.switch.switcher import switch_layout

    buffer, unified = harness.RANK_STATE["buffer"], harness.RANK_STATE["unified"]
    before = [[part.clone() for part in unified.view(layer)] for layer in range(LAYERS)]
    started = time.monotonic()
    report = switch_layout(buffer, "tp", weights=unified, timeout_us=int(DEADLINE_S * 1e6))
    seconds = time.monotonic() - started
    intact = unified.layout == "ep" and all(
        torch.equal(got, want) for layer in range(LAYERS) for got, want in zip(unified.view(layer), before[layer]))
    reduced, reduce_s = _error(lambda: _reduce(ctx, 30.0))
    return (report.outcome, report.layout, report.reason, seconds, intact), reduced, reduce_s


def rank_seal_and_reduce(ctx):
    """Seal the killed peer out, then reduce: (the view's ranks, the reduce's result)."""
    view = harness.RANK_STATE["buffer"].update_ep_member(timeout_s=UPDATE_S)
    return list(view.ranks), _reduce(ctx, 30.0)


def rank_reduce_while_a_peer_dies(ctx, marker):
    """An all-reduce with a 60 s deadline (`marker` file written just before): (error, seconds)."""
    with open(marker, "w"):
        pass
    return _error(lambda: _reduce(ctx, 60.0))


def rank_end(ctx):
    for name in ("reduce", "unified"):
        harness.RANK_STATE.pop(name).destroy()
    harness.rank_teardown(ctx)
    os._exit(0)  # an abandoned gloo work runs on until its group's timeout (120 s): do not join its thread


def test_a_collective_switch_and_all_reduce_end_by_their_deadline_when_a_peer_stalls_or_dies(tmp_path):
    with harness.fresh_cluster(3) as cluster:
        pids = harness.check_outcomes(cluster.run(rank_start, timeout_s=60))

        # 1. rank 2 stopped: the switch ends at its own deadline, not the world group's 120 s.
        harness.stop_process(pids[2])
        try:
            results = harness.check_outcomes(cluster.run(rank_switch_stalled, ranks=[0, 1], timeout_s=40))
        finally:
            _kill(pids[2])
            cluster.processes[2].join(10)
        for rank, ((outcome, layout, reason, seconds, intact), reduced, reduce_s) in enumerate(results):
            assert (outcome, layout) == ("refused", "ep") and "deadline" in reason, (rank, reason)
            assert DEADLINE_S - 0.1 <= seconds < DEADLINE_S + SLACK_S, (rank, seconds, reason)
            assert intact, f"rank {rank}: a refused switch changed the weights"
            assert reduced[0] == "MembershipError" and "update_ep_member" in reduced[2], (rank, reduced)
            assert reduce_s < SLACK_S, (rank, reduce_s)
        cluster.accept_dead(2)

        # 2. rank 2 sealed out: the next view's group works.
        sealed = harness.check_outcomes(cluster.run(rank_seal_and_reduce, ranks=[0, 1], timeout_s=60))
        assert sealed == [([0, 1], ([1, 1, 0], True))] * 2, sealed

        # 3. rank 1 stopped, then killed while rank 0 is in an all-reduce: named within seconds.
        harness.stop_process(pids[1])
        marker = tmp_path / "entered"
        outcomes = []
        caller = threading.Thread(target=lambda: outcomes.append(
            cluster.run(rank_reduce_while_a_peer_dies, str(marker), ranks=[0], timeout_s=40)))
        caller.start()
        try:
            deadline = time.monotonic() + 30
            while not marker.exists():
                assert time.monotonic() < deadline and caller.is_alive(), "rank 0 never started the all-reduce"
                time.sleep(0.01)
        finally:
            _kill(pids[1])
            caller.join(60)
        assert not caller.is_alive()
        [(error, seconds)] = harness.check_outcomes(outcomes[0])
        assert error[:2] == ("MembershipError", [1]) and "ranks [1]" in error[2], error
        assert seconds < IN_CALL_BOUND_S, (seconds, error)
        ended = cluster.run(rank_end, ranks=[0], timeout_s=30)
        assert not ended[0].ok and ended[0].exitcode == 0, ended


# ---------------------------------------------------------------- in process: two threads as two ranks of a gloo group

GROUP_TIMEOUT_S = 3.0  # the in-process groups' own timeout: what a wait that ignored the deadline would take


def _gloo_pair(prefix):
    """Rank 0's and rank 1's ProcessGroupGloo of one 2-rank group on a HashStore (built in two threads)."""
    from datetime import timedelta

    import torch.distributed as dist

    store, groups = dist.HashStore(), {}

    def build(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2,
                                             timedelta(seconds=GROUP_TIMEOUT_S))

    threads = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(groups) == {0, 1}, "the in-process gloo group was not built"
    return groups[0], groups[1]


def _answer_late(group):
    """The absent rank's side of `gather_objects`'s first exchange, late: the abandoned work of its peer
    completes instead of holding gloo's worker thread until the group's timeout."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    group.allgather([lengths], [torch.zeros(1, dtype=torch.int64)]).wait()


def test_gather_objects_and_its_waits_in_process():
    """`gather_objects` returns every rank's object in rank order; with rank 1 absent, rank 0's wait ends at
    its 0.5 s deadline (`TimeoutError`, not the group's 3 s) or at once when the watcher names rank 1
    (`MembershipError`, `missing` [1], no deadline); each such group is abandoned and dropped from the
    structure it was built for, whose next rendezvous of the epoch counts one more attempt."""
    from types import SimpleNamespace

    import pytest

    from mooncake_ep_switch.errors import MembershipError
    from mooncake_ep_switch.switch import group_wait

    dead = []
    buffer = SimpleNamespace(epoch=4, members=(0, 1), dead_peers=lambda: list(dead))
    first, second = _gloo_pair("gather")
    gathered = {}
    peer = threading.Thread(target=lambda: gathered.update(
        one=group_wait.gather_objects({"rank": 1, "long": "x" * 300}, second, time.monotonic() + 30, buffer, (0, 1),
                                      "test")))
    peer.start()
    gathered["zero"] = group_wait.gather_objects(("rank", 0), first, time.monotonic() + 30, buffer, (0, 1), "test")
    peer.join(30)
    assert gathered["zero"] == gathered["one"] == [("rank", 0), {"rank": 1, "long": "x" * 300}], gathered
    assert not group_wait.is_abandoned(first)

    owner = SimpleNamespace(view_group=(4, first))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        group_wait.gather_objects("alone", first, time.monotonic() + 0.5, buffer, (0, 1), "test", owner)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < GROUP_TIMEOUT_S - 0.5, elapsed
    assert group_wait.is_abandoned(first) and not group_wait.is_abandoned(second)
    assert owner.view_group is None and owner.group_attempt == (4, 1), vars(owner)
    _answer_late(second)

    first, second = _gloo_pair("watched")
    dead.append(1)
    started = time.monotonic()
    with pytest.raises(MembershipError, match=r"ranks \[1\] ended") as raised:
        group_wait.gather_objects("alone", first, None, buffer, (0, 1), "test")
    assert raised.value.missing == (1,) and time.monotonic() - started < GROUP_TIMEOUT_S - 0.5
    assert "ranks [1] ended" in group_wait.abandoned_reason(first)
    _answer_late(second)


# ---------------------------------------------------------------- the record of abandoned groups stays bounded

class _Work:
    """A collective given up on: running until the test completes it."""

    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done

    def wait(self):
        pass


class _Group:
    """A process group stand-in (weakly referenceable, as ProcessGroupGloo is)."""


def _give_up(group_wait, group, work):
    """Abandon `group`: `wait_work` on a running `work` with its deadline already passed."""
    from types import SimpleNamespace

    import pytest

    buffer = SimpleNamespace(epoch=1, members=(0, 1), dead_peers=lambda: [])
    with pytest.raises(TimeoutError, match="abandoned"):
        group_wait.wait_work(work, group, time.monotonic(), buffer, (0, 1), "test")


def test_an_abandoned_group_is_let_go_once_its_work_completed_and_nobody_holds_it(monkeypatch):
    """Before, every abandoned group stayed referenced for the life of the process."""
    import weakref

    from mooncake_ep_switch.switch import group_wait

    monkeypatch.setattr(group_wait, "_ABANDONED", [])
    works, refs = [], []
    for _ in range(3):
        group, work = _Group(), _Work()
        _give_up(group_wait, group, work)
        works.append(work)
        refs.append(weakref.ref(group))
        del group
    assert all(ref() is not None and group_wait.is_abandoned(ref()) for ref in refs)  # held while the work runs
    for work in works:
        work.done = True  # gloo's timeout passed
    latest = _Group()
    _give_up(group_wait, latest, _Work())
    assert [ref() for ref in refs] == [None] * 3 and len(group_wait._ABANDONED) == 1
    assert group_wait.is_abandoned(latest) and "deadline" in group_wait.abandoned_reason(latest)


def test_past_the_cap_the_oldest_completed_records_are_dropped(monkeypatch):
    """Groups still held elsewhere: at most MAX_ABANDONED records, never one whose work still runs."""
    from mooncake_ep_switch.switch import group_wait

    monkeypatch.setattr(group_wait, "_ABANDONED", [])
    monkeypatch.setattr(group_wait, "MAX_ABANDONED", 4, raising=False)
    running = _Group()
    _give_up(group_wait, running, _Work())
    held = [_Group() for _ in range(6)]
    for group in held:
        work = _Work()
        _give_up(group_wait, group, work)
        work.done = True
    last = _Group()
    _give_up(group_wait, last, _Work())
    assert len(group_wait._ABANDONED) == 4
    assert [group_wait.is_abandoned(g) for g in [running] + held + [last]] == [True] + [False] * 4 + [True] * 3
