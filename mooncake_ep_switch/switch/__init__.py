"""Runtime TP<->EP layout switching: unified weight memory, reshard, KV redistribution, policy.

Submodules import torch lazily where they can; the names below are the public API.
"""
from mooncake_ep_switch.switch.kv_cache import KVCacheConfig, PagedKVCache
from mooncake_ep_switch.switch.planning.policy import Calibration, Decision, PolicySettings, SwitchPolicy, calibrate
from mooncake_ep_switch.switch.planning.simulator import CostModel, Metrics, compare, format_table, plot_timeline, simulate
from mooncake_ep_switch.switch.switcher import SwitchError, SwitchFenced, SwitchReport, switch_layout
from mooncake_ep_switch.switch.tp_collective import TPAllReduce
from mooncake_ep_switch.switch.planning.traces import bursty_trace, rollout_trace
from mooncake_ep_switch.switch.unified_weights import MemoryReport, UnifiedWeights, WeightShape

__all__ = [
    "Calibration", "CostModel", "Decision", "KVCacheConfig", "MemoryReport", "Metrics", "PagedKVCache",
    "PolicySettings", "SwitchError", "SwitchFenced", "SwitchPolicy", "SwitchReport", "TPAllReduce",
    "UnifiedWeights", "WeightShape", "bursty_trace", "calibrate", "compare", "format_table", "plot_timeline",
    "rollout_trace", "simulate", "switch_layout",
]
