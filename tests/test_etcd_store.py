"""EtcdStore against a real 3-member etcd cluster on loopback ports (issue 38 items 1 and 2).

Every operation is checked against torch's own HashStore running the same script (the reference);
timeouts; a member killed between operations, the leader killed during a compare_set race (exactly
one winner per key); failover past a dead endpoint; the quorum lost (two members stopped) and
restored; and the bad inputs of `elastic.connect_store`, each a clear error within the connect
timeout with nothing written. The cluster is the session's (`etcd_cluster` in conftest.py); a test
that kills or stops a member brings it back before it ends.
"""
import os
import re
import signal
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.store_deadline import BoundedStore, store_deadline
from mooncake_ep_switch.elastic import connect_store
from mooncake_ep_switch.errors import StoreUnavailable
from mooncake_ep_switch.store.etcd_client import b64
from tests import harness

SLACK_S = 2.0  # scheduling slack on a loaded 2-core box


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def _total_keys(cluster) -> int:
    """Every key of the cluster (all jobs), read from a running member."""
    for index, process in enumerate(cluster.processes):
        if process is not None and process.poll() is None:
            reply = cluster._request(index, "/v3/kv/range", {"key": b64(b"\0"), "range_end": b64(b"\0"),
                                                             "count_only": True}, timeout_s=5)
            return int(reply.get("count", 0) or 0)
    raise AssertionError("no member running")


@pytest.fixture
def store(etcd_cluster):
    # request_s=1: a call in flight to a follower when the leader dies is sent again after 1 s, not 3
    return connect_store(etcd_cluster.url(_prefix()) + "?request_s=1", timeout_s=20, job="tests")


def _script(s, full=True):
    out = []
    s.set("a", b"1")
    out += [s.get("a"), s.check(["a"]), s.check(["a", "b"])]
    out += [s.compare_set("a", b"1", b"2"), s.compare_set("a", b"1", b"3"), s.get("a")]
    out += [s.compare_set("b", b"", b"new"), s.compare_set("c", b"x", b"y"), s.check(["c"])]
    s.set("e", b"")
    out += [s.compare_set("e", b"", b"filled"), s.get("e")]
    out += [s.add("n", 5), s.add("n", -2), s.get("n")]
    s.append("l", b"ab")
    s.append("l", b"cd")
    out.append(s.get("l"))
    s.multi_set(["m1", "m2"], [b"x", b"y"])
    out.append(s.multi_get(["m1", "m2", "a"]))
    if full:  # torch's PrefixStore does not pass these two on to a Python Store
        out += [s.num_keys(), s.delete_key("m1"), s.delete_key("m1"), s.check(["m1"]), s.num_keys()]
    return out


def test_every_operation_answers_as_torchs_hashstore(store):
    expected = _script(dist.HashStore())
    assert _script(store) == expected
    # Through the wrappers the runtime puts around a group's store (a BoundedStore under a PrefixStore).
    bounded = BoundedStore(store)
    try:
        assert _script(dist.PrefixStore("grp", bounded), full=False) == _script(dist.PrefixStore("grp", dist.HashStore()),
                                                                                  full=False)
    finally:
        bounded.close()
    assert store.get("grp/a") == b"2", "the PrefixStore's keys are the etcd store's keys"


def test_an_add_whose_answer_was_lost_is_applied_once(store, monkeypatch):
    """The member applied the add, its answer never came: the retry (on another member) finds the result
    the first attempt left and returns it instead of adding again."""
    import importlib

    client = importlib.import_module("etcd3gw.client")  # (etcd3gw's package also has a function `client`)
    exceptions = importlib.import_module("etcd3gw.exceptions")
    real, lost = client.Etcd3Client.post, []

    def post(self, url, *args, json=None, **kwargs):
        reply = real(self, url, *args, json=json, **kwargs)
        if url.endswith("/kv/txn") and "lease" in str(json) and not lost:
            lost.append(url)
            raise exceptions.ConnectionTimeoutError("the answer was lost")
        return reply

    store.add("n", 1)
    monkeypatch.setattr(client.Etcd3Client, "post", post)
    assert store.add("n", 1) == 2 and lost
    store.append("s", b"ab")
    monkeypatch.undo()
    assert store.get("n") == b"2" and store.get("s") == b"ab"


