"""The membership control plane alone at scale: ranks as threads on one TCPStore, no data plane.

`python -m mooncake_ep_switch.bench membership [--quick] [--ranks 8,16,...] [--store tcp|etcd] [--steps ...]`. Every rank
is a thread with its own store client (a TCPStore hosted in this process, or with `--store etcd` an
`EtcdStore` on a 3-member etcd cluster on loopback), wrapped as a Buffer wraps it (`BoundedStore`: every
call on a worker with a deadline) and counted (`CountingStore`). Rows, per group size R:

* death: rank 0 is dead; the other R-1 call `agree_next_view()` at once, as the survivors'
  `update_ep_member()` does (expected: the other survivors), then `max_call()` of the view;
* join: a replacement of rank 0 waits to be admitted (it is listed by `joining()`), then the R-1
  members agree again and admit it;
* pending joiners, switch decision, EPLB begin and vote, construction: `bench.control_plane_steps`.

Each row gives the wall time from the start until the last rank returned and the store operations
all ranks made in that time (setup excluded), also per rank. Prints a markdown table.

What the times measure: R ranks as threads of one process share one interpreter lock, so the CPU work of
every rank (store calls through their worker threads, decoding records) adds up on the cores this
process gets, and a step that costs each rank O(R) work costs the bench O(R^2); R processes on R cores
(production) pay only their own share. Records decoded once per process (`records.py`) are decoded
once for all the thread ranks here, once per rank in production. The store operation counts are the
same either way.
"""
import argparse
import itertools
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.protocol import Membership
from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore
from mooncake_ep_switch.launcher.launch import host_store

__all__ = ["CountingStore", "Group", "agree_after_death", "admit_joiner", "main", "run_all"]

SIZES = (8, 16, 32, 64, 128, 256)
_GROUPS = itertools.count()  # one etcd key prefix per group
QUICK_SIZES = (8, 32)


class CountingStore(dist.Store):
    """A `torch.distributed.Store` that counts the calls made on it (by name) and passes them on.

    Arguments:
        inner: the store to delegate to.
        counts: a shared `Counter` to add to (several ranks' wrappers may share one), or None for its own.
        lock: the lock guarding `counts` (shared with it), or None for its own.
    """

    def __init__(self, inner, counts: Optional[Counter] = None, lock: Optional[threading.Lock] = None):
        super().__init__()
        self.inner = inner
        self.counts = Counter() if counts is None else counts
        self._lock = threading.Lock() if lock is None else lock

    def _count(self, op: str) -> None:
        with self._lock:
            self.counts[op] += 1

    def set(self, key, value):
        self._count("set")
        return self.inner.set(key, value)

    def get(self, key):
        self._count("get")
        return self.inner.get(key)

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def add(self, key, amount):
        self._count("add")
        return self.inner.add(key, amount)

    def append(self, key, value):
        self._count("append")
        return self.inner.append(key, value)

    def delete_key(self, key):
        self._count("delete_key")
        return self.inner.delete_key(key)

    def multi_get(self, keys):
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self._count("multi_set")
        return self.inner.multi_set(keys, values)

    def num_keys(self):
        self._count("num_keys")
        return self.inner.num_keys()

    def wait(self, keys, timeout=None):
        self._count("wait")
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)


