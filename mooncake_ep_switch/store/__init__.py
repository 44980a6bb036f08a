"""Stores for the control plane besides torch's TCPStore: `EtcdStore` on an etcd v3 cluster.

`elastic.connect_store("etcd://h1:2379,h2:2379,h3:2379/prefix")` opens one; `LocalEtcdCluster`
starts a local cluster (tests, one-host jobs). The `etcd` extra installs the client (etcd3gw).
"""
from mooncake_ep_switch.store.connect import connect_etcd, is_etcd_url, parse_etcd_url
from mooncake_ep_switch.store.etcd_cluster import LocalEtcdCluster
from mooncake_ep_switch.store.etcd_store import EtcdStore

__all__ = ["EtcdStore", "LocalEtcdCluster", "connect_etcd", "is_etcd_url", "parse_etcd_url"]
