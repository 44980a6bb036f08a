"""The compiled local search (`eplb.local_search.search`): invariants, a brute-force reference for
one move, independence of the thread count, and argument checks."""
import numpy as np
import pytest

from mooncake_ep_switch.eplb.policy.construct import Topology
from mooncake_ep_switch.eplb.policy.tables import expert_counts
from mooncake_ep_switch.eplb.policy.local_search import search
from mooncake_ep_switch.eplb.policy.placement import rebalance_experts


def problem(seed: int, hierarchical: bool, layers: int = 4, nodes: int = 2, gpus_per_node: int = 4,
            experts: int = 32, slots: int = 5):
    """A random previous placement, a drifted load, pinned primaries (hierarchical) and a target."""
    rng = np.random.default_rng(seed)
    gpus = nodes * gpus_per_node
    topo = Topology(experts, gpus * slots, 2 * nodes, nodes, gpus, hierarchical)
    before = rng.permutation(1.0 / np.arange(1, experts + 1)) * rng.uniform(0.5, 1.5, (layers, experts))
    previous = rebalance_experts(before, topo.num_replicas, topo.num_groups, nodes, gpus, hierarchical=hierarchical)
    experts_table = previous.phy2log.numpy().copy()
    weight = np.stack([rng.permutation(row) for row in before]) * rng.uniform(0.8, 1.2, before.shape)
    weight = weight / weight.sum(axis=1, keepdims=True)
    pinned = np.zeros(experts_table.shape, dtype=bool)
    if hierarchical:  # the first copy of each expert is its primary
        for layer in range(layers):
            _, first = np.unique(experts_table[layer], return_index=True)
            pinned[layer, first] = True
    counts = expert_counts(experts_table, experts)
    mean = weight.sum(axis=1) / gpus
    return topo, weight, experts_table, counts, pinned, mean


def gpu_loads(weight, table, counts, topo):
    per_slot = np.take_along_axis(weight / np.maximum(counts, 1), table, axis=1)
    return per_slot.reshape(table.shape[0], topo.num_gpus, -1).sum(axis=2)


