"""Membership that survives dead ranks: epochs, views, states and endpoints in the store.

A gloo or nccl group cannot lose a member, so membership lives in the torch.distributed store
(a TCPStore hosted by the launcher/agent), which outlives any rank. Keys (under a prefix):

    epoch                       current epoch number (0 before any change)
    view/<e>                    JSON list of the member ranks of epoch e (sealed once, by CAS)
    ready/<e>/<rank>            JSON {"incarnation", "call"}: rank asks to be in epoch e
    state/<rank>                "active" | "inactive" | "joining"
    incarnation/<rank>          counter, bumped by every process that takes the rank id
    endpoint/<rank>/<inc>       JSON endpoint of that incarnation (region pid/fd, TE session)
    evidence/<e>/<reporter>     JSON list of ranks the reporter saw fail in epoch e

The rule that turns evidence into a new epoch: every rank that wants to continue posts `ready`
for epoch e+1 and waits, up to its deadline, for every rank it expects (the members it has not
seen fail, and every joining rank); then it seals `view/<e+1>` with compare-and-set to the set of
ranks that posted. The store's CAS picks one sealed view and every rank adopts it, so no rank
decides alone and all agree; a rank that posted too late is told it was left out.
"""
import json
import time
from typing import Dict, Iterable, List, NamedTuple, Optional

ACTIVE, INACTIVE, JOINING = "active", "inactive", "joining"


class MembershipError(RuntimeError):
    """Raised when this rank is not part of the agreed view, or a deadline passed.

    Attributes:
        missing: ranks that did not arrive where they were waited for (may be empty).
    """

    def __init__(self, message: str, missing=()):
        super().__init__(message)
        self.missing = tuple(missing)


class View(NamedTuple):
    """Members of one epoch.

    Fields:
        epoch: the epoch number.
        ranks: member ranks, ascending.
    """

    epoch: int
    ranks: tuple


