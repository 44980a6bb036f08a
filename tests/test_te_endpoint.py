"""TeEndpoint: one-sided writes over the Mooncake Transfer Engine (TCP, P2PHANDSHAKE).

Multi-process tests spawn "agent" processes (multiprocessing, spawn) that each own a TeEndpoint
and a registered buffer and execute commands sent over a Pipe; session ids and addresses travel
through those pipes. Every agent has a watchdog that ends it after AGENT_DEADLINE_S, every reply
is awaited with a timeout, and every agent is killed in a finally block (the fixture).

If the Transfer Engine cannot be imported (package or libibverbs1 missing) these tests FAIL.
"""
import ctypes
import gc
import mmap
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mooncake_ep_switch.buffer.transport.one_sided import (PROBE_BYTES, PROBE_FAST_FAIL_S, PROBE_RETRY_S,
                                                           PROBE_RETRY_WINDOW_S, write_probe)
from mooncake_ep_switch.buffer.transport.te_endpoint import PeerWrite, TeEndpoint, load_transfer_engine
from mooncake_ep_switch.errors import PeerBusy, TransferFailed
from tests.harness import stop_process

_CTX = multiprocessing.get_context("spawn")
AGENT_DEADLINE_S = 40.0  # hard cap on an agent's life (the watchdog calls os._exit)
STARTUP_TIMEOUT_S = 25.0  # importing torch in 4 fresh processes on 2 cores takes a while
REPLY_TIMEOUT_S = 15.0
SLACK_S = 2.0  # a failed write must be reported within timeout_s + SLACK_S


def _kernel_buffering() -> int:
    """The most payload a TCP connection's kernel buffers can hold (the sender's send buffer plus the
    receiver's autotuned receive buffer, tcp_wmem and tcp_rmem maxima): TE may report a write of no
    more than this complete while the peer's process is stopped, as the kernels took the bytes."""
    total = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            with open(f"/proc/sys/net/ipv4/{name}") as handle:
                total += int(handle.read().split()[2])
        except (OSError, ValueError, IndexError):
            total += 32 << 20
    return total


# A write to a SIGSTOPped peer times out only when the kernels cannot take all of it (a 1 MiB write did
# complete once, 1 of ~100 runs under load, into buffers autotuned to tens of MB): write more than that.
STALL_BYTES = ((_kernel_buffering() + (8 << 20)) >> 20) << 20


def _engine_or_fail():
    """The TransferEngine class; a missing engine FAILS the calling test (never a skip)."""
    try:
        return load_transfer_engine()
    except ImportError as exc:
        pytest.fail(f"Mooncake Transfer Engine unavailable, the TE transport is untested: {exc}",
                    pytrace=False)


def _address(buffer) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _pattern(tag: int, nbytes: int) -> bytes:
    """Structured bytes: a position-dependent ramp seeded by `tag` (misplaced bytes show)."""
    return bytes((tag * 37 + i * 7 + (i >> 8)) & 0xFF for i in range(nbytes))


# ---------------------------------------------------------------- the agent (child process)