class Group:
    """R ranks' memberships on one store server, each with its own bounded, counted client.

    Arguments:
        num_ranks: R.
        prefix: the memberships' key prefix.
        etcd: None for a TCPStore hosted in this process, or a started `store.etcd_cluster.LocalEtcdCluster`
            (each rank an `EtcdStore` client of its own, under a fresh key prefix of the cluster).
    """

    def __init__(self, num_ranks: int, prefix: str = "bench", etcd=None):
        if etcd is None:
            self.server = host_store("127.0.0.1", 0, None, timeout_s=60)
        else:
            from mooncake_ep_switch.elastic import connect_store
            self.server = connect_store(etcd.url(f"{prefix}-{next(_GROUPS)}-{os.getpid()}"), timeout_s=60)
        self.etcd = etcd
        self.num_ranks, self.prefix = num_ranks, prefix
        self.counts, self.lock = Counter(), threading.Lock()
        self.bounded: List[BoundedStore] = []
        self.kept: list = []
        with ThreadPoolExecutor(16) as pool:  # connecting takes ~0.1 s a client: not one after the other
            self.members = list(pool.map(self.member, range(num_ranks)))

    def member(self, rank: int) -> Membership:
        if self.etcd is not None:
            client = self.server.clone()  # HTTP sessions of its own
        else:
            client = dist.TCPStore("127.0.0.1", self.server.port, None, False, timeout=self.server.timeout,
                                   wait_for_workers=False)
        bounded = BoundedStore(client)
        with self.lock:
            self.bounded.append(bounded)
        counted = CountingStore(bounded, self.counts, self.lock)
        membership = Membership(counted, rank, self.num_ranks, prefix=self.prefix)
        with self.lock:
            self.kept.append((client, counted))  # the Store objects PrefixStore calls into stay alive
        return membership

    def operations(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()

    def close(self) -> None:
        for bounded in self.bounded:
            bounded.close()


def run_all(calls: Dict[object, Callable[[], object]], timeout_s: float) -> Dict[object, object]:
    """Run every call on its own thread, released together; returns key -> result or exception."""
    results: Dict[object, object] = {}
    start = threading.Barrier(len(calls))

    def run(key, fn):
        start.wait(timeout_s)
        try:
            results[key] = fn()
        except Exception as error:  # noqa: BLE001 - reported to the caller
            results[key] = error

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"ranks did not return within {timeout_s} s")
    return results


def _member_call(member: Membership, current: int, expected, deadline_s: float, dead=None):
    def call():
        view = member.agree_next_view(current, expected, time.monotonic() + deadline_s, dead=dead)
        member.max_call(view.epoch, view.ranks)
        return view
    return call


def agree_after_death(group: Group, dead_rank: int = 0, deadline_s: float = 60.0) -> dict:
    """Rank `dead_rank` is dead; the others agree on the next view. Returns seconds, ops and the views."""
    survivors = [r for r in range(group.num_ranks) if r != dead_rank]
    current = group.members[survivors[0]].epoch()
    group.reset()
    started = time.monotonic()
    results = run_all({r: _member_call(group.members[r], current, survivors, deadline_s, dead=lambda: {dead_rank})
                        for r in survivors}, deadline_s + 30)
    seconds = time.monotonic() - started
    return {"seconds": seconds, "ops": group.operations(), "results": results, "counts": dict(group.counts)}


def admit_joiner(group: Group, rank: int = 0, deadline_s: float = 60.0) -> dict:
    """A replacement of `rank` waits to be admitted; the other ranks (the current view) agree and admit it."""
    members = [r for r in range(group.num_ranks) if r != rank]
    current = group.members[members[0]].epoch()
    joiner = group.members[rank] = group.member(rank)
    outcome: Dict[str, object] = {}

    def join():
        try:
            outcome["joiner"] = joiner.agree_next_view(current, (), time.monotonic() + deadline_s, joining=True)
        except Exception as error:  # noqa: BLE001 - reported to the caller
            outcome["joiner"] = error

    group.reset()
    started = time.monotonic()
    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    observer = Membership(group.server, rank, group.num_ranks, prefix=group.prefix, take_incarnation=False)
    while rank not in observer.joining(current + 1):  # an uncounted client of its own  # the members call once they see it pending
        if time.monotonic() - started > deadline_s:
            raise TimeoutError("the joiner was never listed as joining")
        time.sleep(0.001)
    results = run_all({r: _member_call(group.members[r], current, members, deadline_s) for r in members},
                       deadline_s + 30)
    thread.join(deadline_s + 30)
    seconds = time.monotonic() - started
    results[rank] = outcome.get("joiner")
    return {"seconds": seconds, "ops": group.operations(), "results": results, "counts": dict(group.counts)}


def _check(results: dict, expected: tuple) -> None:
    wrong = {r: v for r, v in results.items() if getattr(v, "ranks", None) != expected}
    if wrong:
        raise RuntimeError(f"ranks did not agree on {expected}: {dict(list(wrong.items())[:4])}")


def _check_all(results: dict, good) -> None:
    wrong = {r: v for r, v in results.items() if not good(r, v)}
    if wrong:
        raise RuntimeError(f"ranks ended otherwise than expected: {dict(list(wrong.items())[:4])}")


