"""The package's structure: packages import each other in one direction only, and nothing uses ctypes.

Every `import` and `from ... import` in every module of `mooncake_ep_switch` is read with `ast`,
including the ones inside functions (a lazy import is still a dependency). A module belongs to its
top-level package or module (`mooncake_ep_switch.buffer.transport.te_endpoint` -> `buffer`); the
package graph built from those imports must have no cycle. The native modules `_native` and `_cuda` are leaves.
"""
import ast
import pathlib
from collections import defaultdict
from typing import Dict, List, Set, Tuple

import pytest

import mooncake_ep_switch

PACKAGE_DIR = pathlib.Path(mooncake_ep_switch.__file__).resolve().parent
PACKAGE = "mooncake_ep_switch"


def _modules() -> Dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR)
        if relative.parts[0] == "fallback":  # the design card's thin entry point (a link to ../fallback)
            continue
        parts = (PACKAGE,) + relative.with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: pathlib.Path, modules) -> List[Tuple[str, int]]:
    """(imported module, line) for every import of the package's own modules in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.append((full if full in modules or alias.name in ("_native", "_cuda") else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names if alias.name.startswith(PACKAGE)]
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; the package uses absolute imports")
    return out


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def package_graph() -> Dict[str, Dict[str, List[str]]]:
    """room -> {room it imports: ['file:line', ...]} over every module of the package."""
    modules = _modules()
    graph: Dict[str, Dict[str, List[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in modules.items():
        for target, line in _imports(path, modules):
            source_room, target_room = _room(module), _room(target)
            if source_room != target_room:
                graph[source_room][target_room].append(f"{path.relative_to(PACKAGE_DIR)}:{line}")
    return graph


def _cycles(graph) -> List[List[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return components


def test_the_graph_reader_finds_a_cycle():
    """The checker itself: a two-room loop and a three-room loop are found, a chain is not."""
    assert _cycles({"a": {"b": []}, "b": {"a": []}}) == [["a", "b"]]
    assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": []}, "b": {"c": []}}) == []


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert "switch" in graph["eplb"] and "buffer" in graph["switch"], "the reader lost the known edges"
    cycles = _cycles(graph)
    where = {tuple(c): {a: {b: graph[a][b] for b in c if b in graph[a]} for a in c} for c in cycles}
    assert not cycles, f"import cycles between packages: {where}"


@pytest.mark.parametrize("room", ["buffer", "layouts", "checks", "config", "faults", "errors"])
def test_the_core_imports_no_feature_package(room):
    """buffer (the data plane) and the leaf modules (layouts, checks, config, faults, errors) import none
    of switch, eplb, models, bench."""
    graph = package_graph()
    assert not {"switch", "eplb", "models", "bench", "apps", "launcher", "elastic", "elastic_buffer"} & set(
        graph.get(room, {})), dict(graph[room])


def test_the_elastic_buffer_sits_on_the_buffer_only():
    """elastic_buffer/ (DeepEP V2's API) is built on the Buffer alone: no switching, EPLB or entry points."""
    graph = package_graph()
    assert set(graph["elastic_buffer"]) <= {"buffer", "checks", "errors", "elastic_buffer", "_native"}, dict(graph["elastic_buffer"])


def test_no_ctypes_in_the_package():
    """One native binding path (pybind11): no module imports ctypes (numpy's `.ctypes.data` is not ctypes)."""
    users = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            users += [f"{module}:{node.lineno}" for name in names if name.split(".")[0] == "ctypes"]
    assert not users, f"ctypes imported in {users}"


POLICY_ROOMS = {
    # pure policy: decides from numbers, never touches a Buffer, a region or the runtime beside it
    "mooncake_ep_switch.eplb.policy": ("mooncake_ep_switch.buffer", "mooncake_ep_switch.switch",
                                       "mooncake_ep_switch.eplb.recorder", "mooncake_ep_switch.eplb.maps",
                                       "mooncake_ep_switch.eplb.slots", "mooncake_ep_switch.eplb.online",
                                       "mooncake_ep_switch.eplb.serving"),
    "mooncake_ep_switch.switch.planning": ("mooncake_ep_switch.buffer", "mooncake_ep_switch.eplb",
                                           "mooncake_ep_switch.switch.unified_weights",
                                           "mooncake_ep_switch.switch.reshard", "mooncake_ep_switch.switch.switcher",
                                           "mooncake_ep_switch.switch.kv",
                                           "mooncake_ep_switch.switch.tp_collective"),
}


def runtime_imports(room: str, modules: Dict[str, pathlib.Path]) -> List[Tuple[str, str, int]]:
    """(module, imported runtime module, line) for every import of a runtime module by `room`'s modules."""
    inside = [m for m in modules if m == room or m.startswith(room + ".")]
    assert len(inside) > 3, f"{room}: expected its modules, found {inside}"
    return [(m, target, line) for m in inside for target, line in _imports(modules[m], modules)
            if target.startswith(POLICY_ROOMS[room])]


def test_the_policy_reader_finds_a_runtime_import(tmp_path):
    """The checker itself: a policy module that imports the runtime (even lazily, inside a function)
    is found; one that imports another policy module is not."""
    modules = {name: path for name, path in _modules().items() if name.startswith("mooncake_ep_switch.eplb.policy")}
    planted = tmp_path / "planted.py"
    planted.write_text("from mooncake_ep_switch.eplb.policy import tables\n"
                       "def f():\n    from mooncake_ep_switch.eplb.slots import ExpertSlots\n    return ExpertSlots\n")
    modules["mooncake_ep_switch.eplb.policy.planted"] = planted
    assert runtime_imports("mooncake_ep_switch.eplb.policy", modules) == [
        ("mooncake_ep_switch.eplb.policy.planted", "mooncake_ep_switch.eplb.slots", 3)]


@pytest.mark.parametrize("room", sorted(POLICY_ROOMS))
def test_policy_is_apart_from_the_runtime(room):
    """eplb.policy (placement) and switch.planning (when to switch) import no runtime module."""
    bad = runtime_imports(room, _modules())
    assert not bad, f"{room} imports the runtime: {bad}"


def test_setup_lists_every_package():
    """setup.py's `packages` names every package directory (a missing one installs without its modules)."""
    setup_py = PACKAGE_DIR.parent / "setup.py"
    if not setup_py.exists():
        pytest.fail(f"setup.py not found beside the package ({setup_py}); run the tests from a checkout")
    listed = None
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "packages":
            listed = {element.value for element in node.value.elts}
    found = {".".join((PACKAGE,) + path.parent.relative_to(PACKAGE_DIR).parts)
             for path in PACKAGE_DIR.rglob("__init__.py") if "fallback" not in path.relative_to(PACKAGE_DIR).parts}
    assert listed is not None, "setup.py has no packages=[...]"
    assert found <= listed, f"packages missing from setup.py: {sorted(found - listed)}"


def test_environment_read_only_in_config():
    """Environment variables are read (and the engine's written) only in config.py; a launcher or a
    benchmark may set variables for the ranks it starts, which read them through config.py."""
    readers = []
    for module, path in _modules().items():
        if module == f"{PACKAGE}.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                named = (isinstance(owner, ast.Attribute) and owner.attr == "environ") or \
                    (isinstance(owner, ast.Name) and owner.id == "os" and node.func.attr == "getenv")
                if named and node.func.attr in ("get", "getenv", "setdefault", "pop", "__getitem__"):
                    readers.append(f"{module}:{node.lineno}")
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
                readers.append(f"{module}:{node.lineno}")
    assert not readers, f"environment read outside config.py: {readers}"


def test_errors_is_a_leaf_and_every_runtime_error_class_is_under_its_base():
    """One error hierarchy (issue 24 item 3): errors.py imports nothing of the package, and every
    exception class the package defines outside it derives from MooncakeEpError, except argument
    errors (ValueError/TypeError subclasses, which the peers' callers catch) and private ones."""
    from mooncake_ep_switch import errors
    assert not package_graph().get("errors"), "errors.py must import nothing of the package"
    offenders = []
    for module, path in _modules().items():
        if module == f"{PACKAGE}.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if bases & {"Exception", "RuntimeError", "ConnectionError", "OSError", "TimeoutError"}:
                offenders.append(f"{module}.{node.name}")
    assert not offenders, f"exception classes outside errors.py not under MooncakeEpError: {offenders}"
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.MooncakeEpError)


