"""The launcher's store: a TCPStore that listens on one address only (torch's own listens on every interface)."""
import socket
from datetime import timedelta
from typing import Optional

__all__ = ["host_store"]

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
