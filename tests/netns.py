"""The multi-host test fixture: every host a Linux network namespace (mooncake_ep_switch.bench.netns).

`make_network(num_hosts)` (a pytest fixture returning a factory) builds the namespaces and always
deletes them, also when the test fails, and then checks none is left. No skip: a machine where
namespaces cannot be made fails the test with the reason.

Start the ranks in their hosts: `harness.fresh_cluster(n, network=network.placement([0, 0, 1, 1]))`
puts the launcher's store on the hub's bridge and has every rank enter its host's namespace before
it reaches the store and builds its gloo group (both then cross the veths). `enter_host` is the
older way, for ranks of a cluster started in the root namespace: it moves a rank in later, so only
what the rank opens afterwards (its Buffer) uses the namespace; its store and gloo stay on loopback.
"""
import os

import pytest

from mooncake_ep_switch.bench import netns
from mooncake_ep_switch.bench.netns import Network


@pytest.fixture()
def make_network():
    """Factory `make(num_hosts) -> Network` whose networks are deleted after the test."""
    made = []

    def make(num_hosts: int) -> Network:
        netns.remove_stale()
        network = Network(num_hosts)
        made.append(network)
        try:
            network.create()
        except (RuntimeError, OSError) as error:
            pytest.fail(f"cannot build the test network in network namespaces (needs root and iproute2): {error}")
        return network

    try:
        yield make
    finally:
        for network in made:
            network.delete()
        left = [name for network in made for name in network.left_behind()]
        assert not left, f"namespaces left behind: {left}"


def enter_host(namespace: str, address: str, host_id: str = "") -> None:
    """Rank side: move this rank into its host's namespace and advertise the host's address; with
    `host_id`, also name its host (ranks of one namespace then reach each other over shm). Needless
    (and harmless) for ranks a cluster started with `Network.placement`."""
    netns.enter(namespace)
    os.environ["MEP_BIND_HOST"] = address  # read by config.settings() when the Buffer is made
    if host_id:
        os.environ["MEP_HOST_ID"] = host_id