# ------------------------------------------------------------------ no side doors (issue 24 item 2)
# Underscored names that are public API elsewhere: NamedTuple's methods, and third-party internals the
# runtime relies on knowingly (each with its reason).
_PUBLIC_UNDERSCORE = {"_asdict", "_replace", "_fields", "_make",
                      "_use_fallback"}  # Mooncake's Buffer attribute: the engines' public switch
_THIRD_PARTY = {
    "torch._C": "torch's storage use count (calls.py: a pooled output is reused only when nothing holds it)",
    "torch._C._storage_Use_Count": "the same",
    "torch._C._cuda_getCurrentRawStream": "the current stream's raw handle (transport/cuda.py: "
                                          "torch.cuda.current_stream builds a Stream object per launch; torch's "
                                          "inductor calls this getter)",
    "self.storage._cdata": "torch's storage handle for that count",
    "distributed_c10d._get_default_store": "the default group's store (group_keys.py; torch has no public getter)",
    "config._attn_implementation": "transformers' config field for the attention kernel (models/tiny.py)",
    "config._experts_implementation": "transformers' config field for the experts kernel (models/tiny.py)",
    "os._exit": "exit without cleanup in a killed or finished rank process",
    "group._set_default_backend": "a ProcessGroup over a gloo backend built through the store, not registered with "
                                  "torch's world (membership/grow.py: torch has no public way to make one)",
    "group._register_backend": "the same",
    "getattr(worker, '_threads', ())": "concurrent.futures' worker threads (completion.py joins them within "
                                        "destroy()'s bound; the executor has no public handle on them)",
}


