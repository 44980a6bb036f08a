"""Pretend hosts made real: Linux network namespaces joined by veth pairs to a bridge.

One namespace per host (`<prefix><pid>h<host>`), each with one veth (address `<subnet>.<1+host>/24`)
whose peer end sits on a bridge in a hub namespace (`<prefix><pid>hub`). The bridge itself has an
address too (`<subnet>.254`, `Network.store_address`): the launcher's store listens there, inside the
hub namespace, so ranks reach it over their host's veth like any host reaches a store on another
machine, and nothing is added to the root namespace (no device, route or address there; networks of
concurrent runs that use the same subnet never meet).

`Network.placement` gives `launch.LocalCluster` the store address and, per rank, its host's
namespace, address and veth: each rank enters its namespace (setns, `enter`) before it connects to
the store and builds its gloo group (bound to the veth with GLOO_SOCKET_IFNAME), so the store
traffic, gloo, the Transfer Engine (listeners, I/O threads, puts) and every other socket of the rank
live in that namespace, and only the veths carry traffic between hosts. Downing a host's veth
(`set_link`) is a real link outage with real TCP underneath: the host loses its peers and the store
at once (its established connections stay open and carry on when the link comes back; a new
connection fails at once, no route).

Needs root and iproute2. Used by the multi-host tests (tests/netns.py) and the cross-host benchmark
(`bench.hosts`). `Network.delete` removes everything it made; `remove_stale` removes what a killed
earlier run of this prefix left behind.
"""
import json
import os
import re
import subprocess
from typing import List, Sequence

from mooncake_ep_switch.launcher.namespaces import enter, inside  # noqa: F401  (re-exported: rank functions use netns.enter)

