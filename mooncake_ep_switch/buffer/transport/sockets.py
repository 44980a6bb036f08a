"""This process's TCP sockets as the kernel lists them (/proc/self/fd, /proc/net/tcp{,6}).

Helpers of `te_endpoint.TeEndpoint`: which listening sockets a Transfer Engine opened (the
engine binds wildcard addresses and does not report them), and shutting down the sockets of a
handshake that outlived its deadline (TE blocks in a read while holding an engine-wide lock).
Linux only; every reader returns nothing rather than raising where /proc is missing.
"""
from __future__ import annotations

import os
import socket
from typing import List, Set, Tuple

__all__ = ["abort_connections", "listening", "parse_session", "socket_inodes"]


def parse_session(peer_session: str) -> Tuple[str, int]:
    if not isinstance(peer_session, str):
        raise TypeError(f"peer_session must be a 'host:port' string, got {type(peer_session).__name__}")
    host, sep, port = peer_session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer_session must look like 'host:port', got {peer_session!r}")
    return host.strip("[]"), int(port)


def socket_inodes() -> Set[int]:
    inodes = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _tcp_rows():
    """Yield (fields, is_ipv6) for every socket row of /proc/net/tcp and /proc/net/tcp6."""
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            yield row.split(), v6


def _decode_addr(hex_addr: str, v6: bool) -> str:
    """The IP address of a /proc/net/tcp{,6} hex address field (kernel byte order)."""
    raw = bytes.fromhex(hex_addr)
    if v6:
        return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return socket.inet_ntop(socket.AF_INET, raw[::-1])


def listening(inodes: Set[int]) -> List[str]:
    """'addr:port' of the LISTEN sockets among `inodes` (from /proc/net/tcp and tcp6)."""
    found = []
    for fields, v6 in _tcp_rows():
        if len(fields) < 10 or fields[3] != "0A" or int(fields[9]) not in inodes:
            continue
        hex_addr, hex_port = fields[1].split(":")
        addr = _decode_addr(hex_addr, v6)
        addr = f"[{addr}]" if v6 else addr
        found.append(f"{addr}:{int(hex_port, 16)}")
    return sorted(found)


def abort_connections(peer_session: str) -> int:
    """Shut down this process's TCP sockets to `peer_session` (established or connecting).

    Used on a handshake that outlived its deadline: TE blocks in a read (up to ~60 s) while
    holding an engine-wide lock; shutting the socket down makes that read fail at once. Only
    sockets of this process whose remote end is exactly the peer's handshake address are
    touched, each verified by inode through a dup, so an fd reused meanwhile is never hit.
    Returns how many sockets were shut down.
    """
    host, port = parse_session(peer_session)
    try:
        remote_ips = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return 0
    remote_ips |= {"::ffff:" + ip for ip in remote_ips if "." in ip}
    targets = set()
    for fields, v6 in _tcp_rows():
        if len(fields) < 10 or fields[3] not in ("01", "02"):  # ESTABLISHED, SYN_SENT
            continue
        hex_addr, hex_port = fields[2].split(":")
        if int(hex_port, 16) != port:
            continue
        addr = _decode_addr(hex_addr, v6)
        if addr in remote_ips:
            targets.add(int(fields[9]))
    aborted = 0
    if not targets:
        return 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) not in targets:
            continue
        try:
            dup = os.dup(int(name))
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino in targets:
                sock = socket.socket(fileno=dup)
                dup = -1
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    aborted += 1
                except OSError:
                    pass
                finally:
                    sock.close()  # closes only the dup; TE still owns and closes its fd
        finally:
            if dup >= 0:
                os.close(dup)
    return aborted

