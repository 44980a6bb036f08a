"""The docs agree with the code and with each other (issue 41 items 1 and 2).

* every file path, `tests/x.py::test_name` and `mooncake_ep_switch.module` the docs name exists;
* every relative markdown link resolves, to a file and, with `#anchor`, to a heading of it;
* every ratio README quotes (`3.6-4.5x`) is one docs/ states (README restates docs/benchmarks.md,
  never its own rounding);
* docs/api.md is what scripts/gen_api.py writes, and that covers every public name.

Each check is shown to fail on a planted mistake. Pure Python: no processes.
"""
import importlib
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gen_api  # noqa: E402  (scripts/ is no package)

DOCS = ["README.md", "mooncake_ep_switch/eplb/README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))

# Named in the docs but not files of this repository, each for a reason.
NOT_OURS_PREFIXES = ("deep_ep/", "tests/elastic/")  # DeepEP's repository (its V1/V2 sources and V2 test programs)
OUTPUTS = {"metrics.json", "timeline.png", "bursty_timeline.png", "rollout_timeline.png", "simulate.json"}  # written by runs

PATH = re.compile(r"(?<![\w./<>*-])((?:[\w-][\w.-]*/)*[\w.-]*\w\.(?:py|md|sh|cpp|cc|h|hpp|cu|cuh|json|png|toml|txt|cfg)"
                  r"|(?:[\w-][\w.-]*/)+)(?![\w/<>*])")
TEST_REF = re.compile(r"(tests/\w+\.py)::(\w+)")
MODULE_REF = re.compile(r"(?<![\w./])(mooncake_ep_switch(?:\.\w+)+)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RATIO = re.compile(r"(?<![\w.~-])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x)(?!\w)")


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as handle:
        return handle.read()


def _repo_paths():
    found = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".git", "__pycache__", "build") and not d.endswith(".egg-info")]
        rel = os.path.relpath(top, ROOT)
        if rel != ".":
            found.add(rel)
        found.update(os.path.normpath(os.path.join(rel, name)) for name in files)
    return found


REPO_PATHS = _repo_paths()


def _exists(path, doc):
    """A path the docs name: relative to the doc (`../x`), to the root, or the tail of a repository path
    (`buffer/peer_regions.py` inside the package)."""
    path = path.rstrip("/")
    if path.startswith("."):
        return os.path.normpath(os.path.join(os.path.dirname(doc), path)) in REPO_PATHS
    return any(p == path or p.endswith("/" + path) for p in REPO_PATHS)