class Membership:
    """Read and change the EP membership kept in a store.

    Arguments:
        store: a torch.distributed Store shared by every rank (and replacements).
        rank: this process's EP rank.
        num_ranks: EP group size (fixed; a dead rank's id is taken by its replacement).
        prefix: key prefix (one EP group per prefix).
    """

    def __init__(self, store, rank: int, num_ranks: int, prefix: str = "mep"):
        import torch.distributed as dist

        self.raw_store = root_store(store)
        self.store = dist.PrefixStore(prefix, self.raw_store)
        self.rank = rank
        self.num_ranks = num_ranks
        self.incarnation = int(self.store.add(f"incarnation/{rank}", 1))

    # ------------------------------------------------------------------ reads
    def _get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        if not self.store.check([key]):
            return default
        return self.store.get(key).decode()

    def epoch(self) -> int:
        """Current epoch number.

        Returns:
            epoch: int, 0 before any change (reading creates the key).
        """
        return int(self.store.add("epoch", 0))

    def view(self, epoch: Optional[int] = None) -> View:
        """Members of `epoch` (default the current one); epoch 0 is every rank.

        Arguments:
            epoch: epoch number, or None for the current one.

        Returns:
            view: a `View`; every rank when no view of that epoch was sealed.
        """
        epoch = self.epoch() if epoch is None else epoch
        text = self._get(f"view/{epoch}")
        ranks = tuple(range(self.num_ranks)) if text is None else tuple(json.loads(text))
        return View(epoch, ranks)

    def state(self, rank: int) -> str:
        """State of `rank`: active, inactive or joining.

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            state: `"active"` (also when never set), `"inactive"` or `"joining"`.
        """
        return self._get(f"state/{rank}", ACTIVE)

    def joining(self) -> List[int]:
        """Ranks waiting to be admitted.

        Returns:
            ranks: list of int, ascending, the ranks whose state is `"joining"`.
        """
        keys = [f"state/{r}" for r in range(self.num_ranks)]
        return [r for r, key in enumerate(keys) if self.store.check([key]) and self.store.get(key).decode() == JOINING]

    def endpoint(self, rank: int) -> dict:
        """The published endpoint of `rank`'s current incarnation.

        Arguments:
            rank: EP rank in `[0, num_ranks)`.

        Returns:
            endpoint: dict as published (see `publish_endpoint`) plus `"incarnation"` (int).

        Raises:
            MembershipError: that incarnation has published no endpoint yet.
        """
        incarnation = int(self.store.add(f"incarnation/{rank}", 0))
        text = self._get(f"endpoint/{rank}/{incarnation}")
        if text is None:
            raise MembershipError(f"rank {rank} (incarnation {incarnation}) has published no endpoint")
        return dict(json.loads(text), incarnation=incarnation)

    def evidence(self, epoch: Optional[int] = None) -> Dict[int, List[int]]:
        """Failures reported in `epoch`: reporter -> ranks it saw fail.

        Arguments:
            epoch: epoch number, or None for the current one.

        Returns:
            evidence: dict int -> list of int, for reporters that posted evidence only.
        """
        epoch = self.epoch() if epoch is None else epoch
        found = {}
        for reporter in range(self.num_ranks):
            text = self._get(f"evidence/{epoch}/{reporter}")
            if text is not None:
                found[reporter] = json.loads(text)
        return found

    # ------------------------------------------------------------------ writes
    def publish_endpoint(self, endpoint: dict) -> None:
        """Publish this incarnation's endpoint (region pid/fd, TE session, host identity).

        Arguments:
            endpoint: JSON-serialisable dict (the transport's `endpoint()` plus `"host_id"`).
        """
        self.store.set(f"endpoint/{self.rank}/{self.incarnation}", json.dumps(endpoint))

    def set_state(self, state: str, rank: Optional[int] = None) -> None:
        """Set `rank`'s (default this rank's) state.

        Arguments:
            state: `"active"`, `"inactive"` or `"joining"`.
            rank: EP rank, or None for this rank.

        Raises:
            ValueError: an unknown state.
        """
        if state not in (ACTIVE, INACTIVE, JOINING):
            raise ValueError(f"state: expected one of active, inactive, joining, got {state!r}")
        self.store.set(f"state/{self.rank if rank is None else rank}", state)

    def report_failures(self, ranks: Iterable[int]) -> None:
        """Publish the ranks this rank saw fail in the current epoch (data-plane evidence).

        Replaces this rank's earlier evidence for the epoch; nothing is written for no ranks.

        Arguments:
            ranks: iterable of int EP ranks (duplicates are dropped).
        """
        ranks = sorted(set(int(r) for r in ranks))
        if ranks:
            self.store.set(f"evidence/{self.epoch()}/{self.rank}", json.dumps(ranks))

    def deactivate(self, ranks: Iterable[int]) -> None:
        """Mark ranks inactive (an operator's or a survivor's decision after evidence).

        Arguments:
            ranks: iterable of int EP ranks.
        """
        for rank in ranks:
            self.set_state(INACTIVE, rank)

    # ------------------------------------------------------------------ agreement
    def agree_next_view(self, current: int, expected: Iterable[int], deadline: float, call: int = 0) -> View:
        """Post readiness for epoch `current + 1`, wait for `expected`, and adopt the sealed view.

        Arguments:
            current: the epoch this rank is in (a joiner: the store's current epoch).
            expected: ranks this rank waits for (besides itself) before sealing.
            deadline: `time.monotonic()` value after which it seals with whoever is ready.
            call: this rank's call counter (the next epoch's counters start above every one).

        Returns:
            view: the agreed `View` of the next epoch (this rank is a member).
        """
        target = current + 1
        self.store.set(f"ready/{target}/{self.rank}", json.dumps({"incarnation": self.incarnation, "call": call}))
        waiting = sorted(set(int(r) for r in expected) | {self.rank})
        pause = 0.001
        while True:
            sealed = self._get(f"view/{target}")
            if sealed is not None:
                break
            present = [r for r in waiting if self.store.check([f"ready/{target}/{r}"])]
            if len(present) == len(waiting) or time.monotonic() >= deadline:
                candidates = [r for r in range(self.num_ranks) if self.store.check([f"ready/{target}/{r}"])]
                self.store.compare_set(f"view/{target}", "", json.dumps(candidates))
                sealed = self._get(f"view/{target}")
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        ranks = tuple(json.loads(sealed))
        if self.rank not in ranks:
            raise MembershipError(f"rank {self.rank} was left out of epoch {target} (members {list(ranks)}): "
                                  "it was not ready before the view was sealed; call update_ep_member() again")
        self.epoch()  # creates the key if no one has read it yet: a CAS on a missing key does nothing
        self.store.compare_set("epoch", str(current), str(target))  # the first member advances it
        self.set_state(ACTIVE)
        return View(target, ranks)

    def max_call(self, epoch: int, ranks: Iterable[int]) -> int:
        """Largest call counter the members of `epoch` posted with their readiness.

        Arguments:
            epoch: epoch number whose `ready` records are read.
            ranks: iterable of int EP ranks (ranks without a record are skipped).

        Returns:
            call: int, the maximum, or 0 when none posted.
        """
        best = 0
        for rank in ranks:
            text = self._get(f"ready/{epoch}/{rank}")
            if text is not None:
                best = max(best, int(json.loads(text)["call"]))
        return best

    def barrier(self, name: str, ranks: Iterable[int], deadline: float) -> None:
        """Wait until every rank of `ranks` reached the barrier `name` (store keys, no collective).

        Arguments:
            name: barrier name, unique per use (e.g. `"connect/<epoch>"`).
            ranks: iterable of int EP ranks to wait for (include this rank).
            deadline: `time.monotonic()` deadline in seconds.

        Raises:
            MembershipError: the deadline passed; `missing` names the ranks that did not arrive.
        """
        self.store.set(f"barrier/{name}/{self.rank}", "1")
        keys = [f"barrier/{name}/{r}" for r in ranks]
        try:
            self.wait_for(lambda: True if self.store.check(keys) else None, deadline,
                          f"barrier {name!r} of {list(ranks)}")
        except MembershipError as error:
            missing = [r for r in ranks if not self.store.check([f"barrier/{name}/{r}"])]
            raise MembershipError(f"{error}; missing ranks {missing}", missing) from None

    def wait_for(self, predicate, deadline: float, what: str):
        """Poll `predicate()` (returns a value or None) with backoff until `deadline`.

        Arguments:
            predicate: callable with no arguments, returning None while not ready.
            deadline: `time.monotonic()` deadline in seconds (the predicate runs at least once).
            what: description for the error message.

        Returns:
            value: the first non-None value of `predicate()`.

        Raises:
            MembershipError: the deadline passed first.
        """
        pause = 0.001
        while True:
            value = predicate()
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise MembershipError(f"deadline passed while waiting for {what}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def root_store(store):
    """The store under any PrefixStore wrappers: every handle to one server gives the same keys.

    The default group's store arrives wrapped by torch.distributed's own prefixes, a replacement
    rank's store client does not; membership keys must not depend on which handle a rank holds.

    Arguments:
        store: a torch.distributed Store, possibly wrapped in PrefixStores.

    Returns:
        store: the innermost Store (the argument itself when not a PrefixStore).
    """
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def generation_prefix(store, rank: int, num_ranks: int, base: str = "mep", joining: bool = False) -> str:
    """Key prefix of the Buffer being built: one membership record per Buffer generation.

    Every rank constructs its Buffers in the same order, so the n-th Buffer of every rank gets
    generation n and never reads an endpoint a previous Buffer left in the store. A joining rank
    adopts the newest generation any rank has reached.

    Arguments:
        store: a torch.distributed Store (PrefixStore wrappers are removed).
        rank: this EP rank.
        num_ranks: EP group size.
        base: key prefix of the EP group.
        joining: a replacement rank: adopt the newest generation instead of advancing its own counter.

    Returns:
        prefix: str, `"<base>/g<n>"` for generation `n`.
    """
    store = root_store(store)
    counter = f"{base}/generation/{rank}"
    if joining:
        newest = max(int(store.add(f"{base}/generation/{r}", 0)) for r in range(num_ranks))
        store.set(counter, str(newest))
        return f"{base}/g{newest}"
    return f"{base}/g{int(store.add(counter, 1))}"


def view_group(store, view: View, rank: int, timeout_s: float, prefix: str = "mep"):
    """A gloo process group over the members of `view` (group rank = position in `view.ranks`).

    Built from the store with the epoch in its key prefix, so it never meets a previous epoch's
    group. Collective over the members.

    Arguments:
        store: the torch.distributed Store shared by the members.
        view: the `View` whose members form the group; `rank` must be one of them.
        rank: this EP rank.
        timeout_s: the group's timeout in seconds.
        prefix: key prefix of the EP group.

    Returns:
        group: a `torch.distributed.ProcessGroupGloo`.
    """
    from datetime import timedelta

    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{prefix}/group/{view.epoch}", store)
    return dist.ProcessGroupGloo(prefixed, view.ranks.index(rank), len(view.ranks), timedelta(seconds=timeout_s))
