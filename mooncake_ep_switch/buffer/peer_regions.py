"""Every shared region peers map, owned by the Buffer's membership: registered, re-mapped, rebuilt.

Structures built on a `Buffer` that own regions peers write into (the switch's unified weights and
their control words, the TP all-reduce, the paged KV cache, the EPLB expert slots) register as
*participants* of the Buffer's `PeerRegions` at construction, in construction order (the same on
every rank: construction is collective). Participant `i` of every rank publishes its regions'
endpoints in the membership store (`regions/<i>/<rank>/<incarnation>`), so that:

- at construction, every member maps every other member's regions of participant `i` (over the
  constructor's group in epoch 0, through the store after a membership change);
- when `update_ep_member()` admits a replacement, the members publish what it must take over from
  each participant (`peer_state()`: switch sequence, layout, call counters, placement), then wait,
  participant by participant in that one agreed order, for the replacement's regions and map them;
  they also forget the replaced rank's failure (`readmitted()`) and, on the collective transport,
  move each participant onto the new view's group;
- the replacement, once admitted, rebuilds its participants with the same constructors in the same
  order: each constructor takes its state over (`joined_state()`), loads its weights from the
  caller's loader, and maps the members' regions of the same participant.

Across hosts (a Buffer on the `"mooncake"` transport): every participant region is registered
with the Buffer's Transfer Engine and its registered address is published in the record
(`"te_bases"`, one per region). A member the transport reaches over shared memory is mapped as
above; one it reaches over the Transfer Engine (another host) is set *remote* in each region
(`SharedRegion.set_remote`: the session the transport connected, the published address), so the
participant reads it one-sided over the engine. Records are exchanged through the store on this
transport (no group collective), and re-admission refreshes a replacement's remote addresses the
same way it re-maps a same-host replacement.

A participant is any object with `shared_regions() -> list of SharedRegion`, `peer_state() -> dict`
(JSON) and `readmitted(ranks) -> None` (see `Participant`); the registry holds it weakly, and
its `destroy()` calls `PeerRegions.remove`.
"""
import time
import weakref
from typing import Dict, List, NamedTuple, Optional, Protocol, Sequence

from mooncake_ep_switch.buffer.membership import batch_reads
from mooncake_ep_switch.buffer.membership.protocol import MembershipError, View
from mooncake_ep_switch.buffer.shared_region import RemoteRegion


class Participant(Protocol):
    """What a structure registered with `PeerRegions` provides."""

    group: object

    def shared_regions(self) -> list:
        """The `SharedRegion`s peers map (empty on the collective transport), in a fixed order."""

    def peer_state(self) -> dict:
        """JSON dict a replacement of this rank takes over (passed back by `joined_state()`)."""

    def readmitted(self, ranks: Sequence[int]) -> None:
        """`ranks` were replaced and re-admitted (their new regions are mapped)."""


class _Entry(NamedTuple):
    index: int
    kind: str
    owner: weakref.ref


