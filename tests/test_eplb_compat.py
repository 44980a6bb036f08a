"""DeepSeek/vLLM-compatible EPLB entry point: call shapes, the triple, and the classic mode's exactness.

The classic algorithm is re-derived below from its published description (plain Python loops,
no code shared with the package): pack expert groups onto nodes heaviest first (least-loaded node
with room), hand redundant slots to the expert with the largest load per copy, pack copies onto
each node's GPUs heaviest first; the global policy is the same with one group and one node.
"""
import numpy as np
import pytest
import torch

from mooncake_ep_switch.eplb.policy.compat import rebalance_experts

EXAMPLE = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
# DeepSeek EPLB's README: rebalance_experts(EXAMPLE, 16, 4, 2, 8) prints this phy2log.
EXAMPLE_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                   [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def _pack(weights, num_packs):
    """Heaviest first into the least-loaded pack with room (ties: lower pack); items of equal weight in
    the order torch's descending sort of the float32 weights gives them (the published code sorts
    with `torch.sort(descending=True)`, which is not stable past small sizes); with one item per pack,
    item i simply goes to pack i (the published code's shortcut)."""
    per_pack = len(weights) // num_packs
    if per_pack == 1:
        return {item: (item, 0) for item in range(len(weights))}
    loads, items, where = [np.float32(0)] * num_packs, [[] for _ in range(num_packs)], {}
    for item in torch.tensor([float(w) for w in weights], dtype=torch.float32).sort(descending=True).indices.tolist():
        pack = min((p for p in range(num_packs) if len(items[p]) < per_pack), key=lambda p: (loads[p], p))
        where[item] = (pack, len(items[pack]))
        items[pack].append(item)
        loads[pack] = np.float32(loads[pack] + weights[item])
    return where


def _classic_reference(row, num_replicas, num_groups, num_nodes, num_gpus):
    """One layer: (phy2log, copy index of each slot) of the classic greedy."""
    row = [np.float32(v) for v in row]
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    experts = len(row)
    size = experts // num_groups
    group_where = _pack([sum(row[g * size:(g + 1) * size], np.float32(0)) for g in range(num_groups)], num_nodes)
    phy2log, copy = [None] * num_replicas, [None] * num_replicas
    per_node = num_replicas // num_nodes
    per_gpu = num_replicas // num_gpus
    for node in range(num_nodes):
        groups = sorted((g for g in range(num_groups) if group_where[g][0] == node), key=lambda g: group_where[g][1])
        members = [g * size + j for g in groups for j in range(size)]
        count = [1] * len(members)
        slots = [(m, 0) for m in range(len(members))]
        for _ in range(per_node - len(members)):
            ratios = [np.float32(row[e]) / np.float32(c) for e, c in zip(members, count)]
            hot = max(range(len(members)), key=lambda m: (ratios[m], -m))
            slots.append((hot, count[hot]))
            count[hot] += 1
        where = _pack([np.float32(row[members[m]]) / np.float32(count[m]) for m, _ in slots], num_gpus // num_nodes)
        for index, (m, rank) in enumerate(slots):
            gpu, position = where[index]
            slot = node * per_node + gpu * per_gpu + position
            phy2log[slot], copy[slot] = members[m], rank
    return phy2log, copy


def _check_triple(phy2log, log2phy, logcnt, num_layers, num_experts, num_replicas):
    assert all(t.dtype == torch.int64 and t.device.type == "cpu" for t in (phy2log, log2phy, logcnt))
    assert phy2log.shape == (num_layers, num_replicas)
    assert log2phy.shape == (num_layers, num_experts, num_replicas - num_experts + 1)
    assert logcnt.shape == (num_layers, num_experts)
    for layer in range(num_layers):
        counts = np.bincount(phy2log[layer].numpy(), minlength=num_experts)
        assert (counts >= 1).all() and counts.tolist() == logcnt[layer].tolist()
        for expert in range(num_experts):
            n = int(logcnt[layer, expert])
            slots = log2phy[layer, expert].tolist()
            assert all(s == -1 for s in slots[n:]) and all(phy2log[layer, s] == expert for s in slots[:n])
            assert len(set(slots[:n])) == n


def _check_classic_against_reference(weight, combo):
    """The classic mode's triple on `weight` `[3, E]` equals the reference, log2phy in copy order."""
    experts, replicas, groups, nodes, gpus = combo
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus, mode="classic")
    _check_triple(phy2log, log2phy, logcnt, 3, experts, replicas)
    for layer in range(3):
        ref_phy2log, ref_copy = _classic_reference(weight[layer].tolist(), replicas, groups, nodes, gpus)
        assert phy2log[layer].tolist() == ref_phy2log
        for slot, (expert, copy) in enumerate(zip(ref_phy2log, ref_copy)):
            assert log2phy[layer, expert, copy] == slot


def test_deepseek_readme_example_exact():
    phy2log, log2phy, logcnt = rebalance_experts(EXAMPLE, 16, 4, 2, 8, mode="classic")
    assert phy2log.tolist() == EXAMPLE_PHY2LOG
    _check_triple(phy2log, log2phy, logcnt, 2, 12, 16)
    for layer in range(2):
        ref_phy2log, ref_copy = _classic_reference(EXAMPLE[layer].tolist(), 16, 4, 2, 8)
        assert ref_phy2log == EXAMPLE_PHY2LOG[layer]
        for slot, (expert, copy) in enumerate(zip(ref_phy2log, ref_copy)):
            assert log2phy[layer, expert, copy] == slot  # DeepSeek's log2phy: copies in copy order


# (experts, replicas, groups, nodes, gpus): hierarchical, global because groups % nodes != 0 (with
# groups not dividing the experts, and nodes not dividing the GPUs), one node with groups, more
# slots than `experts * gpus` (no-two-copies-per-GPU cannot hold), one slot per expert.
COMBOS = [(12, 16, 4, 2, 8), (16, 24, 4, 2, 4), (16, 24, 5, 2, 4), (12, 16, 4, 3, 8), (12, 18, 7, 2, 6),
          (16, 32, 4, 1, 8), (8, 24, 2, 2, 2), (8, 8, 1, 1, 4), (32, 40, 8, 4, 8), (6, 12, 3, 2, 2)]


@pytest.mark.parametrize("combo", COMBOS)
def test_classic_mode_equals_the_classic_algorithm(combo):
    experts, replicas = combo[:2]
    weight = torch.randint(0, 1000, (3, experts), generator=torch.Generator().manual_seed(experts * replicas))
    _check_classic_against_reference(weight, combo)


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16])
def test_every_combination_returns_the_triple(combo, dtype):
    experts, replicas, groups, nodes, gpus = combo
    weight = (torch.rand((2, experts), generator=torch.Generator().manual_seed(7)) * 100).to(dtype)
    per_gpu = replicas // gpus
    for result in (rebalance_experts(weight, replicas, groups, nodes, gpus),  # DeepSeek's positional call
                   rebalance_experts(weight, num_replicas=replicas, num_groups=groups, num_nodes=nodes,
                                     num_ranks=gpus),  # vLLM's keywords
                   rebalance_experts(weight.numpy() if dtype != torch.bfloat16 else weight.float().numpy(),
                                     replicas, groups, nodes, gpus, mode="classic")):
        _check_triple(*result, 2, experts, replicas)
    if replicas <= experts * gpus:  # our placement: never two copies of an expert on one GPU
        phy2log = rebalance_experts(weight, replicas, groups, nodes, gpus)[0].view(2, gpus, per_gpu)
        assert all(len(set(phy2log[l, g].tolist())) == per_gpu for l in range(2) for g in range(gpus))


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[1] <= c[0] * c[4]])
def test_movement_mode_keeps_slots_of_experts_that_stay(combo):
    experts, replicas, groups, nodes, gpus = combo
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(1, 1000, (4, experts), generator=generator)
    old = rebalance_experts(weight, replicas, groups, nodes, gpus)[0]
    # vLLM's call: old_global_expert_indices as the sixth argument; an unchanged load moves nothing.
    assert torch.equal(rebalance_experts(weight, replicas, groups, nodes, gpus, old)[0], old)
    drifted = (weight.double() * (0.7 + 0.6 * torch.rand(weight.shape, generator=generator, dtype=torch.float64)))
    new, log2phy, logcnt = rebalance_experts(drifted, replicas, groups, nodes, gpus, old_global_expert_indices=old)
    _check_triple(new, log2phy, logcnt, 4, experts, replicas)
    per_gpu = replicas // gpus
    for layer in range(4):
        for gpu in range(gpus):
            before = old[layer, gpu * per_gpu:(gpu + 1) * per_gpu].tolist()
            after = new[layer, gpu * per_gpu:(gpu + 1) * per_gpu].tolist()
            for position, expert in enumerate(after):
                if expert in before and before.count(expert) == 1:
                    assert before[position] == expert, f"layer {layer} gpu {gpu}: expert {expert} changed slot"


