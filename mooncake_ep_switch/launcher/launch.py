"""Local multi-rank launcher: spawned CPU ranks with a gloo group, every wait bounded.

The launching process hosts the TCPStore, so the store (and with it the membership record) outlives
any rank, including rank 0. The store listens on one address only (`host_store`): 127.0.0.1 by
default, or the address a `ClusterNetwork` names, inside that network's namespace. It is not
authenticated, so it must never be reachable from a network you do not trust. Ranks are persistent
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
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from mooncake_ep_switch.config import (BIND_HOST_ENV, GLOO_SOCKET_IFNAME_ENV, HOST_ID_ENV, JOB_SECRET_ENV,
                                       new_job_secret)


class RankContext(NamedTuple):
    """What a rank function receives as its first argument.

    Fields:
        rank: this rank.
        num_ranks: number of ranks.
        group: the gloo process group of all ranks (torch.distributed WORLD).
        store: the default group's store (a prefix of the launcher's TCPStore, which outlives any
            rank); a replacement joins through it.
        store_addr: (host, port) of that store, for building further groups or clients.
    """

    rank: int
    num_ranks: int
    group: Any
    store: Any
    store_addr: tuple


class RankPlace(NamedTuple):
    """Where one rank of a `ClusterNetwork` lives.

    Fields:
        namespace: the network namespace (a name under /var/run/netns) the rank enters first, before
            it connects to the store or builds its gloo group.
        bind_host: its host's address: `MEP_BIND_HOST` (what the Transfer Engine advertises, where
            the peer watcher listens).
        interface: the device gloo binds to (`GLOO_SOCKET_IFNAME`), e.g. the host's veth.
        host_id: `MEP_HOST_ID` (ranks with the same one share memory); "" keeps the rank's default.
    """

    namespace: str
    bind_host: str
    interface: str
    host_id: str = ""


class ClusterNetwork(NamedTuple):
    """A `LocalCluster` spread over network namespaces (`bench.netns.Network.placement` builds one).

    Fields:
        store_host: the address the launcher's store listens on (only there), reachable from every
            rank's namespace.
        store_namespace: the network namespace the store's listening socket is made in (the
            launcher's thread enters it for that moment only); None: the launcher's own.
        ranks: one `RankPlace` per rank, in rank order.
    """

    store_host: str
    store_namespace: Optional[str]
    ranks: Tuple[RankPlace, ...]


def _check_network(network: Optional[ClusterNetwork], num_ranks: int) -> None:
    if network is None:
        return
    if not isinstance(network, ClusterNetwork):
        raise TypeError(f"network: expected a ClusterNetwork or None, got {type(network).__name__}")
    if not isinstance(network.store_host, str) or not network.store_host:
        raise ValueError(f"network.store_host: expected a non-empty address, got {network.store_host!r}")
    if network.store_namespace is not None and (not isinstance(network.store_namespace, str)
                                                or not network.store_namespace):
        raise ValueError(f"network.store_namespace: expected a namespace name or None, got "
                         f"{network.store_namespace!r}")
    if len(network.ranks) != num_ranks:
        raise ValueError(f"network.ranks: expected one RankPlace per rank ({num_ranks}), got {len(network.ranks)}")
    for rank, place in enumerate(network.ranks):
        if not isinstance(place, RankPlace):
            raise TypeError(f"network.ranks[{rank}]: expected a RankPlace, got {type(place).__name__}")
        for field in ("namespace", "bind_host", "interface"):
            if not isinstance(getattr(place, field), str) or not getattr(place, field):
                raise ValueError(f"network.ranks[{rank}].{field}: expected a non-empty str, got "
                                 f"{getattr(place, field)!r}")
        if not isinstance(place.host_id, str):
            raise ValueError(f"network.ranks[{rank}].host_id: expected a str, got {place.host_id!r}")


def _enter_place(place: RankPlace) -> None:
    """Rank side, first thing: move into the rank's namespace and set what its settings read."""
    from mooncake_ep_switch.launcher.namespaces import enter

    enter(place.namespace)  # the main thread, before any socket or thread exists
    os.environ[BIND_HOST_ENV] = place.bind_host
    os.environ[GLOO_SOCKET_IFNAME_ENV] = place.interface
    if place.host_id:
        os.environ[HOST_ID_ENV] = place.host_id


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