class PeerRegions:
    """The participants of one Buffer (see the module docstring).

    Arguments:
        buffer: the `Buffer` (its membership, rank, members, epoch, group and transport are used).
    """

    def __init__(self, buffer):
        self._buffer = weakref.ref(buffer)
        self._entries: List[_Entry] = []
        self._next_index = 0
        self._expected: List[dict] = []  # a replacement's participants still to rebuild (from the members)
        self._known: Dict[int, int] = {}  # member -> incarnation whose regions are mapped here

    def snapshot(self, ranks: Sequence[int], epoch: int) -> None:
        """Remember the incarnations of `ranks` (the members now mapped); a later one is a joiner.

        Arguments:
            ranks: iterable of int EP ranks.
            epoch: the epoch of the view whose members were mapped (its incarnations: those read to map them are
                kept, so no store call re-reads them).
        """
        membership = self._buffer().membership
        if membership is not None:
            self._known = membership.incarnations_at(epoch, ranks)

    # ------------------------------------------------------------------ construction
    def joined_state(self, kind: str) -> Optional[dict]:
        """The members' state for this rank's next participant, while a replacement rebuilds.

        Arguments:
            kind: the participant's kind (e.g. `"unified_weights"`); must be the kind the members
                registered at this position.

        Returns:
            state: the JSON dict the members' participant returned from `peer_state()`, or None
                when this rank is not rebuilding (an ordinary collective construction).

        Raises:
            ValueError: the members' participant at this position is of another kind (the
                replacement builds its structures in another order than the members did).
        """
        if not self._expected:
            return None
        head = self._expected[0]
        if head["kind"] != kind:
            raise ValueError(f"kind: the members' next participant is a {head['kind']!r} (participant {head['index']}); "
                             f"a replacement rebuilds in the members' construction order, got a {kind!r}")
        return head["state"]

    def add(self, owner, kind: str) -> int:
        """Register `owner` and map its regions with every member's regions of the same participant.

        Collective over the members, except while this rank rebuilds after its admission (then
        only the members' published regions are mapped; the members map this rank's regions in
        their `update_ep_member()`).

        Arguments:
            owner: a `Participant`.
            kind: its kind (the same on every rank for this position).

        Returns:
            index: the participant index.

        Raises:
            MembershipError: a member's regions were not published before the connect timeout.
            ValueError: a member's region has another size or kind.
        """
        buffer = self._buffer()
        if buffer.joining:
            raise RuntimeError(f"{kind}: rank {buffer.rank} is not a member yet; build it after update_ep_member() "
                               "admits this rank (it then takes the members' state over)")
        rebuilding = bool(self._expected)
        if rebuilding:
            index = self._expected.pop(0)["index"]
            self._next_index = max(self._next_index, index + 1)
        else:
            index = self._next_index
            self._next_index += 1
        regions = owner.shared_regions()
        membership = buffer.membership
        self._entries.append(_Entry(index, kind, weakref.ref(owner)))
        if membership is not None:
            membership.publish_region_record(index, self._record(kind, regions))
        if not regions:
            return index
        peers = [r for r in buffer.members if r != buffer.rank]
        deadline = time.monotonic() + buffer.settings.connect_timeout_s
        if not rebuilding and buffer.epoch == 0 and buffer.group is not None and buffer.transport == "shm":
            for region in regions:  # the constructor's group: one all-gather per region
                region.group = buffer.group
                region.connect()
            return index
        if membership is None:
            raise RuntimeError(f"{kind}: mapping peers after a membership change needs the group's store")
        # Collective over the members (their records read once all are there, `batch_reads`), except while this rank
        # rebuilds (the members registered this participant before it came).
        self._map_all(membership, index, kind, peers, regions, deadline,
                      together=None if rebuilding else buffer.epoch)
        if not rebuilding:  # nobody returns (and could close an fd a slower peer opens) before all mapped
            membership.barrier(f"regions/{index}/{buffer.epoch}", buffer.members, deadline)
        return index

    def remove(self, owner) -> None:
        """Forget `owner` (its `destroy()`); a replacement no longer rebuilds it.

        Arguments:
            owner: a registered participant (others are ignored).
        """
        self._entries = [e for e in self._entries if e.owner() is not None and e.owner() is not owner]

    def participants(self) -> list:
        """(index, kind, owner) of the live participants, in construction order."""
        found = []
        for entry in self._entries:
            owner = entry.owner()
            if owner is not None:
                found.append((entry.index, entry.kind, owner))
        return found

    def clear(self) -> None:
        """Forget every participant (the Buffer is destroyed)."""
        self._entries, self._expected = [], []

    # ------------------------------------------------------------------ re-admission
    def admitted(self, view: View, deadline: float) -> None:
        """This rank was admitted into `view` as a joiner: learn what to rebuild, or re-map what it has.

        A fresh replacement (no participants) reads the members' participant list and state; a
        rank that was left out and rejoins keeps its participants, republishes them for its new
        incarnation and maps the members' regions.

        Arguments:
            view: the view that admitted this rank.
            deadline: `time.monotonic()` deadline.

        Raises:
            MembershipError: the members published no state before `deadline`.
        """
        buffer = self._buffer()
        membership = buffer.membership
        states = membership.wait_for(lambda: membership.peer_state(view.epoch), deadline,
                                     f"the members' participant state of epoch {view.epoch}")
        self.snapshot(view.ranks, view.epoch)
        live = self.participants()
        if not live:
            self._expected = list(states)
            return
        peers = [r for r in view.ranks if r != buffer.rank]
        for index, kind, owner in live:
            regions = owner.shared_regions()
            membership.publish_region_record(index, self._record(kind, regions))
            if regions:
                self._map_all(membership, index, kind, peers, regions, deadline)

    def readmit(self, view: View, deadline: float) -> None:
        """A member's half of a re-admission: hand the joiners their state, then map their regions.

        Joiners are the ranks of `view` whose incarnation is not the one mapped here (a
        replacement process, or a rank that was left out and rejoined).

        Arguments:
            view: the newly agreed view.
            deadline: `time.monotonic()` deadline; the joiners must have rebuilt every participant by then.

        Raises:
            MembershipError: a joiner did not publish a participant's regions before `deadline`
                (`missing` names the joiners).
        """
        buffer = self._buffer()
        membership = buffer.membership
        live = self.participants()
        if buffer.transport == "collective":
            for _, _, owner in live:
                owner.group = buffer.process_group
        incarnations = batch_reads.incarnations_of(membership, view.ranks)
        joiners = [r for r in view.ranks if r != buffer.rank and incarnations[r] != self._known.get(r)]
        if not joiners:
            self._known = incarnations
            return
        publisher = min(r for r in view.ranks if r not in joiners)
        if buffer.rank == publisher:
            membership.publish_peer_state(view.epoch, [{"index": index, "kind": kind, "state": owner.peer_state()}
                                                       for index, kind, owner in live])
        for index, kind, owner in live:
            regions = owner.shared_regions()
            if not regions:
                continue
            found = batch_reads.published_region_records(membership, index, joiners, deadline)
            for joiner in joiners:
                try:
                    self._map(membership, index, kind, joiner, regions, deadline, found.get(joiner))
                except MembershipError as error:
                    raise MembershipError(f"{error} (the replacement must rebuild every participant, in the "
                                          "members' order, before the members' update_ep_member() times out)",
                                          [joiner]) from None
        for _, _, owner in live:
            owner.readmitted(joiners)
        self._known = incarnations

    def transfer_engine(self):
        """The Buffer's Transfer Engine endpoint (`TeEndpoint`), or None when it has none."""
        buffer = self._buffer()
        return None if buffer is None else buffer.runtime.transfer_engine()

    def _record(self, kind: str, regions: list) -> dict:
        """The region record of a participant; regions are registered with the Transfer Engine first."""
        record = {"kind": kind, "regions": [list(r.endpoint) for r in regions]}
        te = self.transfer_engine()
        if te is not None and regions:
            for region in regions:
                region.register_te(te)
            record["te_bases"] = [region.base for region in regions]
        return record

    def _map_all(self, membership, index: int, kind: str, peers: Sequence[int], regions: list,
                 deadline: float, together: Optional[int] = None) -> None:
        """`_map` every peer of `peers`, their records read together (`batch_reads`: a constant number of
        store calls, not a few per peer; `together`: the epoch when every peer publishes and reads at once, else
        None)."""
        found = batch_reads.published_region_records(membership, index, peers, deadline, together=together)
        for peer in peers:
            self._map(membership, index, kind, peer, regions, deadline, found.get(peer))

    def _map(self, membership, index: int, kind: str, peer: int, regions: list, deadline: float,
             record: Optional[dict] = None) -> None:
        """Map `peer`'s regions of participant `index` (shared memory), or set them remote when the
        transport reaches `peer` over the Transfer Engine (another host). `record`: the peer's record as
        read already (`batch_reads`, with its incarnation), or None to wait for it alone."""
        if record is None:
            record = membership.wait_for(lambda: membership.region_record(index, peer), deadline,
                                         f"rank {peer}'s regions of participant {index} ({kind})")
        if record["kind"] != kind or len(record["regions"]) != len(regions):
            raise ValueError(f"rank {peer}'s participant {index} is a {record['kind']!r} with "
                             f"{len(record['regions'])} regions, expected a {kind!r} with {len(regions)}")
        buffer = self._buffer()
        route = None if buffer is None else buffer.runtime.te_peer(peer)
        if route is None:
            incarnation = record.get("incarnation")  # an equal (pid, fd) of a newer incarnation is remapped
            if incarnation is None:
                incarnation = membership.incarnation_of(peer)
            for region, endpoint in zip(regions, record["regions"]):
                region.map_peer(peer, region.endpoint_from(endpoint), incarnation)
            return
        bases = record.get("te_bases")
        if bases is None:
            raise ValueError(f"rank {peer}'s participant {index} ({kind}) published no Transfer Engine addresses, "
                             "but it is reached over the Transfer Engine (another host)")
        for region, endpoint, base in zip(regions, record["regions"], bases):
            region.set_remote(peer, RemoteRegion(route.session, base, endpoint[2]))


