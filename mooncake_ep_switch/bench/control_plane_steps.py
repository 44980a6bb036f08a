"""The control plane's other group-wide steps at scale: ballots and construction (issue 40 item 2).

Each step runs on a `membership_bench.Group` (ranks as threads, each with its own bounded, counted
store client on one TCPStore) and returns what `membership_bench.agree_after_death` returns: seconds
from the start until the last rank returned, the store operations all ranks made, the per-rank
results and the operations by name.

* pending joiners: one replacement of rank 0 registered as joining; every other rank lists the
  joiners once (`Membership.joining()`, what `Buffer.pending_joiners()` asks each serving step);
* switch decision: every rank prepares the switch's decision slot and proposes GO
  (`switch.switcher`'s store part: its votes are words in shared memory);
* EPLB vote: every rank votes GO on a chunk, waits for every peer's vote and proposes COMMIT (the
  commit step of `eplb.online`), after `begin`'s store part (its vote key, the chunk numbering read
  from the peers' records with `eplb.epochs.agreed_base`, the chunk's decision slot), which is not
  timed;
* construction: every rank takes an incarnation, binds it to epoch 0, publishes its endpoint (with
  its host id) and one participant's region record, reads every peer's endpoint and region record
  and the incarnations whose regions it maps, and meets the others at the regions' barrier (what a
  Buffer's constructor and `PeerRegions.add` exchange through the store: each read a collective step's,
  `batch_reads` with `together`: the bindings, then the records, each in one wait once all are there).
"""
import itertools
import time
from typing import Callable, Dict, List

from mooncake_ep_switch.bench.membership_bench import Group, run_all
from mooncake_ep_switch.buffer.ballot import Ballot
from mooncake_ep_switch.buffer.membership import batch_reads
from mooncake_ep_switch.buffer.membership.protocol import Membership
from mooncake_ep_switch.eplb import epochs

__all__ = ["construction", "constructor", "eplb_vote", "pending_joiners", "switch_decision"]

GO, COMMIT = 1, 1
_NAMES = itertools.count()


def _timed(group: Group, calls: Dict[int, object], deadline_s: float) -> dict:
    group.reset()
    started = time.monotonic()
    results = run_all(calls, deadline_s + 30)
    seconds = time.monotonic() - started
    return {"seconds": seconds, "ops": group.operations(), "results": results, "counts": dict(group.counts)}


def pending_joiners(group: Group, rank: int = 0, deadline_s: float = 60.0) -> dict:
    """Register a replacement of `rank` as joining (untimed), then every other rank lists the joiners once; each
    result is the list it read."""
    membership = group.members[rank] = group.member(rank)
    target = membership.epoch() + 1
    membership.store.set(f"ready/{target}/{rank}", membership.encode_record(
        f"ready/{target}/{rank}", {"incarnation": membership.incarnation, "call": 0}))
    membership.set_state("joining", epoch=target)
    calls = {r: group.members[r].joining for r in range(group.num_ranks) if r != rank}
    return _timed(group, calls, deadline_s)


def switch_decision(group: Group, deadline_s: float = 60.0) -> dict:
    """Every rank prepares a switch's decision slot and proposes GO; each result is the decision it adopted."""
    name = f"switch/{next(_NAMES)}"
    ballots = {r: Ballot(m, name, r, group.num_ranks, what="switch_layout") for r, m in enumerate(group.members)}

    def call(rank):
        def run():
            ballots[rank].prepare([1], votes=False)
            return ballots[rank].propose(1, GO)
        return run

    return _timed(group, {r: call(r) for r in range(group.num_ranks)}, deadline_s)


def eplb_vote(group: Group, deadline_s: float = 60.0) -> dict:
    """One online EPLB commit step on every rank (vote, wait for every peer's vote, propose), after `begin`'s store
    part (vote keys, chunk numbering, decision slot), timed apart; each result is (decision, votes seen, ranks
    gone); `"begin"` holds `begin`'s part (its results: each rank's chunk base)."""
    name = f"eplb/{next(_NAMES)}"
    size = group.num_ranks
    ballots = {r: Ballot(m, name, r, size) for r, m in enumerate(group.members)}
    digest, arguments = 12345, (777, 0, 1)

    def begin(rank):
        def run():
            ballot = ballots[rank]
            ballot.prepare((), votes=True)
            base = epochs.agreed_base(ballot, 0, arguments)
            ballot.prepare([base + 1], votes=False)
            return base
        return run

    began = _timed(group, {r: begin(r) for r in range(size)}, deadline_s)
    bases = began["results"]

    def call(rank):
        def run():
            ballot, base = ballots[rank], bases[rank]
            epoch = base + 1
            ballot.vote(epoch, GO, digest, (base, epoch, *arguments), voters=size, commit_if=range(size))  # as eplb.online
            peers = [p for p in range(size) if p != rank]
            votes, gone, _ = ballot.wait_votes(peers, epoch, int(deadline_s * 1e6))
            good = len(votes) == len(peers) and all(v == (GO, digest) for v in votes.values())
            return ballot.propose(epoch, COMMIT if good else 2), len(votes), gone
        return run

    voted = _timed(group, {r: call(r) for r in range(size)}, deadline_s)
    voted["begin"] = began
    return voted


def construction(group: Group, deadline_s: float = 60.0) -> dict:
    """The store part of every rank's Buffer construction, under a fresh prefix; each result is the list of
    host ids that rank read (its own first)."""
    call = constructor(group, f"ctor{next(_NAMES)}", deadline_s)
    return _timed(group, {r: (lambda rank=r: call(rank)) for r in range(group.num_ranks)}, deadline_s)


def constructor(group: Group, prefix: str, deadline_s: float = 60.0) -> Callable[[int], List[str]]:
    """The store part of one rank's Buffer construction under `prefix` (what `construction` runs on every rank).

    Arguments:
        group: the ranks (each rank's counted client is used).
        prefix: a key prefix no construction used before.
        deadline_s: seconds each rank's construction may take.

    Returns:
        build: `build(rank)` constructs `rank` and returns the host ids it read (its own first).
    """
    size = group.num_ranks
    stores = [m.store.underlying_store for m in group.members]  # each rank's counted client (no prefix)

    def build(rank: int) -> List[str]:
        deadline = time.monotonic() + deadline_s
        membership = Membership(stores[rank], rank, size, prefix)
        membership.bind_incarnation(0, rank, membership.incarnation)
        membership.epoch()
        membership.publish_endpoint({"region": [1000 + rank, 3, 4096], "host_id": f"host{rank // 8}",
                                     "te_session": "", "te_base": 1 << 20})
        membership.publish_region_record(0, {"kind": "bench", "regions": [[1000 + rank, 4, 4096]]})
        peers = [p for p in range(size) if p != rank]
        endpoints = batch_reads.published_endpoints(membership, peers, deadline, together=0)
        records = batch_reads.published_region_records(membership, 0, peers, deadline, together=0)
        if any(len(records[p]["regions"]) != 1 for p in peers):
            raise RuntimeError("a region record did not read back")
        membership.incarnations_at(0, range(size))  # PeerRegions.snapshot
        membership.barrier("regions/0/0", range(size), deadline)
        return [f"host{rank // 8}"] + [endpoints[p]["host_id"] for p in peers]

    return build


def expected_hosts(size: int) -> List[List[str]]:
    """The host ids each rank of `construction` reads (its own first)."""
    return [[f"host{r // 8}"] + [f"host{p // 8}" for p in range(size) if p != r] for r in range(size)]