DEFAULT_PREFIX = "mep"
DEFAULT_SUBNET = "10.251.0"


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS` (20 s deadline); returns stdout.

    Raises:
        RuntimeError: the command failed (with its stderr) and `check` is set.
    """
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def namespaces() -> List[str]:
    """Names of every network namespace (`ip netns list`)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def remove_stale(prefix: str = DEFAULT_PREFIX) -> None:
    """Delete namespaces of `prefix` whose creating process is gone (a run killed before its cleanup)."""
    for name in namespaces():
        found = re.fullmatch(rf"{prefix}(\d+)(?:h\d+|r\d+|hub)", name)
        if found and int(found.group(1)) != os.getpid() and not os.path.exists(f"/proc/{found.group(1)}"):
            ip("netns", "delete", name, check=False)


def tx_bytes(namespace: str, device: str) -> int:
    """Bytes `device` in `namespace` has sent so far (headers included: bytes on the wire)."""
    found = json.loads(ip("-n", namespace, "-s", "-j", "link", "show", "dev", device))
    return int(found[0]["stats64"]["tx"]["bytes"])


class Network:
    """`num_hosts` host namespaces on one bridge; a context manager that always deletes them.

    Arguments:
        num_hosts: hosts to make (1..200).
        prefix: namespace name prefix (the creating pid follows it).
        subnet: first three octets of the /24 the hosts get addresses in.

    Attributes:
        names: namespace of each host.
        devices: the veth device of each host (inside its namespace).
        addresses: the IPv4 address of each host.
        store_address: the bridge's address in the hub namespace (`<subnet>.254`), where the
            launcher's store listens (`placement`).
    """

    def __init__(self, num_hosts: int, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET):
        if not isinstance(num_hosts, int) or not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts: expected an int in [1, 200], got {num_hosts!r}")
        tag = f"{prefix}{os.getpid()}"
        self.tag = tag
        self.hub = f"{tag}hub"
        self.names = [f"{tag}h{h}" for h in range(num_hosts)]
        self.devices = [f"{tag}v{h}"[-15:] for h in range(num_hosts)]  # device names: at most 15 characters
        self.addresses = [f"{subnet}.{1 + h}" for h in range(num_hosts)]
        self.store_address = f"{subnet}.254"
        self.made: List[str] = []

    def create(self) -> "Network":
        """Make the hub with its bridge and every host with its veth; undoes itself on failure.

        Raises:
            RuntimeError / OSError / subprocess.SubprocessError: a step failed (everything made is deleted).
        """
        try:
            for name in [self.hub] + self.names:
                ip("netns", "add", name)
                self.made.append(name)
                ip("-n", name, "link", "set", "lo", "up")
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "addr", "add", f"{self.store_address}/24", "dev", "br0")
            ip("-n", self.hub, "link", "set", "br0", "up")
            for h, (name, device, address) in enumerate(zip(self.names, self.devices, self.addresses)):
                ip("-n", name, "link", "add", device, "type", "veth", "peer", "name", f"p{h}", "netns", self.hub)
                ip("-n", self.hub, "link", "set", f"p{h}", "master", "br0", "up")
                ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
                ip("-n", name, "link", "set", device, "up")
        except BaseException:
            self.delete()
            raise
        return self

    def placement(self, rank_hosts: Sequence[int], name_hosts: bool = True):
        """Where a `launch.LocalCluster` on this network puts its store and its ranks.

        Arguments:
            rank_hosts: the host of each rank, in rank order (e.g. `[0, 0, 1, 1]`).
            name_hosts: give each rank its host's namespace name as `MEP_HOST_ID` (ranks of one
                host then reach each other over shared memory); False keeps the default identity.

        Returns:
            network: a `launch.ClusterNetwork`: the store on `store_address` in the hub namespace,
                rank r in `names[rank_hosts[r]]` advertising that host's address, gloo on its veth.

        Raises:
            ValueError: a host index outside `[0, num_hosts)`.
        """
        from mooncake_ep_switch.launcher.launch import ClusterNetwork, RankPlace

        places = []
        for rank, host in enumerate(rank_hosts):
            if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < len(self.names):
                raise ValueError(f"rank_hosts[{rank}]: expected a host in [0, {len(self.names)}), got {host!r}")
            places.append(RankPlace(self.names[host], self.addresses[host], self.devices[host],
                                    self.names[host] if name_hosts else ""))
        return ClusterNetwork(self.store_address, self.hub, tuple(places))

    def set_link(self, host: int, up: bool) -> None:
        """Bring host `host`'s veth down (a link outage: its peers and the store) or up again."""
        ip("-n", self.names[host], "link", "set", self.devices[host], "up" if up else "down")

    def set_rate(self, host: int, rate: str = "", spare_store: bool = False) -> None:
        """Limit what host `host` sends on its veth to `rate` (tc's units, e.g. "256kbit"): a slow link
        with a short queue (tbf, at most 200 ms of backlog, so small packets behind a transfer still
        arrive within that); "" removes the limit.

        Arguments:
            host: the host index.
            rate: a tc rate, or "" to remove the limit.
            spare_store: leave packets to the store's address unlimited (a slow data link while the
                control plane keeps its own path, as a store on a separate management network would).

        Raises:
            ValueError: `rate` is not a tc rate.
            RuntimeError: tc failed.
        """
        if rate and not re.fullmatch(r"\d+(?:\.\d+)?(?:bit|kbit|mbit|gbit)", rate):
            raise ValueError(f"rate: expected a tc rate such as '256kbit' (or '' for none), got {rate!r}")
        device = self.devices[host]
        tc = ("netns", "exec", self.names[host], "tc")
        ip(*tc, "qdisc", "del", "dev", device, "root", check=False)
        if rate and not spare_store:
            ip(*tc, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "16kb", "latency", "200ms")
        elif rate:
            # Two htb classes (htb, not prio: some kernels lack sch_prio): packets to the store in 1:1, unlimited;
            # everything else in 1:2 (the default) behind the same tbf as above.
            ip(*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "2", "r2q", "100000")
            for klass in ("1:1", "1:2"):
                ip(*tc, "class", "add", "dev", device, "parent", "1:", "classid", klass, "htb", "rate", "10gbit")
            ip(*tc, "qdisc", "add", "dev", device, "parent", "1:2", "handle", "20:", "tbf", "rate", rate, "burst",
               "16kb", "latency", "200ms")
            ip(*tc, "filter", "add", "dev", device, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
               "ip", "dst", f"{self.store_address}/32", "flowid", "1:1")

    def tx_bytes(self, host: int) -> int:
        """Bytes host `host` has sent on its veth so far (headers included: bytes on the wire)."""
        return tx_bytes(self.names[host], self.devices[host])

    def delete(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them). Idempotent."""
        for name in reversed(self.made):
            ip("netns", "delete", name, check=False)
        self.made.clear()

    def left_behind(self) -> List[str]:
        """Namespaces of this network that still exist (empty after `delete`)."""
        return [n for n in namespaces() if n.startswith(self.tag + "h") or n == self.hub]

    def __enter__(self) -> "Network":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()
