"""Transports under a `Buffer`: the contract they keep and their implementations.

* `contract.Transport`: what a `Buffer` calls (no `hasattr` probes).
* `one_sided.OneSidedTransport`: `"shm"` and `"mooncake"`, the one-sided protocol of docs/protocol.md,
  with `te_endpoint.TeEndpoint` (puts over the Mooncake Transfer Engine; `sockets` reads its TCP
  sockets from /proc) and `peer_watch.PeerWatch` (a dead peer process fails its receive waits at once).
* `collective.CollectiveTransport`: `"collective"`, torch.distributed all-to-all (the fallback).
"""
from mooncake_ep_switch.buffer.transport.contract import Transport

__all__ = ["Transport"]