def test_invalid_combinations_are_refused_like_deepseek():
    w = EXAMPLE
    with pytest.raises(ValueError, match="num_groups: the hierarchical policy"):
        rebalance_experts(w, 16, 8, 2, 8)  # 8 % 2 == 0 -> hierarchical, 8 does not divide 12
    with pytest.raises(ValueError, match="num_nodes: the hierarchical policy"):
        rebalance_experts(w, 16, 6, 3, 8)  # 6 % 3 == 0 -> hierarchical, 3 nodes do not divide 8 GPUs
    with pytest.raises(ValueError, match="num_replicas: expected a multiple of num_gpus=8"):
        rebalance_experts(w, 20, 4, 2, 8)
    with pytest.raises(ValueError, match="num_replicas: expected a multiple"):
        rebalance_experts(w, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="mode: expected one of"):
        rebalance_experts(w, 16, 4, 2, 8, mode="fast")
    with pytest.raises(ValueError, match="old_global_expert_indices: the 'movement' mode"):
        rebalance_experts(w, 16, 4, 2, 8, mode="movement")
    with pytest.raises(ValueError, match=r"old_global_expert_indices: expected shape \[2, 16\]"):
        rebalance_experts(w, 16, 4, 2, 8, torch.zeros((2, 8), dtype=torch.int64))
    with pytest.raises(TypeError, match="num_gpus, num_ranks: expected exactly one"):
        rebalance_experts(w, 16, 4, 2, 8, num_ranks=8)


