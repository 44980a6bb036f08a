"""Local multi-rank launcher: spawned CPU ranks with a gloo group, every wait bounded.

The launching process hosts the TCPStore, so the store (and with it the membership record) outlives
any rank, including rank 0. The store listens on one address only (`host_store`): 127.0.0.1 by
default, or the address a `ClusterNetwork` names, inside that network's namespace. It is not
authenticated, so it must never be reachable from a network you do not trust. With `store="etcd"` the
ranks' store is a local 3-member etcd cluster instead, which outlives any one member (launcher/stores.py). Ranks are persistent
workers: `run()` sends a function (by reference, so it must be importable) to every rank and
collects each rank's return value, error or exit code before a deadline. A rank that dies is
reported, never waited for past the deadline; `close()` (or leaving the `with` block) ends every
rank, and each rank also dies with its parent (PDEATHSIG).

With a `ClusterNetwork` (multi-host tests and benchmarks on Linux network namespaces,
`bench/netns.py`) each rank first moves into its host's network namespace and only then connects to
the store and joins the gloo group, so the store traffic and gloo cross the namespaces' links like
any other traffic between hosts.
"""
import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from mooncake_ep_switch.config import JOB_SECRET_ENV, new_job_secret
from mooncake_ep_switch.launcher.processes import native_stacks, process_created_at
from mooncake_ep_switch.launcher.places import ClusterNetwork, RankPlace, check_network, enter_place
from mooncake_ep_switch.launcher.store import host_store
from mooncake_ep_switch.launcher.stores import ClusterStore, check_store, etcd_places, open_rank_store

__all__ = ["RankContext", "RankOutcome", "RankPlace", "ClusterNetwork", "LocalCluster", "host_store", "check_outcomes",
           "process_created_at", "STANDBY"]


class RankContext(NamedTuple):
    """What a rank function receives as its first argument.

    Fields:
        rank: this rank.
        num_ranks: number of ranks.
        group: the gloo process group of all ranks (torch.distributed WORLD).
        store: the default group's store (a prefix of the launcher's TCPStore, or of the etcd store
            with `store="etcd"`, which outlive any rank); a replacement joins through it.
        store_addr: (host, port) of that store, or (etcd URL, None): `elastic.connect_store(*store_addr)`
            opens another client (for further groups).
    """

    rank: int
    num_ranks: int
    group: Any
    store: Any
    store_addr: tuple


class RankOutcome(NamedTuple):
    """One rank's outcome of a `run()`.

    Fields:
        rank: the rank.
        ok: the function returned normally.
        value: its return value (when ok).
        error: formatted traceback (when the function raised), or a description of how it died.
        exitcode: the process exit code if it exited, else None.
    """

    rank: int
    ok: bool
    value: Any
    error: Optional[str]
    exitcode: Optional[int]


def _die_with_parent() -> None:
    from mooncake_ep_switch import _native

    _native.set_parent_death_signal(int(signal.SIGKILL))


def _worker_main(rank: int, num_ranks: int, store_addr: tuple, env: Dict[str, str], threads: int, conn,
                 replacement: bool = False, place: Optional[RankPlace] = None) -> None:
    # Phases of a start (wall clocks, compared across processes): created, entered (interpreter and the imports
    # of this module done), torch imported, store connected.
    started = {"created": process_created_at(), "entered": time.time()}
    _die_with_parent()
    # A rank the launcher gives up on is sent SIGUSR1 first: every thread's stack goes to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    if place is not None:
        enter_place(place)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    started["torch_imported"] = time.time()
    store = open_rank_store(store_addr, num_ranks)  # stays referenced: the PrefixStore holds only its C++ half
    world_store = dist.PrefixStore("world", store)  # the default group's store, and membership's
    if replacement:  # a dead rank's successor: the world group cannot take it back; it joins via the store
        context = RankContext(rank, num_ranks, None, world_store, store_addr)
    else:
        dist.init_process_group("gloo", store=world_store, rank=rank, world_size=num_ranks,
                                timeout=timedelta(seconds=120))
        context = RankContext(rank, num_ranks, dist.group.WORLD, world_store, store_addr)
    started["ready"] = time.time()
    conn.send(("ready", started))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        function, args, kwargs = message
        if function == _ASSIGN:  # a standby is told which rank it replaces (LocalCluster.assign_standby)
            context = context._replace(rank=args[0])
            conn.send(("ok", time.time()))
            continue
        try:
            result = ("ok", function(context, *args, **kwargs))
        except BaseException:  # reported to the launcher, never swallowed
            result = ("error", traceback.format_exc())
        try:
            conn.send(result)
        except (BrokenPipeError, OSError):
            break
    if not replacement:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    os._exit(0)  # skip interpreter teardown of gloo threads


