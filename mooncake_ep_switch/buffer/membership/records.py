"""Store records of the membership: their codec, validation and authentication.

Every membership record is one JSON value at one key of the torch.distributed store (the keys are
listed in `membership.py`). `RecordStore` reads and writes them; `membership.Membership` builds the
epoch/view protocol on top of it.

Records are validated when read (types, ranges, distinct ranks, sizes): the `valid_*` checks
below say what this job's ranks write, and a record that is anything else is refused with a
`MembershipError`. With a per-job secret (`MEP_JOB_SECRET`, see `config.py`) every record is also
authenticated: the stored text is `mac1:<HMAC-SHA256 over prefix, key and value>:<JSON>`, so a record
forged, copied from another key or written by another job fails. Counters are `"<n>"` or
`"<n>:<nonce>"`, read with get() and bumped with compare-and-set, never with the store's add(),
which closes the connection of a client whose counter key holds a non-number.
"""
import hashlib
import hmac
import json
import secrets
from typing import Any, Callable, List, Optional, Sequence

from mooncake_ep_switch.errors import MembershipError  # noqa: F401 (raised here; importers take it from here too)


ACTIVE, INACTIVE, JOINING = "active", "inactive", "joining"
STATES = (ACTIVE, INACTIVE, JOINING)
MAX_RECORD_BYTES = 1 << 16  # no honest record comes near this; bigger ones are refused unparsed
MAX_COUNTER = 1 << 53
MAX_STATE_BYTES = 1 << 24  # peer state of every registered participant (a placement table is the big part)
_MAC = "mac1:"


# MembershipError lives in errors.py (one hierarchy); imported here for the modules that raise it.



def _is_int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def rank_list(value, num_ranks: int, allow_empty: bool = False) -> Optional[tuple]:
    """`value` as an ascending tuple of distinct ranks in [0, num_ranks), or None if it is not one."""
    if not isinstance(value, list) or len(value) > num_ranks or (not value and not allow_empty):
        return None
    if not all(_is_int(r, 0, num_ranks) for r in value) or len(set(value)) != len(value):
        return None
    if list(value) != sorted(value):
        return None
    return tuple(value)


def valid_ready(value) -> bool:
    return (isinstance(value, dict) and _is_int(value.get("incarnation"), 1, MAX_COUNTER)
            and _is_int(value.get("call"), 0, 1 << 62))


def valid_incarnation(value) -> bool:
    return _is_int(value, 1, MAX_COUNTER)


def valid_state(value) -> bool:
    return (isinstance(value, dict) and value.get("state") in STATES
            and _is_int(value.get("incarnation"), 0, MAX_COUNTER) and _is_int(value.get("epoch"), 0, MAX_COUNTER))


def valid_endpoint(value) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("host_id", ""), str):
        return False
    region = value.get("region")
    if region is not None and not (isinstance(region, list) and len(region) == 3
                                   and _is_int(region[0], 1, 1 << 31) and _is_int(region[1], 0, 1 << 31)
                                   and _is_int(region[2], 0, 1 << 62)):
        return False
    if "te_session" in value and not isinstance(value["te_session"], str):
        return False
    return "te_base" not in value or _is_int(value["te_base"], 1, 1 << 64)


def _is_region_key(value) -> bool:
    """A host region's fd (int), or a device region's CUDA IPC handle (128 lowercase hex digits)."""
    if isinstance(value, str):
        return len(value) == 128 and all(c in "0123456789abcdef" for c in value)
    return _is_int(value, 0, 1 << 31)


def valid_region_record(value) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        return False
    regions = value.get("regions")
    if not (isinstance(regions, list) and len(regions) <= 64 and all(
            isinstance(r, list) and len(r) == 3 and _is_int(r[0], 1, 1 << 31) and _is_region_key(r[1])
            and _is_int(r[2], 1, 1 << 62) for r in regions)):
        return False
    bases = value.get("te_bases")  # Transfer Engine addresses, one per region (a Buffer on "mooncake")
    return bases is None or (isinstance(bases, list) and len(bases) == len(regions) and all(
        _is_int(b, 1, 1 << 64) and b + r[2] <= 1 << 64 for b, r in zip(bases, regions)))


def valid_admission(value, num_ranks: int) -> bool:
    """The admission record of a sealed epoch: {"ranks": [[rank, incarnation], ...] ascending, "call": int}."""
    if not isinstance(value, dict) or not _is_int(value.get("call"), 0, 1 << 62):
        return False
    pairs = value.get("ranks")
    if not isinstance(pairs, list) or not pairs or len(pairs) > num_ranks:
        return False
    if not all(isinstance(p, list) and len(p) == 2 and _is_int(p[0], 0, num_ranks) and _is_int(p[1], 1, MAX_COUNTER)
               for p in pairs):
        return False
    ranks = [p[0] for p in pairs]
    return ranks == sorted(set(ranks))