def _agent_main(conn, options):
    watchdog = threading.Timer(options.get("deadline_s", AGENT_DEADLINE_S), os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    try:
        endpoint = TeEndpoint(timeout_s=options.get("timeout_s", 5.0), log_level="ERROR",
                              tcp_stall_timeout_s=options.get("tcp_stall_timeout_s"),
                              tcp_lanes_per_peer=options.get("tcp_lanes_per_peer"))
        nbytes = options.get("nbytes", 1 << 20)
        if options.get("buffer") == "torch":
            import torch

            tensor = torch.zeros(nbytes, dtype=torch.uint8)
            base = tensor.data_ptr()
            view = (ctypes.c_char * nbytes).from_address(base)
            holder = tensor
        else:
            holder = mmap.mmap(-1, nbytes)
            base = _address(holder)
            view = (ctypes.c_char * nbytes).from_buffer(holder)
        endpoint.register(base, nbytes)
    except BaseException as exc:
        conn.send(("err", type(exc).__name__, str(exc), 0.0))
        return
    conn.send(("ok", {"session": endpoint.session_id, "addr": base, "nbytes": nbytes, "pid": os.getpid()}))
    watcher = {}

    def watch(sig_off, data_off, data_len, last_round):
        # Invariant of "data, wait for completion, then signal": whenever signal s is visible,
        # every data byte is >= s (round r fills the data with byte r; rounds only increase).
        seen = violations = 0
        end = time.monotonic() + 20
        while time.monotonic() < end:
            signal_value = struct.unpack_from("<Q", view, sig_off)[0]
            if signal_value:
                seen += 1
                if min(view[data_off:data_off + data_len]) < signal_value:
                    violations += 1
                if signal_value >= last_round:
                    break
        watcher["result"] = (seen, violations, signal_value)

    handlers = {
        "fill": lambda off, data: view.__setitem__(slice(off, off + len(data)), data),
        "read": lambda off, n: bytes(view[off:off + n]),
        "connect": lambda peer, timeout: endpoint.connect(peer, timeout_s=timeout),
        "write": lambda peer, src_off, dst, n, timeout: endpoint.write(peer, base + src_off, dst, n, timeout_s=timeout),
        "write_batch": lambda peer, src_offs, dsts, lens, timeout: endpoint.write_batch(
            peer, [base + o for o in src_offs], dsts, lens, timeout_s=timeout),
        "write_each": lambda writes, timeout: _write_each(endpoint, base, writes, timeout),
        "read_batch": lambda peer, dst_offs, srcs, lens, timeout: endpoint.read_batch(
            peer, [base + o for o in dst_offs], srcs, lens, timeout_s=timeout),
        "num_abandoned": lambda: endpoint.num_abandoned,
        "abandoned_with": lambda peer: endpoint.abandoned_with(peer),
        "reading_into": lambda off, n: endpoint.reading_into(base + off, n),
        "wait_reaped": lambda peer, timeout: endpoint.wait_reaped(peer, timeout),
        "close": lambda: endpoint.close(),
        "data_port": lambda: _data_port(endpoint),
        "connections_to": _connections_to,
        "lanes_setting": lambda: os.environ.get("MC_TCP_LANES_PER_PEER"),
    }

    def rounds(peer, remote_base, data_off, data_len, sig_off, count, each=False):
        for r in range(1, count + 1):
            view[data_off:data_off + data_len] = bytes([r]) * data_len
            struct.pack_into("<Q", view, sig_off, r)
            if each:  # data as two ranges, then the signal, through write_each
                half = data_len // 2
                data = [(base + data_off, remote_base + data_off, half),
                        (base + data_off + half, remote_base + data_off + half, data_len - half)]
                failures = endpoint.write_each([PeerWrite(peer, data, [(base + sig_off, remote_base + sig_off, 8)])])
                assert not failures, failures
                continue
            endpoint.write(peer, base + data_off, remote_base + data_off, data_len)
            endpoint.write(peer, base + sig_off, remote_base + sig_off, 8)

    def _await_word(offset, timeout):
        """The CLOCK_MONOTONIC time at which the 8-byte word at `offset` first reads non-zero."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if struct.unpack_from("<Q", view, offset)[0]:
                return time.monotonic()
            time.sleep(0.0002)
        raise TimeoutError(f"word at {offset} still zero after {timeout} s")

    def start_watch(*args):
        thread = threading.Thread(target=watch, args=args, daemon=True)
        watcher["thread"] = thread
        thread.start()

    def watch_result():
        watcher["thread"].join(20)
        return watcher.get("result")

    handlers.update(rounds=rounds, watch=start_watch, watch_result=watch_result, await_word=_await_word)
    end = time.monotonic() + options.get("deadline_s", AGENT_DEADLINE_S)
    while conn.poll(max(0.0, end - time.monotonic())):
        try:
            command, *args = conn.recv()
        except EOFError:
            break
        if command == "quit":
            break
        began = time.monotonic()
        try:
            value = handlers[command](*args)
            conn.send(("ok", value, time.monotonic() - began))
        except BaseException as exc:
            conn.send(("err", type(exc).__name__, str(exc), time.monotonic() - began))
    endpoint.close()


def _data_port(endpoint) -> int:
    """The port of `endpoint`'s TE data listener: the one of its listening ports that is not its session's
    (the handshake port)."""
    handshake = int(endpoint.session_id.rpartition(":")[2])
    ports = {int(address.rpartition(":")[2]) for address in endpoint.listen_addresses} - {handshake}
    assert len(ports) == 1, (endpoint.session_id, endpoint.listen_addresses)
    return ports.pop()


def _connections_to(port: int) -> int:
    """How many established TCP sockets this process holds whose remote port is `port`."""
    from mooncake_ep_switch.buffer.transport.sockets import _tcp_rows, socket_inodes

    mine = socket_inodes()
    return sum(len(fields) >= 10 and fields[3] == "01" and int(fields[2].split(":")[1], 16) == port
               and int(fields[9]) in mine for fields, _ in _tcp_rows())


def _write_each(endpoint, base, writes, timeout):
    """Agent side of write_each: `writes` as (peer, [(src_off, dst, n)], [(src_off, dst, n)]) tuples."""
    started = time.monotonic()
    failures = endpoint.write_each(
        [PeerWrite(peer, [(base + o, d, n) for o, d, n in data], [(base + o, d, n) for o, d, n in signal])
         for peer, data, signal in writes], timeout_s=timeout)
    return started, {index: type(exc).__name__ for index, exc in failures.items()}


class AgentError(Exception):
    def __init__(self, kind, message, elapsed):
        super().__init__(f"{kind}: {message} (after {elapsed:.3f} s)")
        self.kind, self.message, self.elapsed = kind, message, elapsed


class Agent:
    def __init__(self, **options):
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_agent_main, args=(child, options), daemon=True)
        self.proc.start()
        child.close()
        self.info = None

    def ready(self, timeout=STARTUP_TIMEOUT_S):
        status, *rest = self._receive(timeout)
        if status != "ok":
            raise AgentError(*rest)
        self.info = rest[0]
        return self

    @property
    def session(self):
        return self.info["session"]

    @property
    def addr(self):
        return self.info["addr"]

    def call(self, *message, timeout=REPLY_TIMEOUT_S):
        """Run a command; return (value, elapsed) or raise AgentError with the agent's exception."""
        self.conn.send(message)
        status, *rest = self._receive(timeout)
        if status != "ok":
            raise AgentError(*rest)
        return rest[0], rest[1]

    def _receive(self, timeout):
        if not self.conn.poll(timeout):
            raise AssertionError(f"agent pid={self.proc.pid} did not answer within {timeout} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(1)
            raise AssertionError(f"agent pid={self.proc.pid} died (exit code {self.proc.exitcode})")

    def kill(self):
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            self.proc.kill()
        self.proc.join(5)


@pytest.fixture
def agents():
    created = []

    def spawn(count=None, *, each=None, **options):
        """`count` agents with `options`, or one agent per options dict in `each`."""
        _engine_or_fail()
        group = [Agent(**o) for o in (each if each is not None else [options] * count)]
        created.extend(group)
        return [agent.ready() for agent in group]

    try:
        yield spawn
    finally:
        for agent in created:
            agent.kill()


def _expect_failure(agent, *message, timeout_s, kinds=("ConnectionError", "ConnectionRefusedError", "TimeoutError")):
    began = time.monotonic()
    with pytest.raises(AgentError) as caught:
        agent.call(*message, timeout=timeout_s + 10)
    wall = time.monotonic() - began
    assert caught.value.kind in kinds, str(caught.value)
    assert caught.value.elapsed <= timeout_s + SLACK_S, str(caught.value)
    assert wall <= timeout_s + SLACK_S + 1.0
    return caught.value


# ---------------------------------------------------------------- in-process tests


def test_transfer_engine_importable():
    engine_class = _engine_or_fail()
    for method in ("initialize", "register_memory", "unregister_memory", "transfer_submit_write",
                   "transfer_check_status", "get_rpc_port"):
        assert hasattr(engine_class, method), method


def _thread_count():
    return len(os.listdir("/proc/self/task"))


def test_session_id_listeners_self_write_and_close():
    _engine_or_fail()
    gc.collect()
    threads_before = _thread_count()
    buffer = mmap.mmap(-1, 1 << 16)
    target = mmap.mmap(-1, 1 << 16)
    with TeEndpoint(log_level="ERROR") as endpoint:
        host, port = endpoint.session_id.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) == endpoint.rpc_port > 0
        listening = endpoint.listen_addresses
        assert any(a.endswith(f":{endpoint.rpc_port}") for a in listening), listening
        # TE binds its listeners to the wildcard whatever it advertises (no setting changes it).
        for address in listening:
            assert address.rsplit(":", 1)[0] in ("127.0.0.1", "0.0.0.0", "[::]"), listening
        endpoint.register(_address(buffer), len(buffer))
        endpoint.register(_address(target), len(target))
        buffer[0:300] = _pattern(5, 300)
        endpoint.write(endpoint.session_id, _address(buffer), _address(target) + 1000, 300)
        assert target[1000:1300] == _pattern(5, 300)
    assert endpoint.listen_addresses == []
    assert endpoint.registered == {}
    endpoint.close()  # idempotent
    gc.collect()
    # TE keeps at most one lazily started process-wide thread; the engine's own are gone.
    assert _thread_count() <= threads_before + 1


def test_bad_arguments_are_clear_errors():
    _engine_or_fail()
    for bad_host in ("0.0.0.0", "", "127.0.0.1:5000"):
        with pytest.raises(ValueError):
            TeEndpoint(bind_host=bad_host)
    before = os.environ.get("MC_TCP_LANES_PER_PEER")
    for bad_lanes, error in ((0, ValueError), (17, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="tcp_lanes_per_peer"):
            TeEndpoint(tcp_lanes_per_peer=bad_lanes)
    assert os.environ.get("MC_TCP_LANES_PER_PEER") == before  # nothing set by a refused call
    buffer = mmap.mmap(-1, 1 << 16)
    outside = mmap.mmap(-1, 1 << 16)
    base = _address(buffer)
    with TeEndpoint(timeout_s=3, log_level="ERROR") as endpoint:
        me = endpoint.session_id
        with pytest.raises(ValueError):
            endpoint.register(base, 0)
        with pytest.raises(ValueError):
            endpoint.register(0, 4096)
        with pytest.raises(TypeError):
            endpoint.register(float(base), 4096)
        endpoint.register(base, len(buffer))
        with pytest.raises(ValueError, match="overlaps"):
            endpoint.register(base + 4096, 4096)
        with pytest.raises(KeyError):
            endpoint.unregister(base + 64)
        for nbytes in (0, -1):
            with pytest.raises(ValueError, match="lengths"):
                endpoint.write(me, base, base, nbytes)
        with pytest.raises(ValueError, match="host:port"):
            endpoint.write("no-port", base, base, 8)
        with pytest.raises(ValueError, match="differ"):
            endpoint.write_batch(me, [base, base], [base], [8, 8])
        with pytest.raises(ValueError, match="at least one"):
            endpoint.write_batch(me, [], [], [])
        with pytest.raises(ValueError, match="timeout_s"):
            endpoint.write(me, base, base, 8, timeout_s=0)
        # The source must be registered (TCP would not need it, RDMA does).
        with pytest.raises(ValueError, match="not inside memory registered"):
            endpoint.write(me, _address(outside), base, 8)
        with pytest.raises(ValueError, match="not inside memory registered"):
            endpoint.write(me, base + len(buffer) - 4, base, 8)
        # TE's server rejects a destination outside the target's registered memory.
        began = time.monotonic()
        with pytest.raises(ConnectionError, match="registered") as caught:
            endpoint.write(me, base, _address(outside), 8)
        assert not isinstance(caught.value, ConnectionRefusedError)
        with pytest.raises(ConnectionError, match="registered"):
            endpoint.write(me, base, base + len(buffer) - 4, 8)  # overruns the region
        assert time.monotonic() - began < 3
        # A session nobody listens on: refused at once.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            dead = "127.0.0.1:%d" % probe.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            endpoint.write(dead, base, base, 8)
        assert time.monotonic() - began < 3
        endpoint.unregister(base)
        with pytest.raises(ValueError, match="not inside memory registered"):
            endpoint.write(me, base, base, 8)
    with pytest.raises(RuntimeError, match="closed"):
        endpoint.write(me, base, base, 8)
    with pytest.raises(RuntimeError, match="closed"):
        endpoint.register(base, 4096)


# ---------------------------------------------------------------- multi-process tests


def test_two_processes_write_structured_bytes_into_each_other(agents):
    # One buffer is an anonymous mmap, the other a torch uint8 tensor (its data_ptr).
    pair = agents(each=[{"nbytes": 1 << 20}, {"nbytes": 1 << 20, "buffer": "torch"}])
    chunk = 4096 + 17
    staging = 700000  # sources live above every destination range
    pieces = [(720000, 1), (730000, 65536 + 3), (900000, 1000)]  # (source offset, size)
    for rank, agent in enumerate(pair):
        peer = pair[1 - rank]
        agent.call("fill", staging, _pattern(rank, chunk))
        agent.call("write", peer.session, staging, peer.addr + rank * chunk, chunk, 5.0)
        # A batch of several ranges, scattered on both sides.
        for i, (offset, size) in enumerate(pieces):
            agent.call("fill", offset, _pattern(10 * rank + i, size))
        destinations, position = [], 300000 + rank * 100000
        for i, (_, size) in enumerate(pieces):
            destinations.append(peer.addr + position + 7 * i)
            position += size
        agent.call("write_batch", peer.session, [o for o, _ in pieces], destinations,
                   [s for _, s in pieces], 5.0)
    for rank, agent in enumerate(pair):
        source = 1 - rank
        assert agent.call("read", source * chunk, chunk)[0] == _pattern(source, chunk)
        assert agent.call("read", rank * chunk, chunk)[0] == bytes(chunk)  # nobody wrote there
        position = 300000 + source * 100000
        for i, (_, size) in enumerate(pieces):
            got = agent.call("read", position + 7 * i, size)[0]
            assert got == _pattern(10 * source + i, size), (rank, i)
            position += size


class _FailingWrites:
    """A stand-in for `TeEndpoint.write` that raises `errors[i]` on call i (None: the write lands),
    after `delay_s`."""

    def __init__(self, errors, delay_s=0.0):
        self.errors, self.calls, self.delay_s = list(errors), [], delay_s

    def write(self, session, local_addr, remote_addr, nbytes, timeout_s=None):
        self.calls.append((session, local_addr, remote_addr, nbytes, timeout_s))
        time.sleep(self.delay_s)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error


@pytest.mark.parametrize("fails", [0, 1, 3])
def test_connect_probe_tries_again_while_te_reconnects(fails):
    """After a link outage the first write to a peer whose only TE connection was lost fails at once
    while the peer's engine answers (`TransferFailed`), and starts TE's 1 s reconnect cooldown. The
    connect probe's range is valid, so it tries again: with one lane per peer a rejoin's probe otherwise
    failed and the rank agreed a view alone (tests/test_partition.py, issue 43)."""
    te = _FailingWrites([TransferFailed("TE is reconnecting")] * fails)
    started = time.monotonic()
    write_probe(te, "10.0.0.1:7000", 4096, 8192, started + 5.0)
    assert len(te.calls) == fails + 1
    assert all(call[:4] == ("10.0.0.1:7000", 4096, 8192, PROBE_BYTES) for call in te.calls)
    assert all(0.1 <= call[4] <= 5.0 for call in te.calls)  # each try gets what is left of the deadline
    assert time.monotonic() - started >= fails * PROBE_RETRY_S


@pytest.mark.parametrize("error", [TimeoutError("no answer"), ConnectionRefusedError("engine gone"),
                                   ConnectionError("unreachable"), PeerBusy("abandoned writes in flight")])
def test_connect_probe_does_not_retry_a_dead_or_silent_peer(error):
    """Only `TransferFailed` is tried again: a refused, unreachable, busy or timed-out peer is reported at
    once (a member that died after the seal is found missing without waiting for the deadline)."""
    te = _FailingWrites([error, None])
    with pytest.raises(type(error)):
        write_probe(te, "10.0.0.1:7000", 4096, 8192, time.monotonic() + 5.0)
    assert len(te.calls) == 1


def test_connect_probe_does_not_retry_a_slow_failure():
    """A `TransferFailed` that took PROBE_FAST_FAIL_S or more (a stalled peer, failed by TE's stall
    timeout while its host still accepts connections) is reported, not tried again until the deadline."""
    te = _FailingWrites([TransferFailed("stalled"), None], delay_s=PROBE_FAST_FAIL_S)
    with pytest.raises(TransferFailed, match="stalled"):
        write_probe(te, "10.0.0.1:7000", 4096, 8192, time.monotonic() + 10.0)
    assert len(te.calls) == 1


@pytest.mark.parametrize("budget_s", [1.0, 30.0])
def test_connect_probe_gives_up_at_its_deadline_or_retry_window(budget_s):
    """A probe that keeps failing at once gives up at its deadline, or PROBE_RETRY_WINDOW_S after the first
    failure when the deadline is further (a range the peer rejects is not retried for a whole deadline)."""
    te = _FailingWrites([TransferFailed("still failing")] * 1000)
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="still failing"):
        write_probe(te, "10.0.0.1:7000", 4096, 8192, started + budget_s)
    limit = min(budget_s, PROBE_RETRY_WINDOW_S)
    assert limit - PROBE_RETRY_S <= time.monotonic() - started < limit + 1.0
    assert 1 < len(te.calls) <= 1 + limit / PROBE_RETRY_S


@pytest.mark.parametrize("lanes", [None, 1])
def test_one_lane_keeps_every_write_on_the_connection_the_first_write_opened(agents, lanes):
    """With `tcp_lanes_per_peer=1` (what a Buffer sets, `config.TE_TCP_LANES_PER_PEER`) every write to a
    peer, however many are in flight, goes over the one data connection the first write opened. TE's
    own default (None here, 4 lanes) opens more while a batch's ranges wait: fresh connections inside a
    call, which under CPU contention now and then stalled a write for a whole deadline (issue 43)."""
    writer, victim = agents(each=[{"nbytes": 1 << 20, "tcp_lanes_per_peer": lanes}, {"nbytes": 1 << 20}])
    assert writer.call("lanes_setting")[0] == (None if lanes is None else str(lanes))
    port = victim.call("data_port")[0]
    writer.call("fill", 0, _pattern(5, 1 << 16))
    writer.call("write", victim.session, 0, victim.addr, 64, 5.0)  # the first write: one connection
    assert writer.call("connections_to", port)[0] == 1
    ranges = 32  # a round's many ranges in flight at once
    for _ in range(10):
        writer.call("write_batch", victim.session, [2048 * i for i in range(ranges)],
                    [victim.addr + 2048 * i for i in range(ranges)], [2048] * ranges, 5.0)
    assert victim.call("read", 0, 1 << 16)[0] == _pattern(5, 1 << 16)
    opened = writer.call("connections_to", port)[0]
    if lanes == 1:
        assert opened == 1
    else:  # TE's default: more lanes opened inside the batches (what the setting avoids)
        assert opened > 1


def test_four_processes_all_to_all_batches(agents):
    group = agents(4, nbytes=1 << 21)
    slot = 1 << 18  # source s writes into [s * slot, (s + 1) * slot) of every peer
    staging = 1 << 20  # sources live above every destination range
    sizes = [1, 3000, 50000]
    for agent in group:  # handshake with everyone while everyone is healthy
        for peer in group:
            if peer is not agent:
                agent.call("connect", peer.session, 5.0)
    for src, agent in enumerate(group):
        offsets = []
        position = staging
        for i, size in enumerate(sizes):
            agent.call("fill", position, _pattern(src * 10 + i, size))
            offsets.append(position)
            position += size + 13
        for dst, peer in enumerate(group):
            if dst == src:
                continue
            remote = [peer.addr + src * slot + 100 * dst + o - staging for o in offsets]
            agent.call("write_batch", peer.session, offsets, remote, sizes, 5.0)
    for dst, agent in enumerate(group):
        for src in range(4):
            if src == dst:
                continue
            position = 0
            for i, size in enumerate(sizes):
                got = agent.call("read", src * slot + 100 * dst + position, size)[0]
                assert got == _pattern(src * 10 + i, size), (src, dst, i)
                position += size + 13


@pytest.mark.parametrize("each", [False, True], ids=["write", "write_each"])
def test_signal_after_completed_data_is_never_seen_early(agents, each):
    writer, reader = agents(2, nbytes=1 << 21)
    data_off, data_len, sig_off, count = 0, 1 << 20, (1 << 20) + 4096, 30
    writer.call("connect", reader.session, 5.0)
    reader.call("watch", sig_off, data_off, data_len, count)
    writer.call("rounds", reader.session, reader.addr, data_off, data_len, sig_off, count, each, timeout=25)
    seen, violations, last = reader.call("watch_result", timeout=25)[0]
    assert last == count
    assert seen > 0
    assert violations == 0


def test_write_each_dead_and_stopped_peers_do_not_delay_a_live_one(agents):
    """One call to a SIGKILLed, a SIGSTOPped and a healthy peer: the healthy peer's data and signal
    land at once (not after the others' failures), the others are reported within the deadline."""
    writer, dead, stopped, healthy = agents(4, nbytes=STALL_BYTES + (1 << 20))
    timeout_s = 2.5
    for peer in (dead, stopped, healthy):
        writer.call("connect", peer.session, 5.0)
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.join(5)
    # Warm TE's reconnect pause to the dead peer: later writes to it take ~1 s each to fail.
    _expect_failure(writer, "write", dead.session, 0, dead.addr, 64, timeout_s, timeout_s=timeout_s)
    stop_process(stopped.proc.pid)
    try:
        data_len, sig_off = 1 << 20, (1 << 20) + 4096
        writer.call("fill", 0, _pattern(7, data_len))
        writer.call("fill", sig_off, struct.pack("<Q", 7))
        half = data_len // 2

        def write_for(peer):
            data = [(0, peer.addr, half), (half, peer.addr + half, data_len - half)]
            if peer is stopped:  # more than the kernels' buffers take: the write cannot complete
                data.append((sig_off + 4096, peer.addr + sig_off + 4096, STALL_BYTES - data_len))
            return (peer.session, data, [(sig_off, peer.addr + sig_off, 8)])

        healthy.conn.send(("await_word", sig_off, timeout_s + 5))
        writer.conn.send(("write_each", [write_for(p) for p in (dead, stopped, healthy)], timeout_s))
        status, *rest = writer._receive(timeout_s + 10)
        assert status == "ok", rest
        (started, failures), elapsed = rest
        status, *rest = healthy._receive(10)
        assert status == "ok", rest
        landed = rest[0]
        assert landed - started < 0.5, f"the healthy peer's signal landed {landed - started:.3f} s after the start"
        assert healthy.call("read", 0, data_len)[0] == _pattern(7, data_len)
        assert set(failures) == {0, 1}, failures
        assert failures[0] in ("ConnectionRefusedError", "ConnectionError"), failures
        assert failures[1] == "TimeoutError", failures
        assert timeout_s - 0.05 <= elapsed <= timeout_s + SLACK_S, elapsed
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)


