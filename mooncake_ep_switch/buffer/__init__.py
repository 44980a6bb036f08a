"""Buffer, packed layouts, transports (Python side), membership."""
from mooncake_ep_switch.buffer.buffer import Buffer
from mooncake_ep_switch.buffer.handle import DispatchHandle, DispatchPlan, EventOverlap
from mooncake_ep_switch.buffer.layout import RegionLayout, region_layout

__all__ = ["Buffer", "DispatchHandle", "DispatchPlan", "EventOverlap", "RegionLayout", "region_layout"]
