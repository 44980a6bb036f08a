"""The package's vocabulary: the two MoE layouts' names, and argument checks with one message style.

Layouts. `TP` (tensor parallel: every rank holds a slice of every expert) and `EP` (expert
parallel: every rank holds whole experts) are the layouts a MoE layer is served in; `LAYOUTS[i]` is
also the layout's code in the simulator's plans (0 = TP, 1 = EP). ("Layout" means only this: the
EP region's byte layout is `buffer.layout.RegionLayout`, EPLB's slot tables are placements.)

Checks. Every error names the argument, what was expected and what came:
``"<name>: expected <what>, got <value>"`` (a wrong type also shows the type's name). This module
imports nothing from the package, so buffer/, switch/, eplb/ and the top-level modules can all use
it without an import cycle.
"""
import operator
from typing import Optional

TP = "tp"  # tensor parallel: every rank holds a slice of every expert
EP = "ep"  # expert parallel: every rank holds whole experts
LAYOUTS = (TP, EP)


def _shown(value) -> str:
    """The value as it appears after "got" for a wrong type: type name and a short repr."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
    """Check that `value` is an integer (Python, NumPy or anything with `__index__`; not bool) of at least `minimum`.

    Arguments:
        name: the argument's name, for error messages.
        value: the value to check.
        minimum: the smallest accepted value, or None for no bound.

    Returns:
        value: the value as a Python int.

    Raises:
        TypeError: not an integer, or a bool ("<name>: expected an int >= <minimum>, got <type> <repr>").
        ValueError: below `minimum` ("<name>: expected an int >= <minimum>, got <value>").
    """
    what = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {what}, got {_shown(value)}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {what}, got {_shown(value)}") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name}: expected {what}, got {result}")
    return result
