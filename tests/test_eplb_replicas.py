"""Tests of `place_redundant_experts`: redundant experts around fixed primaries.

The quick default runs the same 40 hypothesis examples every time (reproducible CI); set EPLB_EXAMPLES
to run that many examples drawn afresh each run (exploration: 3000 passed on 2026-11-22).
"""
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_ep_switch.eplb import greedy_rebalance_experts, layer_balancedness
from mooncake_ep_switch.eplb.policy.redundant import place_redundant_experts

SETTINGS = settings(
    max_examples=int(os.environ.get("EPLB_EXAMPLES", "40")), deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize="EPLB_EXAMPLES" not in os.environ,
)


def loads(kind: str, num_layers: int, num_logical: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.uniform(0.0, 1.0, (num_layers, num_logical))
    if kind == "zipf":
        return np.stack([rng.permutation(1.0 / np.arange(1, num_logical + 1) ** rng.uniform(0.3, 1.5)) for _ in range(num_layers)])
    if kind == "hot":
        weight = rng.uniform(0.5, 1.5, (num_layers, num_logical))
        weight[np.arange(num_layers), rng.integers(0, num_logical, num_layers)] *= rng.uniform(5, 50)
        return weight
    if kind == "integers":
        return rng.integers(0, 1000, (num_layers, num_logical))
    if kind == "sparse":
        return rng.uniform(0.0, 1.0, (num_layers, num_logical)) * (rng.uniform(size=(num_layers, num_logical)) < 0.3)
    return np.zeros((num_layers, num_logical))


@st.composite
def problems(draw):
    num_gpus = draw(st.sampled_from([1, 2, 4, 8]))
    primaries = draw(st.integers(1, 6))
    num_logical = num_gpus * primaries
    redundant = draw(st.integers(0, min(3, num_logical - primaries)))
    num_layers = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["uniform", "zipf", "hot", "integers", "sparse", "zero"]))
    return loads(kind, num_layers, num_logical, draw(st.integers(0, 2**31 - 1))), num_gpus, redundant


def check_layout(table: torch.Tensor, num_layers: int, num_logical: int, num_gpus: int, redundant: int) -> None:
    primaries = num_logical // num_gpus
    spg = primaries + redundant
    assert table.dtype == torch.int64
    assert table.shape == (num_layers, num_gpus * spg)
    per_gpu = table.numpy().reshape(num_layers, num_gpus, spg)
    assert (per_gpu >= 0).all() and (per_gpu < num_logical).all(), "every slot holds a valid logical expert"
    expected = np.arange(num_logical).reshape(num_gpus, primaries)
    assert (per_gpu[:, :, :primaries] == expected).all(), "primaries stay at GPU e // P, position e % P"
    ordered = np.sort(per_gpu, axis=2)
    assert not (ordered[:, :, 1:] == ordered[:, :, :-1]).any(), "two copies of one expert on one GPU"


def no_replicas(num_layers: int, num_logical: int) -> np.ndarray:
    return np.tile(np.arange(num_logical), (num_layers, 1))


@SETTINGS
@given(problems())
def test_layout_invariants_and_determinism(problem):
    weight, num_gpus, redundant = problem
    table = place_redundant_experts(weight, num_gpus, redundant)
    check_layout(table, *weight.shape, num_gpus, redundant)
    assert torch.equal(table, place_redundant_experts(weight.copy(), num_gpus, redundant))
    assert torch.equal(table, place_redundant_experts(torch.as_tensor(weight), num_gpus, redundant))
    # Placement depends on relative loads only.
    assert torch.equal(table, place_redundant_experts(weight * 3.0, num_gpus, redundant))


@pytest.mark.parametrize("num_logical, num_gpus, redundant", [(64, 8, 1), (128, 8, 2), (128, 16, 1), (256, 32, 1), (256, 64, 2)])
@pytest.mark.parametrize("kind", ["uniform", "zipf", "hot", "integers", "sparse"])
def test_at_least_as_balanced_as_no_replicas(num_logical, num_gpus, redundant, kind):
    # Not a theorem for tiny layouts: every redundant slot carries a copy and every copy takes its
    # share of the load (2 GPUs with loads {1, 0} and {0.5, 0.5}: any filling gives 1.25 vs 1).
    weight = loads(kind, 8, num_logical, seed=num_logical + num_gpus + redundant)
    table = place_redundant_experts(weight, num_gpus, redundant)
    ours = layer_balancedness(weight, table, num_gpus)
    plain = layer_balancedness(weight, no_replicas(*weight.shape), num_gpus)
    assert (ours >= plain - 1e-9).all()


@SETTINGS
@given(problems(), st.floats(0.1, 10.0))
def test_unchanged_or_scaled_load_moves_nothing(problem, scale):
    weight, num_gpus, redundant = problem
    table = place_redundant_experts(weight, num_gpus, redundant)
    assert torch.equal(place_redundant_experts(weight, num_gpus, redundant, previous=table), table)
    assert torch.equal(place_redundant_experts(weight * scale, num_gpus, redundant, previous=table), table)