def _module_names(tree) -> Set[str]:
    """Underscored names a module defines itself (functions, classes, self/cls attributes, slots, globals)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in node.targets)
              and isinstance(node.value, (ast.Tuple, ast.List))):
            names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))  # __slots__ entries
    return {name for name in names if isinstance(name, str) and name.startswith("_")}


def side_doors(source: str, name: str = "<module>") -> List[str]:
    """Uses in `source` of another module's underscored attribute: `obj._x` where this module does not
    define `_x`, `from package.module import _x`, and `getattr(obj, "_x")`."""
    tree = ast.parse(source)
    own = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
                continue
            text = ast.unparse(node)
            if node.attr in own or node.attr in _PUBLIC_UNDERSCORE or text in _THIRD_PARTY:
                continue
            found.append(f"{name}:{node.lineno}: {text}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            found += [f"{name}:{node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and alias.name not in ("_native", "_cuda", "_cuda_sim")]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and node.args[1].value.startswith("_")
              and not node.args[1].value.startswith("__") and node.args[1].value not in own
              and ast.unparse(node) not in _THIRD_PARTY):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_side_door_reader_finds_each_kind():
    """The checker itself, on planted violations of each kind, and on the accesses it allows."""
    planted = ("from mooncake_ep_switch.buffer.lifetime import _helper\n"
               "def f(buffer):\n    return buffer._impl.routes\n"
               "def g(buffer):\n    return getattr(buffer, '_impl', None)\n")
    assert sorted(line.split(": ", 1)[1] for line in side_doors(planted)) == [
        "buffer._impl", "from mooncake_ep_switch.buffer.lifetime import _helper", "getattr(buffer, '_impl', None)"]
    allowed = ("class A:\n    def __init__(self):\n        self._x = 1\n    def same(self, other):\n"
               "        return other._x + self._x\n"
               "def h(point):\n    return point._asdict()\n")
    assert side_doors(allowed) == []


def test_no_module_uses_another_modules_underscored_names():
    """No side doors (issue 24 item 2): what a module needs of another is a public name, declared in
    `buffer/transport/contract.py` for transports and in `buffer/core.py` for the Buffer's helpers."""
    found = []
    for module, path in _modules().items():
        found += side_doors(path.read_text(), str(path.relative_to(PACKAGE_DIR)))
    assert not found, "side doors:\n" + "\n".join(found)


def test_every_long_module_has_its_reason_in_the_architecture_doc():
    """A module over 500 lines is named, with why it stays one file, in docs/architecture.md's
    "Modules above ~500 lines" paragraph (issue 24)."""
    doc = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    start = doc.index("Modules above ~500 lines")
    paragraph = doc[start:doc.index("\n\n", start)]
    long_modules = [str(path.relative_to(PACKAGE_DIR)) for path in sorted(PACKAGE_DIR.rglob("*.py"))
                    if len(path.read_text().splitlines()) > 500]
    assert long_modules, "the reader found no long module (the threshold or the walk is wrong)"
    missing = [module for module in long_modules if f"`{module}`" not in paragraph]
    assert not missing, f"modules over 500 lines without their reason in docs/architecture.md: {missing}"


def positional_flags(doc: str) -> List[str]:
    """The `bool` parameters a pybind11 function takes by position, from its docstring's signature lines
    (`name(a: int, *, flag: bool) -> None`: a parameter after `*` is keyword-only)."""
    found = []
    for line in doc.splitlines():
        name, paren, rest = line.partition("(")
        if not paren or not name.isidentifier() or ") ->" not in rest:
            continue
        depth, current, params = 0, "", []
        for ch in rest[:rest.rindex(") ->")]:
            depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
            if ch == "," and depth == 0:
                params.append(current.strip())
                current = ""
            else:
                current += ch
        params.append(current.strip())
        for param in params:
            if param == "*":
                break
            if param.partition(":")[2].partition("=")[0].strip() == "bool":
                found.append(f"{name}: {param.partition(':')[0]}")
    return found


def test_the_flag_reader_finds_a_positional_bool():
    """The checker itself: a flag before `*` is found, one after it is not, nor an int parameter."""
    planted = ("run(x: typing.SupportsInt, use_fp8: bool, stream: int = 0) -> None\n\nDocs.\n"
               "ok(x: int, *, compact: bool = False) -> int\n")
    assert positional_flags(planted) == ["run: use_fp8"]


@pytest.mark.parametrize("module", ["_native", "_cuda_sim", "_cuda"])
def test_native_flags_are_keyword_only(module):
    """issue 24 item 5: no positional booleans across the native boundary (`py::kw_only()` before every
    flag), so `..., -1, True, False, compact` cannot silently shift one flag into another's place."""
    import importlib

    try:
        native = importlib.import_module(f"{PACKAGE}.{module}")
    except ImportError as error:
        pytest.skip(f"{module} is not built here: {error}")
    functions = [getattr(native, name) for name in dir(native) if not name.startswith("__")]
    docs = [fn.__doc__ or "" for fn in functions if callable(fn)]
    docs += [getattr(cls, "__init__").__doc__ or "" for cls in functions if isinstance(cls, type)]
    assert sum(bool(doc) for doc in docs) > 5, "the reader saw no native signatures"
    found = [flag for doc in docs for flag in positional_flags(doc)]
    assert not found, f"positional bool parameters at the native boundary: {found}"