def test_write_each_bad_arguments_submit_nothing():
    _engine_or_fail()
    buffer = mmap.mmap(-1, 1 << 16)
    target = mmap.mmap(-1, 1 << 16)
    base, dest = _address(buffer), _address(target)
    with TeEndpoint(timeout_s=3, log_level="ERROR") as endpoint:
        me = endpoint.session_id
        endpoint.register(base, len(buffer))
        endpoint.register(dest, len(target))
        good = PeerWrite(me, [(base, dest, 64)], [(base + 64, dest + 64, 8)])
        with pytest.raises(TypeError, match=r"writes\[0\] must be a PeerWrite"):
            endpoint.write_each([(me, [], [])])
        with pytest.raises(ValueError, match="appears twice"):
            endpoint.write_each([good, good])
        with pytest.raises(ValueError, match=r"writes\[0\].data\[0\] nbytes: expected an int >= 1"):
            endpoint.write_each([PeerWrite(me, [(base, dest, 0)], [])])
        with pytest.raises(ValueError, match=r"writes\[0\].signal\[0\] must be"):
            endpoint.write_each([PeerWrite(me, [], [(base, dest)])])
        with pytest.raises(ValueError, match="not inside memory registered"):
            endpoint.write_each([PeerWrite(me, [(base + len(buffer), dest, 8)], [])])
        with pytest.raises(ValueError, match="timeout_s"):
            endpoint.write_each([good], timeout_s=0)
        assert target[0:72] == bytes(72)  # nothing was submitted by the refused calls
        buffer[0:72] = _pattern(9, 72)
        assert endpoint.write_each([good]) == {}
        assert target[0:72] == _pattern(9, 72)
        # A destination outside the peer's registered memory: reported, not raised.
        failures = endpoint.write_each([PeerWrite(me, [(base, dest + len(target) - 4, 8)], [(base, dest, 8)])])
        assert list(failures) == [0] and "registered" in str(failures[0])
    with pytest.raises(RuntimeError, match="closed"):
        endpoint.write_each([good])


