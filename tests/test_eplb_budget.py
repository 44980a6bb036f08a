"""Unit tests of the redundancy budget helper (replica slots vs KV-cache capacity)."""
import numpy as np
import pytest

from mooncake_ep_switch.eplb import layer_balancedness, place_experts, suggest_redundancy

GB = 1e9


def test_uniform_load_needs_no_redundancy():
    advice = suggest_redundancy(np.ones(16), 4, replica_bytes=1 * GB, free_bytes_per_gpu=40 * GB, kv_bytes_per_token=1e5)
    assert advice.redundant_per_gpu == 0
    assert advice.num_physical_experts == 16
    assert advice.balancedness[0] == pytest.approx(1.0)


def test_free_kv_takes_the_most_balanced_candidate():
    load = np.ones((2, 16))
    load[:, 3] = 12.0  # one hot expert
    advice = suggest_redundancy(load, 4, replica_bytes=1.0, free_bytes_per_gpu=1e12, kv_bytes_per_token=1.0, kv_weight=0.0, max_redundant_per_gpu=4)
    # Independent reference: place every candidate and take the first best balancedness.
    reference = []
    for extra in range(5):
        placement = place_experts(load, (4 + extra) * 4, 1, 1, 4)
        reference.append(layer_balancedness(load, placement.phy2log, 4).mean())
    np.testing.assert_allclose(advice.balancedness, reference)
    best = int(np.flatnonzero(np.asarray(reference) >= max(reference) * (1 - 1e-9))[0])
    assert advice.redundant_per_gpu == best > 0


def test_expensive_replicas_are_not_worth_it():
    load = np.ones(16)
    load[0] = 3.0
    # Each slot would eat half the KV cache: the balance gain cannot pay for it.
    advice = suggest_redundancy(load, 4, replica_bytes=10 * GB, free_bytes_per_gpu=20 * GB, kv_bytes_per_token=1e5)
    assert advice.redundant_per_gpu == 0
    assert advice.marginal_cost[1] == pytest.approx(0.5)
    assert advice.marginal_gain[1] < advice.marginal_cost[1]


def test_kv_numbers_and_marginals_follow_their_formulas():
    load = np.arange(1, 17, dtype=float)
    advice = suggest_redundancy(load, 4, replica_bytes=2 * GB, free_bytes_per_gpu=10 * GB, kv_bytes_per_token=1e6, kv_weight=0.5)
    extra = advice.candidates
    assert extra.tolist() == [0, 1, 2, 3, 4, 5]  # memory allows at most 5 slots
    np.testing.assert_allclose(advice.kv_tokens, (10 * GB - extra * 2 * GB) / 1e6)
    capacity = (advice.kv_tokens / advice.kv_tokens[0]) ** 0.5
    np.testing.assert_allclose(advice.relative_throughput, advice.balancedness * capacity)
    np.testing.assert_allclose(advice.marginal_gain[1:], advice.balancedness[1:] / advice.balancedness[:-1] - 1)
    np.testing.assert_allclose(advice.marginal_cost[1:], 1 - capacity[1:] / capacity[:-1])
    assert advice.redundant_per_gpu == int(np.argmax(advice.relative_throughput))
    assert str(advice.redundant_per_gpu) in advice.reason


def test_min_kv_tokens_caps_the_candidates():
    advice = suggest_redundancy(np.arange(1, 9, dtype=float), 2, replica_bytes=1 * GB, free_bytes_per_gpu=5 * GB, kv_bytes_per_token=1e6, min_kv_tokens=2000)
    assert advice.candidates.tolist() == [0, 1, 2, 3]
    assert advice.kv_tokens.min() >= 2000


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(free_bytes_per_gpu=1e3, min_kv_tokens=10), ValueError, "free_bytes_per_gpu: .* fewer than min_kv_tokens"),
        (dict(kv_bytes_per_token=0.0), ValueError, "kv_bytes_per_token: expected a positive number"),
        (dict(kv_weight=-1.0), ValueError, "kv_weight"),
        (dict(replica_bytes="big"), TypeError, "replica_bytes: expected a real number"),
        (dict(expert_load=np.ones((1, 2, 8))), ValueError, r"expert_load: expected \[E\] or \[L, E\]"),
    ],
)
def test_clear_errors(kwargs, error, match):
    arguments = dict(expert_load=np.ones(8), num_gpus=2, replica_bytes=1.0, free_bytes_per_gpu=1e6, kv_bytes_per_token=1e3)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        suggest_redundancy(**arguments)