def test_waits_end_at_their_timeout_and_when_the_key_comes(store):
    store.set_timeout(timedelta(seconds=0.3))
    for call in (lambda: store.get("missing"), lambda: store.multi_get(["missing"]),
                 lambda: store.wait(["missing"]), lambda: store.wait(["missing"], timedelta(seconds=0.2))):
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=r"the etcd store etcd://.*timed out.*missing"):
            call()
        assert 0.15 <= time.monotonic() - start < 0.3 + SLACK_S
    store.set_timeout(timedelta(seconds=20))
    setter = threading.Timer(0.3, lambda: store.clone().set("late", b"v"))
    start = time.monotonic()
    setter.start()
    try:
        assert store.get("late") == b"v"
        store.wait(["late"], timedelta(seconds=5))
    finally:
        setter.join()
    assert time.monotonic() - start < 0.3 + SLACK_S


def test_a_member_killed_between_operations(etcd_cluster, store):
    """The store's first endpoint is killed between two operations (the leader is killed during a race
    below, and the quorum lost under real Buffers in tests/test_store_stall.py)."""
    store.set("before", b"1")
    etcd_cluster.kill(0)
    try:
        start = time.monotonic()
        assert store.get("before") == b"1"
        assert store.compare_set("cas", b"", b"mine") == b"mine"
        assert store.add("count", 2) == 2
        store.set("after", b"x")
        assert store.multi_get(["before", "after"]) == [b"1", b"x"]
        assert time.monotonic() - start < 5 + SLACK_S, "failover took longer than an election"
    finally:
        etcd_cluster.restart(0)
    assert store.add("count", 2) == 4


def test_exactly_one_winner_of_a_compare_set_race_while_the_leader_dies(etcd_cluster):
    prefix, threads_n, keys = _prefix(), 6, 8
    base = connect_store(etcd_cluster.url(prefix), timeout_s=20, job="race")
    endpoints = etcd_cluster.endpoints
    stores = []
    for t in range(threads_n):  # each thread's first endpoint differs
        rotated = endpoints[t % 3:] + endpoints[:t % 3]
        # A call in flight to a follower when the leader dies waits for the election: give up on it after 1 s.
        stores.append(connect_store(f"etcd://{','.join(rotated)}/{prefix}?request_s=1", timeout_s=20, job="race"))
    results = [[None] * keys for _ in range(threads_n)]
    errors = []
    progress = threading.Semaphore(0)
    start = threading.Barrier(threads_n)

    def contend(t):
        try:
            start.wait(10)
            for k in range(keys):
                results[t][k] = stores[t].compare_set(f"k{k}", b"", f"t{t}".encode())
                progress.release()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    workers = [threading.Thread(target=contend, args=(t,)) for t in range(threads_n)]
    for worker in workers:
        worker.start()
    for _ in range(threads_n * 2):  # a quarter of the way in
        assert progress.acquire(timeout=30)
    leader = etcd_cluster.leader()
    etcd_cluster.kill(leader)
    try:
        for worker in workers:
            worker.join(60)
        assert not errors and not any(w.is_alive() for w in workers), errors
        for k in range(keys):
            winners = [t for t in range(threads_n) if results[t][k] == f"t{t}".encode()]
            assert len(winners) == 1, (k, [results[t][k] for t in range(threads_n)])
            stored = base.get(f"k{k}")
            assert {results[t][k] for t in range(threads_n)} == {stored} == {f"t{winners[0]}".encode()}
    finally:
        etcd_cluster.restart(leader)


def test_failover_past_a_dead_endpoint_and_a_deadline_without_quorum(etcd_cluster):
    prefix = _prefix()
    # A port nobody listens on, first in the list, held bound for the whole test: freed, it could be taken by a
    # member of another test's etcd cluster (they start on free ports), which would answer for a dead endpoint.
    with socket_pair() as (dead, _):
        _failover_and_deadline(etcd_cluster, prefix, dead)


