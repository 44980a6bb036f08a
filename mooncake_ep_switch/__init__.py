"""mooncake_ep_switch: fault-tolerant MoE expert-parallel communication runtime.

Drop-in for Mooncake EP's / DeepEP low-latency `Buffer` and DeepEP V2's `ElasticBuffer`, with shared-memory, Transfer Engine and
PyTorch-collective transports, elastic membership, runtime TP<->EP switching and online EPLB.
"""
import logging

from mooncake_ep_switch.version import VERSION as __version__
from mooncake_ep_switch.buffer.buffer import Buffer
from mooncake_ep_switch.buffer.handle import DispatchHandle, EventOverlap
from mooncake_ep_switch.elastic_buffer import ElasticBuffer, EPHandle
from mooncake_ep_switch.errors import (BufferDestroyed, LeftOut, MembershipError, MooncakeEpError, PeerBusy, PeerLost,
                                       SlotsNotLoaded, StoreRefused, StoreUnavailable, SwitchError, SwitchFenced,
                                       TransferFailed)

# The library logs on "mooncake_ep_switch.<room>" loggers (docs/observability.md) and adds no handler but this.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["Buffer", "DispatchHandle", "EventOverlap", "ElasticBuffer", "EPHandle", "MooncakeEpError", "BufferDestroyed", "MembershipError",
           "LeftOut", "SwitchError", "SwitchFenced", "PeerLost", "PeerBusy", "TransferFailed", "StoreUnavailable",
           "StoreRefused", "SlotsNotLoaded", "__version__"]
