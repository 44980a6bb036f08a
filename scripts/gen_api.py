"""Generate docs/api.md from the docstrings (issue 41 item 2).

Usage:
    python scripts/gen_api.py            write docs/api.md (exit 1, listing them, on coverage problems)
    python scripts/gen_api.py --check    exit 1 when docs/api.md differs from what would be written,
                                         or on coverage problems

The reference's organisation (sections, their intro prose, which names each lists) is in
scripts/api_sections.py; every entry's text is its object's docstring: the summary paragraph as
prose, the rest in a ```text block, as `help()` shows it. A class entry lists every public method
and property of the class (and of its bases in this package): names without a leading underscore,
in the order the section gives, then in definition order.

Coverage (`coverage_problems()`): every public name of the modules in `api_sections.FULL_COVERAGE`
(their `__all__`, or without one the functions and classes the module defines) has an entry, and
every entry and class member has a docstring of its own. tests/test_docs.py runs both checks.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import re
import sys
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

sys.modules.setdefault("gen_api", sys.modules[__name__])  # run as a script, api_sections imports this module
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(ROOT, "docs", "api.md")


class Entry(NamedTuple):
    """One public function or class: `module` is where users import it from, `name` its name there.

    Fields:
        prefix: written before the name in the heading (`"elastic."` gives `elastic.join(...)`).
        order: class members to list first, in this order (the others follow in definition order).
        note: markdown written after the docstring (before the members), for what a docstring cannot
            say (instance attributes, a table).
        members_as: the name the class's member headings start with (default: the class's name).
        extra: underscored members to list too (peers' names such as Mooncake's `_use_fallback`).
    """

    module: str
    name: str
    prefix: str = ""
    order: Tuple[str, ...] = ()
    note: str = ""
    members_as: str = ""
    extra: Tuple[str, ...] = ()


class Data(NamedTuple):
    """A public constant (no docstring of its own): `text` says what it is."""

    module: str
    name: str
    text: str
    prefix: str = ""


class Section(NamedTuple):
    """A titled part of the reference: its intro prose, then its items (entries or subsections).

    Fields:
        title: the heading's text.
        intro: markdown under the heading.
        items: `Entry`, `Data` or `Section`, in order.
        level: heading level (2 for the reference's parts; a subsection's is its parent's + 1).
    """

    title: str
    intro: str = ""
    items: Tuple[Union["Section", Entry, Data], ...] = ()
    level: int = 2


MEMBER_KINDS = (staticmethod, classmethod, property, functools.cached_property)


def _spec():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return importlib.import_module("api_sections")
    finally:
        sys.path.pop(0)


def own_doc(obj) -> Optional[str]:
    """The docstring written for `obj` itself (not inherited, not the one NamedTuple/dataclass make
    up), cleaned as `help()` shows it; None when there is none."""
    if isinstance(obj, property):
        raw = obj.__doc__ or (obj.fget.__doc__ if obj.fget else None)
    elif isinstance(obj, functools.cached_property):
        raw = obj.__doc__ or obj.func.__doc__
    elif isinstance(obj, (staticmethod, classmethod)):
        raw = obj.__func__.__doc__
    elif inspect.isclass(obj):
        raw = obj.__dict__.get("__doc__")
        if raw and re.match(re.escape(obj.__name__) + r"\(", raw):  # NamedTuple's / dataclass's own
            raw = None
    else:
        raw = getattr(obj, "__doc__", None)
    if not raw or not raw.strip():
        return None
    return inspect.cleandoc(raw)


def _default(value) -> str:
    if inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value):
        text = value.__qualname__
    else:
        text = repr(value)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # never an address: the output must be stable


def signature(obj, drop_first: bool = False) -> Optional[str]:
    """`(a, b=1, *, c=None)` of a callable, without annotations; None when Python knows none."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    parts, star_done = [], False
    for i, param in enumerate(params):
        if param.kind is param.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if param.kind is param.VAR_POSITIONAL:
            star_done = True
            parts.append("*" + param.name)
        elif param.kind is param.VAR_KEYWORD:
            parts.append("**" + param.name)
        elif param.default is param.empty:
            parts.append(param.name)
        else:
            parts.append(f"{param.name}={_default(param.default)}")
        if param.kind is param.POSITIONAL_ONLY and (i + 1 == len(params) or
                                                    params[i + 1].kind is not param.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def class_members(cls, extra: Sequence[str] = ()) -> List[Tuple[str, object]]:
    """Public methods and properties of `cls` and of its bases defined in this package, in
    definition order (the class's own first), each name once (the override); the underscored
    names in `extra` too."""
    seen, members = set(), []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("mooncake_ep_switch"):
            continue
        for name, attr in vars(klass).items():
            if (name.startswith("_") and name not in extra) or name in seen:
                continue
            if inspect.isfunction(attr) or isinstance(attr, MEMBER_KINDS):
                seen.add(name)
                members.append((name, attr))
    return members


def _ordered(members, order: Sequence[str]):
    by_name = dict(members)
    unknown = [name for name in order if name not in by_name]
    if unknown:
        raise ValueError(f"order names members that do not exist: {unknown}")
    first = [(name, by_name[name]) for name in order]
    return first + [(name, attr) for name, attr in members if name not in order]


def _doc_block(doc: Optional[str]) -> List[str]:
    if doc is None:
        return []
    summary, _, rest = doc.partition("\n\n")
    lines = ["", summary.strip()]
    rest = rest.strip("\n")
    if rest.strip():
        lines += ["", "```text", rest, "```"]
    return lines


def _heading(level: int, text: str) -> str:
    return "#" * level + " " + text


def _member_lines(owner: str, name: str, attr, level: int) -> List[str]:
    if isinstance(attr, (property, functools.cached_property)):
        title = f"`{owner}.{name}`"
    else:
        func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
        sig = signature(func, drop_first=not isinstance(attr, staticmethod))
        title = f"`{owner}.{name}{sig or '(...)'}`"
    return ["", _heading(level, title)] + _doc_block(own_doc(attr))


def _resolve(item):
    return getattr(importlib.import_module(item.module), item.name)


def _entry_lines(entry: Entry, level: int) -> List[str]:
    obj = _resolve(entry)
    sig = signature(obj)
    title = f"`{entry.prefix}{entry.name}{sig or ''}`"
    lines = ["", _heading(level, title)] + _doc_block(own_doc(obj))
    if entry.note:
        lines += ["", entry.note.strip("\n")]
    if inspect.isclass(obj):
        owner = entry.members_as or entry.name
        for name, attr in _ordered(class_members(obj, entry.extra), entry.order):
            lines += _member_lines(owner, name, attr, level + 1)
    return lines


def _walk(sections) -> Iterator[Union[Section, Entry, Data]]:
    for section in sections:
        yield section
        for item in section.items:
            if isinstance(item, Section):
                yield from _walk([item])
            else:
                yield item


def _section_lines(section: Section) -> List[str]:
    lines = ["", _heading(section.level, section.title)]
    if section.intro.strip():
        lines += ["", section.intro.strip("\n")]
    for item in section.items:
        if isinstance(item, Section):
            lines += _section_lines(item)
        elif isinstance(item, Data):
            lines += ["", _heading(section.level + 1, f"`{item.prefix}{item.name}`"), "", item.text.strip()]
        else:
            lines += _entry_lines(item, section.level + 1)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than `-`/`_` dropped, spaces to `-`."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def render(spec=None) -> str:
    """The text of docs/api.md."""
    spec = spec or _spec()
    contents = " ·\n".join(f"[{s.title.split(' (')[0].replace('`', '')}](#{slug(s.title)})" for s in spec.SECTIONS)
    lines = ["# API reference", "", spec.PREAMBLE.strip("\n"), "", "Contents: " + contents]
    for section in spec.SECTIONS:
        lines += _section_lines(section)
    return "\n".join(lines) + "\n"


def public_names(module) -> List[str]:
    """A module's public names: its `__all__`, or without one the functions and classes it defines
    whose names have no leading underscore."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module.__name__]


def coverage_problems(spec=None) -> List[str]:
    """What keeps the reference from covering the public API: public names of the covered modules
    without an entry, entries or class members without a docstring, objects listed twice."""
    spec = spec or _spec()
    problems, listed, data = [], {}, set()
    for item in _walk(spec.SECTIONS):
        if isinstance(item, Data):
            data.add((item.module, item.name))
        elif isinstance(item, Entry):
            obj = _resolve(item)
            where = f"{item.module}.{item.name}"
            if id(obj) in listed:
                problems.append(f"{where}: listed twice (also as {listed[id(obj)]})")
            listed[id(obj)] = where
            if own_doc(obj) is None:
                problems.append(f"{where}: no docstring")
            if inspect.isclass(obj):
                for name, attr in class_members(obj, item.extra):
                    if own_doc(attr) is None:
                        problems.append(f"{where}.{name}: no docstring")
    for module_name in spec.FULL_COVERAGE:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            obj = getattr(module, name)
            if (module_name, name) in data or ((inspect.isclass(obj) or callable(obj)) and id(obj) in listed):
                continue
            problems.append(f"{module_name}.{name}: public but not in the API reference "
                            "(add an Entry or Data for it to scripts/api_sections.py)")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with docs/api.md instead of writing it")
    args = parser.parse_args(argv)
    problems = coverage_problems()
    for problem in problems:
        print(f"gen_api: {problem}", file=sys.stderr)
    text = render()
    if args.check:
        with open(API_MD, encoding="utf-8") as handle:
            stale = handle.read() != text
        if stale:
            print("gen_api: docs/api.md is stale: run python scripts/gen_api.py", file=sys.stderr)
        return 1 if stale or problems else 0
    with open(API_MD, "w", encoding="utf-8") as handle:
        handle.write(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