def _failover_and_deadline(etcd_cluster, prefix, dead):
    start = time.monotonic()
    store = connect_store(f"etcd://127.0.0.1:{dead},{','.join(etcd_cluster.endpoints)}/{prefix}", timeout_s=10,
                          job="q")
    store.set("k", b"1")
    assert store.get("k") == b"1" and time.monotonic() - start < 1 + SLACK_S
    # Two of three members stopped: no quorum. A membership operation's deadline ends the call with an error
    # naming the store (under real Buffers, and with the quorum back: tests/test_store_stall.py).
    bounded = BoundedStore(store)
    stopped = [etcd_cluster.leader()]
    stopped.append((stopped[0] + 1) % 3)
    for index in stopped:  # returns once stopped: kill() only queues SIGSTOP (CI saw the members answer, state 'R')
        harness.stop_process(etcd_cluster.processes[index].pid)
    try:
        begin = time.monotonic()
        try:
            with store_deadline(time.monotonic() + 0.5, "update_ep_member"):
                got = bounded.compare_set("k", b"1", b"2")
        except StoreUnavailable as error:
            caught = error
        else:  # seen once in CI (cause unknown): say what came back and whether the members were really stopped
            connection = store.connection
            pytest.fail(f"compare_set returned {got!r} after {time.monotonic() - begin:.3f} s without a quorum "
                        f"(last answer from {connection.endpoints[connection.preferred]}, the dead endpoint "
                        f"127.0.0.1:{dead}, the members {etcd_cluster.endpoints}); "
                        f"stopped members {stopped} (leader first), their states "
                        f"{[_process_state(etcd_cluster.processes[i].pid) for i in stopped]}, pids "
                        f"{[etcd_cluster.processes[i].pid for i in stopped]}")
        assert re.search(rf"etcd://.*{prefix}.*update_ep_member", str(caught)), str(caught)
        assert time.monotonic() - begin < 0.5 + SLACK_S and prefix in caught.store
    finally:
        for index in stopped:
            os.kill(etcd_cluster.processes[index].pid, signal.SIGCONT)
        bounded.close()