@pytest.mark.parametrize("nbytes", [4096, 4 << 20], ids=["small", "large"])
def test_write_each_in_flight_runs_once_between_submit_and_wait(nbytes):
    """`in_flight` runs once, after the data was submitted and before the signal (which follows the
    completed data); its writes and the engine's both land; an exception from it propagates and
    leaves the endpoint usable. Small writes spin first, large ones do not (both paths)."""
    _engine_or_fail()
    buffer = mmap.mmap(-1, nbytes + 64)
    target = mmap.mmap(-1, nbytes + 64)
    side = mmap.mmap(-1, 64)
    base, dest = _address(buffer), _address(target)
    with TeEndpoint(timeout_s=10, log_level="ERROR") as endpoint:
        me = endpoint.session_id
        endpoint.register(base, len(buffer))
        endpoint.register(dest, len(target))
        buffer[0:nbytes] = _pattern(3, nbytes)
        buffer[nbytes:nbytes + 8] = _pattern(4, 8)
        write = PeerWrite(me, [(base, dest, nbytes)], [(base + nbytes, dest + nbytes, 8)])
        seen = []

        def in_flight():
            seen.append(bytes(target[nbytes:nbytes + 8]))  # the signal is not submitted yet
            side[0:8] = _pattern(5, 8)

        assert endpoint.write_each([write], in_flight=in_flight) == {}
        assert seen == [bytes(8)]
        assert target[0:nbytes + 8] == _pattern(3, nbytes) + _pattern(4, 8) and side[0:8] == _pattern(5, 8)

        def broken():
            raise KeyError("in_flight failed")

        target[0:nbytes + 8] = bytes(nbytes + 8)
        with pytest.raises(KeyError, match="in_flight failed"):
            endpoint.write_each([write], in_flight=broken)
        assert endpoint.write_each([write]) == {}  # still usable
        assert target[0:nbytes + 8] == _pattern(3, nbytes) + _pattern(4, 8)


