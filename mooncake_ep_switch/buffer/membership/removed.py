"""The ranks removed from a group for good (`Buffer.shrink`), kept in one store record.

Key (under the prefix of one Buffer generation of one EP group, like every membership record):

    removed      JSON {"ranks": [[rank, epoch], ...]}: every rank a shrink removed, with the epoch of
                 the view that left it out; it only grows (compare-and-set over the text read)

Rank ids stay sparse: a removed rank keeps its id (the Buffer keeps `num_ranks`, its slot in every
`[num_ranks]` mask and table), is never a member of a later view and is never admitted again under
that id. Who reads it: a sealer (a removed joiner is never sealed in), `Membership.joining()` (never
listed as pending) and a joiner's own `update_ep_member()` (refused by name before it registers).
Only the ranks of a shrink that committed (the shrink's ballot, `membership/shrink.py`) are written.
"""
from typing import Dict, Iterable, Optional

from mooncake_ep_switch.buffer.membership.records import MembershipError

__all__ = ["REMOVED_KEY", "valid_removed", "removed_ranks", "record_removed", "refuse_removed"]

REMOVED_KEY = "removed"
_CAS_ATTEMPTS = 100  # each failed compare-and-set means another survivor wrote the record


def valid_removed(value, num_ranks: Optional[int] = None) -> bool:
    """Whether `value` is a removed-ranks record: {"ranks": [[rank, epoch], ...]}, distinct ranks in range."""
    if not isinstance(value, dict) or set(value) != {"ranks"} or not isinstance(value["ranks"], list):
        return False
    seen = set()
    for entry in value["ranks"]:
        if (not isinstance(entry, list) or len(entry) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in entry)):
            return False
        if entry[0] in seen or (num_ranks is not None and entry[0] >= num_ranks):
            return False
        seen.add(entry[0])
    return True


def _decode(records, raw) -> Dict[int, int]:
    value = records.checked(REMOVED_KEY, raw, lambda v: valid_removed(v, records.num_ranks),
                            "removed-ranks record")
    return {} if value is None else {int(rank): int(epoch) for rank, epoch in value["ranks"]}


def removed_ranks(records) -> Dict[int, int]:
    """The ranks removed from this group for good, with the epoch of the view that left each out.

    Arguments:
        records: the Buffer's `Membership` (any `RecordStore` with `num_ranks`).

    Returns:
        removed: {rank: epoch}, empty when no shrink committed (one store check, one get).

    Raises:
        MembershipError: the record is malformed or fails authentication.
    """
    return _decode(records, records.read_raw(REMOVED_KEY))


def record_removed(records, ranks: Iterable[int], epoch: int) -> Dict[int, int]:
    """Add `ranks` (removed by the view of `epoch`) to the record; a rank already there keeps its epoch.

    Every survivor of a committed shrink writes the same ranks (idempotent), so the record is there as
    long as one of them lives past the decision.

    Arguments:
        records: the Buffer's `Membership`.
        ranks: the removed ranks.
        epoch: the epoch of the view that leaves them out.

    Returns:
        removed: the record as stored afterwards ({rank: epoch}).

    Raises:
        MembershipError: the record is malformed or forged, or kept changing under 100 attempts.
    """
    ranks = sorted(set(int(r) for r in ranks))
    for _ in range(_CAS_ATTEMPTS):
        raw = records.read_raw(REMOVED_KEY)
        found = _decode(records, raw)
        if all(r in found for r in ranks):
            return found
        merged = dict(found)
        merged.update({r: int(epoch) for r in ranks if r not in found})
        text = records.encode_record(REMOVED_KEY, {"ranks": [[r, merged[r]] for r in sorted(merged)]})
        expected = "" if raw is None else bytes(raw).decode(errors="replace")
        if records.store.compare_set(REMOVED_KEY, expected, text).decode(errors="replace") == text:
            return merged
    raise MembershipError(f"store record {records.prefix}/{REMOVED_KEY} kept changing under {_CAS_ATTEMPTS} attempts")


def refuse_removed(records, rank: int) -> None:
    """Raise when `rank` was removed from the group: a late replacement (or a left-out rank) cannot come back.

    Arguments:
        records: the Buffer's `Membership`.
        rank: the rank about to register as joining.

    Raises:
        MembershipError: `rank` was removed (named, with the epoch), or the record is malformed.
    """
    removed = removed_ranks(records)
    if rank in removed:
        raise MembershipError(f"rank {rank} was removed from this EP group for good (Buffer.shrink, the view of epoch "
                              f"{removed[rank]} left it out): it cannot be re-admitted under its id; a new rank "
                              "needs a new id (grow, not supported yet)")