def _process_state(pid: int) -> str:
    """The state letter of `pid` in /proc (T: stopped), or why it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError as error:
        return type(error).__name__


@pytest.mark.parametrize("url, part", [
    ("etcd://", "no key prefix"),
    ("etcd://127.0.0.1:2379", "no key prefix"),
    ("etcd://127.0.0.1/job", "is not host:port"),
    ("etcd://127.0.0.1:99999/job", "is not host:port"),
    ("etcd://h:1,h:1/job", "named twice"),
    ("etcd://user@h:1/job", "user:password@"),
    ("etcd://h:1/job?color=red", "unknown option 'color'"),
    ("etcd://h:1/bad prefix", "may only hold"),
    ("http://h:1/job", "scheme must be etcd"),
])
def test_a_malformed_url_is_refused_naming_the_argument(url, part):
    with pytest.raises(ValueError, match=r"^host: expected an etcd URL etcd://") as caught:
        connect_store(url)
    assert part in str(caught.value)


def test_bad_input_is_refused_within_the_timeout_with_nothing_written(etcd_cluster):
    before = _total_keys(etcd_cluster)
    with pytest.raises(ValueError, match="port: expected None with an etcd URL"):
        connect_store(etcd_cluster.url("p"), 2379)
    with pytest.raises(ValueError, match="user: given both"):
        connect_store("etcd://a:b@h:1/p", user="a")
    with pytest.raises(ValueError, match="certificates need HTTPS"):
        connect_store("etcd://h:1/p", ca_cert=__file__)
    with pytest.raises(ValueError, match="host: option request_s: expected a number of seconds > 0, got 'x'"):
        connect_store("etcd://h:1/p?request_s=x")
    with pytest.raises(FileNotFoundError, match="cert: no such file"):
        connect_store("etcds://h:1/p", cert="/nonexistent.pem", key="/nonexistent.key")
    # An unreachable cluster: every endpoint refused until the connect timeout, naming the store.
    with socket_pair() as (a, b):
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match=rf"etcd://127.0.0.1:{a},127.0.0.1:{b} did not answer connect"):
            connect_store(f"etcd://127.0.0.1:{a},127.0.0.1:{b}/p", timeout_s=1)
        assert 1 <= time.monotonic() - start < 1 + SLACK_S
    assert _total_keys(etcd_cluster) == before
    # A prefix another job claimed: refused, nothing written; the same job connects again (a replacement).
    prefix = _prefix()
    connect_store(etcd_cluster.url(prefix), timeout_s=5, job="job-a").set("x", b"1")
    claimed = _total_keys(etcd_cluster)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^host: the prefix '{prefix}' .* is used by another job \('job-a'"):
        connect_store(etcd_cluster.url(prefix), timeout_s=5, job="job-b")
    with pytest.raises(ValueError, match="used by another job"):
        connect_store(etcd_cluster.url(prefix), timeout_s=5)  # no identity at all
    assert time.monotonic() - start < 5
    assert connect_store(etcd_cluster.url(prefix) + "?job=job-a", timeout_s=5).get("x") == b"1"
    assert _total_keys(etcd_cluster) == claimed


class socket_pair:
    """Two loopback ports nobody listens on (bound, never listening, closed at the end)."""

    def __enter__(self):
        import socket

        self.sockets = [socket.socket(), socket.socket()]
        for sock in self.sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in self.sockets]

    def __exit__(self, *exc):
        for sock in self.sockets:
            sock.close()


def test_wrong_credentials_are_refused_and_right_ones_work(etcd_cluster):
    def gateway(path, payload, token=None):
        import json
        import urllib.request

        request = urllib.request.Request(f"http://{etcd_cluster.endpoints[0]}/v3/{path}", json.dumps(payload).encode(),
                                         {"Authorization": token} if token else {})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    gateway("auth/role/add", {"name": "root"})
    gateway("auth/user/add", {"name": "root", "password": "sesame"})
    gateway("auth/user/grant", {"user": "root", "role": "root"})
    gateway("auth/enable", {})
    try:
        hosts = ",".join(etcd_cluster.endpoints)
        before = _total_keys_as_root(gateway)
        start = time.monotonic()
        with pytest.raises(PermissionError, match=r"etcd://.*refused connect .*authentication failed.*user:password@"):
            connect_store(f"etcd://root:wrong@{hosts}/{_prefix()}", timeout_s=5)
        assert time.monotonic() - start < 5
        with pytest.raises(PermissionError, match="authentication failed"):
            connect_store(f"etcd://{hosts}/{_prefix()}", timeout_s=5, user="nobody", password="x")
        assert _total_keys_as_root(gateway) == before
        store = connect_store(f"etcd://root:sesame@{hosts}/{_prefix()}", timeout_s=5, job="auth")
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.add("n", 3) == 3
        store.connection._token = "expired.token"  # as after etcd's token TTL: logs in again, once
        assert store.get("k") == b"v" and store.connection._token != "expired.token"
    finally:
        token = gateway("auth/authenticate", {"name": "root", "password": "sesame"})["token"]
        gateway("auth/disable", {}, token)
        gateway("auth/user/delete", {"name": "root"})
        gateway("auth/role/delete", {"role": "root"})


def _total_keys_as_root(gateway) -> int:
    token = gateway("auth/authenticate", {"name": "root", "password": "sesame"})["token"]
    reply = gateway("kv/range", {"key": b64(b"\0"), "range_end": b64(b"\0"), "count_only": True}, token)
    return int(reply.get("count", 0) or 0)


def test_members_die_with_a_sigkilled_starter_and_its_data_is_removed_later(tmp_path):
    """A process that started a cluster is SIGKILLed: its members end with it (setpriv --pdeathsig), and
    the next cluster started in the same directory removes the orphaned data."""
    import subprocess
    import sys

    from mooncake_ep_switch.store import LocalEtcdCluster

    pytest.importorskip("etcd3gw")
    if not __import__("shutil").which("setpriv"):
        pytest.skip("util-linux's setpriv is not installed")
    import mooncake_ep_switch.store.etcd_cluster as module

    # The module alone (it imports nothing of the package): no torch import in the starter.
    code = ("import importlib.util as u, time; "
            f"s = u.spec_from_file_location('etcd_cluster', {module.__file__!r}); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); "
            f"c = m.LocalEtcdCluster(1, data_root={str(tmp_path)!r}).start(); "
            "print(c.processes[0].pid, c.directory, flush=True); time.sleep(120)")
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, directory = starter.stdout.readline().split()
    finally:
        starter.kill()
        starter.wait(10)
        starter.stdout.close()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, f"etcd member {pid} outlived the process that started it"
        time.sleep(0.02)
    assert os.path.isdir(directory)
    with LocalEtcdCluster(1, data_root=str(tmp_path)) as cluster:
        assert not os.path.exists(directory) and os.path.isdir(cluster.directory)
    assert os.listdir(tmp_path) == []


def test_the_store_bench_measures_both_stores(etcd_cluster):
    """`bench store` on the session's cluster, tiny: every operation timed on both stores, and the
    membership steps agreed (the bench raises otherwise) on both."""
    from mooncake_ep_switch.bench import store_bench

    found = store_bench.rows(etcd_cluster.url(_prefix()), n=3, ranks=2)
    steps = {(row["store"], row["what"]) for row in found}
    for kind in ("tcp", "etcd"):
        assert {(kind, name) for name in ("set", "get", "check", "compare_set", "add")} <= steps
        assert (kind, "replacement admitted, R=2") in steps and (kind, "view after a death, R=2") in steps
    assert all(row["seconds"] > 0 for row in found)


def test_gloo_rendezvous_over_the_etcd_store(etcd_cluster):
    """gloo builds a group over a PrefixStore of the etcd store (the collective fallback builds one per
    view that way): two ranks (threads), each with its own client, all-reduce."""
    import torch

    url = etcd_cluster.url(_prefix())
    stores = [connect_store(url, timeout_s=20, job="gloo") for _ in range(2)]
    out, errors = {}, []

    def rank(r):
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("grp/1", stores[r]), r, 2, timedelta(seconds=20))
            value = torch.tensor([r + 1.0])
            group.allreduce([value]).wait()
            out[r] = value.item()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and out == {0: 3.0, 1: 3.0}, (errors, out)


def test_adds_of_one_process_threads_to_one_key_are_applied_together_each_once(store, monkeypatch):
    """32 threads (ranks as threads) add to one counter at once: each gets its own distinct result, the counter ends
    at the sum, and their swaps were combined (fewer transactions than one swap per add); appends too."""
    import threading

    from mooncake_ep_switch.store.etcd_store import EtcdStore

    real, sent = EtcdStore._txn, []

    def txn(self, compare, success, failure, deadline, what):
        if what in ("add", "append"):
            sent.append(what)
        return real(self, compare, success, failure, deadline, what)

    monkeypatch.setattr(EtcdStore, "_txn", txn)
    clients = [store.clone() for _ in range(32)]
    results, start = {}, threading.Barrier(32)

    def add(rank):
        start.wait(30)
        results[rank] = clients[rank].add("tally", 1)
        clients[rank].append("log", f"{rank},")

    threads = [threading.Thread(target=add, args=(r,)) for r in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for client in clients:
        client.close()
    assert sorted(results.values()) == list(range(1, 33))
    assert store.get("tally") == b"32"
    assert sorted(int(r) for r in store.get("log").decode().strip(",").split(",")) == list(range(32))
    assert len(sent) < 2 * 2 * 32  # a swap per add and per append, each a snapshot and a compare-and-swap, before


def test_an_add_whose_deadline_passes_inside_a_swap_in_flight_gets_that_swaps_outcome(store, monkeypatch):
    """A caller whose add waits behind another thread's swap gets StoreUnavailable at its deadline only while its
    add was not taken (not applied); once a swap in flight holds it, it waits for that swap's answer (its add may
    be applied: an error then would hide it)."""
    from mooncake_ep_switch.store import etcd_store

    real, gates, entered = etcd_store.EtcdStore._swap, [threading.Event(), threading.Event()], threading.Semaphore(0)
    calls = []

    def swap(self, key, changes, what, deadline):
        calls.append(len(changes))
        entered.release()
        assert gates[min(len(calls) - 1, 1)].wait(30)
        return real(self, key, changes, what, deadline)

    monkeypatch.setattr(etcd_store.EtcdStore, "_swap", swap)
    short = store.clone()
    short.set_timeout(timedelta(seconds=0.5))
    results = {}

    def add(name, client):
        try:
            results[name] = client.add("n", 1)
        except StoreUnavailable as error:
            results[name] = error

    def queued():
        return etcd_store._CHANGES.waiting()

    first = threading.Thread(target=add, args=("first", store))
    first.start()
    assert entered.acquire(timeout=30)  # the first add's swap is in flight
    late = threading.Thread(target=add, args=("late", short))
    late.start()
    late.join(30)  # waited 0.5 s behind it, never taken: not applied
    assert isinstance(results["late"], StoreUnavailable) and queued() == 0
    held = threading.Thread(target=add, args=("held", short))
    held.start()
    stop = time.monotonic() + 30
    while queued() != 1:
        assert time.monotonic() < stop
        time.sleep(0.001)
    gates[0].set()  # the first swap answers; its thread takes the waiting add into a second swap, held open
    assert entered.acquire(timeout=30)
    held.join(2.0)  # past its 0.5 s deadline it still waits for that swap
    assert held.is_alive() and calls == [1, 1]
    gates[1].set()
    held.join(30), first.join(30)
    assert results["first"] == 1 and results["held"] == 2 and store.get("n") == b"2"
    short.close()