def test_an_exception_in_flight_lets_the_submitted_writes_finish_first():
    """A write that was submitted when `in_flight` raised is not abandoned while it can still finish
    within the deadline: the exception propagates once the data has landed, and the next write to
    the peer goes through (it used to be abandoned at once: a 64 MiB write takes longer than the
    5 ms settle, so the next write_each was refused with PeerBusy)."""
    _engine_or_fail()
    nbytes = 64 << 20
    buffer = mmap.mmap(-1, nbytes + 64)
    target = mmap.mmap(-1, nbytes + 64)
    base, dest = _address(buffer), _address(target)
    data = os.urandom(1 << 20) * 64
    with TeEndpoint(timeout_s=30, log_level="ERROR") as endpoint:
        endpoint.register(base, len(buffer))
        endpoint.register(dest, len(target))
        buffer[0:nbytes] = data
        write = PeerWrite(endpoint.session_id, [(base, dest, nbytes)], [(base + nbytes, dest + nbytes, 8)])

        def broken():
            raise KeyError("in_flight failed")

        with pytest.raises(KeyError, match="in_flight failed"):
            endpoint.write_each([write], in_flight=broken)
        assert target[0:nbytes] == data, "the exception propagated before the submitted data landed"
        assert endpoint.abandoned_with(endpoint.session_id) == 0
        assert endpoint.write_each([write]) == {}