@SETTINGS
@given(problems(), st.sampled_from([0.0, 0.01, 0.05]))
def test_previous_stays_within_tolerance_and_valid(problem, tolerance):
    weight, num_gpus, redundant = problem
    rng = np.random.default_rng(int(weight.size))
    previous = place_redundant_experts(weight, num_gpus, redundant)
    drifted = weight * rng.lognormal(0.0, 0.5, weight.shape)
    fresh = place_redundant_experts(drifted, num_gpus, redundant)
    moved = place_redundant_experts(drifted, num_gpus, redundant, previous=previous, balance_tolerance=tolerance)
    check_layout(moved, *weight.shape, num_gpus, redundant)
    fresh_balance = layer_balancedness(drifted, fresh, num_gpus)
    assert (layer_balancedness(drifted, moved, num_gpus) >= fresh_balance - tolerance - 1e-9).all()


@pytest.mark.parametrize("num_gpus, redundant", [(8, 1), (8, 2), (16, 1), (16, 4)])
@pytest.mark.parametrize("kind", ["zipf", "hot", "uniform"])
def test_close_to_the_classic_greedy(num_gpus, redundant, kind):
    """Fixed primaries give up some freedom; the result stays close to the greedy's free placement."""
    num_logical = 128
    weight = loads(kind, 6, num_logical, seed=num_gpus * 10 + redundant)
    table = place_redundant_experts(weight, num_gpus, redundant)
    ours = layer_balancedness(weight, table, num_gpus).mean()
    slots = num_logical + num_gpus * redundant
    greedy = layer_balancedness(weight, greedy_rebalance_experts(weight, slots, 1, 1, num_gpus).phy2log, num_gpus).mean()
    plain = layer_balancedness(weight, no_replicas(6, num_logical), num_gpus).mean()
    assert ours > plain or plain > 0.999
    assert ours >= greedy - 0.08, (ours, greedy)


def test_hot_expert_gets_the_redundant_slots():
    weight = np.ones((1, 16))
    weight[0, 5] = 30.0
    table = place_redundant_experts(weight, 4, 1).numpy()
    counts = np.bincount(table[0], minlength=16)
    assert counts[5] == 4  # one copy per GPU: the hot expert everywhere
    assert layer_balancedness(weight, table, 4)[0] > 0.95


def test_drift_moves_few_redundant_copies():
    rng = np.random.default_rng(11)
    base = np.stack([rng.permutation(1.0 / np.arange(1, 129)) for _ in range(8)])
    previous = place_redundant_experts(base, 16, 2)
    drifted = base * rng.lognormal(0.0, 0.1, base.shape)
    moved = place_redundant_experts(drifted, 16, 2, previous=previous)
    fresh = place_redundant_experts(drifted, 16, 2)
    assert (moved != previous).sum() < 0.5 * (fresh != previous).sum()


def test_invalid_previous_redundant_slots_are_replaced():
    weight = np.array([[8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    previous = np.array([[0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6]])  # every redundant slot duplicates a primary
    table = place_redundant_experts(weight, 4, 1, previous=previous)
    check_layout(table, 1, 8, 4, 1)


def test_no_redundant_slots_is_the_plain_layout():
    weight = np.arange(24.0).reshape(2, 12)
    assert torch.equal(place_redundant_experts(weight, 4, 0), torch.as_tensor(no_replicas(2, 12)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_gpus=3), ValueError, "num_gpus: expected a divisor of the 8 logical experts, got 3"),
        (dict(num_gpus=0), ValueError, "num_gpus: expected an int >= 1"),
        (dict(num_gpus=2.0), TypeError, "num_gpus: expected an int"),
        (dict(redundant_per_gpu=-1), ValueError, "redundant_per_gpu: expected an int >= 0"),
        (dict(redundant_per_gpu=5), ValueError, "redundant_per_gpu: expected <= 4"),
        (dict(redundant_per_gpu=True), TypeError, "redundant_per_gpu: expected an int"),
        (dict(weight=np.ones(8)), ValueError, "weight: expected 2 dimensions"),
        (dict(weight=np.ones((0, 8))), ValueError, "weight: expected at least one layer"),
        (dict(weight=-np.ones((1, 8))), ValueError, "weight: expected non-negative loads"),
        (dict(previous=np.zeros((1, 8), dtype=np.int64)), ValueError, r"previous: expected shape \[1, 12\]"),
        (dict(previous=np.full((1, 12), 8)), ValueError, "previous: expected values < 8"),
        (dict(previous=np.zeros((1, 12))), TypeError, "previous: expected an integer dtype"),
        (dict(balance_tolerance=2.0), ValueError, "balance_tolerance"),
    ],
)
def test_clear_errors(kwargs, error, match):
    arguments = dict(weight=np.ones((1, 8)), num_gpus=2, redundant_per_gpu=2)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        place_redundant_experts(**arguments)


@pytest.mark.parametrize("seed", range(12))
def test_previous_with_a_clash_in_the_first_redundant_position_is_refilled_there(seed):
    """A deployed redundant slot that repeats a GPU's primary is freed and refilled in place, at
    whatever position it sits (it used to be refilled at the GPU's last position, overwriting a
    valid copy and leaving the freed slot at -1)."""
    rng = np.random.default_rng(seed)
    weight = rng.uniform(0.5, 1.5, (2, 4))
    previous = np.array([[0, 1, 0, 2, 2, 3, 0, 1], [0, 1, 0, 2, 2, 3, 0, 1]])  # GPU 0: primary 0 again
    previous[1, 4:] = rng.permutation(4)
    table = place_redundant_experts(weight, 2, 2, previous=previous, balance_tolerance=0.2)
    check_layout(table, 2, 4, 2, 2)