def _module_exists(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def missing_names(doc, text):
    """Paths, test references and package modules `text` (a doc at `doc`) names that do not exist."""
    missing = []
    for match in PATH.finditer(text):
        path = match.group(1)
        if path.startswith(NOT_OURS_PREFIXES) or os.path.basename(path) in OUTPUTS or path.startswith("..."):
            continue
        if "/" not in path.rstrip("/") and path.endswith("/"):
            continue  # one word and a slash: a store key (`alive/`) or a folder named in passing
        if not _exists(path, doc):
            missing.append(path)
    for path, test in TEST_REF.findall(text):
        if path in REPO_PATHS and not re.search(rf"^\s*(async )?def {test}\(", _read(path), re.M):
            missing.append(f"{path}::{test}")
    missing += [name for name in MODULE_REF.findall(text) if not _module_exists(name.rstrip("."))]
    return missing


def headings(text):
    """GitHub's anchors of a markdown text's headings (fenced code skipped; repeats get -1, -2, ...)."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = gen_api.slug(line.lstrip("#").strip().replace("`", ""))
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def broken_links(doc, text):
    """Relative links of `text` (a doc at `doc`) whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if rel not in REPO_PATHS:
            broken.append(target)
        elif anchor and (not rel.endswith(".md") or anchor not in headings(_read(rel))):
            broken.append(target)
    return broken


def ratios_not_in(text, sources):
    """Ratios (`0.68-0.86x`, `0.146x`) of `text` that no source states verbatim."""
    return sorted({ratio for ratio in RATIO.findall(text) if not any(ratio in source for source in sources)})


# ------------------------------------------------------------------ paths, links, figures


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_and_module_a_doc_names_exists(doc):
    assert missing_names(doc, _read(doc)) == []


def test_the_name_check_finds_planted_stale_names():
    text = ("See `mooncake_ep_switch/vocabulary.py`, buffer/kernels.py, `csrc/nowhere/`, "
            "tests/test_misuse.py::test_no_such_test and `mooncake_ep_switch.eplb.no_such_module`; "
            "but buffer/peer_regions.py, `csrc/eplb/`, tests/test_docs.py::test_the_name_check_finds_planted_stale_names, "
            "`mooncake_ep_switch.eplb.online`, ../LICENSE and deep_ep/buffer.py are fine.")
    assert missing_names("docs/x.md", text) == [
        "mooncake_ep_switch/vocabulary.py", "buffer/kernels.py", "csrc/nowhere/",
        "tests/test_misuse.py::test_no_such_test", "mooncake_ep_switch.eplb.no_such_module"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    assert broken_links(doc, _read(doc)) == []


def test_the_link_check_finds_planted_broken_links():
    text = ("[a](recovery.md) [b](api.md#top-level-mooncake_ep_switch) [c](#api-reference) [d](https://x.org/y) "
            "[e](nothing.md) [f](api.md#local-launcher-mooncake_ep_switchlaunch) [g](../README.md#no-such-part)")
    assert broken_links("docs/api.md", text) == [
        "nothing.md", "api.md#local-launcher-mooncake_ep_switchlaunch", "../README.md#no-such-part"]


def test_readme_quotes_only_figures_the_docs_state():
    sources = [_read(doc) for doc in DOCS if doc != "README.md"]
    assert ratios_not_in(_read("README.md"), sources) == []


def test_the_figure_check_finds_a_rounded_figure():
    sources = [_read("docs/benchmarks.md")]
    planted = "fallback at most 3.6-4.8x; bandwidth 0.68-0.86x; ElasticBuffer 1.2-1.8x; kernels 0.146x"
    assert ratios_not_in(planted, sources) == ["1.2-1.8x", "3.6-4.8x"]


# ------------------------------------------------------------------ docs/api.md


def test_api_md_is_what_the_generator_writes():
    assert _read("docs/api.md") == gen_api.render(), "docs/api.md is stale: run python scripts/gen_api.py"


def test_the_reference_covers_every_public_name():
    assert gen_api.coverage_problems() == []


def test_the_reference_lists_what_an_engine_needs_for_failures():
    text = gen_api.render()
    for heading in ("#### `Buffer.dead_peers()`", "#### `Buffer.members`", "#### `Buffer.epoch`",
                    "#### `Buffer.active_mask()`", "#### `Buffer.pending_joiners()`"):
        assert heading in text, heading
    # the two the hand-kept file lacked (issue 41): a keyword and a field, in signature and text
    all_reduce = re.search(r"`TPAllReduce\.all_reduce\([^`]*float32_result=False\)`.*?\n#", text, re.S)
    assert all_reduce and "float32_result:" in all_reduce.group(0)
    report = re.search(r"`RebalanceReport\([^`]*te_bytes[^`]*\)`.*?\n#", text, re.S)
    assert report and "te_bytes:" in report.group(0)


def test_coverage_reports_a_planted_public_name(monkeypatch):
    eplb = importlib.import_module("mooncake_ep_switch.eplb")
    elastic = importlib.import_module("mooncake_ep_switch.elastic")

    def planted_function(x):
        return x

    def planted_join(store):
        return store

    planted_join.__module__ = elastic.__name__  # a function the module defines (it has no __all__)
    monkeypatch.setattr(eplb, "__all__", list(eplb.__all__) + ["planted_function"])
    monkeypatch.setattr(eplb, "planted_function", planted_function, raising=False)
    monkeypatch.setattr(elastic, "planted_join", planted_join, raising=False)
    problems = gen_api.coverage_problems()
    assert sorted(p.split(":")[0] for p in problems) == ["mooncake_ep_switch.elastic.planted_join",
                                                          "mooncake_ep_switch.eplb.planted_function"], problems
    assert all("not in the API reference" in p for p in problems)


def test_a_planted_member_without_docstring_is_reported_and_makes_api_md_stale(monkeypatch):
    from mooncake_ep_switch import Buffer
    monkeypatch.setattr(Buffer, "planted_method", lambda self, flag=False: flag, raising=False)
    assert gen_api.coverage_problems() == ["mooncake_ep_switch.Buffer.planted_method: no docstring"]
    text = gen_api.render()
    assert "#### `Buffer.planted_method(flag=False)`" in text
    assert text != _read("docs/api.md")
    assert gen_api.main(["--check"]) == 1


def test_a_changed_docstring_makes_api_md_stale(monkeypatch):
    from mooncake_ep_switch import Buffer
    monkeypatch.setattr(Buffer.dead_peers, "__doc__", "Ranks that ended (a planted change).")
    text = gen_api.render()
    assert "Ranks that ended (a planted change)." in text and text != _read("docs/api.md")


def test_signatures_never_carry_an_address():
    class Marker:
        pass

    def function(a, b=Marker(), *, c=print, d=Marker, **rest):
        """Doc."""

    local = "test_signatures_never_carry_an_address.<locals>.Marker"
    assert gen_api.signature(function) == f"(a, b=<{__name__}.{local} object>, *, c=print, d={local}, **rest)"
