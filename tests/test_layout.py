"""The runtime's layout, read from its source with `ast` (nothing is imported or run):
every module of duplex/, models/ and audio_io/, and every import in it, at module level
or inside a function, absolute or relative (``importlib.import_module`` of a constant
name too). audio_io/_proto is left out: protoc's stubs, generated into a checkout.

- the project's modules import one another without a cycle, imports under TYPE_CHECKING
  counted: the arrows point down (STYLE.md 11; a lower layer that needs a higher one
  names a Protocol);
- the runtime never imports `benchmarks` or `tests`, which the wheel does not ship;
- the runtime never touches ``sys.path``: what it imports, it imports as installed;
- the modules stay small (STYLE.md 1), the session controller smaller (STYLE.md 14);
- the wheel's packages are the runtime's only.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import itertools
import tomllib
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ("duplex", "models", "audio_io")
GENERATED = ROOT / "audio_io" / "_proto"
NOT_RUNTIME = ("benchmarks", "tests")  # harnesses and measurements: the checkout's only
MAX_LINES = 450
MAX_LINES_SESSION = 400  # duplex/session.py: a controller stays a controller
SESSION = ROOT / "duplex" / "session.py"


@dataclass(frozen=True)
class Module:
    name: str  # dotted: duplex.transports.sip; a package's __init__ is the package
    path: Path
    source: str

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT))


@dataclass(frozen=True)
class Import:
    names: tuple[str, ...]  # what the statement may load, most specific first
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: a dependency all the same


@functools.cache
def runtime_modules() -> dict[str, Module]:
    modules = {}
    for top in RUNTIME:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(GENERATED):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = Module(name, path, path.read_text())
    return modules


def _tree(module: Module) -> ast.Module:
    return ast.parse(module.source, filename=module.where)


def imports(module: Module) -> list[Import]:
    """Every import in ``module``, in the order of its lines, relative ones made absolute.
    ``from a import b`` may load the module ``a.b`` or take the name ``b`` from ``a``: both
    are named, ``a.b`` first."""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    tree = _tree(module)
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _dotted(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        names: list[tuple[str, ...]]
        if isinstance(node, ast.Import):
            names = [(alias.name,) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.level <= len(package), f"{module.where}:{node.lineno}: beyond the top package"
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            else:
                base = node.module or ""
            names = [(f"{base}.{alias.name}", base) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and _dotted(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [(node.args[0].value,)]
        else:
            continue
        found += [Import(n, node.lineno, id(node) in typing_only) for n in names]
    return sorted(found, key=lambda i: i.line)  # ast.walk goes breadth first


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def import_graph() -> dict[str, dict[str, str]]:
    """Module -> the project's modules it imports -> where (the first import that runs,
    else the first under TYPE_CHECKING)."""
    modules = runtime_modules()
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, module in modules.items():
        for imported in sorted(imports(module), key=lambda i: i.typing_only):
            target = next((n for n in imported.names if n in modules), None)
            if target is not None and target != name:
                only = " (under TYPE_CHECKING)" if imported.typing_only else ""
                graph[name].setdefault(target, f"{module.where}:{imported.line}{only}")
    return graph


def cycles(graph: Mapping[str, Collection[str]]) -> list[list[str]]:
    """One shortest cycle through each group of modules that import one another
    (a strongly connected component of more than one module), as the modules in order,
    the first again at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for after in graph[node]:
            if after not in index:
                connect(after)
                low[node] = min(low[node], low[after])
            elif after in on_stack:
                low[node] = min(low[node], index[after])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    found = []
    for component in components:  # breadth first from the first member, back to it
        start = min(component)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in graph[node]:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                found.append([*reversed(path), start])
                break
            for after in sorted(graph[node]):
                if after in component and after != start and after not in came_from:
                    came_from[after] = node
                    queue.append(after)
    return sorted(found)


def describe_all(found: list[list[str]], graph: dict[str, dict[str, str]]) -> str:
    """Each cycle's path, then where each of its imports is."""
    return "\n".join(
        " -> ".join(cycle)
        + "".join(f"\n    {a} imports {b}: {graph[a][b]}" for a, b in itertools.pairwise(cycle))
        for cycle in found
    )