def test_write_to_sigkilled_peer_fails_within_deadline(agents):
    writer, victim, healthy, never_contacted = agents(4, nbytes=1 << 20)
    timeout_s = 2.0
    writer.call("fill", 0, _pattern(1, 4096))
    for peer in (victim, healthy):
        writer.call("connect", peer.session, 5.0)
        writer.call("write", peer.session, 0, peer.addr, 4096, timeout_s)
    os.kill(victim.proc.pid, signal.SIGKILL)
    os.kill(never_contacted.proc.pid, signal.SIGKILL)
    victim.proc.join(5)
    never_contacted.proc.join(5)
    assert not victim.proc.is_alive() and not never_contacted.proc.is_alive()
    for _ in range(3):  # the first fails at once, later ones after TE's 1 s reconnect pause
        _expect_failure(writer, "write", victim.session, 0, victim.addr, 4096, timeout_s, timeout_s=timeout_s)
    _expect_failure(writer, "write_batch", victim.session, [0, 100], [victim.addr, victim.addr + 5000],
                    [64, 64], timeout_s, timeout_s=timeout_s)
    error = _expect_failure(writer, "write", never_contacted.session, 0, never_contacted.addr, 64, timeout_s,
                            timeout_s=timeout_s)
    assert error.kind == "ConnectionRefusedError", str(error)
    # A dead peer does not disturb writes to a live one.
    writer.call("fill", 0, _pattern(2, 4096))
    _, elapsed = writer.call("write", healthy.session, 0, healthy.addr, 4096, timeout_s)
    assert elapsed < 1.0
    assert healthy.call("read", 0, 4096)[0] == _pattern(2, 4096)


def test_read_batch_in_process_exact_bytes_and_bad_ranges():
    """Reads land exactly; a remote range outside the peer's registered memory is refused by TE (a
    ConnectionError, nothing read); a local range outside registered memory is refused before
    anything is submitted."""
    _engine_or_fail()
    local, remote, outside = mmap.mmap(-1, 1 << 16), mmap.mmap(-1, 1 << 16), mmap.mmap(-1, 4096)
    with TeEndpoint(timeout_s=3, log_level="ERROR") as endpoint:
        me = endpoint.session_id
        endpoint.register(_address(local), len(local))
        endpoint.register(_address(remote), len(remote))
        remote[0:len(remote)] = _pattern(9, len(remote))
        endpoint.read_batch(me, [_address(local) + 5, _address(local) + 40000], [_address(remote) + 100,
                                                                              _address(remote) + 1],
                            [30000, 4096 + 3])
        assert local[5:30005] == remote[100:30100] and local[40000:44099] == remote[1:4100]
        assert local[0:5] == bytes(5) and local[30005:40000] == bytes(9995)
        local[0:len(local)] = bytes(len(local))
        with pytest.raises(ConnectionError, match="registered"):
            endpoint.read_batch(me, [_address(local)], [_address(remote) + len(remote) - 10], [64])
        with pytest.raises(ValueError, match="not inside memory registered"):
            endpoint.read_batch(me, [_address(outside)], [_address(remote)], [64])
        with pytest.raises(ValueError, match="lengths"):
            endpoint.read_batch(me, [_address(local)], [_address(remote)], [])
        assert local[0:len(local)] == bytes(len(local))


def test_read_from_peer_then_from_sigkilled_peer_fails_within_deadline(agents):
    reader, holder = agents(2, nbytes=1 << 20)
    holder.call("fill", 1000, _pattern(4, 70000))
    reader.call("read_batch", holder.session, [0, 80000], [holder.addr + 1000, holder.addr + 60000],
                [60000, 10000], 5.0)
    assert reader.call("read", 0, 60000)[0] == _pattern(4, 70000)[:60000]
    assert reader.call("read", 80000, 10000)[0] == _pattern(4, 70000)[59000:69000]
    os.kill(holder.proc.pid, signal.SIGKILL)
    holder.proc.join(5)
    assert not holder.proc.is_alive()
    _expect_failure(reader, "read_batch", holder.session, [0], [holder.addr], [4096], 2.0, timeout_s=2.0)


def test_write_to_stopped_peer_times_out(agents):
    writer, victim, healthy = agents(3, nbytes=STALL_BYTES)
    timeout_s = 1.5
    for peer in (victim, healthy):
        writer.call("connect", peer.session, 5.0)
    stop_process(victim.proc.pid)
    try:
        error = _expect_failure(writer, "write", victim.session, 0, victim.addr, STALL_BYTES, timeout_s,
                                timeout_s=timeout_s, kinds=("TimeoutError",))
        assert error.elapsed >= timeout_s - 0.05
        assert writer.call("num_abandoned")[0] >= 1  # TE still owns it; reaped once TE gives up
        writer.call("fill", 0, _pattern(3, 512))
        _, elapsed = writer.call("write", healthy.session, 0, healthy.addr + 64, 512, timeout_s)
        assert elapsed < 1.0
        assert healthy.call("read", 64, 512)[0] == _pattern(3, 512)
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)


