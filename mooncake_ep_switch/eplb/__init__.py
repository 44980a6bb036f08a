"""Expert-parallel load balancing: placement, load recorder, dispatch maps, online rebalance.

`rebalance_experts` is DeepSeek's / vLLM's / SGLang's entry point with their arguments and their
`(phy2log, log2phy, logcnt)` triple (`policy/compat.py`); `place_experts` is ours, returning a
`Placement` (`policy/placement.py`).
"""
from mooncake_ep_switch.eplb.policy.budget import RedundancyAdvice, suggest_redundancy
from mooncake_ep_switch.eplb.policy.greedy import greedy_rebalance_experts
from mooncake_ep_switch.eplb.policy.tables import Placement, placement_from_phy2log
from mooncake_ep_switch.eplb.maps import (LiveCopies, build_dispatch_map, live_copies, logical_to_physical,
                                         spread_to_physical)
from mooncake_ep_switch.eplb.online import OnlineRebalancer, RebalanceChunk, RebalanceReport
from mooncake_ep_switch.eplb.coverage import coverage_placement, restore_coverage, uncovered_experts
from mooncake_ep_switch.eplb.serving import physical_ep_forward, physical_ep_round
from mooncake_ep_switch.eplb.shrink_placement import shrink_experts, shrink_placement
from mooncake_ep_switch.eplb.drain import begin_drain, finish_drain
from mooncake_ep_switch.eplb.grow_placement import GrownSlots, grow_placement, grow_slots, renumber_placement
from mooncake_ep_switch.eplb.slots import ExpertSlots, SlotShape
from mooncake_ep_switch.eplb.policy.metrics import balancedness, gpu_loads, layer_balancedness, moved_copies
from mooncake_ep_switch.eplb.policy.placement import rebalance_experts as place_experts
from mooncake_ep_switch.eplb.policy.compat import EplbArgumentError, rebalance_experts
from mooncake_ep_switch.eplb.policy.vllm_api import DefaultEplbPolicy, compute_logical_maps
from mooncake_ep_switch.eplb.policy.redundant import place_redundant_experts
from mooncake_ep_switch.eplb.recorder import ExpertLoadRecorder, LoadBalance, counts_from_topk

__all__ = [
    "DefaultEplbPolicy",
    "EplbArgumentError",
    "ExpertLoadRecorder",
    "ExpertSlots",
    "GrownSlots",
    "OnlineRebalancer",
    "RebalanceChunk",
    "RebalanceReport",
    "SlotShape",
    "LiveCopies",
    "LoadBalance",
    "Placement",
    "RedundancyAdvice",
    "balancedness",
    "begin_drain",
    "build_dispatch_map",
    "compute_logical_maps",
    "counts_from_topk",
    "finish_drain",
    "coverage_placement",
    "gpu_loads",
    "grow_placement",
    "grow_slots",
    "renumber_placement",
    "greedy_rebalance_experts",
    "layer_balancedness",
    "live_copies",
    "logical_to_physical",
    "moved_copies",
    "physical_ep_forward",
    "physical_ep_round",
    "place_experts",
    "place_redundant_experts",
    "placement_from_phy2log",
    "rebalance_experts",
    "restore_coverage",
    "shrink_experts",
    "shrink_placement",
    "spread_to_physical",
    "suggest_redundancy",
    "uncovered_experts",
]
