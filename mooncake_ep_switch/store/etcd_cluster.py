"""A local etcd cluster of several members on loopback ports (tests, the demo, one-host jobs).

Each member is Debian's `etcd` (package `etcd-server`, 3.4; `scripts/install.sh` installs it) with
its data directory in a temporary directory that `close()` removes. The members are started through
`setpriv --pdeathsig KILL` when util-linux's `setpriv` is there, so they die with the process (the
thread) that started them even when it is SIGKILLed; `close()` kills them otherwise. The data of a
cluster whose starter was SIGKILLed is removed by the next `start()` in the same directory (its name
carries the starter's pid). Ports are free loopback ports picked at start.
"""
import json
import numbers
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import List, Optional, Sequence, Tuple

__all__ = ["LocalEtcdCluster"]

# What each member writes to its log (`log()`): warnings too (slow applies, ReadIndex retries, lost peers), the
# record of what the cluster went through when a test that killed or stopped a member fails.
MEMBER_LOG_LEVEL = "warn"


def _free_ports(count: int, host: str) -> List[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _remove_orphans(data_root: Optional[str]) -> None:
    """Remove the data directories of clusters whose starting process is gone (it was SIGKILLed: its
    members died with it, `setpriv --pdeathsig`, but nobody removed their data, ~370 MB per cluster)."""
    root = data_root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["mep", "etcd"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # its owner is alive
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:
            continue  # another user's live process


def _in_namespace(namespace: str, function):
    """`function()` called on a thread of its own inside network namespace `namespace` (its result, or its
    exception raised here); this thread stays where it is."""
    from mooncake_ep_switch import _native

    result: list = []

    def run():
        try:
            fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
            try:
                _native.enter_net_namespace(fd)
            finally:
                os.close(fd)
            result.append((True, function()))
        except BaseException as error:  # handed to the caller
            result.append((False, error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


class LocalEtcdCluster:
    """`members` etcd processes forming one cluster on `host`.

    Arguments:
        members: number of members (>= 1; 3 tolerates the loss of one).
        host: loopback address to listen on.
        data_root: directory the temporary data directory is made in (None: the system's temporary
            directory; `/dev/shm` makes every write skip the disk, for tests).
        binary: the etcd executable.
        timeout_s: seconds for the cluster to elect a leader at `start()`.
        heartbeat_ms, election_ms: etcd's `--heartbeat-interval` and `--election-timeout` (etcd's
            defaults; lower ones elect a new leader sooner after a kill, at the risk of needless
            elections on a loaded machine).
        places: None (default: every member on `host`), or one (network namespace, address) per member:
            member i runs in namespace i (`ip netns exec`) and listens on its address, ports 2379 (clients)
            and 2380 (peers): one member per pretend host (`bench.netns.Network`).
        probe_namespace: the namespace this cluster's own requests (health, leader) are made from when
            `places` are given (one that reaches every member: the network's hub).
    """

    def __init__(self, members: int = 3, host: str = "127.0.0.1", data_root: Optional[str] = None,
                 binary: str = "etcd", timeout_s: float = 30.0, heartbeat_ms: int = 100, election_ms: int = 1000,
                 places: Optional[Sequence[Tuple[str, str]]] = None, probe_namespace: Optional[str] = None):
        if not isinstance(members, int) or isinstance(members, bool) or members < 1:
            raise ValueError(f"members: expected an int >= 1, got {members!r}")
        if places is not None and len(places) != members:
            raise ValueError(f"places: expected one (namespace, address) per member ({members}), got {len(places)}")
        self.host = host
        self.hosts = [host] * members if places is None else [address for _, address in places]
        self.namespaces = None if places is None else [namespace for namespace, _ in places]
        self.probe_namespace = probe_namespace
        self.count = members
        self.binary = shutil.which(binary)
        if self.binary is None:
            raise FileNotFoundError(f"binary: {binary!r} is not on PATH (install Debian's etcd-server: "
                                    "scripts/install.sh)")
        self.timeout_s = timeout_s
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.data_root = data_root
        self.directory: Optional[str] = None
        self.client_ports: List[int] = []
        self.peer_ports: List[int] = []
        self.processes: List[Optional[subprocess.Popen]] = [None] * members
        self._token = f"mep-{uuid.uuid4().hex[:12]}"

    # ------------------------------------------------------------------ lifetime
    def start(self) -> "LocalEtcdCluster":
        """Start every member and wait until the cluster has a leader.

        Returns:
            self.

        Raises:
            RuntimeError: a member exited, or no leader within `timeout_s` (its log is in the message).
        """
        _remove_orphans(self.data_root)
        self.directory = tempfile.mkdtemp(prefix=f"mep-etcd-{os.getpid()}-", dir=self.data_root)
        # Members of their own namespaces have every port free there: etcd's own.
        ports = _free_ports(2 * self.count, self.host) if self.namespaces is None else \
            [2379] * self.count + [2380] * self.count
        self.client_ports, self.peer_ports = ports[:self.count], ports[self.count:]
        try:
            for index in range(self.count):
                self.start_member(index, new=True)
            self.wait_healthy(range(self.count), self.timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "LocalEtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every member and remove the data directory."""
        for index in range(self.count):
            self.kill(index)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    # ------------------------------------------------------------------ members
    @property
    def endpoints(self) -> List[str]:
        """`host:port` of every member's client listener."""
        return [f"{host}:{port}" for host, port in zip(self.hosts, self.client_ports)]

    def url(self, prefix: str) -> str:
        """The `etcd://` URL of this cluster with key prefix `prefix` (for `elastic.connect_store`)."""
        return f"etcd://{','.join(self.endpoints)}/{prefix}"

    def start_member(self, index: int, new: bool = False) -> None:
        """Start member `index` (again: it rejoins with its data directory)."""
        assert self.directory is not None and self.processes[index] is None
        name = f"m{index}"
        host = self.hosts[index]
        peers = ",".join(f"m{i}=http://{self.hosts[i]}:{port}" for i, port in enumerate(self.peer_ports))
        client = f"http://{host}:{self.client_ports[index]}"
        command = [self.binary, "--name", name, "--data-dir", os.path.join(self.directory, name),
                   "--listen-client-urls", client, "--advertise-client-urls", client,
                   "--listen-peer-urls", f"http://{host}:{self.peer_ports[index]}",
                   "--initial-advertise-peer-urls", f"http://{host}:{self.peer_ports[index]}",
                   "--initial-cluster", peers, "--initial-cluster-token", self._token,
                   "--initial-cluster-state", "new" if new else "existing",
                   "--heartbeat-interval", str(self.heartbeat_ms), "--election-timeout", str(self.election_ms),
                   "--logger", "zap", "--log-outputs", "stderr", "--log-level", MEMBER_LOG_LEVEL]
        if self.namespaces is not None:  # on its pretend host
            command = ["ip", "netns", "exec", self.namespaces[index]] + command
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # dies with the thread that started it, even one that was SIGKILLed
            command = [setpriv, "--pdeathsig", "KILL", "--"] + command
        log = open(os.path.join(self.directory, f"{name}.log"), "ab")
        try:
            self.processes[index] = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                     start_new_session=True)
        finally:
            log.close()

    def kill(self, index: int) -> None:
        """SIGKILL member `index` and reap it (nothing when it is not running)."""
        process, self.processes[index] = self.processes[index], None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(10)

    def restart(self, index: int, timeout_s: Optional[float] = None) -> None:
        """Start a killed member `index` again and wait until it serves."""
        self.start_member(index)
        self.wait_healthy([index], self.timeout_s if timeout_s is None else timeout_s)

    def _request(self, index: int, path: str, payload=None, timeout_s: float = 1.0):
        url = f"http://{self.hosts[index]}:{self.client_ports[index]}{path}"
        data = None if payload is None else json.dumps(payload).encode()

        def request():
            with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout_s) as response:
                return json.loads(response.read())

        if self.namespaces is None or self.probe_namespace is None:
            return request()
        return _in_namespace(self.probe_namespace, request)

    def wait_healthy(self, indices: Sequence[int], timeout_s: float) -> None:
        """Wait until every member of `indices` answers and sees a leader.

        Raises:
            RuntimeError: one exited or did not by `timeout_s` (its log in the message).
        """
        deadline = time.monotonic() + timeout_s
        for index in indices:
            while True:
                process = self.processes[index]
                if process is None or process.poll() is not None:
                    raise RuntimeError(f"etcd member m{index} exited: {self.log(index)}")
                try:
                    if self._request(index, "/health").get("health") == "true":
                        break
                except (OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member m{index} not healthy after {timeout_s} s: {self.log(index)}")
                time.sleep(0.05)

    def log(self, index: int, tail_bytes: int = 2000) -> str:
        """The last `tail_bytes` of member `index`'s log (its warnings: slow applies, ReadIndex retries)."""
        if isinstance(tail_bytes, bool) or not isinstance(tail_bytes, numbers.Integral) or tail_bytes < 1:
            raise ValueError(f"tail_bytes: expected an int >= 1, got {tail_bytes!r}")
        tail_bytes = int(tail_bytes)
        try:
            with open(os.path.join(self.directory or "", f"m{index}.log"), "rb") as handle:
                handle.seek(max(0, os.fstat(handle.fileno()).st_size - tail_bytes))  # the tail only: warnings add up
                return handle.read(tail_bytes).decode(errors="replace")
        except OSError:
            return "(no log)"

    def leader(self, timeout_s: float = 10.0) -> int:
        """Index of the current leader, as a running member reports it (waits for an election).

        Raises:
            RuntimeError: no running member names a leader by `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            ids = {}
            leader = None
            for index, process in enumerate(self.processes):
                if process is None or process.poll() is not None:
                    continue
                try:
                    status = self._request(index, "/v3/maintenance/status", {})
                except (OSError, ValueError):
                    continue
                ids[status["header"]["member_id"]] = index
                leader = status.get("leader", leader)
            if leader in ids:
                return ids[leader]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd leader among the running members after {timeout_s} s")
            time.sleep(0.05)

    def move_leader(self, index: int, timeout_s: float = 10.0) -> None:
        """Make member `index` the leader (etcd's leadership transfer), waiting until it is.

        Raises:
            RuntimeError: it is not the leader by `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        target = self._request(index, "/v3/maintenance/status", {})["header"]["member_id"]
        while True:
            leader = self.leader(max(0.1, deadline - time.monotonic()))
            if leader == index:
                return
            try:
                self._request(leader, "/v3/maintenance/transfer-leadership", {"targetID": target}, timeout_s=5.0)
            except (OSError, ValueError):
                pass  # an election meanwhile: ask the next leader
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member m{index} did not become the leader within {timeout_s} s")
