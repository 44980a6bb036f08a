"""Unit tests of the expert load recorder against independent references."""
import logging
from collections import Counter

import numpy as np
import pytest
import torch

from mooncake_ep_switch.eplb import ExpertLoadRecorder, counts_from_topk, place_experts


def random_counts(rng, layers, slots):
    return rng.integers(0, 50, (layers, slots))


def test_window_keeps_exactly_the_last_steps():
    rng = np.random.default_rng(0)
    recorder = ExpertLoadRecorder(3, 8, 4, window_size=3)
    history = []
    for _ in range(7):
        step = random_counts(rng, 3, 8)
        history.append(step)
        recorder.record(torch.as_tensor(step))
    np.testing.assert_array_equal(recorder.physical_load(), np.sum(history[-3:], axis=0))
    assert recorder.step == 7


def test_ema_follows_the_recurrence():
    rng = np.random.default_rng(1)
    recorder = ExpertLoadRecorder(2, 4, 2, mode="ema", ema_decay=0.9)
    reference = np.zeros((2, 4))
    for _ in range(5):
        step = random_counts(rng, 2, 4)
        recorder.record(step)
        reference = 0.9 * reference + 0.1 * step
    np.testing.assert_allclose(recorder.physical_load(), reference)


def test_topk_counting_matches_a_counter():
    rng = np.random.default_rng(2)
    topk = rng.integers(-1, 12, (3, 20, 4))
    counts = counts_from_topk(topk, 12)
    for layer in range(3):
        reference = Counter(int(v) for v in topk[layer].ravel() if v >= 0)
        assert counts[layer].tolist() == [reference.get(s, 0) for s in range(12)]
    assert counts_from_topk(torch.as_tensor(topk[0]), 12).tolist() == counts[0].tolist()


def test_layer_by_layer_recording_equals_whole_step():
    rng = np.random.default_rng(3)
    topk = rng.integers(-1, 8, (2, 16, 2))
    whole = ExpertLoadRecorder(2, 8, 4, window_size=4)
    parts = ExpertLoadRecorder(2, 8, 4, window_size=4)
    whole.record_topk(topk)
    for layer in range(2):
        parts.record_layer(layer, torch.as_tensor(topk[layer]))
    with pytest.raises(RuntimeError, match="end_step"):
        parts.record(np.zeros((2, 8)))
    parts.end_step()
    np.testing.assert_array_equal(whole.physical_load(), parts.physical_load())


def test_logical_load_sums_copies():
    recorder = ExpertLoadRecorder(1, 6, 3, window_size=2)
    recorder.record(np.array([[1, 2, 3, 4, 5, 6]]))
    phy2log = np.array([[0, 1, 2, 0, 3, 1]])
    assert recorder.logical_load(phy2log, 5).tolist() == [[1 + 4, 2 + 6, 3, 5, 0]]


def test_balancedness_per_layer_and_logged(caplog):
    recorder = ExpertLoadRecorder(2, 4, 2, window_size=10)
    recorder.record(np.array([[1, 1, 1, 1], [3, 1, 0, 0]]))
    with caplog.at_level(logging.INFO, logger="mooncake_ep_switch.eplb.recorder"):
        balance = recorder.balancedness()
    # layer 0: GPUs 2 and 2 -> 1.0; layer 1: GPUs 4 and 0 -> mean 2 / max 4
    np.testing.assert_allclose(balance.per_layer, [1.0, 0.5])
    assert balance.mean == pytest.approx(0.75)
    assert "balancedness 0.7500" in caplog.text


def test_should_rebalance_every_interval():
    recorder = ExpertLoadRecorder(1, 2, 1, window_size=2, rebalance_interval=3)
    due = []
    for _ in range(7):
        recorder.record(np.ones((1, 2)))
        due.append(recorder.should_rebalance())
    assert due == [False, False, True, False, False, True, False]
    assert recorder.should_rebalance(0) is False and recorder.should_rebalance(6) is True


def test_remap_keeps_logical_totals_and_splits_evenly():
    rng = np.random.default_rng(4)
    weight = rng.uniform(size=(2, 8))
    old = place_experts(weight, 12, 1, 1, 4)
    new = place_experts(weight[:, ::-1].copy(), 12, 1, 1, 4)
    for mode in ("window", "ema"):
        recorder = ExpertLoadRecorder(2, 12, 4, window_size=3, mode=mode, ema_decay=0.5)
        for _ in range(4):
            recorder.record(random_counts(rng, 2, 12))
        before = recorder.logical_load(old, 8)
        recorder.remap(old, new)
        np.testing.assert_allclose(recorder.logical_load(new, 8), before)
        load = recorder.physical_load()
        table = new.phy2log.numpy()
        for layer in range(2):
            for expert in range(8):
                shares = load[layer, table[layer] == expert]
                assert shares.max() - shares.min() <= (3 if mode == "window" else 1e-9)
    recorder.reset()
    assert recorder.physical_load().sum() == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(mode="median"), ValueError, "mode: expected one of"),
        (dict(ema_decay=1.0), ValueError, r"ema_decay: expected a number in \[0, 1\)"),
        (dict(num_physical_experts=7), ValueError, "num_physical_experts: expected a multiple of num_gpus=2, got 7"),
        (dict(window_size=0), ValueError, "window_size: expected an int >= 1, got 0"),
    ],
)
def test_constructor_errors(kwargs, error, match):
    arguments = dict(num_layers=2, num_physical_experts=8, num_gpus=2)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        ExpertLoadRecorder(**arguments)


def test_record_errors():
    recorder = ExpertLoadRecorder(2, 8, 2)
    with pytest.raises(ValueError, match=r"counts: expected shape \[2, 8\], got \[2, 7\]"):
        recorder.record(np.zeros((2, 7)))
    with pytest.raises(ValueError, match="counts: expected non-negative"):
        recorder.record(-np.ones((2, 8)))
    with pytest.raises(ValueError, match="topk_idx: expected values < 8, got a maximum of 8"):
        recorder.record_layer(0, np.array([[8, 0]]))
    with pytest.raises(ValueError, match="layer: expected < 2, got 2"):
        recorder.record_layer(2, np.array([[1, 0]]))
    with pytest.raises(ValueError, match=r"phy2log: expected shape \[2, 8\]"):
        recorder.logical_load(np.zeros((2, 4), dtype=np.int64), 4)
