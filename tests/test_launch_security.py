"""The stores the project hosts listen only where asked (never on every interface)."""
import errno
import fcntl
import gc
import os
import socket
import struct
from datetime import timedelta

import pytest
import torch.distributed as dist

from mooncake_ep_switch.buffer.transport.sockets import listening, socket_inodes
from mooncake_ep_switch.launcher.launch import LocalCluster
from tests import harness


def _listening_on(port: int):
    """'addr:port' of this process's listening sockets on `port` (from /proc/net/tcp{,6})."""
    return [a for a in listening(socket_inodes()) if a.rsplit(":", 1)[1] == str(port)]


def _non_loopback_ipv4():
    """This host's IPv4 addresses other than loopback (one per interface that has one)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127."):
                found.append(addr)
    return found


def _refused(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        return sock.connect_ex((host, port)) == errno.ECONNREFUSED


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_launcher_store_listens_only_on_loopback():
    """LocalCluster asks for 127.0.0.1: its store must not be reachable on any other address."""
    with LocalCluster(1, preload=True) as cluster:  # forked ranks: the store is what is tested
        host, port = cluster.store_addr
        assert host == "127.0.0.1"
        assert _listening_on(port) == [f"127.0.0.1:{port}"]
        for addr in _non_loopback_ipv4():
            assert _refused(addr, port), f"the launcher's store answers on {addr}:{port}"
        cluster.store.set("probe", "1")
        assert cluster.store.get("probe") == b"1"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_host_store_binds_the_requested_address(host):
    from mooncake_ep_switch.launcher.launch import host_store

    if host == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback")
    before = len(os.listdir("/proc/self/fd"))
    store = host_store(host, 0, timeout_s=30)
    port = store.port
    assert 0 < port < 65536
    listening = _listening_on(port)
    expected = {"127.0.0.1": ["127.0.0.1:%d" % port], "::1": ["[::1]:%d" % port]}
    if host == "localhost":
        assert listening in (expected["127.0.0.1"], expected["::1"]), listening
    else:
        assert listening == expected[host], listening
    for addr in _non_loopback_ipv4():
        assert _refused(addr, port)
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    client.set("key", "value")
    assert store.get("key") == b"value"
    del client, store
    assert len(os.listdir("/proc/self/fd")) <= before  # the listening socket went with the store


def test_host_store_bad_arguments_raise_and_leak_nothing():
    from mooncake_ep_switch.launcher.launch import host_store

    # No descriptor opened here is left open. Compared as (fd, target) pairs opened since, not as the whole list:
    # in a test worker that ran other tests, the collector (or another test's thread) may close descriptors of
    # theirs meanwhile (CI saw 11 fewer after, none more).
    gc.collect()
    before = harness.open_fds()
    with pytest.raises(ValueError, match="port: expected 0 <= port <= 65535, got 70000"):
        host_store("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="host: expected a non-empty"):
        host_store("", 0)
    with pytest.raises(OSError, match="host 'no-such-host.invalid'"):
        host_store("no-such-host.invalid", 0)
    taken = host_store("127.0.0.1", 0, timeout_s=30)
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken.port}") as info:
        host_store("127.0.0.1", taken.port, timeout_s=5)
    assert info.value.errno == errno.EADDRINUSE
    taken.set("still", "usable")
    assert taken.get("still") == b"usable"
    del taken
    gc.collect()
    assert harness.open_fds() - before == set()


def _hang_in_a_named_function(ctx):
    import time

    if ctx.rank == 1:
        raise RuntimeError("rank 1 fails at once")
    time.sleep(30)  # outlives the run's grace: the launcher gives up on rank 0


def test_a_rank_given_up_on_prints_its_stacks(capfd, monkeypatch):
    """A rank that does not answer is named with the deadline that ended it (and the rank whose failure started
    it, with its error), and its threads' stacks
    reach stderr (faulthandler on SIGUSR1) before it is killed, so a hang in CI can be diagnosed; the launcher
    asks for its native stacks too (recorded here: gdb on a rank that imported torch takes ~15 s, and
    test_native_stacks_reach_stderr checks what native_stacks prints)."""
    from mooncake_ep_switch.launcher import launch

    asked = []
    monkeypatch.setattr(launch, "native_stacks", lambda rank, pid: asked.append((rank, pid)))
    # Fresh interpreters (not forked from the preloaded server): their stderr is the fd capfd captures now.
    with LocalCluster(2) as cluster:
        pid = cluster.processes[0].pid
        outcomes = cluster.run(_hang_in_a_named_function, timeout_s=20, failure_grace_s=1)
    assert "rank 1 fails at once" in outcomes[1].error
    # The rank that failed first is named with its error's last line (a test shows only the first outcome it asserts).
    expected = "no answer within 1 s after rank 1 failed (RuntimeError: rank 1 fails at once)"
    assert outcomes[0].error.startswith(expected), outcomes[0]
    err = capfd.readouterr().err
    assert "_hang_in_a_named_function" in err, err[-2000:]
    assert asked == [(0, pid)], asked


def test_native_stacks_reach_stderr(capfd):
    """native_stacks prints a process's native threads' stacks (gdb attached in batch mode) under its rank's name."""
    import shutil
    import subprocess

    from mooncake_ep_switch.launcher.processes import native_stacks

    if shutil.which("gdb") is None:
        pytest.skip("no gdb: native_stacks prints nothing")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        native_stacks(7, sleeper.pid, timeout_s=60)
    finally:
        sleeper.kill()
        sleeper.wait()
    err = capfd.readouterr().err
    assert f"--- native stacks of rank 7 (pid {sleeper.pid}) ---" in err, err[-2000:]
    assert "nanosleep" in err, err[-2000:]  # sleep's only thread, in the C library's sleep