def view_record(value, num_ranks: int) -> Optional[tuple]:
    """(ranks, admission or None) of a sealed view record, or None if it is not one. A view is a rank list
    (`rank_list`), or, as a sealer writes it, {"view": rank list, "admission": its admission record}."""
    if isinstance(value, dict) and set(value) == {"view", "admission"}:
        ranks = rank_list(value["view"], num_ranks)
        if ranks is None or not valid_admission(value["admission"], num_ranks):
            return None
        return ranks, value["admission"]
    ranks = rank_list(value, num_ranks)
    return None if ranks is None else (ranks, None)


def valid_fallback_state(value) -> bool:
    """A `use_fallback/<e>` record: {"on": bool, "switches": int >= 0}, the members' `_use_fallback` switch."""
    return (isinstance(value, dict) and set(value) == {"on", "switches"} and isinstance(value["on"], bool)
            and _is_int(value["switches"], 0, MAX_COUNTER))


def valid_peer_state(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, dict) and _is_int(item.get("index"), 0, MAX_COUNTER) and isinstance(item.get("kind"), str)
        and isinstance(item.get("state"), dict) for item in value)



# Records decoded (and authenticated) or checked before, by (prefix, key, secret, stored bytes[, check]): the same
# bytes at the same key always decode alike, so a rank reading a record again (a poll, each peer's records after a
# change) parses and checks it once. Per process: ranks run as threads of one process (the scale bench) share it,
# so there a record is parsed once per process, not once per rank. Bounded by the bytes it holds.
_DECODED: dict = {}
_CHECKED: dict = {}
_MISSING = object()
DECODE_CACHE_BYTES = 4 << 20  # what both hold at most (record bytes); past it both start empty again
DECODE_CACHE_RECORD = MAX_RECORD_BYTES  # larger records (a peer state list) are not kept
_held = {"bytes": 0}


def _remember(cache: dict, memo: tuple, value: Any) -> None:
    size = len(memo[3]) + 64
    if size > DECODE_CACHE_RECORD:
        return
    if _held["bytes"] + size > DECODE_CACHE_BYTES:
        _DECODED.clear()
        _CHECKED.clear()
        _held["bytes"] = 0
    cache[memo] = value
    _held["bytes"] += size


def _copy(value: Any) -> Any:
    """A copy of a decoded JSON value (lists and dicts new, so a caller may change what it got)."""
    if isinstance(value, list):
        return [_copy(v) if isinstance(v, (list, dict)) else v for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) if isinstance(v, (list, dict)) else v for k, v in value.items()}
    return value