def register(buffer, owner, kind: str) -> Optional[int]:
    """Map `owner`'s regions with its peers': through the Buffer's `PeerRegions`, or over `buffer.group`.

    Arguments:
        buffer: a `Buffer`, or any object with `group`, `rank` and `num_ranks` (regions are then
            connected over `group` and never re-mapped for a replacement).
        owner: a `Participant`.
        kind: the participant's kind.

    Returns:
        index: the participant index (the same on every rank and for a replacement), or None
            without a `PeerRegions`.
    """
    registry = getattr(buffer, "peer_regions", None)
    if registry is not None:
        return registry.add(owner, kind)
    for region in owner.shared_regions():
        region.connect()
    return None


def joined_state(buffer, kind: str) -> Optional[dict]:
    """`buffer.peer_regions.joined_state(kind)`, or None for a Buffer without one."""
    registry = getattr(buffer, "peer_regions", None)
    return None if registry is None else registry.joined_state(kind)


#: The transports whose ranks map each other's memory (host regions on "shm", device regions on "cuda"):
#: structures on them move one-sided; on the others they keep private memory and use collectives.
ONE_SIDED = ("shm", "cuda")


def one_sided(buffer) -> bool:
    """Whether structures on `buffer` keep regions their peers map (its transport is one of `ONE_SIDED`).

    Arguments:
        buffer: a `Buffer`, or any object with a `transport` name.

    Returns:
        one_sided: bool.
    """
    return buffer.transport in ONE_SIDED


def memory_device(buffer):
    """The CUDA device whose memory a participant on `buffer` keeps its regions in, or None (host memory).

    Arguments:
        buffer: a `Buffer` (its transport's `device`: set on the `"cuda"` transport), or any object
            without a `runtime` (host memory).

    Returns:
        device: torch.device or None.
    """
    runtime = getattr(buffer, "runtime", None)
    return None if runtime is None else runtime.device


def group_of(buffer):
    """The process group structures on `buffer` use for collectives: its current view's group."""
    return getattr(buffer, "process_group", None) or getattr(buffer, "group", None)


__all__ = ["Participant", "PeerRegions", "register", "joined_state", "memory_device", "one_sided", "ONE_SIDED", "group_of"]