def check_valid(topo, table, counts, pinned, pinned_before, table_before):
    layers = table.shape[0]
    assert (counts == expert_counts(table, topo.num_logical)).all()
    assert (counts >= 1).all()
    per_gpu = np.sort(table.reshape(layers, topo.num_gpus, -1), axis=2)
    assert not (per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).any(), "two copies of an expert on one GPU"
    # every pinned primary is still there, on its node, and still pinned
    node = topo.gpu_node()[np.arange(topo.num_replicas) // topo.slots_per_gpu]
    assert pinned.sum() == pinned_before.sum()
    for layer in range(layers):
        before = sorted(zip(table_before[layer][pinned_before[layer]], node[pinned_before[layer]]))
        after = sorted(zip(table[layer][pinned[layer]], node[pinned[layer]]))
        assert before == after


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("phases", ["improve", "all"])
def test_search_keeps_invariants_and_never_raises_the_peak_when_only_improving(seed, hierarchical, phases):
    topo, weight, table, counts, pinned, mean = problem(seed, hierarchical)
    start, pinned_before = table.copy(), pinned.copy()
    peak_before = gpu_loads(weight, table, counts, topo).max(axis=1)
    rows = np.arange(weight.shape[0])
    budget = np.full(weight.shape[0], topo.num_replicas // 3)
    everything = phases == "all"
    search(weight, table, counts, pinned, topo, mean * 1.02, np.full(rows.size, np.inf), rows, start=start,
           budget=budget, split=everything, relieve=everything, retries=2 if everything else 0, heavy=3)
    check_valid(topo, table, counts, pinned, pinned_before, start)
    peak_after = gpu_loads(weight, table, counts, topo).max(axis=1)
    if not everything:
        assert (peak_after <= peak_before * (1 + 1e-12)).all()
    # budget: the improvement never leaves more slots changed than the budget (transfers and node
    # relief do not count against it)
    if not everything:
        assert ((table != start).sum(axis=1) <= budget).all()
    # the search moved something somewhere, and lowered the sum of peaks
    assert (table != start).any()
    assert peak_after.sum() < peak_before.sum()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_result_does_not_depend_on_the_thread_count(hierarchical):
    topo, weight, table, counts, pinned, mean = problem(11, hierarchical, layers=9)
    results = []
    for threads in (1, 2, 4):
        t, c, p = table.copy(), counts.copy(), pinned.copy()
        search(weight, t, c, p, topo, mean * 1.01, np.full(9, np.inf), np.arange(9), start=table, threads=threads,
               relieve=hierarchical, retries=2)
        results.append((t, c, p))
    for t, c, p in results[1:]:
        assert np.array_equal(t, results[0][0]) and np.array_equal(c, results[0][1]) and np.array_equal(p, results[0][2])


def brute_force_first_move(topo, weight, table, counts, pinned, start, item_limit):
    """The first improvement move as a plain loop: every swap, park and split of the heaviest GPU
    with every other GPU, scored by (heavy load - largest load among the GPUs it changes) per
    (the increase of slots that differ from `start`, at least 0, + 0.25); returns the best score
    (or None)."""
    slots, gpus = topo.slots_per_gpu, topo.num_gpus
    node = topo.gpu_node()
    loads = gpu_loads(weight[None], table[None], counts[None], topo)[0]
    top = int(np.argmax(loads))
    peak = loads[top]
    on_gpu = [set(table[g * slots:(g + 1) * slots].tolist()) for g in range(gpus)]
    holders = {e: {g for g in range(gpus) if e in on_gpu[g]} for e in range(topo.num_logical)}
    best = None

    def cost(new):
        return max(0, int((new != start).sum()) - int((table != start).sum()))

    def consider(score):
        nonlocal best
        if score > 1e-6 * peak and (best is None or score > best):
            best = score

    def largest_after(new_table, new_counts, touched):
        after = gpu_loads(weight[None], new_table[None], new_counts[None], topo)[0]
        return max(after[g] for g in touched)

    for a in range(top * slots, (top + 1) * slots):  # swaps
        for b in range(topo.num_replicas):
            p = b // slots
            if p == top or table[a] in on_gpu[p] or table[b] in on_gpu[top]:
                continue
            if (pinned[a] or pinned[b]) and node[p] != node[top]:
                continue
            new = table.copy()
            new[a], new[b] = new[b], new[a]
            m = largest_after(new, counts, {top, p})
            if m < peak * (1 - 1e-12):
                consider((peak - m) / (cost(new) + 0.25))
    per_copy_next = np.where(counts < gpus, weight / (counts + 1.0), np.inf)
    per_copy_next[list(on_gpu[top])] = np.inf
    y = int(np.argmin(per_copy_next))
    for a in range(top * slots, (top + 1) * slots):  # parks
        x = table[a]
        if np.isfinite(per_copy_next[y]) and counts[x] >= 2 and not pinned[a] and weight[x] / (counts[x] - 1) <= item_limit:
            new, c = table.copy(), counts.copy()
            new[a] = y
            c[x] -= 1
            c[y] += 1
            m = largest_after(new, c, holders[x] | holders[y] | {top})
            consider((peak - m) / (cost(new) + 0.25))
    sizes = weight[table[top * slots:(top + 1) * slots]] / counts[table[top * slots:(top + 1) * slots]]
    for i in np.argsort(-sizes, kind="stable")[:3]:  # splits of the 3 largest copies
        y = table[top * slots + i]
        if counts[y] >= gpus:
            continue
        for s in range(topo.num_replicas):
            p, x = s // slots, table[s]
            if p == top or y in on_gpu[p] or counts[x] < 2 or pinned[s] or weight[x] / (counts[x] - 1) > item_limit:
                continue
            new, c = table.copy(), counts.copy()
            new[s] = y
            c[x] -= 1
            c[y] += 1
            m = largest_after(new, c, holders[x] | holders[y] | {p})
            consider((peak - m) / (cost(new) + 0.25))
    return best, peak


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_one_move_matches_a_brute_force_reference(seed, hierarchical):
    topo, weight, table, counts, pinned, mean = problem(100 + seed, hierarchical, layers=1)
    rng = np.random.default_rng(seed)
    start = table.copy()
    # some slots already changed (changing them again costs nothing, giving back their start expert
    # saves a copy); the start experts are the experts of other slots, so a move can bring them back
    changed = rng.choice(topo.num_replicas, 8, replace=False)
    start[0, changed] = table[0, rng.permutation(changed)]
    item_limit = float(weight.max()) * 0.6
    best, peak = brute_force_first_move(topo, weight[0], table[0], counts[0], pinned[0], start[0], item_limit)
    t, c, p = table.copy(), counts.copy(), pinned.copy()
    search(weight, t, c, p, topo, np.zeros(1), np.full(1, item_limit), np.arange(1), start=start, split=False,
           relieve=False, revert=False, max_steps=1, near=topo.num_gpus - 1)
    if best is None:
        assert np.array_equal(t, table)
        return
    changed = np.nonzero(t[0] != table[0])[0]
    assert 1 <= changed.size <= 2
    loads_after = gpu_loads(weight, t, c, topo)[0]
    touched = set(changed // topo.slots_per_gpu)
    if not np.array_equal(c, counts):  # a park or split changes every copy of the two experts
        for e in set(table[0][changed]) | set(t[0][changed]):
            touched |= set(np.nonzero(t[0] == e)[0] // topo.slots_per_gpu) | set(np.nonzero(table[0] == e)[0] // topo.slots_per_gpu)
    cost = max(0, int((t[0] != start[0]).sum()) - int((table[0] != start[0]).sum())) + 0.25
    score = (peak - max(loads_after[g] for g in touched)) / cost
    assert score == pytest.approx(best, rel=1e-9)


def test_bad_arguments_name_the_argument():
    topo, weight, table, counts, pinned, mean = problem(3, True, layers=2)
    limits = np.full(2, np.inf)
    with pytest.raises(ValueError, match="experts"):
        search(weight, table.astype(np.int32), counts, pinned, topo, mean, limits, np.arange(2))
    with pytest.raises(ValueError, match="pinned"):
        search(weight, table, counts, pinned[:, :-1].copy(), topo, mean, limits, np.arange(2))
    with pytest.raises(ValueError, match="rows"):
        search(weight, table, counts, pinned, topo, mean, limits, np.array([0, 2]))
    with pytest.raises(ValueError, match="swap_from"):
        search(weight, table, counts, pinned, topo, mean, limits, np.arange(2), swap_from=topo.slots_per_gpu)
    bad = table.copy()
    bad[0, 0] = topo.num_logical
    with pytest.raises(ValueError, match="experts"):
        search(weight, bad, counts, pinned, topo, mean, limits, np.arange(2))
    _, _, original, original_counts, original_pinned, _ = problem(3, True, layers=2)
    assert np.array_equal(table, original) and np.array_equal(counts, original_counts)  # errors change nothing
    assert np.array_equal(pinned, original_pinned)
    peak = gpu_loads(weight, table, counts, topo).max(axis=1)
    search(weight, table, counts, pinned, topo, mean, limits, np.arange(2))  # and a valid call still works
    assert (gpu_loads(weight, table, counts, topo).max(axis=1) < peak).all()


def test_more_bad_arguments_are_refused_before_anything_moves():
    topo, weight, table, counts, pinned, mean = problem(5, False, layers=3)
    limits = np.full(3, np.inf)
    original = table.copy()
    cases = [
        (dict(rows=np.array([0, 0, 1])), "rows: expected distinct"),
        (dict(counts=counts + 1), "counts: expected the copies"),
        (dict(start=np.full(table.shape, -1)), "start: expected logical experts"),
        (dict(budget=np.full(3, -1)), "budget: expected non-negative"),
        (dict(weight=np.where(weight > weight.mean(), np.nan, weight)), "weight: expected finite"),
        (dict(near=-1), "near, heavy, max_steps"),
    ]
    for change, match in cases:
        arguments = dict(weight=weight, counts=counts, rows=np.arange(3))
        arguments.update({k: v for k, v in change.items() if k in arguments})
        options = {k: v for k, v in change.items() if k not in arguments}
        with pytest.raises(ValueError, match=match):
            search(arguments["weight"], table, arguments["counts"], pinned, topo, mean, limits, arguments["rows"], **options)
    doubled = table.copy()
    doubled[0, 1] = doubled[0, 0]  # two copies of one expert on GPU 0
    with pytest.raises(ValueError, match="at most one copy"):
        search(weight, doubled, expert_counts(doubled, topo.num_logical), pinned, topo, mean, limits, np.arange(3))
    assert np.array_equal(table, original)


def test_refinement_refuses_negative_counts():
    from mooncake_ep_switch.eplb.policy.packing import refine_swaps

    ex = np.arange(12, dtype=np.int64).reshape(1, 4, 3)
    sz = np.linspace(0.1, 1.2, 12).reshape(1, 4, 3)
    pn = np.zeros(ex.shape, dtype=bool)
    with pytest.raises(ValueError, match="near"):
        refine_swaps(ex, sz, pn, np.zeros(4, dtype=np.int64), descend_steps=4, near=-1, threads=2)
    refine_swaps(ex, sz, pn, np.zeros(4, dtype=np.int64), descend_steps=4, near=2, threads=2)  # still usable
    assert sorted(ex.ravel().tolist()) == list(range(12))