def test_no_write_to_a_peer_while_an_abandoned_write_to_it_may_still_land(agents):
    """Issue 28 item 3. A write abandoned at its deadline (the peer stopped, or its link down) stays in
    flight inside TE and lands whenever the peer answers again, possibly over bytes written since. So
    every later write to that peer is refused at once (PeerBusy, nothing submitted) until TE has finished
    the abandoned one; other peers are not disturbed; afterwards the newest bytes are the ones that stay."""
    writer, victim, healthy = agents(3, nbytes=STALL_BYTES)
    timeout_s, nbytes = 1.0, STALL_BYTES
    for peer in (victim, healthy):
        writer.call("connect", peer.session, 5.0)
    writer.call("fill", 0, _pattern(5, 8192))  # what is checked; the rest of the write is zeros
    stop_process(victim.proc.pid)
    try:
        _expect_failure(writer, "write", victim.session, 0, victim.addr, nbytes, timeout_s, timeout_s=timeout_s,
                        kinds=("TimeoutError",))
        assert writer.call("abandoned_with", victim.session)[0] >= 1
        assert writer.call("abandoned_with", healthy.session)[0] == 0
        for message in (("write", victim.session, 0, victim.addr, 64, timeout_s),
                        ("write_batch", victim.session, [0], [victim.addr + 64], [64], timeout_s)):
            error = _expect_failure(writer, *message, timeout_s=timeout_s, kinds=("PeerBusy",))
            assert error.elapsed < 0.2 and "abandoned" in error.message, str(error)
        started, failures = writer.call("write_each", [(victim.session, [(0, victim.addr, 64)], [(0, victim.addr, 8)]),
                                                      (healthy.session, [(0, healthy.addr, 4096)],
                                                       [(0, healthy.addr + 4096, 8)])], timeout_s)[0]
        assert failures == {0: "PeerBusy"}, failures
        assert healthy.call("read", 0, 4096)[0] == _pattern(5, 4096)
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    assert writer.call("wait_reaped", victim.session, 15.0, timeout=25)[0] == 0
    writer.call("fill", 0, _pattern(6, 4096))
    writer.call("write", victim.session, 0, victim.addr, 4096, timeout_s)
    time.sleep(0.2)
    assert victim.call("read", 0, 4096)[0] == _pattern(6, 4096)  # the newer bytes stay
    assert victim.call("read", 4096, 4096)[0] == _pattern(5, 8192)[4096:8192]  # the abandoned write landed


def test_no_read_into_bytes_an_abandoned_read_may_still_land_in(agents):
    """Issue 28 item 2, at the engine. A read abandoned at its deadline may still land in its local range;
    `reading_into` says so, and a new read into those bytes (from any peer) is refused until TE finished
    it, while reads into other bytes from a healthy peer go on."""
    reader, stopped, healthy = agents(3, nbytes=1 << 21)
    timeout_s, nbytes = 1.0, 1 << 20
    stopped.call("fill", 0, _pattern(7, 4096))
    healthy.call("fill", 0, _pattern(8, 4096))
    for peer in (stopped, healthy):
        reader.call("connect", peer.session, 5.0)
    stop_process(stopped.proc.pid)
    try:
        _expect_failure(reader, "read_batch", stopped.session, [0], [stopped.addr], [nbytes], timeout_s,
                        timeout_s=timeout_s, kinds=("TimeoutError",))
        assert reader.call("reading_into", 4096, 64)[0] and not reader.call("reading_into", nbytes, 64)[0]
        error = _expect_failure(reader, "read_batch", healthy.session, [4096], [healthy.addr], [4096], timeout_s,
                                timeout_s=timeout_s, kinds=("PeerBusy",))
        assert error.elapsed < 0.2, str(error)
        reader.call("read_batch", healthy.session, [nbytes], [healthy.addr], [4096], timeout_s)
        assert reader.call("read", nbytes, 4096)[0] == _pattern(8, 4096)
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    assert reader.call("wait_reaped", stopped.session, 15.0, timeout=25)[0] == 0
    assert not reader.call("reading_into", 4096, 64)[0]
    reader.call("read_batch", healthy.session, [4096], [healthy.addr], [4096], timeout_s)
    assert reader.call("read", 4096, 4096)[0] == _pattern(8, 4096)


def test_handshake_with_hung_peer_is_aborted_at_the_deadline(agents):
    """A peer that accepts connections but never answers (hung, or SIGSTOPped before first
    contact). TE would block the whole engine ~60 s in the handshake; the endpoint aborts it."""
    writer, healthy = agents(2, nbytes=1 << 20)
    writer.call("connect", healthy.session, 5.0)
    listener = socket.socket()
    accepted = []
    stop = threading.Event()
    thread = None
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.2)

        def accept_forever():
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0])  # never answers
                except OSError:
                    continue

        thread = threading.Thread(target=accept_forever, daemon=True)
        thread.start()
        hung = "127.0.0.1:%d" % listener.getsockname()[1]
        timeout_s = 1.0
        error = _expect_failure(writer, "connect", hung, timeout_s, timeout_s=timeout_s, kinds=("TimeoutError",))
        assert "aborted" in error.message
        _expect_failure(writer, "write", hung, 0, 4096, 64, timeout_s, timeout_s=timeout_s, kinds=("TimeoutError",))
        # The engine is not left blocked by the hung handshake.
        writer.call("fill", 0, _pattern(4, 256))
        _, elapsed = writer.call("write", healthy.session, 0, healthy.addr, 256, timeout_s)
        assert elapsed < 0.5
        assert healthy.call("read", 0, 256)[0] == _pattern(4, 256)
    finally:
        stop.set()
        if thread is not None:
            thread.join(2)
        listener.close()
        for connection in accepted:
            connection.close()


_STALLED_PEER = r"""
import socket, sys, time
host, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with socket.create_connection((host, port), timeout=5) as conn:
    conn.sendall(b"\x01")  # the first byte of a handshake request, then nothing more (or a trickle)
    print("connected", flush=True)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        time.sleep(1.5)
        if mode == "trickle":
            conn.sendall(b"\x7f")
"""


@pytest.mark.parametrize("stall", ["stopped", "trickle"])
def test_close_is_bounded_while_a_peer_stalls_in_a_handshake(agents, stall):
    """Issue 28 item 1. TE's handshake listener reads one inbound handshake at a time (5 s per read)
    and the engine's destructor joins it holding the GIL: a peer SIGSTOPped mid-handshake held close()
    ~5 s, one trickling a byte every 1.5 s ~10 s. close() (and so Buffer.destroy()) must stay bounded."""
    import subprocess
    import sys

    (owner,) = agents(1, nbytes=1 << 16)
    host, port = owner.session.rsplit(":", 1)
    peer = subprocess.Popen([sys.executable, "-c", _STALLED_PEER, host, port, stall], stdout=subprocess.PIPE)
    try:
        assert peer.stdout.readline().strip() == b"connected"
        if stall == "stopped":
            stop_process(peer.pid)
        time.sleep(0.3)  # the listener has accepted it and is blocked reading the rest
        began = time.monotonic()
        _, elapsed = owner.call("close", timeout=40)
        assert elapsed < 2.5 and time.monotonic() - began < 3.5, f"close() took {elapsed:.2f} s"
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(5)


