"""The multi-host test fixture: every host a Linux network namespace (mooncake_ep_switch.bench.netns).

`make_network(num_hosts)` (a pytest fixture returning a factory) builds the namespaces and always
deletes them, also when the test fails, and then checks none is left. No skip: a machine where
namespaces cannot be made fails the test with the reason. Rank functions call `enter_host` first.
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
    `host_id`, also name its host (ranks of one namespace then reach each other over shm)."""
    netns.enter(namespace)
    os.environ["MEP_BIND_HOST"] = address  # read by config.settings() when the Buffer is made
    if host_id:
        os.environ["MEP_HOST_ID"] = host_id