def test_the_walk_sees_every_kind_of_import():
    """Relative imports made absolute, imports inside a function or a TYPE_CHECKING
    block, and modules imported by name are all seen."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import output\n"
        "from ..port import SessionPort\n"
        "import duplex.events as ev\n"
        "if TYPE_CHECKING:\n"
        "    from duplex.session import Session\n"
        "def f():\n"
        "    from models.tts import TtsEngine\n"
        "    return importlib.import_module('benchmarks.caller')\n"
    )
    module = Module("duplex.transports.x", ROOT / "duplex" / "transports" / "x.py", source)
    assert [(i.names, i.line) for i in imports(module)] == [
        (("typing.TYPE_CHECKING", "typing"), 1),
        (("duplex.transports.output", "duplex.transports"), 2),
        (("duplex.port.SessionPort", "duplex.port"), 3),
        (("duplex.events",), 4),
        (("duplex.session.Session", "duplex.session"), 6),
        (("models.tts.TtsEngine", "models.tts"), 8),
        (("benchmarks.caller",), 9),
    ]
    graph = import_graph()
    assert len(graph) > 50
    assert "duplex.service" in graph["duplex.cli"]  # inside `_serve`
    assert "duplex.events" in graph["duplex.session"]  # `from duplex import events`: the module


def test_the_cycle_finder_finds_a_cycle_and_its_path():
    graph = {"a": {"b", "x"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "x": {"b"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]  # the shortest of the two through a
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (the arrows must point one way):\n" + describe_all(found, graph)


def test_the_runtime_imports_no_benchmark_and_no_test():
    modules = runtime_modules().values()
    assert len(modules) > 50 and sum(len(imports(m)) for m in modules) > 500  # the walk read them
    wrong = [
        f"{module.where}:{imported.line} imports {imported.names[-1]}"
        for module in modules
        for imported in imports(module)
        if imported.names[-1].split(".")[0] in NOT_RUNTIME
    ]
    assert not wrong, "the wheel ships neither benchmarks/ nor tests/:\n" + "\n".join(wrong)


def test_the_runtime_leaves_sys_path_alone():
    """Neither ``sys.path`` (however `sys` is named) nor ``from sys import path``, nor
    ``site.addsitedir``: the runtime imports what is installed, never a checkout's
    other directories by path."""
    wrong = []
    modules = runtime_modules().values()
    assert len(modules) > 50  # the walk read them
    for module in modules:
        tree = _tree(module)
        sys_names = {"sys"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                sys_names |= {alias.asname or alias.name for alias in node.names if alias.name == "sys"}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("path", "meta_path", "path_hooks")
                and isinstance(node.value, ast.Name)
                and node.value.id in sys_names
            ):
                wrong.append(f"{module.where}:{node.lineno}: sys.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "sys":
                wrong += [
                    f"{module.where}:{node.lineno}: from sys import {a.name}"
                    for a in node.names
                    if a.name in ("path", "meta_path", "path_hooks")
                ]
            elif isinstance(node, ast.Attribute) and _dotted(node) == "site.addsitedir":
                wrong.append(f"{module.where}:{node.lineno}: site.addsitedir")
        if "sys.path" in module.source and not any(w.startswith(module.where) for w in wrong):
            wrong.append(f"{module.where}: mentions sys.path")
    assert not wrong, "\n".join(wrong)


def test_no_module_is_long():
    lines = {m.where: len(m.source.splitlines()) for m in runtime_modules().values()}
    assert len(lines) > 50 and str(SESSION.relative_to(ROOT)) in lines  # read them, the session's too
    limits = {where: MAX_LINES_SESSION if ROOT / where == SESSION else MAX_LINES for where in lines}
    long = {where: n for where, n in lines.items() if n > limits[where]}
    assert not long, "modules over their limit (lines; 450, duplex/session.py 400):\n" + "\n".join(
        f"{where}: {n}" for where, n in sorted(long.items(), key=lambda item: -item[1])
    )


def test_the_wheel_ships_the_runtimes_packages_only():
    """pyproject's package list: every runtime package, neither benchmarks nor tests
    (which the sdist's MANIFEST.in does not take either)."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    included = found["include"]
    for top in RUNTIME:
        assert any(fnmatch.fnmatch(top, pattern) for pattern in included), (top, included)
    for top in NOT_RUNTIME:
        for name in (top, f"{top}.caller", f"{top}.speech_set"):
            assert not any(fnmatch.fnmatch(name, pattern) for pattern in included), (name, included)
    moved_out = [ROOT / "duplex" / "caller.py", ROOT / "models" / "speech_set.py"]  # now in benchmarks/
    assert not [path for path in moved_out if path.exists()]
