"""PyTorch-collective transport (pure torch), installed as mooncake_ep_switch.fallback."""
