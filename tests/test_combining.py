"""Flat combining of one process's calls (store/combining.py): calls made while a batch is in the air go out
together in the next batch, applied by a caller's own thread; what a batch raises is each of its callers'
error; a call still queued at its caller's deadline is taken back (never applied), and one in a batch in the
air is waited for only when the kind of call asks for it (`flight_grace_s`)."""
import threading
import time

from mooncake_ep_switch.store.combining import Combiner, Waiting

from tests.harness import wait_until


class Call(Waiting):
    def __init__(self, label, deadline):
        super().__init__(deadline)
        self.label = label


class Batches:
    """`apply` for a combiner: records each batch's labels; the first batch blocks until released."""

    def __init__(self, fail=False):
        self.batches, self.fail = [], fail
        self.first_in = threading.Event()
        self.release = threading.Event()

    def __call__(self, taken):
        self.batches.append([call.label for call in taken])
        if len(self.batches) == 1:
            self.first_in.set()
            assert self.release.wait(30), "the test never released the first batch"
        if self.fail:
            raise ConnectionError(f"batch {len(self.batches)} failed")


def _submit(combiner, call, apply, results, **options):
    def run():
        results[call.label] = combiner.submit("k", call, lambda pending: (pending[:2], pending[2:]), apply, **options)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_calls_made_during_a_batch_go_out_in_the_next_batches_applied_by_callers_threads():
    combiner, apply, results = Combiner(), Batches(), {}
    deadline = time.monotonic() + 60
    calls = [Call(label, deadline) for label in "abcd"]
    threads = [_submit(combiner, calls[0], apply, results)]
    assert apply.first_in.wait(30)
    threads += [_submit(combiner, call, apply, results) for call in calls[1:]]
    wait_until(lambda: combiner.waiting("k") == 3)
    assert not any(call.answered for call in calls)  # none answered before its batch
    apply.release.set()
    for thread in threads:
        thread.join(30)
    assert apply.batches == [["a"], ["b", "c"], ["d"]]  # at most 2 per batch (`take`), in order
    assert results == dict.fromkeys("abcd", True) and all(call.error is None for call in calls)
    assert not combiner.has("k") and combiner.waiting() == 0


def test_what_a_batch_raises_is_each_callers_error():
    combiner, apply, results = Combiner(), Batches(fail=True), {}
    deadline = time.monotonic() + 60
    first, second = Call("a", deadline), Call("b", deadline)
    threads = [_submit(combiner, first, apply, results)]
    assert apply.first_in.wait(30)
    threads.append(_submit(combiner, second, apply, results))
    wait_until(lambda: combiner.waiting("k") == 1)
    apply.release.set()
    for thread in threads:
        thread.join(30)
    assert results == {"a": True, "b": True}
    assert str(first.error) == "batch 1 failed" and str(second.error) == "batch 2 failed"


def test_a_late_call_is_taken_back_if_queued_and_waited_for_only_with_a_grace():
    combiner, apply, results = Combiner(), Batches(), {}
    long = time.monotonic() + 60
    threads = [_submit(combiner, Call("a", long), apply, results)]
    assert apply.first_in.wait(30)
    short = time.monotonic() + 0.2
    queued = Call("b", short)
    threads.append(_submit(combiner, queued, apply, results))
    threads[-1].join(30)
    assert results["b"] is False and not queued.answered and combiner.waiting("k") == 0  # taken back
    apply.release.set()
    threads[0].join(30)
    assert apply.batches == [["a"]]  # "b" never applied

    # A call in a batch in the air past its caller's deadline: not waited for without a grace, else answered.
    for grace in (None, 5.0):
        combiner, apply, results = Combiner(), Batches(), {}
        second_in, second_release = threading.Event(), threading.Event()

        def apply_blocking(taken, apply=apply, second_in=second_in, second_release=second_release):
            if apply.batches:  # the second batch (the late callers'): in the air until released
                second_in.set()
                assert second_release.wait(30)
            apply(taken)

        blocker = Call("x", time.monotonic() + 60)
        threads = [_submit(combiner, blocker, apply_blocking, results, flight_grace_s=grace)]
        assert apply.first_in.wait(30)
        first, late = Call("a", time.monotonic() + 0.3), Call("b", time.monotonic() + 0.3)
        threads += [_submit(combiner, call, apply_blocking, results, flight_grace_s=grace) for call in (first, late)]
        wait_until(lambda: combiner.waiting("k") == 2)
        apply.release.set()
        assert second_in.wait(30)  # their batch is in the air (applied by the blocker's thread)
        if grace is None:
            wait_until(lambda: "a" in results and "b" in results)  # back at their deadline, unanswered
            assert results["a"] is False and results["b"] is False
        else:
            wait_until(lambda: time.monotonic() > late.deadline + 0.2)
            assert "a" not in results and "b" not in results  # still waiting for their batch's answer
        second_release.set()
        for thread in threads:
            thread.join(30)
        assert apply.batches == [["x"], ["a", "b"]]
        assert results["a"] is (grace is not None) and results["b"] is (grace is not None), (grace, results)
