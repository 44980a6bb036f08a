"""The group a collective TP<->EP switch runs on (switch/switch_group.py), after a membership change.

* Two structures of weights switching in one epoch each build their group of the view under keys of
  their own: under one prefix, the second build read the first's keys (in-process, two threads as two
  ranks on one store; rank 1 starts its second build only once rank 0's has read rank 1's key, as a
  slower rank does): rank 0's collective timed out, rank 1's connect too.
* On the collective transport (and Mooncake's `_use_fallback`) a switch runs on the fallback's group of
  the current view; after `Buffer.shrink` that group holds the survivors only, while every rank's shard
  is needed. R=2 on the shared cluster: a switch EP -> TP completes; rank 1 is drained out
  (`shrink([1], drain=True)`, no process ends); rank 0's switch back to EP is refused naming rank 1, and
  its weights stay the TP shards of the checkpoint, bit-exact.
"""
import threading
import time
from types import SimpleNamespace

import torch

from tests import harness
from tests.test_switch_kv import E, H, I
from tests.test_switch_weights import _expected_shard

LAYERS = 2
STRUCTURES = 6  # weights switching in one epoch, in the two-structures case


class _SpyStore:
    """Builds torch Stores over one shared store that log each rank's reads (op, key) as they happen."""

    def __init__(self):
        import torch.distributed as dist

        class Spy(dist.Store):
            def __init__(self, inner, log):
                super().__init__()
                self.inner, self.log = inner, log

            def set(self, key, value):
                return self.inner.set(key, value)

            def get(self, key):
                self.log.append(("get", key))
                return self.inner.get(key)

            def add(self, key, amount):
                return self.inner.add(key, amount)

            def compare_set(self, key, expected, desired):
                return self.inner.compare_set(key, expected, desired)

            def wait(self, keys, timeout=None):
                self.log.extend(("wait", key) for key in keys)
                return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

            def check(self, keys):
                return self.inner.check(keys)

            def delete_key(self, key):
                return self.inner.delete_key(key)

            def num_keys(self):
                return self.inner.num_keys()

            def set_timeout(self, timeout):
                return self.inner.set_timeout(timeout)

        self.inner = dist.HashStore()
        self.logs = {0: [], 1: []}
        self.stores = {rank: Spy(self.inner, self.logs[rank]) for rank in (0, 1)}


def test_two_weights_switching_in_one_epoch_build_their_groups_apart():
    """Ranks 0 and 1 build the switch group of weights 0, 1, ... (participant indexes) in epoch 1 on the
    "mooncake" transport, each followed by an all-reduce on it. Rank 1 starts each later build only once
    rank 0's has read rank 1's gloo address key, or waits for it (a key of its own group, not set yet).
    Every all-reduce gives 1 + 2 on both ranks. (Under one prefix rank 0 read rank 1's address of the
    previous group; whether that hangs depends on which side of the pair connects, by address order, so
    several structures make it all but certain: before, rank 0's all-reduce timed out ("Timed out waiting
    5000ms for recv") and rank 1's connect ("Connect timeout").)"""
    from mooncake_ep_switch.switch.switch_group import switch_group

    spy = _SpyStore()
    results = {}

    def rank_0_read_rank_1(started):
        if started is None:
            return False
        ops = [(op, key) for op, key in spy.logs[0][started:] if key.endswith("/0/1")]  # rank 1's address
        if any(op == "get" for op, _ in ops):
            return True
        return any(op == "wait" and not spy.inner.check([key]) for op, key in ops)

    def rank(me):
        buffer = SimpleNamespace(rank=me, epoch=1, members=(0, 1), transport="mooncake", group=None,
                                 process_group=None, dead_peers=lambda: [],
                                 membership=SimpleNamespace(store=spy.stores[me]))
        sums = []
        try:
            for index in range(STRUCTURES):
                unified = SimpleNamespace(group=None, index=index, num_ranks=2)
                if me == 1 and index > 0:
                    deadline = time.monotonic() + 30
                    while not rank_0_read_rank_1(results.get(("rank 0 builds", index))):
                        assert time.monotonic() < deadline, f"rank 0 never began build {index}"
                        time.sleep(0.001)
                if me == 0:
                    results[("rank 0 builds", index)] = len(spy.logs[0])
                group, refusal = switch_group(buffer, unified, 5.0)
                assert refusal == "" and group is unified.group, refusal
                value = torch.full((1,), float(me + 1))
                group.allreduce([value]).wait()
                sums.append(value.item())
            results[me] = sums
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            results[me] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=rank, args=(me,)) for me in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), results
    assert (results[0], results[1]) == ([3.0] * STRUCTURES, [3.0] * STRUCTURES), results


def _weights_match(unified, layout, rank, num_ranks):
    """Whether every layer of `unified` holds `rank`'s shard of the checkpoint in `layout`, bit-exact."""
    from mooncake_ep_switch.reference.moe_block import random_weights

    for layer in range(LAYERS):
        want = _expected_shard(random_weights(E, H, I, seed=layer), layout, rank, num_ranks)
        got = unified.view(layer)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            return False
    return True


def rank_switch_after_drain(ctx, transport="collective", timeout_us=30_000_000):
    """Switch EP -> TP, drain rank 1 out, then rank 0 switches back to EP (with `timeout_us`): ((outcome,
    layout, reason) of each switch, weights exact after each[, seconds of the second]) on rank 0, the first
    switch's on rank 1."""
    from mooncake_ep_switch import Buffer
    from mooncake_ep_switch.reference.moe_block import random_weights
    from mooncake_ep_switch.switch.switcher import switch_layout
    from mooncake_ep_switch.switch.unified_weights import UnifiedWeights, WeightShape

    buffer = Buffer(ctx.group, Buffer.get_ep_buffer_size_hint(8, H, ctx.num_ranks, E), transport=transport)
    unified = UnifiedWeights(buffer, WeightShape(E, H, I), LAYERS)
    try:
        unified.load_full([random_weights(E, H, I, seed=layer) for layer in range(LAYERS)])
        results = []
        report = switch_layout(buffer, "tp", weights=unified, timeout_us=30_000_000)
        results.append(((report.outcome, report.layout, report.reason),
                        _weights_match(unified, "tp", ctx.rank, ctx.num_ranks)))
        view = buffer.shrink([1], timeout_s=60, drain=True)
        assert list(view.ranks) == [0], view
        if ctx.rank == 0:
            started = time.monotonic()
            report = switch_layout(buffer, "ep", weights=unified, timeout_us=timeout_us)
            results.append(((report.outcome, report.layout, report.reason),
                            unified.layout == "tp" and _weights_match(unified, "tp", ctx.rank, ctx.num_ranks),
                            time.monotonic() - started))
        return results
    finally:
        unified.destroy()
        buffer.destroy()


def test_a_collective_switch_after_a_shrink_is_refused_naming_the_ranks_that_left():
    """Before, the fallback branch took the weights' group without checking the view: rank 0's switch
    after the drain ran on a group of the survivors alone and failed inside the switch (see the commit)."""
    rank0, rank1 = harness.run(2, rank_switch_after_drain, timeout_s=120)
    assert rank1 == [(("completed", "tp", ""), True)], rank1
    assert rank0[0] == (("completed", "tp", ""), True), rank0
    (outcome, layout, reason), unchanged, _ = rank0[1]
    assert (outcome, layout) == ("refused", "tp") and "ranks [1] are not members" in reason, rank0
    assert unchanged, "a refused switch changed rank 0's weights"
