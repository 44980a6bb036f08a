"""Early death detection for the one-sided transports: a peer process that is gone is failed at once.

Without it a receive learns that a source died only at its deadline (`timeout_us`), and a survivor
that spent that deadline waiting for a dead peer then starts its own sends late, so a survivor that
had learned of the death sooner (a refused write) times out on a live rank: one death masks two.
`PeerWatch` keeps one background thread that blocks in poll() on one file descriptor per watched
peer and raises that peer's flag in `dead` (an int32 `[R]` tensor the native receive waits read)
when the descriptor says the process is gone:

* a peer reached through shared memory: a pidfd of its process (readable once it exits, SIGKILL
  included; the pid is the one its region was published with). Opened before the region is mapped,
  and the mapping checks that this pid holds the rank's sealed region, so the pid is the peer's.
* a peer reached over the Transfer Engine (on this host or another): a TCP connection to the
  peer's watch listener (bound to the configured address, published with the endpoint). An end of
  file or a reset is confirmed by reconnecting: a refused connection means the peer process is
  gone; if the peer answers it is alive and is watched again (a connection closed within 1 s of
  opening is not reopened: watching that peer stops and its deadline decides). A cut link raises
  nothing (no end of file crosses it): the deadline decides, as before.

A flag only makes a wait stop early for a source whose signals are not all there; a peer that sent
everything and died after is still counted, exactly as the deadline would. Flags are cleared when a
peer is watched again (a replacement admitted with `update_ep_member`).
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["PeerWatch"]

log = logging.getLogger("mooncake_ep_switch.buffer.transport")

_PROBE_TIMEOUT_S = 0.5  # confirming a closed watch connection: connect() to the peer's listener


_ANSWER = b"\x01"  # what a listener sends a watcher it accepted
_SETTLE_S = 0.1  # pause before probing again a listener that dropped a connection unanswered
_PROBES = 4  # probe connections before a peer that keeps dropping them is given up on
_MIN_CONNECTION_S = 1.0  # a watch connection closed younger than this is not reopened (no reconnect storm)
_VERDICT_S = _PROBES * (_PROBE_TIMEOUT_S + _SETTLE_S)  # bounds `confirm_gone`: the probes of one verdict


class _Watched:
    __slots__ = ("kind", "fd", "handle", "address", "opened")

    def __init__(self, kind: str, fd: int, handle, address: Optional[Tuple[str, int]] = None):
        self.kind = kind  # "pid" or "socket"
        self.fd = fd
        self.handle = handle  # the pidfd (int) or the socket object
        self.address = address
        self.opened = time.monotonic()


class PeerWatch:
    """Flags dead peers in `dead` as soon as their process is gone (see the module docstring).

    Arguments:
        num_ranks: group size (length of `dead`).
        rank: this rank (never watched).
        bind_host: address the watch listener binds to, or None for no listener (then peers on
            other hosts cannot watch this rank and fall back to their deadlines).
        max_accepted: cap on connections the listener holds open (further ones are closed at once).
        dead: `[num_ranks]` torch.int32 CPU tensor the verdicts are written into (the cuda transport
            passes words of its pinned control block, which its device waits read), or None for a
            tensor of its own. Zeroed here.
    """

    def __init__(self, num_ranks: int, rank: int, bind_host: Optional[str], max_accepted: Optional[int] = None,
                 dead: Optional[torch.Tensor] = None):
        self.num_ranks = num_ranks
        self.rank = rank
        if dead is not None and (dead.dtype != torch.int32 or tuple(dead.shape) != (num_ranks,) or not dead.is_cpu
                                 or not dead.is_contiguous()):
            raise ValueError(f"dead: expected a contiguous [{num_ranks}] torch.int32 CPU tensor, got "
                             f"{dead.dtype} {list(dead.shape)} on {dead.device}")
        self.dead = torch.zeros(num_ranks, dtype=torch.int32) if dead is None else dead.zero_()
        self.dead_ptr = self.dead.data_ptr()
        self._lock = threading.Lock()
        self._verdict = threading.Condition(self._lock)  # notified whenever a peer's watch entry changes
        self._watched: Dict[int, _Watched] = {}
        self._accepted: Dict[int, socket.socket] = {}
        self._max_accepted = max_accepted if max_accepted is not None else 4 * num_ranks
        self._closed = False
        self._listener: Optional[socket.socket] = None
        self.port = 0
        if bind_host is not None:
            family = socket.AF_INET6 if ":" in bind_host.strip("[]") else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.bind((bind_host.strip("[]"), 0))
                listener.listen(max(8, num_ranks))
                listener.setblocking(False)
            except OSError:
                listener.close()
                raise
            self._listener = listener
            self.port = listener.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=f"mep-peer-watch-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ watching
    def watch_process(self, peer: int, pid: int) -> None:
        """Watch `peer` through its process id (a peer on this host); clears its flag.

        Arguments:
            peer: the peer's rank.
            pid: its process id, > 0.
        """
        self._check_peer(peer)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"pid: expected a process id > 0, got {pid!r}")
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._replace(peer, None)
            self.dead[peer] = 1  # already gone
            return
        self._replace(peer, _Watched("pid", fd, fd))

    def watch_address(self, peer: int, host: str, port: int, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
        """Watch `peer` through a connection to its watch listener (a TE peer); clears its flag.

        Returns once the peer's listener has accepted the connection (it answers one byte), so after
        a barrier every member holds the connections of its watchers (a fixed descriptor count), or,
        if no answer came within `timeout_s` but the connection is still open (a starved listener
        thread), watches it anyway.

        Arguments:
            peer: the peer's rank.
            host: the peer's address.
            port: its watch listener's port, in (0, 65536).
            timeout_s: connect and answer timeout in seconds.

        Returns:
            watched: bool, False when the listener took the connection but closed or reset it
                unanswered (its cap): then the peer is not watched and its deadline decides, as
                without a watcher.

        Raises:
            ConnectionError / OSError: the listener cannot be reached (the caller treats the peer
                as unreachable, as for any other endpoint).
        """
        self._check_peer(peer)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port: expected an int in (0, 65536), got {port!r}")
        address = (host.strip("[]"), port)
        sock = _open(address, timeout_s, keep_unanswered=True)
        if sock is None:
            self._replace(peer, None)
            return False
        self._replace(peer, _Watched("socket", sock.fileno(), sock, address))
        return True

    def forget(self, peer: int) -> None:
        """Stop watching `peer` and clear its flag (it left the view)."""
        self._check_peer(peer)
        self._replace(peer, None)

    def dead_ranks(self) -> List[int]:
        """Ranks whose process was seen to end since they were last watched (the `dead` flags).

        Returns:
            ranks: list of int, ascending.
        """
        # One read of each word (`tolist`), never `torch.nonzero`: the watcher thread (and, on the cuda
        # transport, the device) writes these words while we read them, and nonzero counts in one pass
        # and writes in another, so a flag set in between overruns its output (heap corruption).
        return [rank for rank, flag in enumerate(self.dead.tolist()) if flag]

    def confirm_gone(self, peer: int, timeout_s: float = _VERDICT_S) -> bool:
        """Whether `peer`'s process is gone, waiting up to `timeout_s` for the watcher's verdict on its
        watch connection.

        A Transfer Engine write to a peer being SIGKILLed is reset a few milliseconds before its watch
        connection ends (the dying process closes its descriptors one by one), so the call that met the
        failure asks why before this thread saw the end: without the wait a death on another host read
        as a cut link. Call it with a wait only when the peer's end is likely (a write refused or
        reset): a live peer costs the whole wait. Returns at once for a peer not watched through a
        connection (its flag as it is).

        Arguments:
            peer: the peer's rank.
            timeout_s: the longest wait for the verdict, >= 0 (default: the probes of one verdict).

        Returns:
            gone: bool, whether the peer's flag in `dead` is raised: False when the watcher found it
                alive, could not tell, does not watch it through a connection, or said nothing in time.
        """
        self._check_peer(peer)
        with self._verdict:
            watched = self._watched.get(peer)
            if not self.dead[peer] and watched is not None and watched.kind == "socket":
                self._verdict.wait_for(lambda: self._closed or self._watched.get(peer) is not watched, timeout_s)
            return bool(self.dead[peer])

    def is_watched(self, peer: int) -> bool:
        with self._lock:
            return peer in self._watched

    def close(self) -> bool:
        """Stop the thread and close every descriptor. Idempotent.

        Returns:
            stopped: bool, whether the watcher thread has ended (it no longer writes `dead`).
        """
        with self._lock:
            if self._closed:
                return not self._thread.is_alive()
            self._closed = True
            self._verdict.notify_all()  # a `confirm_gone` waits no more
        self._wake()
        self._thread.join(5.0)
        with self._lock:
            for watched in self._watched.values():
                _close(watched)
            self._watched.clear()
            for sock in self._accepted.values():
                sock.close()
            self._accepted.clear()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        return not self._thread.is_alive()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ internals
    def _check_peer(self, peer: int) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.num_ranks or peer == self.rank:
            raise ValueError(f"peer: expected a rank in [0, {self.num_ranks}) other than {self.rank}, got {peer!r}")

    def _replace(self, peer: int, watched: Optional[_Watched]) -> None:
        with self._lock:
            if self._closed:
                if watched is not None:
                    _close(watched)
                raise RuntimeError("PeerWatch is closed")
            old = self._watched.pop(peer, None)
            if watched is not None:
                self._watched[peer] = watched
            self.dead[peer] = 0
            self._verdict.notify_all()
        if old is not None:
            _close(old)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _run(self) -> None:
        poller = select.poll()
        registered: Dict[int, object] = {}
        while True:
            with self._lock:
                if self._closed:
                    return
                wanted: Dict[int, object] = {self._wake_r: "wake"}
                if self._listener is not None:
                    wanted[self._listener.fileno()] = "listen"
                for peer, watched in self._watched.items():
                    wanted[watched.fd] = (peer, watched)
                for fd, sock in self._accepted.items():
                    wanted[fd] = ("accepted", sock)
            for fd in list(registered):
                if fd not in wanted or registered[fd] != wanted[fd]:
                    poller.unregister(fd)
                    del registered[fd]
            for fd, what in wanted.items():
                if fd not in registered:
                    poller.register(fd, select.POLLIN | select.POLLPRI)
                    registered[fd] = what
            try:
                events = poller.poll(1000)
            except InterruptedError:
                continue
            for fd, _ in events:
                what = registered.get(fd)
                if what == "wake":
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except OSError:
                        pass
                elif what == "listen":
                    self._accept()
                elif isinstance(what, tuple) and what[0] == "accepted":
                    self._drain_accepted(fd, what[1])
                elif isinstance(what, tuple):
                    self._peer_event(*what)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            with self._lock:
                if self._closed or len(self._accepted) >= self._max_accepted:
                    sock.close()
                    continue
                sock.setblocking(False)
                self._accepted[sock.fileno()] = sock  # held before the watcher hears the answer
                try:
                    sock.send(_ANSWER)  # the watcher waits for it (a few bytes always fit the buffer)
                except OSError:
                    del self._accepted[sock.fileno()]
                    sock.close()

    def _drain_accepted(self, fd: int, sock: socket.socket) -> None:
        """A watcher of this rank went away or sent data (watchers never send): close the connection."""
        try:
            sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        with self._lock:
            self._accepted.pop(fd, None)
        sock.close()

    def _peer_event(self, peer: int, watched: _Watched) -> None:
        if watched.kind == "pid":
            verdict = "gone"  # a pidfd polls readable once the process exited
        else:
            if not self._socket_closed(watched):
                return
            verdict = self._reconnect(peer, watched)
            if verdict == "alive":
                return
        with self._lock:
            if self._watched.get(peer) is not watched:
                return  # replaced meanwhile (a new member): its flag is not this one's
            del self._watched[peer]
            if verdict == "gone":
                self.dead[peer] = 1
            self._verdict.notify_all()
        if verdict == "gone":
            log.warning("rank %d: the process of rank %d ended (seen by its %s); waits for it stop now",
                        self.rank, peer, "pidfd" if watched.kind == "pid" else "watch connection")
        else:
            log.info("rank %d: the watch connection of rank %d closed and its process could not be confirmed "
                     "alive or gone; its deadlines decide", self.rank, peer)
        _close(watched)  # "unknown": not watched any more; the deadline decides

    @staticmethod
    def _socket_closed(watched: _Watched) -> bool:
        try:
            data = watched.handle.recv(4096)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return not data

    def _reconnect(self, peer: int, watched: _Watched) -> str:
        """After the watch connection ended: "gone" if the peer's listener refuses (its process is
        gone), "alive" (and watched again) if it answers, "unknown" if it cannot be reached or keeps
        dropping connections. A process being torn down can still complete a connect() into its
        listener's queue and then reset it, so a connection dropped unanswered is retried.
        A watch connection closed younger than _MIN_CONNECTION_S is not reopened (a live listener
        dropping it: its cap, or a stranger's listener): watching stops, the deadline decides."""
        young = time.monotonic() - watched.opened < _MIN_CONNECTION_S
        for _ in range(_PROBES):
            try:
                sock = _open(watched.address, _PROBE_TIMEOUT_S)
            except ConnectionRefusedError:
                return "gone"
            except (ConnectionResetError, ConnectionAbortedError, socket.timeout):
                sock = None  # the handshake met a listener being torn down, or a starved one: look again
            except OSError:
                return "unknown"  # unreachable (a cut link): the deadline decides
            if sock is None:  # taken and dropped (a dying listener resets its queue): look again
                time.sleep(_SETTLE_S / 2)
                continue
            if young:
                sock.close()
                return "unknown"
            fresh = _Watched("socket", sock.fileno(), sock, watched.address)
            with self._lock:
                if self._watched.get(peer) is not watched:
                    sock.close()
                    return "alive"
                self._watched[peer] = fresh
                self._verdict.notify_all()
            _close(watched)
            return "alive"
        return "unknown"


def _open(address: Tuple[str, int], timeout_s: float, keep_unanswered: bool = False) -> Optional[socket.socket]:
    """A watch connection to `address` once its listener answered (non-blocking), or None if the
    connection was taken but closed or reset unanswered within `timeout_s`.

    With `keep_unanswered`, a connection still open but not answered within `timeout_s` is kept
    (the listener's thread may be starved on a loaded host; its answer, read later, is ignored):
    watching it is better than leaving the peer to its deadline.

    Raises:
        ConnectionRefusedError: nothing listens there; OSError: unreachable.
    """
    sock = socket.create_connection(address, timeout=timeout_s)
    if _connected_to_itself(sock):
        # A loopback connect to a port nobody listens on can pick that port as its own source
        # port and reach itself (TCP simultaneous open): nothing listens there.
        sock.close()
        raise ConnectionRefusedError(f"nothing listens on {address}: the connection reached itself")
    try:
        answer = sock.recv(len(_ANSWER))
    except socket.timeout:  # open, not answered yet
        answer = None
    except OSError:  # reset
        answer = b""
    if answer == _ANSWER or (answer is None and keep_unanswered):
        sock.setblocking(False)
        return sock
    sock.close()
    return None


def _connected_to_itself(sock: socket.socket) -> bool:
    try:
        return sock.getsockname() == sock.getpeername()
    except OSError:  # reset already: not a self-connection
        return False


def _close(watched: _Watched) -> None:
    try:
        if watched.kind == "pid":
            os.close(watched.handle)
        else:
            watched.handle.close()
    except OSError:
        pass