def host_store(host: str = "127.0.0.1", port: int = 0, world_size: Optional[int] = None,
               timeout_s: float = 60.0):
    """Host a TCPStore server that listens on `host` only.

    torch's TCPStore server binds every interface (`[::]`, dual stack) whatever host it is given,
    and the store has no authentication: anyone who reaches the port can read and rewrite every
    key (membership views, endpoint records). This function binds the listening socket itself to
    the address `host` resolves to and hands it to the store (`master_listen_fd`), so the store is
    reachable only there. Pass a wildcard ("0.0.0.0", "::") only on purpose.

    Arguments:
        host: address or name to listen on (its first `getaddrinfo` result); default loopback.
        port: TCP port, or 0 for a free one (read it back from the returned store's `.port`).
        world_size: the store's world size (None: any number of clients).
        timeout_s: the store's timeout for its own operations, in seconds.

    Returns:
        store: the server `torch.distributed.TCPStore`; the socket is closed with it.

    Raises:
        ValueError: `host` is empty or `port` is outside [0, 65535].
        OSError: `host` does not resolve, or the address cannot be bound (e.g. EADDRINUSE); the
            message names host and port.
    """
    import torch.distributed as dist

    if not isinstance(host, str) or not host:
        raise ValueError(f"host: expected a non-empty address or host name, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected 0 <= port <= 65535, got {port!r}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"host {host!r} does not resolve: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)  # not inheritable: spawned ranks never hold it
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
        except OSError as exc:
            shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
            raise OSError(exc.errno, f"cannot listen on {shown}:{port} (host {host!r}): {exc.strerror}") from None
        bound_port = sock.getsockname()[1]
        store = dist.TCPStore(host, bound_port, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()  # the store did not take the descriptor (it keeps it only once constructed)
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it is destroyed
    return store


def _native_stacks(rank: int, pid: Optional[int], timeout_s: float = 20.0) -> None:
    """Print every native thread's stack of a rank that does not answer to stderr (gdb, if installed)."""
    gdb = shutil.which("gdb")
    if gdb is None or pid is None:
        return
    try:
        found = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 24"],
                               capture_output=True, text=True, timeout=timeout_s)
        print(f"--- native stacks of rank {rank} (pid {pid}) ---\n{found.stdout[-60000:]}", file=sys.stderr)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"--- no native stacks of rank {rank}: {error}", file=sys.stderr)


def _die_with_parent() -> None:
    from mooncake_ep_switch import _native

    _native.set_parent_death_signal(int(signal.SIGKILL))


