"""The shared multi-rank harness: persistent local clusters per size, fresh ones for fault tests.

`cluster(num_ranks)` returns a cached `LocalCluster` (spawned once per size and environment);
`run(num_ranks, function, ...)` runs an importable function on every rank and raises with every
failed rank's traceback. Fault tests use `fresh_cluster()` so that killed ranks do not poison the
cached ones. Every run has a deadline.
"""
import os
import select
import signal
import subprocess
import sys
import time
from typing import Dict, Optional

from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes
from mooncake_ep_switch.models.tiny import RANK_MODULES

_CLUSTERS: Dict[tuple, LocalCluster] = {}

# Ranks are forked from one server that imported torch and the runtime once per test session
# (`LocalCluster(preload=True)`): a cluster starts in ~0.1 s instead of seconds of imports per rank.
# MEP_TEST_SPAWN=1 starts every rank as a fresh interpreter instead (as a user's job does).
PRELOAD = os.environ.get("MEP_TEST_SPAWN", "") != "1"
# That server also imports the transformers modules of the tiny models (once per pytest worker, ~3 s of CPU):
# a rank that builds one (tests/test_models_serve.py) does not import them again (~3-5 s of CPU per rank);
# and the switch and EPLB packages (~0.3 s of CPU per rank that uses them).
PRELOAD_MODULES = RANK_MODULES + ("mooncake_ep_switch.switch", "mooncake_ep_switch.eplb")

# Per-run deadline: generous for 8 ranks on 2 cores, small enough that a hang fails fast.
DEFAULT_TIMEOUT_S = float(os.environ.get("MEP_TEST_RUN_TIMEOUT_S", "120"))

# `timeout_us` of dispatch/combine in the fault tests: how long a survivor waits for a dead peer.
# A live peer must never miss it, even when 4-8 ranks share 2 cores with other work (1.5 s was
# missed once under a load average far above the core count), and every survivor must return
# within it plus FAULT_SLACK_S. Over the Transfer Engine a write to a freshly killed peer can take
# up to ~1 s to fail and puts to peers are serial, so a healthy sender can be ~2 s late: TE waits more.
FAULT_TIMEOUT_US = 2_500_000
FAULT_TIMEOUT_US_TE = 4_000_000
FAULT_SLACK_S = 2.0


def cluster(num_ranks: int, env: Optional[Dict[str, str]] = None) -> LocalCluster:
    """A cached cluster of `num_ranks` ranks with `env`; rebuilt if a previous run broke it."""
    key = (num_ranks, tuple(sorted((env or {}).items())))
    existing = _CLUSTERS.get(key)
    if existing is not None and not existing.broken:
        return existing
    if existing is not None:
        existing.close()
    created = LocalCluster(num_ranks, env=env, preload=PRELOAD, preload_replacements=PRELOAD,
                           preload_modules=PRELOAD_MODULES)
    _CLUSTERS[key] = created
    return created


def open_fds() -> set:
    """(fd, what it names) of every descriptor open in this process. Leak checks compare the pairs opened since
    (`after - before`), never the whole list: in a test worker that ran other tests, the collector or another
    test's thread may close descriptors of theirs meanwhile; a descriptor left open is a new pair even where it
    reuses a number closed meanwhile."""
    pairs = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            pairs.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor, or another thread's)
    return pairs


def run(num_ranks: int, function, *args, env=None, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
    """Run `function(ctx, *args, **kwargs)` on every rank of a cached cluster; return the values."""
    return check_outcomes(cluster(num_ranks, env).run(function, *args, timeout_s=timeout_s, **kwargs))


def fresh_cluster(num_ranks: int, env: Optional[Dict[str, str]] = None, network=None, store: str = "tcp") -> LocalCluster:
    """A new cluster for a test that kills ranks (or spreads its ranks over the network namespaces of
    a `launch.ClusterNetwork`, tests/netns.py); use it in a `with` block. `store`: "tcp" (the launcher's
    TCPStore) or an etcd URL (`etcd_store`)."""
    return LocalCluster(num_ranks, env=env, network=network, preload=PRELOAD,
                        preload_replacements=PRELOAD, store=store, preload_modules=PRELOAD_MODULES)


def etcd_store(request, kind: str = "etcd") -> str:
    """`fresh_cluster`'s `store` for a test parametrised over the stores: "tcp" for `kind` "tcp", else the
    URL of the session's etcd cluster (the `etcd_cluster` fixture: skipped where etcd is not installed)
    on a prefix of its own, each member given up on after 1 s."""
    if kind == "tcp":
        return "tcp"
    etcd = request.getfixturevalue("etcd_cluster")
    return etcd.url(f"t-{os.getpid()}-{time.monotonic_ns()}") + "?request_s=1"


def close_all() -> None:
    """Stop every cached cluster."""
    for created in _CLUSTERS.values():
        created.close()
    _CLUSTERS.clear()


# Objects a multi-step test keeps in each rank process between `cluster.run` calls (the rank
# functions of one test read and write it; `rank_teardown` empties it).
RANK_STATE: Dict[str, object] = {}


def rank_teardown(ctx) -> bool:
    """Rank function: destroy the Buffer kept in `RANK_STATE` (if any) and forget everything."""
    buffer = RANK_STATE.pop("buffer", None)
    if buffer is not None:
        buffer.destroy()
    RANK_STATE.clear()
    return True


def thread_group_fixture(num_ranks: int, prefix: str):
    """A module-scoped pytest fixture named `group`: `num_ranks` ranks as threads on an in-process TCPStore, each
    with its own bounded, counted client (the scale bench's `membership_bench.Group`, keys under `prefix`),
    closed after the module. Use as `group = harness.thread_group_fixture(2, "name")` in a test module."""
    import pytest

    @pytest.fixture(scope="module", name="group")
    def group():
        from mooncake_ep_switch.bench.membership_bench import Group

        built = Group(num_ranks, prefix=prefix)
        yield built
        built.close()

    return group


def outcome_value(outcome):
    """The value of one rank's `Outcome`, asserting that the rank succeeded."""
    assert outcome.ok, outcome.error
    return outcome.value


def wait_until(condition, timeout_s: float = 30.0) -> None:
    """Poll `condition()` every millisecond until it is true; fail the test after `timeout_s`."""
    stop = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < stop, "condition not reached"
        time.sleep(0.001)


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Return once every thread of process `pid` is stopped (SIGSTOP); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # a thread that ended meanwhile
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once it is stopped: kill() only queues the signal, and on a loaded host
    the process may run on (answer a write, beat a heartbeat) for a while after it returned."""
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid, timeout_s)


_STORE_HOST = """
import sys
from mooncake_ep_switch.launcher.launch import host_store
store = host_store("127.0.0.1", 0, None, timeout_s=60)
print(store.port, flush=True)
sys.stdin.read()  # until the test closes the pipe (or dies)
"""


class StoreHost:
    """A TCPStore hosted by a process of its own (`launch.host_store`), which a test stops (SIGSTOP, a host
    that stalls without a TCP reset) and resumes; use it in a `with` block.

    Arguments:
        timeout_s: deadline for the process to start listening.
    """

    def __init__(self, timeout_s: float = 60.0):
        self.process = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            self.close()
            raise AssertionError(f"the store host did not start within {timeout_s} s")
        self.addr = ("127.0.0.1", int(self.process.stdout.readline()))

    def stop(self) -> None:
        """SIGSTOP the store's process and return once it is stopped."""
        stop_process(self.process.pid)

    def resume(self) -> None:
        """SIGCONT the store's process."""
        os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        """End the store's process (resumed first) and reap it."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
