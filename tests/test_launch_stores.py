"""LocalCluster's `store=` argument (issue 38): checked before anything starts."""
import pytest

from mooncake_ep_switch.launcher.launch import LocalCluster
from mooncake_ep_switch.launcher.places import ClusterNetwork, RankPlace


@pytest.mark.parametrize("store", ["zk", "", None, "etcd:/x", "http://127.0.0.1:2379/p"])
def test_an_unknown_store_is_refused_naming_the_argument(store):
    with pytest.raises(ValueError, match=r"store: expected one of \('tcp', 'etcd'\) or an etcd:// URL"):
        LocalCluster(2, store=store)


def test_an_etcd_store_with_a_cluster_network_is_refused():
    places = tuple(RankPlace(f"ns{r}", f"10.9.0.{r + 1}", f"h{r}") for r in range(2))
    network = ClusterNetwork("10.9.0.254", "hub", places)
    with pytest.raises(ValueError, match="store: 'etcd' with a ClusterNetwork is not supported"):
        LocalCluster(2, store="etcd", network=network)