class RecordStore:
    """Read, write and count JSON records under one key prefix of a store.

    Arguments:
        store: a torch.distributed Store holding the records (already wrapped in its prefix).
        prefix: the key prefix, named in error messages and covered by the authentication tag.
        secret: per-job secret (bytes or str) that authenticates every record, or None (records
            are then only validated).
    """

    def __init__(self, store, prefix: str, secret=None):
        self.store = store
        self.prefix = prefix
        self.secret = secret.encode() if isinstance(secret, str) else secret

    # ------------------------------------------------------------------ records
    def _mac(self, key: str, text: str) -> str:
        message = f"{self.prefix}\0{key}\0{text}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def encode_record(self, key: str, value: Any) -> str:
        text = json.dumps(value, separators=(",", ":"))
        return text if self.secret is None else f"{_MAC}{self._mac(key, text)}:{text}"

    def _decode(self, key: str, raw: bytes, limit: int = MAX_RECORD_BYTES) -> Any:
        """Parse (and authenticate) one record; MembershipError if it is malformed or forged. A record read
        again (the same bytes at the same key, prefix and secret) is not parsed again (`_DECODED`)."""
        if len(raw) > limit:
            raise MembershipError(f"store record {self.prefix}/{key} is {len(raw)} bytes (at most "
                                  f"{limit}): not written by this job's ranks; refused")
        memo = (self.prefix, key, self.secret, bytes(raw))
        found = _DECODED.get(memo, _MISSING)
        if found is _MISSING:
            found = self._parse(key, raw)
            _remember(_DECODED, memo, found)
        return _copy(found)

    def _parse(self, key: str, raw: bytes) -> Any:
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise MembershipError(f"store record {self.prefix}/{key} is not UTF-8 text; refused") from None
        if text.startswith(_MAC):
            if self.secret is None:
                raise MembershipError(f"store record {self.prefix}/{key} is authenticated but this process "
                                      "has no MEP_JOB_SECRET: every rank and replacement must share the job's "
                                      "secret")
            tag, _, text = text[len(_MAC):].partition(":")
            if not hmac.compare_digest(tag, self._mac(key, text)):
                raise MembershipError(f"store record {self.prefix}/{key} fails authentication with this job's "
                                      "secret (forged, copied from another key, or another job's); refused")
        elif self.secret is not None:
            raise MembershipError(f"store record {self.prefix}/{key} carries no authentication tag although "
                                  "MEP_JOB_SECRET is set (written without the job's secret); refused")
        try:
            return json.loads(text)
        except ValueError:
            raise MembershipError(f"store record {self.prefix}/{key} is not JSON: {text[:80]!r}; refused") from None

    def read_raw(self, key: str) -> Optional[bytes]:
        if not self.store.check([key]):
            return None
        return self.store.get(key)

    def read_raws(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        """The values of `keys` as stored, None where absent: one `check` and one `multi_get` when every key
        is there; else the absent keys are found by checking halves (about 2 m log2(n / m) checks for m absent
        of n), then one `multi_get` of the others. (`multi_get` is part of the Store interface: a store
        without a batched one gets the base class's, one `get` per key.)"""
        keys = list(keys)
        there = self._present(keys)
        found = dict(zip(there, (bytes(raw) for raw in self.store.multi_get(there)))) if there else {}
        return [found.get(key) for key in keys]

    def _present(self, keys: List[str]) -> List[str]:
        """The keys of `keys` that exist (halves checked in turn, one `check` for all when all are there)."""
        if not keys or self.store.check(keys):
            return keys
        if len(keys) == 1:
            return []
        half = len(keys) // 2
        return self._present(keys[:half]) + self._present(keys[half:])

    def _read(self, key: str, valid: Callable[[Any], Any], what: str, limit: int = MAX_RECORD_BYTES) -> Any:
        """The record at `key` (None when absent); MembershipError when malformed, forged or invalid."""
        return self.checked(key, self.read_raw(key), valid, what, limit)

    def checked(self, key: str, raw: Optional[bytes], valid: Callable[[Any], Any], what: str,
                 limit: int = MAX_RECORD_BYTES) -> Any:
        """Decode and check the record `raw` read at `key`.

        Arguments:
            key: the key it was read at (authenticated with it).
            raw: the stored bytes, or None (absent).
            valid: returns whether the decoded value is a valid record.
            what: the record's description, for the error.
            limit: the largest record accepted, in bytes.

        Returns:
            value: the decoded record, or None for None.

        Raises:
            MembershipError: malformed, forged or invalid.
        """
        if raw is None:
            return None
        cacheable = "<" not in getattr(valid, "__qualname__", "<")  # a module's check (not a lambda made per call)
        memo = (self.prefix, key, self.secret, bytes(raw), valid) if cacheable else None
        found = _CHECKED.get(memo, _MISSING) if cacheable else _MISSING
        if found is not _MISSING and len(raw) <= limit:
            return _copy(found)
        value = self._decode(key, raw, limit)
        if cacheable and valid(value):
            _remember(_CHECKED, memo, value)
            return _copy(value)
        if not valid(value):
            raise MembershipError(f"store record {self.prefix}/{key} is not a valid {what}: {str(value)[:120]!r}; "
                                  "refused (this job's ranks never write such a record)")
        return value

    def _put(self, key: str, value: Any) -> None:
        self.store.set(key, self.encode_record(key, value))

    def read_counter_raw(self, key: str):
        """(value, raw text) of a counter; (0, None) when absent. Values are `"<n>"` or `"<n>:<nonce>"`."""
        return self.counter_of(key, self.read_raw(key))

    def counter_of(self, key: str, raw: Optional[bytes]):
        """(value, raw text) of the counter `raw` read at `key` (see `read_counter_raw`)."""
        if raw is None:
            return 0, None
        try:
            text = raw.decode()
            value = int(text.split(":", 1)[0])
        except (UnicodeDecodeError, ValueError):
            text, value = None, -1
        if not 0 <= value < MAX_COUNTER:
            raise MembershipError(f"store counter {self.prefix}/{key} holds {raw[:40]!r}, not a count; refused")
        return value, text

    def read_counter(self, key: str) -> int:
        return self.read_counter_raw(key)[0]

    def bump_counter(self, key: str, expected: Optional[int] = None) -> int:
        """Add 1 to a counter with compare-and-set (never add(): see the module docstring).

        The new value carries a random nonce, so two writers that raced from one value never both
        believe they won. With `expected`, only when the counter still holds it; returns the new
        value, or -1 when the counter moved on. Without `expected` the first attempt assumes the counter
        absent (a rank's first incarnation, a group's first generation: one store call, no read before it);
        a counter that is there answers that compare-and-set with its value, which the next attempt starts
        from (a compare-and-set answers the current value when it does not set).
        """
        if expected is None:
            old, text = 0, None
        else:
            old, text = self.read_counter_raw(key)
        for _ in range(1000):  # bounded: each failed CAS means another writer succeeded
            if expected is not None and old != expected:
                return -1
            new = f"{old + 1}:{secrets.token_hex(8)}"
            stored = bytes(self.store.compare_set(key, "" if text is None else text, new))
            if stored.decode(errors="replace") == new:
                return old + 1
            if text is not None and stored.decode(errors="replace") == text:
                old, text = self.read_counter_raw(key)  # the answer of a CAS on an absent key: read it
            else:
                old, text = self.counter_of(key, stored)
        raise MembershipError(f"store counter {self.prefix}/{key} kept changing under 1000 attempts")
