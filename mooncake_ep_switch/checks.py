"""Argument checks with one message style (integers, deadlines and flags).

Every error names the argument, what was expected and what came:
``"<name>: expected <what>, got <value>"`` (a wrong type also shows the type's name). This module
imports nothing from the package, so buffer/, switch/, eplb/ and the top-level modules can all use
it without an import cycle.
"""
import operator
from typing import Optional

import numpy as np


def _shown(value) -> str:
    """The value as it appears after "got" for a wrong type: type name and a short repr."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


INT32_MAX = 2 ** 31 - 1
INT64_MAX = 2 ** 63 - 1


def _as_int(name: str, value, expected: str) -> int:
    """`value` as a Python int (anything with `__index__` but a bool), else TypeError naming `expected`."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {expected}, got {_shown(value)}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {expected}, got {_shown(value)}") from None


def check_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = INT64_MAX) -> int:
    """Check that `value` is an integer (Python, NumPy or anything with `__index__`; not bool) in range.

    Every integer that reaches native code passes here first, so the upper bound defaults to the
    largest int64: a value the native call could not take is refused before any state changes.

    Arguments:
        name: the argument's name, for error messages.
        value: the value to check.
        minimum: the smallest accepted value, or None for no lower bound.
        maximum: the largest accepted value (default INT64_MAX; INT32_MAX for int32 native fields), or None for
            no upper bound (a value that never reaches native code).

    Returns:
        value: the value as a Python int.

    Raises:
        TypeError: not an integer, or a bool ("<name>: expected an int >= <minimum>, got <type> <repr>").
        ValueError: below `minimum` ("<name>: expected an int >= <minimum>, got <value>") or above
            `maximum` ("<name>: expected an int in [<minimum>, <maximum>], got <value>").
    """
    what = "an int" if minimum is None else f"an int >= {minimum}"
    result = _as_int(name, value, what)
    if minimum is not None and result < minimum:
        raise ValueError(f"{name}: expected {what}, got {result}")
    if maximum is not None and result > maximum:
        bounds = f"<= {maximum}" if minimum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected an int {bounds}, got {result}")
    return result


# The timeouts `check_timeout` accepts: -1 (none) up to the native int64. The hot paths test
# `type(t) is int and t in TIMEOUT_RANGE` (a C-level test, no Python call), the rule staying here.
TIMEOUT_RANGE = range(-1, INT64_MAX + 1)


def timeout_in_range(timeout_us) -> bool:
    """Whether `timeout_us` is a plain int that `check_timeout` accepts (the hot paths' cheap form of it)."""
    return type(timeout_us) is int and timeout_us in TIMEOUT_RANGE


def check_timeout(timeout_us, name: str = "timeout_us") -> int:
    """Check a deadline in microseconds: -1 (no deadline) or a number of microseconds the native calls take.

    Arguments:
        timeout_us: microseconds, or -1 for no deadline.
        name: the argument's name, for error messages.

    Returns:
        timeout_us: the value as a Python int.

    Raises:
        TypeError: not an integer, or a bool.
        ValueError: below -1 or above INT64_MAX (native waits longer than 2**40 us, about 12.7 days,
            are capped there).
    """
    expected = f"-1 (no deadline) or a number of microseconds in [0, {INT64_MAX}]"
    value = _as_int(name, timeout_us, expected)
    if not -1 <= value <= INT64_MAX:
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value


def check_flag(name: str, value, allow_none: bool = False) -> Optional[bool]:
    """Check a flag the way the peers' bindings take one (DeepEP's and Mooncake's pybind11 `bool`).

    Accepted: a bool, a NumPy bool (`np.bool_`), and the integers 0 and 1 (Python or NumPy), as the
    callers of DeepEP and Mooncake pass them (`--allow-hybrid-mode 1`, `async_with_compute_stream=0`).
    Refused, naming the argument: every other value, among them 2, -1, 1.0, "yes", a tensor, and None
    unless `allow_none` (pybind11 would turn 2, 1.0 or None into a bool; a flag given so is a caller's
    mistake here). Every flag of an API that mirrors a peer's (`Buffer`, `ElasticBuffer`,
    `deep_ep.Buffer`) passes here, so the rule is the same at every call site.

    Arguments:
        name: the argument's name, for error messages.
        value: the value to check.
        allow_none: None is accepted (and returned) too, for flags whose None means a default.

    Returns:
        flag: the value as a Python bool (None when `allow_none` and None came).

    Raises:
        TypeError: not a bool, a NumPy bool or an integer (`"<name>: expected a bool (or 0/1), got <type>
            <repr>"`).
        ValueError: an integer other than 0 and 1 (`"<name>: expected a bool (or 0/1), got <value>"`).
    """
    if value is True or value is False:
        return value
    expected = "None, a bool (or 0/1)" if allow_none else "a bool (or 0/1)"
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name}: expected {expected}, got {_shown(value)}")
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected {expected}, got {_shown(value)}")
    if value == 0 or value == 1:
        return bool(value)
    raise ValueError(f"{name}: expected {expected}, got {int(value)}")
