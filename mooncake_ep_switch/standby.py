"""A warm standby: a replacement process made ready before any rank dies, told later which rank it replaces.

A cold replacement pays, after the death, for its process start, its imports (torch: most of it),
the engine's weights and its Buffer. A standby pays them in advance and, once told the rank, only
builds the rank's Buffer from a join ticket, joins and is admitted (SGLang's `--elastic-ep-rejoin`
and vLLM's standby groups keep such processes too)::

    standby = WarmStandby(store, num_ranks, num_ep_buffer_bytes, prepare=load_weights)  # before any death
    ...                                                   # the engine learns rank r died (PeerMasked)
    buffer = standby.replace(r)                           # refused (ValueError) while rank r runs
    buffer.update_ep_member()                             # admitted by the members' update_ep_member()
    weights = standby.prepared                            # what prepare() returned

The Buffer is built once the rank is known: its region, incarnation and endpoint records are the
rank's (a Buffer of "some rank" cannot be made in advance); what it costs is measured in
docs/recovery.md. `replace` refuses a rank whose process it can see running: on this host the pid
of the rank's published endpoint runs (and is no zombie); on another host its watch listener still
accepts a connection. A rank it cannot see either way (no endpoint published, the listener does not
answer in time) is taken: the members' admission decides, as for any joiner.
"""
import socket
import time
from typing import Any, Callable, Optional, Sequence

from mooncake_ep_switch.buffer.buffer import Buffer
from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.elastic import join

__all__ = ["WarmStandby", "rank_process_alive"]

_PROBE_S = 0.5  # connecting to a remote rank's watch listener


def _pid_runs(pid: int) -> bool:
    """Whether process `pid` exists on this host and is not a zombie (a SIGKILLed child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _listener_answers(host: str, port: int) -> Optional[bool]:
    """True: a connection to host:port was accepted; False: refused; None: no answer in time."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_S):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def rank_process_alive(endpoint: dict, host_id: str) -> Optional[bool]:
    """Whether the process that published `endpoint` runs, as far as this process can see.

    Arguments:
        endpoint: a rank's published endpoint (`Membership.endpoint`): `"region"` `[pid, fd, nbytes]`
            or `"pid"`, `"host_id"`, and across hosts `"watch_host"`/`"watch_port"` or
            `"te_session"` with `"watch_port"`.
        host_id: this process's host identity (`settings().host_id`).

    Returns:
        alive: True (it runs), False (it is gone) or None (this process cannot tell).
    """
    pid = endpoint.get("pid")
    if pid is None and isinstance(endpoint.get("region"), (list, tuple)) and endpoint["region"]:
        pid = endpoint["region"][0]
    if endpoint.get("host_id") == host_id and isinstance(pid, int) and pid > 0:
        return _pid_runs(pid)
    port = endpoint.get("watch_port")
    host = endpoint.get("watch_host") or str(endpoint.get("te_session", "")).rsplit(":", 1)[0]
    if isinstance(port, int) and port > 0 and host:
        return _listener_answers(host, port)
    return None