@pytest.mark.parametrize("combo", [(64, 64, 1, 1, 8), (64, 80, 8, 2, 8), (48, 64, 4, 4, 16)])
def test_classic_mode_breaks_ties_as_deepseek(combo):
    """Loads that tie (a few distinct values over many experts): the heaviest-first order among equal
    loads is torch's descending sort's, as in DeepSeek's code (issue 27: a stable sort differed in 31 of
    258 cases), in phy2log and in log2phy's copy order."""
    experts = combo[0]
    values = torch.tensor([664, 100, 3, 664, 250])
    weight = values[torch.randint(0, len(values), (3, experts), generator=torch.Generator().manual_seed(experts))]
    _check_classic_against_reference(weight, combo)


@pytest.mark.parametrize("kwargs", [dict(num_replicas=7, num_groups=2, num_nodes=1, num_gpus=4),   # not a multiple
                                    dict(num_replicas=8, num_groups=4, num_nodes=2, num_gpus=3),   # nodes vs gpus
                                    dict(num_replicas=4, num_groups=1, num_nodes=1, num_gpus=2)])  # fewer than E
def test_refused_combinations_raise_what_deepseek_and_vllm_callers_catch(kwargs):
    """vLLM's parameter-validation test expects AssertionError (DeepSeek asserts); ours names the argument and
    is a ValueError too."""
    weight = torch.ones((1, 8))
    for kind in (AssertionError, ValueError):
        with pytest.raises(kind, match=r"^num_"):
            rebalance_experts(weight, **kwargs)


def test_sglang_keywords_enable_hierarchical_and_no_groups():
    """SGLang's call: `enable_hierarchical=` picks the policy (False: global whatever the groups, True: the
    hierarchical one, checked), and `num_groups=None` for models without expert groups (global)."""
    weight = torch.randint(0, 1000, (3, 16), generator=torch.Generator().manual_seed(5))
    as_global = rebalance_experts(weight, 24, 4, 2, 4, mode="classic", enable_hierarchical=False)
    for layer in range(3):  # the global policy is the hierarchical one with one group and one node
        assert as_global[0][layer].tolist() == _classic_reference(weight[layer].tolist(), 24, 1, 1, 4)[0]
    forced = rebalance_experts(weight, 24, 4, 2, 4, mode="classic", enable_hierarchical=True)
    assert torch.equal(forced[0], rebalance_experts(weight, 24, 4, 2, 4, mode="classic")[0])
    no_groups = rebalance_experts(weight, 24, None, 1, 4, mode="classic", enable_hierarchical=False)
    assert torch.equal(no_groups[0], as_global[0])
    _check_triple(*rebalance_experts(weight, 24, None, 2, 4, enable_hierarchical=False), 3, 16, 24)  # default mode
    for kind in (AssertionError, ValueError):
        with pytest.raises(kind, match=r"^num_groups: enable_hierarchical=True needs"):
            rebalance_experts(weight, 24, None, 2, 4, enable_hierarchical=True)
        with pytest.raises(kind, match=r"^num_groups: enable_hierarchical=True needs a multiple"):
            rebalance_experts(weight, 24, 3, 2, 4, enable_hierarchical=True)
    with pytest.raises(TypeError, match="enable_hierarchical"):
        rebalance_experts(weight, 24, 4, 2, 4, enable_hierarchical="yes")


