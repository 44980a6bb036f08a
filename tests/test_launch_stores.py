"""LocalCluster's `store=` argument (issue 38): checked before anything starts."""
import pytest

from mooncake_ep_switch.launcher.launch import LocalCluster


@pytest.mark.parametrize("store", ["zk", "", None, "etcd:/x", "http://127.0.0.1:2379/p"])
def test_an_unknown_store_is_refused_naming_the_argument(store):
    with pytest.raises(ValueError, match=r"store: expected one of \('tcp', 'etcd'\) or an etcd:// URL"):
        LocalCluster(2, store=store)