_ASSIGN = "assign rank"  # the message that tells a standby which rank it is
STANDBY = -1  # the rank a standby's functions see until it is assigned one


def _last_line(error: Optional[str], limit: int = 400) -> str:
    """The last non-empty line of a rank's error (a traceback's exception line), at most `limit` characters."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    line = lines[-1] if lines else "no message"
    return line if len(line) <= limit else line[:limit] + "..."


class LocalCluster:
    """A set of local CPU ranks that run functions on request.

    Arguments:
        num_ranks: number of ranks to spawn.
        env: environment variables set in every rank before torch is imported (a fresh
            `MEP_JOB_SECRET` is added unless given: replacements get the same one).
        threads: torch intra-op threads per rank.
        start_timeout_s: deadline for spawning and joining the process group.
        network: None (default): every rank in the launcher's network namespace, the store on
            127.0.0.1. A `ClusterNetwork`: the store listens on its `store_host` only (made inside
            `store_namespace`), and rank r (and any replacement of it) enters
            `network.ranks[r].namespace` before it connects to the store and joins the gloo group
            (bound to the place's interface), with `MEP_BIND_HOST` / `MEP_HOST_ID` from the place.
        preload_replacements: start replacements (`respawn`) by forking a server that imported this
            module, torch included, when the cluster started (multiprocessing's "forkserver"): a
            replacement is still a new process started after the death, without the seconds of
            its imports. False (default): a fresh interpreter, as the ranks are started.
        preload_modules: further modules that server imports (what the rank functions use: a
            replacement then imports none of them after the death).
        preload: start the ranks (and a standby) from that server too: a cluster then starts after one
            import of torch instead of one per rank (the demo's and the test suite's clusters).
            Replacements follow `preload_replacements`. The server is one per launching process,
            started by the first cluster that asks for it (later clusters' `preload_modules` are not
            added to it); it exits with the launching process, and its children die with it.
        store: "tcp" (default): the launcher hosts a TCPStore. "etcd": it starts a local 3-member etcd
            cluster (`store.LocalEtcdCluster`, stopped by `close()`) and every rank's world group and
            membership live on it (no single point of failure, issue 38); with a `network`, one member
            on each of the ranks' hosts and `self.store` None (launcher/stores.py). An `etcd://` URL:
            that cluster and prefix.

    Raises:
        ValueError / TypeError: a bad argument (named in the message).
        OSError: the store cannot listen on `network.store_host`, or a namespace cannot be entered.
        FileNotFoundError, RuntimeError: `store="etcd"` without the etcd binary, or no leader elected.
        TimeoutError: a rank did not start (or join the group) within `start_timeout_s`.
    """

    def __init__(self, num_ranks: int, env: Optional[Dict[str, str]] = None, threads: int = 1,
                 start_timeout_s: float = 120.0, network: Optional[ClusterNetwork] = None,
                 preload_replacements: bool = False, preload: bool = False, store: str = "tcp",
                 preload_modules: Sequence[str] = ()):
        if num_ranks < 1:
            raise ValueError(f"num_ranks: expected >= 1, got {num_ranks}")
        check_network(network, num_ranks)
        check_store(store)
        self.num_ranks = num_ranks
        self.network = network
        self.env = dict(env or {})
        # Every rank and replacement authenticates its membership records with this job's secret.
        self.env.setdefault(JOB_SECRET_ENV, new_job_secret())
        # A TCPStore listens on one address only (torch's own server would listen on every interface).
        listen = ("127.0.0.1", None) if network is None else (network.store_host, network.store_namespace)
        self._store = ClusterStore(store, num_ranks, self.env, listen,
                                   places=etcd_places(network) if store == "etcd" else None)
        self.store, self.store_addr, self.etcd = self._store.client, self._store.addr, self._store.etcd
        spawned = forked = mp.get_context("spawn")
        if preload_replacements or preload:  # the server imports torch now, in the background
            from multiprocessing import forkserver

            forked = mp.get_context("forkserver")
            forked.set_forkserver_preload([__name__, *preload_modules])
            forkserver.ensure_running()
        self._ctx = forked if preload else spawned
        self._replacement_ctx = forked if preload_replacements else spawned
        self.processes: List[Any] = []
        self.conns: List[Any] = []
        self.broken = False
        self.standby = None  # (process, connection) of a warm standby (start_standby), or None
        for rank in range(num_ranks):
            self._spawn(rank, threads)
        deadline = time.monotonic() + start_timeout_s
        for rank, conn in enumerate(self.conns):
            if not self._poll(conn, deadline):
                self.close()
                raise TimeoutError(f"LocalCluster: rank {rank} did not start within {start_timeout_s} s")
            conn.recv()

    def _spawn(self, rank: int, threads: int, replacement: bool = False) -> None:
        context = self._replacement_ctx if replacement else self._ctx
        parent, child = context.Pipe()
        place = None if self.network is None else self.network.ranks[rank]
        process = context.Process(target=_worker_main, args=(rank, self.num_ranks, self.store_addr, self.env,
                                                               threads, child, replacement, place), daemon=True)
        process.start()
        child.close()
        if replacement:
            self.processes[rank], self.conns[rank] = process, parent
        else:
            self.processes.append(process)
            self.conns.append(parent)

    def respawn(self, rank: int, threads: int = 1, timeout_s: float = 60.0) -> dict:
        """Start a replacement process for a dead `rank` (same rank id and `RankPlace`, no world group).

        Its functions get a context whose `group` is None and whose `store` reaches the launcher's
        store, which is how a replacement joins (`mooncake_ep_switch.elastic.join`). On success the
        cluster is no longer marked broken.

        Arguments:
            rank: id of the rank to replace, in `[0, num_ranks)`; raises RuntimeError if it is alive.
            threads: torch intra-op threads of the new process.
            timeout_s: deadline in seconds for the new process to start; TimeoutError after it.

        Returns:
            started: dict of wall-clock times (`time.time()`): "spawn" (this call), "created" (the
                process, from /proc), "entered" (its interpreter and imports up to the worker),
                "torch_imported", "ready" (connected to the store).
        """
        spawn = time.time()
        self._check_dead(rank)
        self.conns[rank].close()
        self._spawn(rank, threads, replacement=True)
        if not self._poll(self.conns[rank], time.monotonic() + timeout_s):
            raise TimeoutError(f"LocalCluster: replacement for rank {rank} did not start within {timeout_s} s")
        started = dict(self.conns[rank].recv()[1], spawn=spawn)
        self.broken = False
        return started

    def add_rank(self, threads: int = 1, timeout_s: float = 60.0) -> int:
        """Start a new process with the next rank id, outside the world group (a newcomer of a grow, which
        joins through its context's `store`: `elastic.join_grow`); `run(..., ranks=[rank])` reaches it. It is
        started as `respawn` starts a replacement (forked from the preloaded server with `preload_replacements`).

        Returns:
            rank: its id (`num_ranks` before the call, which counts it from then on).

        Raises:
            RuntimeError: the cluster has a `ClusterNetwork` (no place for the new rank).
            TimeoutError: it did not start within `timeout_s`.
        """
        if self.network is not None:
            raise RuntimeError("add_rank: a cluster over a ClusterNetwork has no place for a new rank")
        rank, self.num_ranks = self.num_ranks, self.num_ranks + 1
        self.processes.append(None)
        self.conns.append(None)
        self._spawn(rank, threads, replacement=True)
        if not self._poll(self.conns[rank], time.monotonic() + timeout_s):
            raise TimeoutError(f"LocalCluster: new rank {rank} did not start within {timeout_s} s")
        self.conns[rank].recv()
        return rank

    def accept_dead(self, rank: int) -> None:
        """Serve on without the dead `rank`: `run(..., ranks=...)` may be called again for the others (a run
        that found a rank dead marks the cluster broken until then, or until `respawn`).

        Raises:
            ValueError: `rank` is not a rank of the cluster. RuntimeError: it is alive (named; nothing changed).
        """
        self._check_dead(rank)
        self.broken = False

    def _check_dead(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank: expected a rank in [0, {self.num_ranks}), got {rank!r}")
        old = self.processes[rank]
        if old.is_alive():
            raise RuntimeError(f"rank: {rank} is still alive (pid {old.pid}); only a dead rank can be replaced")
        old.join(1)

    def start_standby(self, threads: int = 1, timeout_s: float = 60.0) -> dict:
        """Start a warm standby: a replacement process with no rank yet (its functions see rank `STANDBY`).

        Run its preparation with `run_standby` (imports, weights); `assign_standby(rank)` later makes it
        `rank`'s replacement, as `respawn(rank)` would start one. One standby at a time; without a
        `ClusterNetwork` only (a standby's namespace would depend on the rank it replaces).

        Arguments:
            threads: torch intra-op threads of the standby.
            timeout_s: deadline in seconds for it to start; TimeoutError after it.

        Returns:
            started: dict of wall-clock times, as `respawn` returns them.

        Raises:
            RuntimeError: a standby is already held, or the cluster has a `ClusterNetwork`.
        """
        if self.standby is not None:
            raise RuntimeError("start_standby: a standby is already held; assign it first")
        if self.network is not None:
            raise RuntimeError("start_standby: a cluster over a ClusterNetwork takes no standby (its namespace is "
                               "the rank's)")
        spawn = time.time()
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(STANDBY, self.num_ranks, self.store_addr, self.env,
                                                               threads, child, True, None), daemon=True)
        process.start()
        child.close()
        self.standby = (process, parent)
        if not self._poll(parent, time.monotonic() + timeout_s):
            raise TimeoutError(f"LocalCluster: the standby did not start within {timeout_s} s")
        return dict(parent.recv()[1], spawn=spawn)

    def run_standby(self, function: Callable, *args, timeout_s: float = 60.0, **kwargs) -> Any:
        """Run `function(context, *args, **kwargs)` on the standby (rank `STANDBY`) and return its value.

        Raises:
            RuntimeError: no standby is held, or the function raised (its traceback) or the standby died.
        """
        process, conn = self._standby("run_standby")
        conn.send((function, args, kwargs))
        if not self._poll(conn, time.monotonic() + timeout_s):
            raise TimeoutError(f"LocalCluster: the standby did not answer within {timeout_s} s")
        try:
            status, value = conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"LocalCluster: the standby exited (exit code {process.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"LocalCluster: the standby failed:\n{value}")
        return value

    def assign_standby(self, rank: int) -> float:
        """Make the standby `rank`'s replacement (its functions see `rank` from now on); it is no standby after.

        Arguments:
            rank: a dead rank in `[0, num_ranks)`.

        Returns:
            assigned: wall-clock time the standby took the rank.

        Raises:
            RuntimeError: no standby is held, or `rank` is still alive (named; nothing changed).
            ValueError: `rank` is not a rank of the cluster.
        """
        process, conn = self._standby("assign_standby")
        self._check_dead(rank)
        conn.send((_ASSIGN, (rank,), {}))
        if not self._poll(conn, time.monotonic() + 30):
            raise TimeoutError("LocalCluster: the standby did not take its rank within 30 s")
        assigned = conn.recv()[1]
        self.conns[rank].close()
        self.processes[rank], self.conns[rank] = process, conn
        self.standby = None
        self.broken = False
        return assigned

    def _standby(self, what: str):
        if self.standby is None:
            raise RuntimeError(f"{what}: no standby is held (start_standby first)")
        return self.standby

    @staticmethod
    def _poll(conn, deadline: float) -> bool:
        try:
            return conn.poll(max(0.0, deadline - time.monotonic()))
        except (EOFError, OSError):
            return True

    def run(self, function: Callable, *args, timeout_s: float = 60.0, ranks: Optional[List[int]] = None,
            failure_grace_s: float = 10.0, **kwargs) -> List[RankOutcome]:
        """Run `function(context, *args, **kwargs)` on every rank (or `ranks`) and collect outcomes.

        Arguments:
            function: an importable module-level function.
            args: positional arguments passed to `function` after the context (picklable).
            timeout_s: deadline for every rank to answer; ranks still running then are killed and
                the cluster is marked broken.
            failure_grace_s: once a rank has failed, the others get at most this long to answer
                (they may be blocked in a collective with the failed rank).
            ranks: subset of ranks to run on (default all).
            kwargs: keyword arguments passed to `function` (picklable).

        Returns:
            outcomes: one `RankOutcome` per rank run, in rank order.
        """
        if self.broken:
            raise RuntimeError("LocalCluster: a previous run left the ranks in an unknown state")
        targets = list(range(self.num_ranks)) if ranks is None else list(ranks)
        for rank in targets:
            try:
                self.conns[rank].send((function, args, kwargs))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        failed_at: Optional[float] = None  # when a rank first failed (the others then get failure_grace_s)
        first_failed: Optional[RankOutcome] = None  # that rank's outcome, named to the ranks that did not answer
        outcomes: Dict[int, RankOutcome] = {}
        pending = set(targets)
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                conn, process = self.conns[rank], self.processes[rank]
                try:
                    ready = conn.poll(0.02)
                except (EOFError, OSError):
                    ready = True
                if ready:
                    try:
                        status, value = conn.recv()
                        outcomes[rank] = RankOutcome(rank, status == "ok", value if status == "ok" else None,
                                                     None if status == "ok" else value, None)
                    except (EOFError, OSError):
                        process.join(5)
                        outcomes[rank] = RankOutcome(rank, False, None, "rank exited", process.exitcode)
                        self.broken = True
                    pending.discard(rank)
                elif not process.is_alive():
                    outcomes[rank] = RankOutcome(rank, False, None, "rank exited", process.exitcode)
                    pending.discard(rank)
                    self.broken = True
                if rank in outcomes and not outcomes[rank].ok:
                    if failed_at is None:
                        failed_at, first_failed = time.monotonic(), outcomes[rank]
                    deadline = min(deadline, time.monotonic() + failure_grace_s)
        waited = (f"{timeout_s} s" if failed_at is None or failed_at + failure_grace_s > deadline + 1e-3
                  else f"{failure_grace_s} s after rank {first_failed.rank} failed ({_last_line(first_failed.error)})")
        for rank in pending:
            outcomes[rank] = RankOutcome(rank, False, None, f"no answer within {waited} (its threads' stacks: "
                                         "the test's captured stderr)", None)
            self.broken = True
        if pending:
            for rank in pending:  # faulthandler in the rank prints every thread's stack
                try:
                    os.kill(self.processes[rank].pid, signal.SIGUSR1)
                except (OSError, TypeError):
                    pass
            time.sleep(1.0)
            for rank in pending:  # and the native ones (a thread inside the engine or gloo), where gdb is
                native_stacks(rank, self.processes[rank].pid)
            self.kill()
        return [outcomes[rank] for rank in targets]

    def kill(self) -> None:
        """Kill every rank at once."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(10)
        self.broken = True

    def close(self) -> None:
        """Stop every rank and any standby (politely, then by force) and release the store."""
        standby, self.standby = getattr(self, "standby", None), None
        if standby is not None:
            self.processes.append(standby[0])
            self.conns.append(standby[1])
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 10
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        self.store = None
        self._store.close()  # an etcd cluster it started ends after the ranks

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False


def check_outcomes(outcomes: List[RankOutcome]) -> List[Any]:
    """Return every rank's value, raising with every failed rank's error if any failed.

    Arguments:
        outcomes: `RankOutcome`s, e.g. from `LocalCluster.run`.

    Returns:
        values: list of each outcome's `value`, in the order of `outcomes` (if any outcome is not
            ok, raises RuntimeError with every failed rank's error and exit code instead).
    """
    failures = [o for o in outcomes if not o.ok]
    if failures:
        text = "\n".join(f"--- rank {o.rank} (exitcode {o.exitcode}):\n{o.error}" for o in failures)
        raise RuntimeError(f"{len(failures)} rank(s) failed:\n{text}")
    return [o.value for o in outcomes]
