"""The store a `LocalCluster`'s ranks share: the launcher's TCPStore (default), or an etcd cluster.

`store="tcp"`: the launcher hosts a TCPStore (`store.host_store`); the ranks reach it at
`(host, port)`. `store="etcd"`: the launcher starts a local 3-member etcd cluster
(`store.LocalEtcdCluster`, one member per loopback port, data on /dev/shm where there is one) and the
ranks open `EtcdStore`s on it by URL, so the membership outlives any one member (issue 38). With a
`ClusterNetwork` one member runs on each pretend host the ranks live on (its namespace, its address),
so losing a host loses its ranks and its member together. An
`etcd://` URL instead: an etcd cluster someone else runs (the tests' session cluster), on the URL's
prefix. Either way a rank's address is a pair that `elastic.connect_store(*addr)` opens: `(host,
port)` of the TCPStore, or `(url, None)`.
"""
import os
import uuid
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from mooncake_ep_switch.config import etcd_job_id
from mooncake_ep_switch.launcher.store import host_store

__all__ = ["STORES", "ClusterStore", "check_store", "etcd_places", "open_rank_store"]

STORES = ("tcp", "etcd")  # the named kinds; an etcd:// or etcds:// URL is the third form


def _is_url(store: Any) -> bool:
    return isinstance(store, str) and store.split("://", 1)[0].lower() in ("etcd", "etcds") and "://" in store


def check_store(store: Any) -> None:
    """Raise ValueError (naming `store`) unless it is "tcp", "etcd" or an etcd URL."""
    if not (store in STORES or _is_url(store)):
        raise ValueError(f"store: expected one of {STORES} or an etcd:// URL, got {store!r}")


def etcd_places(network: Any) -> Optional[List[Tuple[str, str]]]:
    """(namespace, address) of each distinct host of a `ClusterNetwork`'s ranks, in rank order (one etcd
    member each); None without a network."""
    if network is None:
        return None
    places: List[Tuple[str, str]] = []
    for place in network.ranks:
        if (place.namespace, place.bind_host) not in places:
            places.append((place.namespace, place.bind_host))
    return places


class ClusterStore:
    """The launcher's side of the ranks' store.

    Arguments:
        store: "tcp", "etcd" or an `etcd://host:port[,...]/prefix` URL (checked by `check_store`).
        num_ranks: the TCPStore's world size.
        env: the ranks' environment (the job's identity on an etcd prefix comes from its `MEP_JOB_SECRET`).
        listen: (host, namespace or None) where the TCPStore listens.
        timeout_s: each store operation's timeout, and the etcd cluster's deadline to elect a leader.
        places: with "etcd": None (members on loopback), or the (namespace, address) of each host the
            ranks live on (one member each), reached from namespace `listen[1]` (the network's hub).

    Attributes:
        client: the launcher's store (the TCPStore server, or an `EtcdStore` client on the same prefix):
            a key a rank sets as `world/x` on its world store is `x` under "world/" here. None for an
            etcd cluster on pretend hosts (the launcher's namespace does not reach them).
        addr: what a rank opens (`open_rank_store`): (host, port), or (url, None).
        etcd: the `LocalEtcdCluster` started for `store="etcd"`, else None.

    Raises:
        FileNotFoundError: `store="etcd"` and no etcd binary (scripts/install.sh installs Debian's).
        RuntimeError: the etcd cluster did not elect a leader in time.
        StoreUnavailable, ValueError: the etcd URL's cluster does not answer, or its prefix is another job's.
    """

    def __init__(self, store: str, num_ranks: int, env: Dict[str, str], listen: Tuple[str, Optional[str]],
                 timeout_s: float = 60.0, places: Optional[List[Tuple[str, str]]] = None):
        self.etcd = None
        if store == "tcp":
            host, namespace = listen
            if namespace is None:
                self.client = host_store(host, 0, num_ranks, timeout_s=timeout_s)
            else:
                from mooncake_ep_switch.launcher.namespaces import inside

                with inside(namespace):  # the socket stays in that namespace
                    self.client = host_store(host, 0, num_ranks, timeout_s=timeout_s)
            self.addr: Tuple[str, Optional[int]] = (host, self.client.port)
            return
        from mooncake_ep_switch.store import LocalEtcdCluster, connect_etcd, parse_etcd_url

        url = store
        if store == "etcd":
            self.etcd = LocalEtcdCluster(3 if places is None else len(places), places=places,
                                         probe_namespace=listen[1], timeout_s=timeout_s,
                                         data_root="/dev/shm" if os.path.isdir("/dev/shm") else None).start()
            url = self.etcd.url(f"mep-{uuid.uuid4().hex[:12]}")
        self.addr = (url, None)
        self.client = None
        if places is not None:
            return  # the ranks claim the prefix (each with the job's identity)
        try:
            job = None if "job" in parse_etcd_url(url, "store").options else etcd_job_id(env)
            self.client = connect_etcd(url, timeout_s, job=job, argument="store")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the launcher's client and stop the etcd cluster it started (after the ranks ended)."""
        self.client = None
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None


def open_rank_store(addr: Tuple[str, Optional[int]], num_ranks: int, timeout_s: float = 60.0):
    """A rank's client of the cluster's store (`ClusterStore.addr`): a TCPStore, or an `EtcdStore` claimed
    with the job's identity from this process's `MEP_JOB_SECRET` (the launcher's, inherited).

    Keep a reference to the returned store while a `PrefixStore` of it is used (torch's wrappers hold only
    the C++ half of a Python store).
    """
    if addr[1] is None:
        from mooncake_ep_switch.store import connect_etcd

        return connect_etcd(addr[0], timeout_s, argument="store")
    import torch.distributed as dist

    return dist.TCPStore(addr[0], addr[1], num_ranks, is_master=False, timeout=timedelta(seconds=timeout_s))
