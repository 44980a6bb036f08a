"""The collective transport's entry point, installed as mooncake_ep_switch.fallback (a re-export of
`mooncake_ep_switch.buffer.transport.collective`, where the transport lives)."""
