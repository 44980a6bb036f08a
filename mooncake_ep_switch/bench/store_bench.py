"""The control plane's store: TCPStore against an etcd cluster, same run (issue 38, bench).

`python -m mooncake_ep_switch.bench store [--quick] [--ranks 8]` starts a local 3-member etcd cluster
(`store.LocalEtcdCluster`, data on /dev/shm where there is one) beside a TCPStore and prints, for
each: the median latency of every store operation the runtime uses (one client, one thread), then
the membership steps of `bench.membership_bench` at R ranks (threads, each with its own bounded,
counted client): the view agreed after a death, and a replacement's admission.
"""
import argparse
import os
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

from mooncake_ep_switch.bench.membership_bench import CountingStore, Group, admit_joiner, agree_after_death
from mooncake_ep_switch.buffer.membership.protocol import Membership
from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore
from mooncake_ep_switch.elastic import connect_store
from mooncake_ep_switch.launcher.launch import host_store

__all__ = ["EtcdGroup", "main", "op_latencies", "rows"]


def op_latencies(store, n: int) -> Dict[str, float]:
    """Median seconds of each store operation over `n` calls on `store` (keys under "lat/")."""
    store.set("lat/k", b"v")
    ops: Dict[str, Callable[[int], object]] = {
        "set": lambda i: store.set(f"lat/s{i}", b"v"),
        "get": lambda i: store.get("lat/k"),
        "check": lambda i: store.check(["lat/k"]),
        "compare_set": lambda i: store.compare_set("lat/k", b"v", b"v"),
        "add": lambda i: store.add("lat/n", 1),
        "multi_get (8 keys)": lambda i: store.multi_get(["lat/k"] * 8),
        "multi_set (8 keys)": lambda i: store.multi_set([f"lat/m{j}" for j in range(8)], [b"x"] * 8),
    }
    found = {}
    for name, call in ops.items():
        times = []
        for i in range(n):
            start = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - start)
        found[name] = statistics.median(times)
    return found


class EtcdGroup(Group):
    """`membership_bench.Group` on an etcd store: R ranks' memberships, each with its own client.

    Arguments:
        num_ranks: R.
        url: the etcd store's URL (`etcd://.../prefix`).
        prefix: the membership key prefix.
    """

    def __init__(self, num_ranks: int, url: str, prefix: str = "bench"):  # pylint: disable=super-init-not-called
        self.url = url
        self.server = connect_store(url, timeout_s=60, job="store-bench")  # the observers' client
        self.num_ranks, self.prefix = num_ranks, prefix
        self.counts, self.lock = Counter(), threading.Lock()
        self.bounded: List[BoundedStore] = []
        self.kept: list = []
        with ThreadPoolExecutor(16) as pool:
            self.members = list(pool.map(self.member, range(num_ranks)))

    def member(self, rank: int) -> Membership:
        client = connect_store(self.url, timeout_s=60, job="store-bench")
        bounded = BoundedStore(client)
        counted = CountingStore(bounded, self.counts, self.lock)
        with self.lock:
            self.bounded.append(bounded)
            self.kept.append((client, counted))  # the Store objects PrefixStore calls into stay alive
        return Membership(counted, rank, self.num_ranks, prefix=self.prefix)


def _membership_rows(kind: str, group: Group, ranks: int) -> List[dict]:
    found = []
    try:
        for what, step, expected in (("view after a death", agree_after_death, tuple(range(1, ranks))),
                                     ("replacement admitted", admit_joiner, tuple(range(ranks)))):
            result = step(group)
            wrong = {r: v for r, v in result["results"].items() if getattr(v, "ranks", None) != expected}
            if wrong:
                raise RuntimeError(f"{kind} store, {what}: ranks did not agree on {expected}: {wrong}")
            found.append({"store": kind, "what": f"{what}, R={ranks}", "seconds": result["seconds"],
                          "ops": result["ops"]})
    finally:
        group.close()
    return found


def rows(url: str, n: int = 200, ranks: int = 8) -> List[dict]:
    """Measure the TCPStore and the etcd store at `url`; one dict per (store, step).

    Arguments:
        url: an etcd store URL with a prefix of its own (`etcd://h:p,.../prefix`).
        n: calls per operation for the latencies.
        ranks: R of the membership steps.

    Returns:
        rows: dicts with "store", "what", "seconds" and, for membership steps, "ops".

    Raises:
        RuntimeError: the ranks of a membership step did not all agree on the expected view.
    """
    found = []
    server = host_store("127.0.0.1", 0, None, timeout_s=60)
    etcd = connect_store(url, timeout_s=60, job="store-bench")
    for kind, store in (("tcp", server), ("etcd", etcd)):
        for name, seconds in op_latencies(store, n).items():
            found.append({"store": kind, "what": name, "seconds": seconds})
    found += _membership_rows("tcp", Group(ranks), ranks)
    found += _membership_rows("etcd", EtcdGroup(ranks, url), ranks)
    return found


def main(argv: Optional[list] = None) -> int:
    """Start a local etcd cluster, print the table (see the module docstring).

    Arguments:
        argv: command-line arguments (`--quick`, `--ranks R`), default `sys.argv[1:]`.

    Returns:
        exit status 0.
    """
    from mooncake_ep_switch.store import LocalEtcdCluster

    parser = argparse.ArgumentParser(prog="python -m mooncake_ep_switch.bench store")
    parser.add_argument("--quick", action="store_true", help="50 calls per operation instead of 200")
    parser.add_argument("--ranks", type=int, default=8, help="R of the membership steps (default 8)")
    args = parser.parse_args(argv)
    with LocalEtcdCluster(3, data_root="/dev/shm" if os.path.isdir("/dev/shm") else None) as cluster:
        found = rows(cluster.url("store-bench"), 50 if args.quick else 200, args.ranks)
    print("| store | what | ms | store ops |")
    print("|---|---|---|---|")
    for row in found:
        ops = row.get("ops", "")
        print(f"| {row['store']} | {row['what']} | {row['seconds'] * 1e3:.3f} | {ops} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