def _worker_main(rank: int, num_ranks: int, store_addr: tuple, env: Dict[str, str], threads: int, conn,
                 replacement: bool = False, place: Optional[RankPlace] = None) -> None:
    _die_with_parent()
    # A rank the launcher gives up on is sent SIGUSR1 first: every thread's stack goes to stderr.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    if place is not None:
        _enter_place(place)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.TCPStore(store_addr[0], store_addr[1], num_ranks, is_master=False,
                          timeout=timedelta(seconds=60))
    world_store = dist.PrefixStore("world", store)  # the default group's store, and membership's
    if replacement:  # a dead rank's successor: the world group cannot take it back; it joins via the store
        context = RankContext(rank, num_ranks, None, world_store, store_addr)
    else:
        dist.init_process_group("gloo", store=world_store, rank=rank, world_size=num_ranks,
                                timeout=timedelta(seconds=120))
        context = RankContext(rank, num_ranks, dist.group.WORLD, world_store, store_addr)
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        function, args, kwargs = message
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

    Raises:
        ValueError / TypeError: a bad argument (named in the message).
        OSError: the store cannot listen on `network.store_host`, or a namespace cannot be entered.
        TimeoutError: a rank did not start (or join the group) within `start_timeout_s`.
    """

    def __init__(self, num_ranks: int, env: Optional[Dict[str, str]] = None, threads: int = 1,
                 start_timeout_s: float = 120.0, network: Optional[ClusterNetwork] = None):
        if num_ranks < 1:
            raise ValueError(f"num_ranks: expected >= 1, got {num_ranks}")
        _check_network(network, num_ranks)
        self.num_ranks = num_ranks
        self.network = network
        self.env = dict(env or {})
        # Every rank and replacement authenticates its membership records with this job's secret.
        self.env.setdefault(JOB_SECRET_ENV, new_job_secret())
        # Listens on one address only (torch's own server would listen on every interface).
        if network is None:
            self.store = host_store("127.0.0.1", 0, num_ranks, timeout_s=60)
        else:
            from mooncake_ep_switch.launcher.namespaces import inside

            with inside(network.store_namespace):  # the socket stays in that namespace
                self.store = host_store(network.store_host, 0, num_ranks, timeout_s=60)
        self.store_addr = ("127.0.0.1" if network is None else network.store_host, self.store.port)
        self._ctx = mp.get_context("spawn")
        self.processes: List[Any] = []
        self.conns: List[Any] = []
        self.broken = False
        for rank in range(num_ranks):
            self._spawn(rank, threads)
        deadline = time.monotonic() + start_timeout_s
        for rank, conn in enumerate(self.conns):
            if not self._poll(conn, deadline):
                self.close()
                raise TimeoutError(f"LocalCluster: rank {rank} did not start within {start_timeout_s} s")
            conn.recv()

    def _spawn(self, rank: int, threads: int, replacement: bool = False) -> None:
        parent, child = self._ctx.Pipe()
        place = None if self.network is None else self.network.ranks[rank]
        process = self._ctx.Process(target=_worker_main, args=(rank, self.num_ranks, self.store_addr, self.env,
                                                               threads, child, replacement, place), daemon=True)
        process.start()
        child.close()
        if replacement:
            self.processes[rank], self.conns[rank] = process, parent
        else:
            self.processes.append(process)
            self.conns.append(parent)

    def respawn(self, rank: int, threads: int = 1, timeout_s: float = 60.0) -> None:
        """Start a replacement process for a dead `rank` (same rank id and `RankPlace`, no world group).

        Its functions get a context whose `group` is None and whose `store` reaches the launcher's
        store, which is how a replacement joins (`mooncake_ep_switch.elastic.join`). On success the
        cluster is no longer marked broken.

        Arguments:
            rank: id of the rank to replace, in `[0, num_ranks)`; raises RuntimeError if it is alive.
            threads: torch intra-op threads of the new process.
            timeout_s: deadline in seconds for the new process to start; TimeoutError after it.
        """
        old = self.processes[rank]
        if old.is_alive():
            raise RuntimeError(f"rank: {rank} is still alive; only a dead rank can be replaced")
        old.join(1)
        self.conns[rank].close()
        self._spawn(rank, threads, replacement=True)
        if not self._poll(self.conns[rank], time.monotonic() + timeout_s):
            raise TimeoutError(f"LocalCluster: replacement for rank {rank} did not start within {timeout_s} s")
        self.conns[rank].recv()
        self.broken = False

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
                        failed_at = time.monotonic()
                    deadline = min(deadline, time.monotonic() + failure_grace_s)
        waited = (f"{timeout_s} s" if failed_at is None or failed_at + failure_grace_s > deadline + 1e-3
                  else f"{failure_grace_s} s after another rank failed")
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
                _native_stacks(rank, self.processes[rank].pid)
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
        """Stop every rank (politely, then by force) and release the store."""
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