# ---------------------------------------------------------------- issue 27 item 6 (rest)


def _kept_slots_reference(old_row, new_row, num_gpus):
    """vLLM's rule, formulated with multisets: per GPU, each old slot (in order) keeps its expert while
    the GPU's new experts still have an unclaimed copy of it; the unclaimed new experts, in their new
    order, fill the free slots in order. -1 (an empty old slot) never matches."""
    from collections import Counter

    per_gpu = len(new_row) // num_gpus
    out = []
    for gpu in range(num_gpus):
        old_gpu = old_row[gpu * per_gpu:(gpu + 1) * per_gpu]
        new_gpu = new_row[gpu * per_gpu:(gpu + 1) * per_gpu]
        available, claimed = Counter(new_gpu), Counter()
        result = [None] * per_gpu
        for slot, expert in enumerate(old_gpu):
            if available[expert] > 0:
                result[slot] = expert
                available[expert] -= 1
                claimed[expert] += 1
        rest = []
        for expert in new_gpu:
            if claimed[expert] > 0:
                claimed[expert] -= 1
            else:
                rest.append(expert)
        free = [slot for slot in range(per_gpu) if result[slot] is None]
        for slot, expert in zip(free, rest):
            result[slot] = expert
        out.extend(result)
    return out


def test_the_package_entry_point_has_the_peers_semantics():
    """`mooncake_ep_switch.eplb.rebalance_experts` is the peers' entry point: num_groups=3 with 4
    experts on 2 nodes falls back to the global policy as DeepSeek's does (it raised before), it
    returns their triple, refuses as they do (ValueError and AssertionError); `place_experts` is ours."""
    from mooncake_ep_switch import eplb

    weight = torch.tensor([[10, 40, 25, 5], [7, 7, 30, 1]])
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 8, 3, 2, 4, mode="classic")
    _check_triple(phy2log, log2phy, logcnt, 2, 4, 8)
    for layer in range(2):
        assert phy2log[layer].tolist() == _classic_reference(weight[layer].tolist(), 8, 3, 2, 4)[0]
    _check_triple(*eplb.rebalance_experts(weight, 8, 3, 2, num_ranks=4), 2, 4, 8)  # vLLM's keyword, our default
    with pytest.raises(AssertionError, match="num_replicas"):
        eplb.rebalance_experts(weight, 6, 3, 2, 4)
    placement = eplb.place_experts(weight, 8, 1, 1, 4)
    assert isinstance(placement, eplb.Placement) and placement.phy2log.shape == (2, 8)


@pytest.mark.parametrize("combo", [(12, 16, 4, 2, 8), (8, 24, 2, 2, 2), (16, 24, 5, 2, 4), (6, 12, 3, 2, 2)])
def test_classic_mode_keeps_the_slots_of_experts_that_stay(combo):
    """vLLM's default policy with `old_global_expert_indices`: DeepSeek's placement, each GPU's slots
    permuted so that experts that stay keep their slots (duplicates on a GPU included). Before, the
    classic mode ignored the argument."""
    experts, replicas, groups, nodes, gpus = combo
    generator = torch.Generator().manual_seed(11)
    weight = torch.randint(1, 1000, (3, experts), generator=generator)
    drifted = weight * torch.randint(1, 4, weight.shape, generator=generator)
    old = rebalance_experts(weight, replicas, groups, nodes, gpus, mode="classic")[0]
    plain = rebalance_experts(drifted, replicas, groups, nodes, gpus, mode="classic")
    kept = rebalance_experts(drifted, replicas, groups, nodes, gpus, old, mode="classic")
    _check_triple(*kept, 3, experts, replicas)
    assert torch.equal(kept[2], plain[2])  # the same copies per expert
    for layer in range(3):
        assert kept[0][layer].tolist() == _kept_slots_reference(old[layer].tolist(), plain[0][layer].tolist(), gpus)
    assert (kept[0] == old).sum() >= (plain[0] == old).sum()


