"""One resize of a Buffer at a time: a grow and a shrink (or two of one kind) refuse each other by name.

A shrink (`membership/shrink.py`) holds its Buffer from its checks until it returns; a grow
(`membership/grow.py`) from its request until its `poll()` returns the grown Buffer or raises. A second
resize of the same Buffer started meanwhile, on another thread, raises `RuntimeError` naming the one in
progress before it reads or writes anything. The Buffer is named by its `Membership` (one per Buffer,
the same object as `buffer.membership` and its core's: a resize needs the group's store).
"""
import threading
import weakref
from typing import Optional

__all__ = ["begin", "end", "in_progress"]

_LOCK = threading.Lock()
_ACTIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Membership -> "grow" or "shrink"
_SAME = {"grow": "grow: another grow of this Buffer is in progress (one resize at a time)",
         "shrink": "shrink: another shrink of this Buffer is in progress (one at a time)"}


def begin(owner, kind: str) -> None:
    """Hold `owner`'s Buffer for a resize of `kind` ("grow" or "shrink"); release it with `end`.

    Arguments:
        owner: the Buffer's `Membership`.
        kind: "grow" or "shrink".

    Raises:
        RuntimeError: a resize of this Buffer is in progress (named: another of `kind`, or the other kind);
            nothing held.
    """
    with _LOCK:
        current = _ACTIVE.get(owner)
        if current == kind:
            raise RuntimeError(_SAME[kind])
        if current is not None:
            raise RuntimeError(f"{kind}: a {current} of this Buffer is in progress (one resize at a time: a grow "
                               "holds the Buffer until its poll() returns the grown Buffer or raises, a shrink "
                               f"until it returns); nothing changed: {kind} again after it")
        _ACTIVE[owner] = kind


def end(owner, kind: str) -> None:
    """Release `owner`'s Buffer held by `begin(owner, kind)` (nothing when another kind holds it).

    Arguments:
        owner: the Buffer's `Membership`.
        kind: "grow" or "shrink".
    """
    with _LOCK:
        if _ACTIVE.get(owner) == kind:
            del _ACTIVE[owner]


def in_progress(owner) -> Optional[str]:
    """The resize holding `owner`'s Buffer: "grow", "shrink", or None.

    Arguments:
        owner: the Buffer's `Membership`.

    Returns:
        kind: str or None.
    """
    with _LOCK:
        return _ACTIVE.get(owner)