def test_an_abandoned_write_to_a_stopped_peer_is_reaped_within_the_stall_timeout(agents):
    """Issue 28 items 1 and 3. A write the peer's kernel took whole (it fits the socket buffers) but whose
    peer process is SIGSTOPped waits inside TE for the peer's status frame: TE's default gives up after
    30 s, and until then the peer is refused (PeerBusy) and close() must wait for or leave the write.
    The Buffer sets a stall timeout (`config.TE_TCP_STALL_TIMEOUT_S`); with it TE fails the write after
    about that long, the write is reaped while the peer is still stopped, and close() is quick."""
    stall_timeout_s = 3
    writer, victim = agents(each=[{"nbytes": 1 << 20, "tcp_stall_timeout_s": stall_timeout_s}, {"nbytes": 1 << 20}])
    writer.call("connect", victim.session, 5.0)
    stop_process(victim.proc.pid)
    try:
        _expect_failure(writer, "write", victim.session, 0, victim.addr, 64 << 10, 1.0, timeout_s=1.0,
                        kinds=("TimeoutError",))
        assert writer.call("abandoned_with", victim.session)[0] >= 1
        began = time.monotonic()
        assert writer.call("wait_reaped", victim.session, stall_timeout_s + 4.0, timeout=20)[0] == 0, \
            "the abandoned write was not failed by TE within its stall timeout"
        assert time.monotonic() - began < stall_timeout_s + 4.0
        _, elapsed = writer.call("close", timeout=20)
        assert elapsed < 2.5, f"close() took {elapsed:.2f} s"
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)


def test_shutdown_inbound_ends_accepted_connections_only(tmp_path):
    """The native helper of close(): this process's accepted connections on the port are shut down,
    the listening socket and connections on other ports are not, and no other descriptor is touched
    (closing a duplicate of a file would drop the process's fcntl locks on it); bad arguments are
    clear errors."""
    import fcntl

    from mooncake_ep_switch import _native

    locked = open(tmp_path / "lock", "w")
    fcntl.lockf(locked, fcntl.LOCK_EX)

    def holds_lock():
        inode = os.fstat(locked.fileno()).st_ino
        with open("/proc/locks") as table:
            return any(f":{inode} " in line and f" {os.getpid()} " in line for line in table)

    assert holds_lock()

    with socket.socket() as listener, socket.socket() as other:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        other.bind(("127.0.0.1", 0))
        other.listen(4)
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        served, _ = listener.accept()
        bystander = socket.create_connection(other.getsockname(), timeout=5)
        kept, _ = other.accept()
        try:
            assert _native.shutdown_inbound(port) == 1
            assert holds_lock()  # the scan never duplicated (and closed) the locked file's descriptor
            served.settimeout(2)
            assert served.recv(1) == b""  # shut down: reads end at once
            kept.settimeout(0.2)
            with pytest.raises(socket.timeout):
                kept.recv(1)  # another port: untouched
            later = socket.create_connection(("127.0.0.1", port), timeout=5)  # still listening
            listener.accept()[0].close()
            later.close()
            reaper = _native.InboundReaper(port, 0.01, 30.0)
            again = socket.create_connection(("127.0.0.1", port), timeout=5)
            accepted, _ = listener.accept()
            accepted.settimeout(2)
            assert accepted.recv(1) == b""  # shut down by the running reaper
            assert reaper.stop() >= 1 and reaper.stop() == reaper.aborted  # stop is idempotent
            for sock in (again, accepted):
                sock.close()
        finally:
            for sock in (client, served, bystander, kept):
                sock.close()
    for bad in ((0, 0.01, 1.0), (70000, 0.01, 1.0), (port, 0.0, 1.0), (port, -1.0, 1.0), (port, 0.01, 0.0)):
        with pytest.raises(ValueError, match="port|period_s|max_s"):
            _native.InboundReaper(*bad)
    with pytest.raises(ValueError, match="port"):
        _native.shutdown_inbound(-1)
    with pytest.raises(ValueError, match="report_after_s"):
        _native.InboundReaper(port, 0.01, 1.0, report_after_s=-1.0)
    locked.close()


def test_a_teardown_that_takes_long_reports_what_each_thread_waits_in():
    """issue 28 item 1: the engine's destructor can hold the GIL, so no Python code can say why close()
    takes long; the native reaper writes once to stderr, after `report_after_s`, every thread of the
    process with what it waits in, while the main thread holds the GIL (a pure-Python busy loop)."""
    code = textwrap.dedent("""
        import os, sys, threading, time
        from mooncake_ep_switch import _native
        sleeper = threading.Thread(target=time.sleep, args=(3.0,), daemon=True)
        sleeper.start()
        reaper = _native.InboundReaper(65000, 0.01, 30.0, report_after_s=0.2)
        quiet = _native.InboundReaper(65001, 0.01, 30.0)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass  # holds the GIL throughout
        reaper.stop(); quiet.stop()
        print(os.getpid(), sleeper.native_id, reaper.reported, quiet.reported)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid, sleeper, reported, quiet = done.stdout.split()
    assert (reported, quiet) == ("True", "False")
    head, *threads = done.stderr.strip().splitlines()
    assert "port 65000 is still not destroyed 0.2 s after close()" in head and "65001" not in done.stderr
    tids = {line.split()[0]: line for line in threads}
    assert pid in tids and sleeper in tids, done.stderr
    assert all(" wchan=" in line and " syscall=" in line for line in threads)
    # a thread in time.sleep waits in the kernel: its line names a syscall number, not "running"
    assert tids[sleeper].split("syscall=")[1].strip().isdigit(), tids[sleeper]
    from mooncake_ep_switch import _native

    assert "\n" in _native.thread_report(4) and _native.thread_report(1).count("\n") <= 2


@pytest.mark.parametrize("probe, refused, answered", [
    (ConnectionRefusedError, True, True),  # nothing listens: the engine is gone
    (ConnectionResetError, False, True),  # a listener torn down with the probe in its queue: its host answered
    (socket.timeout, False, False),  # no answer from its host (a cut link): the cause is chained
])
def test_a_failed_writes_probe_tells_an_answering_host_from_a_silent_one(monkeypatch, probe, refused, answered):
    """`OneSidedTransport` asks the peer watcher why a write failed only when the peer's host answered the probe
    (an error without `__cause__`). A reset of the probe (seen beside 2 CPU hogs: the dying peer's listener closed
    while the probe sat in its queue) is an answer; it used to be chained as "no answer", and the survivor masked
    a SIGKILLed peer as a cut link ('cut') before its watcher, 50 ms later, saw the process end."""
    def create_connection(address, timeout=None):
        raise probe("probe")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    error = TeEndpoint._failure_error("10.0.0.1:12345", "TE write to 10.0.0.1:12345 failed")
    assert isinstance(error, ConnectionError) and isinstance(error, ConnectionRefusedError) is refused, error
    assert (error.__cause__ is None) is answered, (error, error.__cause__)