STEPS = ("death", "join", "joiners", "switch", "eplb", "construction")  # `--steps` names, in the order they run


def rows(sizes, etcd=None, steps=STEPS) -> List[dict]:
    """Measure each size (on the etcd cluster `etcd`, or a TCPStore when None); returns one dict per (size,
    scenario). `steps`: the names of `STEPS` to run (a joiner is admitted after a death: "join" runs "death")."""
    from mooncake_ep_switch.bench import control_plane_steps as cp
    found = []
    for size in sizes:
        group = Group(size, etcd=etcd)
        try:
            if "death" in steps or "join" in steps:
                death = agree_after_death(group)
                _check(death["results"], tuple(range(1, size)))
                found.append({"R": size, "step": "view after a death", "seconds": death["seconds"], "ops": death["ops"]})
            if "join" in steps:
                join = admit_joiner(group)
                _check(join["results"], tuple(range(size)))
                found.append({"R": size, "step": "joiner admitted", "seconds": join["seconds"], "ops": join["ops"]})
            if "joiners" in steps:
                listed = cp.pending_joiners(group)
                _check_all(listed["results"], lambda r, v: v == [0])
                found.append({"R": size, "step": "pending joiners listed", "seconds": listed["seconds"],
                              "ops": listed["ops"]})
            if "switch" in steps:
                switch = cp.switch_decision(group)
                _check_all(switch["results"], lambda r, v: v == 1)
                found.append({"R": size, "step": "switch decision", "seconds": switch["seconds"], "ops": switch["ops"]})
            if "eplb" in steps:
                vote = cp.eplb_vote(group)
                _check_all(vote["results"], lambda r, v: isinstance(v, tuple) and v[:2] == (1, size - 1))
                _check_all(vote["begin"]["results"], lambda r, v: v == 0)
                found.append({"R": size, "step": "EPLB begin", "seconds": vote["begin"]["seconds"],
                              "ops": vote["begin"]["ops"]})
                found.append({"R": size, "step": "EPLB vote", "seconds": vote["seconds"], "ops": vote["ops"]})
            if "construction" in steps:
                built = cp.construction(group)
                hosts = cp.expected_hosts(size)
                _check_all(built["results"], lambda r, v: v == hosts[r])
                found.append({"R": size, "step": "construction", "seconds": built["seconds"], "ops": built["ops"]})
        finally:
            group.close()
        print(f"R={size} done", file=sys.stderr, flush=True)
    return found


def main(argv=None) -> int:
    """Print the membership control plane's table (see the module docstring).

    Arguments:
        argv: command-line arguments (`--quick`, `--ranks 8,16`, `--steps construction`), default `sys.argv[1:]`.

    Returns:
        exit status 0.
    """
    parser = argparse.ArgumentParser(prog="python -m mooncake_ep_switch.bench membership")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} only")
    parser.add_argument("--ranks", default=None, help="comma-separated group sizes (default 8..256)")
    parser.add_argument("--store", choices=("tcp", "etcd"), default="tcp",
                        help="a TCPStore in this process (default) or a 3-member etcd cluster on loopback")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated steps to run, of {','.join(STEPS)} (default all; join runs death)")
    args = parser.parse_args(argv)
    sizes = [int(v) for v in args.ranks.split(",")] if args.ranks else (QUICK_SIZES if args.quick else SIZES)
    steps = [v.strip() for v in args.steps.split(",") if v.strip()]
    unknown = [v for v in steps if v not in STEPS]
    if unknown or not steps:
        parser.error(f"--steps: expected names of {','.join(STEPS)}, got {args.steps!r}")
    print(f"| R | step ({args.store}) | seconds | store ops | ops per rank |")
    print("|---|---|---|---|---|")

    def show(found):
        for row in found:
            print(f"| {row['R']} | {row['step']} | {row['seconds']:.3f} | {row['ops']} | {row['ops'] / row['R']:.1f} |",
                  flush=True)

    if args.store == "tcp":
        show(rows(sizes, steps=steps))
        return 0
    from mooncake_ep_switch.store.etcd_cluster import LocalEtcdCluster
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with LocalEtcdCluster(3, data_root=shm) as cluster:
        show(rows(sizes, etcd=cluster, steps=steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
