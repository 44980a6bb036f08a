"""Argument checks with one message style.

Every error names the argument, what was expected and what came:
``"<name>: expected <what>, got <value>"`` (a wrong type also shows the type's name). This module
imports nothing from the package, so buffer/, switch/, eplb/ and the top-level modules can all use
it without an import cycle.
"""
import operator
from typing import Optional

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