@pytest.mark.parametrize("mode", [None, "classic", "balanced"])
def test_old_indices_with_empty_slots_of_a_scale_up(mode):
    """vLLM's elastic scale-up passes the deployed phy2log padded with -1 for the new GPUs' slots
    (refused with ValueError before). Every mode accepts it: the new GPUs get experts, and experts
    that stay on an old GPU keep their slots there."""
    experts, per_gpu, old_gpus, gpus = 8, 3, 4, 6
    generator = torch.Generator().manual_seed(5)
    weight = torch.randint(1, 1000, (2, experts), generator=generator)
    deployed = rebalance_experts(weight, old_gpus * per_gpu, 1, 1, old_gpus)[0]
    padded = torch.cat([deployed, torch.full((2, (gpus - old_gpus) * per_gpu), -1, dtype=torch.int64)], dim=1)
    drifted = weight * torch.randint(1, 3, weight.shape, generator=generator)
    phy2log, log2phy, logcnt = rebalance_experts(drifted, gpus * per_gpu, 1, 1, gpus, padded, mode=mode)
    _check_triple(phy2log, log2phy, logcnt, 2, experts, gpus * per_gpu)
    fresh = rebalance_experts(drifted, gpus * per_gpu, 1, 1, gpus, mode=mode or "balanced")[0]
    for layer in range(2):
        row = phy2log[layer].tolist()
        assert sorted(row) == sorted(fresh[layer].tolist())  # the same copies per GPU as a fresh placement
        assert row == _kept_slots_reference(padded[layer].tolist(), fresh[layer].tolist(), gpus)
    with pytest.raises(ValueError, match="old_global_expert_indices"):
        rebalance_experts(drifted, gpus * per_gpu, 1, 1, gpus, padded - 1)  # -2 is no slot marker


def test_vllm_newest_policy_api():
    """vLLM's newest call pattern: `DefaultEplbPolicy.rebalance_experts` returns phy2log alone, the
    caller derives log2phy/logcnt with `compute_logical_maps` (which skips -1 slots), and
    `preserve_intragpu_slots` keeps the slots of experts that stay (duplicates included)."""
    from mooncake_ep_switch.eplb import DefaultEplbPolicy, compute_logical_maps

    phy2log = DefaultEplbPolicy.rebalance_experts(EXAMPLE, 16, 4, 2, 8)
    assert phy2log.tolist() == EXAMPLE_PHY2LOG
    log2phy, logcnt = compute_logical_maps(phy2log, 12)
    for layer in range(2):
        counts = np.bincount(np.array(EXAMPLE_PHY2LOG[layer]), minlength=12)
        assert logcnt[layer].tolist() == counts.tolist()
        for expert in range(12):
            slots = [s for s, e in enumerate(EXAMPLE_PHY2LOG[layer]) if e == expert]
            assert log2phy[layer, expert].tolist() == slots + [-1] * (log2phy.shape[2] - len(slots))
    assert DefaultEplbPolicy.rebalance_experts(torch.tensor([[10, 20, 30, 40]]), 8, 3, 2, 4).shape == (1, 8)
    with pytest.raises(AssertionError):
        DefaultEplbPolicy.rebalance_experts(torch.tensor([[10, 20, 30, 40]]), 7, 2, 2, 4)
    unused = torch.tensor([[0, 1, -1, 2, 3, -1], [3, -1, 2, 1, 0, -1]])
    log2phy, logcnt = compute_logical_maps(unused, 4)
    assert log2phy.shape == (2, 4, 1) and logcnt.tolist() == [[1] * 4] * 2
    assert log2phy[0, :, 0].tolist() == [0, 1, 3, 4] and log2phy[1, :, 0].tolist() == [4, 3, 2, 0]
    old = np.array([[0, 1, 0, 2, 3, 4, 5, 6, 1, 2]])
    new = np.array([[0, 5, 4, 0, 1, 6, 2, 3, 2, 1]])
    kept = DefaultEplbPolicy.preserve_intragpu_slots(new, 2, old)
    assert kept[0].tolist() == _kept_slots_reference(old[0].tolist(), new[0].tolist(), 2)
    assert kept[0, :5].tolist()[:3] == [0, 1, 0]  # both copies of expert 0 and expert 1 keep their slots
    weight = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    deployed = DefaultEplbPolicy.rebalance_experts(weight, 12, 1, 1, 4)
    moved = DefaultEplbPolicy.rebalance_experts(weight.flip(1), 12, 1, 1, 4, deployed)
    plain = DefaultEplbPolicy.rebalance_experts(weight.flip(1), 12, 1, 1, 4)
    for layer in range(2):
        assert moved[layer].tolist() == _kept_slots_reference(deployed[layer].tolist(), plain[layer].tolist(), 4)
