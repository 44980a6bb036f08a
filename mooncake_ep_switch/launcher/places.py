"""Where the ranks of a `LocalCluster` live: network namespaces, each with its host's address and interface.

`launch.LocalCluster(network=ClusterNetwork(...))` spreads its ranks over Linux network namespaces
(`bench/netns.py` builds them); each rank enters its place before it connects to the store.
"""
import os
from typing import NamedTuple, Optional, Tuple

from mooncake_ep_switch.config import BIND_HOST_ENV, GLOO_SOCKET_IFNAME_ENV, HOST_ID_ENV

__all__ = ["RankPlace", "ClusterNetwork", "check_network", "enter_place"]

class RankPlace(NamedTuple):
    """Where one rank of a `ClusterNetwork` lives.

    Fields:
        namespace: the network namespace (a name under /var/run/netns) the rank enters first, before
            it connects to the store or builds its gloo group.
        bind_host: its host's address: `MEP_BIND_HOST` (what the Transfer Engine advertises, where
            the peer watcher listens).
        interface: the device gloo binds to (`GLOO_SOCKET_IFNAME`), e.g. the host's veth.
        host_id: `MEP_HOST_ID` (ranks with the same one share memory); "" keeps the rank's default.
    """

    namespace: str
    bind_host: str
    interface: str
    host_id: str = ""


class ClusterNetwork(NamedTuple):
    """A `LocalCluster` spread over network namespaces (`bench.netns.Network.placement` builds one).

    Fields:
        store_host: the address the launcher's store listens on (only there), reachable from every
            rank's namespace.
        store_namespace: the network namespace the store's listening socket is made in (the
            launcher's thread enters it for that moment only); None: the launcher's own.
        ranks: one `RankPlace` per rank, in rank order.
    """

    store_host: str
    store_namespace: Optional[str]
    ranks: Tuple[RankPlace, ...]


def check_network(network: Optional[ClusterNetwork], num_ranks: int) -> None:
    if network is None:
        return
    if not isinstance(network, ClusterNetwork):
        raise TypeError(f"network: expected a ClusterNetwork or None, got {type(network).__name__}")
    if not isinstance(network.store_host, str) or not network.store_host:
        raise ValueError(f"network.store_host: expected a non-empty address, got {network.store_host!r}")
    if network.store_namespace is not None and (not isinstance(network.store_namespace, str)
                                                or not network.store_namespace):
        raise ValueError(f"network.store_namespace: expected a namespace name or None, got "
                         f"{network.store_namespace!r}")
    if len(network.ranks) != num_ranks:
        raise ValueError(f"network.ranks: expected one RankPlace per rank ({num_ranks}), got {len(network.ranks)}")
    for rank, place in enumerate(network.ranks):
        if not isinstance(place, RankPlace):
            raise TypeError(f"network.ranks[{rank}]: expected a RankPlace, got {type(place).__name__}")
        for field in ("namespace", "bind_host", "interface"):
            if not isinstance(getattr(place, field), str) or not getattr(place, field):
                raise ValueError(f"network.ranks[{rank}].{field}: expected a non-empty str, got "
                                 f"{getattr(place, field)!r}")
        if not isinstance(place.host_id, str):
            raise ValueError(f"network.ranks[{rank}].host_id: expected a str, got {place.host_id!r}")


def enter_place(place: RankPlace) -> None:
    """Rank side, first thing: move into the rank's namespace and set what its settings read."""
    from mooncake_ep_switch.launcher.namespaces import enter

    enter(place.namespace)  # the main thread, before any socket or thread exists
    os.environ[BIND_HOST_ENV] = place.bind_host
    os.environ[GLOO_SOCKET_IFNAME_ENV] = place.interface
    if place.host_id:
        os.environ[HOST_ID_ENV] = place.host_id
