"""Moving a thread into a Linux network namespace: what the launcher needs to start a rank on its host.

`enter` moves the calling thread for good (a rank's main thread, before any socket exists);
`inside` moves it for one block and back (the launcher's store socket made in the hub namespace).
The namespaces themselves are made by `bench.netns.Network`.
"""
import contextlib
import os
from typing import Iterator, Optional

from mooncake_ep_switch import _native


def enter(namespace: str) -> None:
    """Move the calling thread into network namespace `namespace` (setns).

    Arguments:
        namespace: a name from `Network.names`.

    Raises:
        OSError: the namespace does not exist or setns failed (needs CAP_SYS_ADMIN).
    """
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _native.enter_net_namespace(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside(namespace: Optional[str]) -> Iterator[None]:
    """Run the block with the calling thread in network namespace `namespace`, then move it back.

    Sockets made in the block stay in `namespace` (so do threads started in it) after the thread
    returns: how the launcher makes its store listen inside the hub namespace.

    Arguments:
        namespace: a namespace name, or None (the block runs where the thread is).

    Raises:
        OSError: the namespace does not exist, or setns failed (needs CAP_SYS_ADMIN).
    """
    if namespace is None:
        yield
        return
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(namespace)
        try:
            yield
        finally:
            _native.enter_net_namespace(home)
    finally:
        os.close(home)