class WarmStandby:
    """A replacement prepared in advance: imports done, the engine's `prepare()` run, the store connected.

    Arguments:
        store: client of the group's store (`elastic.connect_store`, or the launcher's).
        num_ranks: EP group size.
        num_ep_buffer_bytes: the EP region size the members' Buffers have.
        prepare: called once, here, with no arguments (load weights, build caches); its value is
            `prepared`. None: nothing to prepare.
        transport: the members' Buffer transport.
        prefix, group_ranks, keep_prefix, buffer_index: as `elastic.join` takes them.

    Attributes:
        prepared: what `prepare()` returned (None without it).
        timings: wall-clock times (`time.time()`): "prepared", and after `replace` "assigned" and "buffer".

    Raises:
        TypeError, ValueError: a bad argument (named); `prepare` not callable.
    """

    def __init__(self, store, num_ranks: int, num_ep_buffer_bytes: int, *, prepare: Optional[Callable[[], Any]] = None,
                 transport: str = "auto", prefix: str = "mep", group_ranks: Optional[Sequence[int]] = None,
                 keep_prefix: bool = False, buffer_index: Optional[int] = None):
        self.num_ranks = check_int("num_ranks", num_ranks, 1)
        self.num_ep_buffer_bytes = check_int("num_ep_buffer_bytes", num_ep_buffer_bytes, 0)
        if prepare is not None and not callable(prepare):
            raise TypeError(f"prepare: expected a callable or None, got {type(prepare).__name__}")
        join(store, 0, self.num_ranks, prefix=prefix, group_ranks=group_ranks, keep_prefix=keep_prefix,
             buffer_index=buffer_index)  # the arguments checked now: replace() only adds the rank
        self.store, self.transport = store, transport
        self._join = dict(prefix=prefix, group_ranks=group_ranks, keep_prefix=keep_prefix, buffer_index=buffer_index)
        self.buffer: Optional[Buffer] = None
        self.prepared = prepare() if prepare is not None else None
        self.timings = {"prepared": time.time()}

    def replace(self, rank: int) -> Buffer:
        """Take over `rank`: build its Buffer from a join ticket (not a member until `update_ep_member()`).

        Arguments:
            rank: the dead rank to replace, in `[0, num_ranks)`.

        Returns:
            buffer: the replacement's `Buffer`; call its `update_ep_member()` to be admitted.

        Raises:
            TypeError, ValueError: `rank` is not a rank of the group, or its process still runs
                (named with its pid or listener; nothing was written to the store).
            RuntimeError: this standby already replaced a rank.
        """
        rank = check_int("rank", rank, 0)
        if rank >= self.num_ranks:
            raise ValueError(f"rank: expected 0 <= rank < num_ranks={self.num_ranks}, got {rank}")
        if self.buffer is not None:
            raise RuntimeError(f"replace: this standby already replaced rank {self.buffer.rank}")
        self.timings["assigned"] = time.time()
        endpoint = self._endpoint(rank)
        if endpoint is not None:
            from mooncake_ep_switch.config import settings

            if rank_process_alive(endpoint, settings().host_id):
                where = (f"process {endpoint.get('pid') or endpoint['region'][0]} on this host"
                         if endpoint.get("host_id") == settings().host_id else "its watch listener answers")
                raise ValueError(f"rank: expected a dead rank to replace, got rank {rank}, which is alive ({where}, "
                                 f"incarnation {endpoint.get('incarnation')}); nothing was changed")
        ticket = join(self.store, rank, self.num_ranks, **self._join)
        self.buffer = Buffer(ticket, self.num_ep_buffer_bytes, transport=self.transport)
        self.timings["buffer"] = time.time()
        return self.buffer

    def _endpoint(self, rank: int) -> Optional[dict]:
        """The endpoint the members' current incarnation of `rank` published (read only), or None."""
        import torch.distributed as dist

        from mooncake_ep_switch.buffer.membership.group_keys import group_prefix, root_store
        from mooncake_ep_switch.buffer.membership.protocol import Membership, MembershipError
        from mooncake_ep_switch.buffer.membership.records import RecordStore
        from mooncake_ep_switch.config import settings

        options = self._join
        store = self.store if options["keep_prefix"] else root_store(self.store)
        ranks = options["group_ranks"] if options["group_ranks"] is not None else range(self.num_ranks)
        base = group_prefix(ranks, options["prefix"])
        counters = RecordStore(dist.PrefixStore(f"{base}/generation", store), f"{base}/generation")
        newest = max(counters.read_counter(str(r)) for r in range(self.num_ranks))
        if newest < 1:  # no member built a Buffer of the group yet
            return None
        generation = options["buffer_index"] or 1  # what join() takes in a process holding no joined Buffer
        observer = Membership(store, rank, self.num_ranks, f"{base}/g{generation}", secret=settings().job_secret,
                              take_incarnation=False)
        try:
            return observer.endpoint(rank)
        except MembershipError:
            return None

    def __repr__(self) -> str:
        state = "ready" if self.buffer is None else f"replaced rank {self.buffer.rank}"
        return f"WarmStandby(num_ranks={self.num_ranks}, {state})"
