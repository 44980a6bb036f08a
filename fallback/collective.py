"""The PyTorch-collective transport's entry point: it lives in `mooncake_ep_switch.buffer.transport.collective`."""
from mooncake_ep_switch.buffer.transport.collective import FIXED_MODE_MAX_BYTES, CollectiveTransport, PeerLost

__all__ = ["CollectiveTransport", "PeerLost", "FIXED_MODE_MAX_BYTES"]
