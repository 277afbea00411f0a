"""Dependency direction between radixmesh's packages, and no import cycles.

Every module under ``src/radixmesh`` is parsed with :mod:`ast`; every import counts, at any
depth (inside functions and ``if TYPE_CHECKING:`` blocks too): a lazy import is still a
dependency. The intended layering is core ← engine ← runtime, core ← sim, ``results`` and
``workload`` below bench and sim, bench and chaos on top; ``child_process`` (one OS call,
no radixmesh imports) below everything that starts processes.

Three more rules are read off the syntax tree: inside ``core/`` no part reads another
object's private attributes (``obj._name`` with ``obj`` other than ``self``/``cls``); anywhere
under ``src/radixmesh`` no function is longer than ``MAX_FUNCTION_LINES`` (from ``def`` to its
last line, docstring included) unless a comment on its ``def`` line says ``# long: <reason>``
(argument tables), and no file is longer than ``MAX_FILE_LINES`` unless its module docstring
says why ("... over 400 lines ..." or "Why 400 lines"). And docs/modules.md's
"Request decisions" table names, for each decision about a request, a core function that
exists (imported and looked up).
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT_PACKAGE = "radixmesh"


@dataclass(frozen=True, slots=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported radixmesh module, dotted
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        where = " (under TYPE_CHECKING)" if self.typing_only else ""
        return f"{self.source}:{self.line} imports {self.target}{where}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / ROOT_PACKAGE).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (resolving leading dots)."""
    if node.level == 0:
        return node.module or ""
    base = source.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(node: ast.AST, source: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The radixmesh modules one import statement loads (``from pkg import mod`` -> pkg.mod)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = _absolute(node, source, is_package)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield sub if sub in known else base


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _imports(node: ast.AST, typing_only: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement below ``node``, and whether only type checkers run it."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, typing_only
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
        for child in node.body:
            yield from _imports(child, True)
        for child in node.orelse:
            yield from _imports(child, typing_only)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _imports(child, typing_only)


def import_edges() -> list[Edge]:
    modules = all_modules()
    known = set(modules)
    edges: dict[Edge, None] = {}  # ordered, without repeats
    for source, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, typing_only in _imports(tree):
            for target in _targets(node, source, is_package, known):
                if target.split(".")[0] == ROOT_PACKAGE and target != source:
                    edges[Edge(source, target, node.lineno, typing_only)] = None
    return list(edges)


def layer(module: str) -> str:
    """``radixmesh.sim.runner`` -> ``sim``; top-level modules are their own layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@dataclass(frozen=True, slots=True)
class Rule:
    layer: str
    allowed: frozenset[str] | None = None  # only these layers (None: any but ``forbidden``)
    forbidden: frozenset[str] = frozenset()

    def violated_by(self, edge: Edge) -> bool:
        if layer(edge.source) != self.layer:
            return False
        to = layer(edge.target)
        if self.allowed is not None:
            return to not in self.allowed
        return to in self.forbidden


RULES = {
    "core imports only core": Rule("core", allowed=frozenset({"core"})),
    "engine imports only core": Rule("engine", allowed=frozenset({"core", "engine"})),
    "sim is below runtime, bench, chaos and engine": Rule(
        "sim", forbidden=frozenset({"runtime", "bench", "chaos", "engine"})
    ),
    "runtime is below sim, bench and chaos": Rule(
        "runtime", forbidden=frozenset({"sim", "bench", "chaos"})
    ),
    "workload is below runtime, sim, bench and chaos": Rule(
        "workload", forbidden=frozenset({"runtime", "sim", "bench", "chaos"})
    ),
    "results imports only results": Rule("results", allowed=frozenset({"results"})),
    "testing imports only core and child_process": Rule(
        "testing", allowed=frozenset({"core", "testing", "child_process"})
    ),
    "child_process imports nothing of radixmesh": Rule("child_process", allowed=frozenset()),
    "emulate imports only core and engine": Rule(
        "emulate", allowed=frozenset({"core", "engine", "emulate"})
    ),
}


@pytest.mark.parametrize("name", list(RULES))
def test_layer(name: str) -> None:
    bad = [str(e) for e in import_edges() if RULES[name].violated_by(e)]
    assert not bad, f"{name}:\n  " + "\n  ".join(bad)


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    return _Components(graph).found


class _Components:
    """Tarjan's strongly connected components, iterative (no recursion limit)."""

    def __init__(self, graph: dict[str, set[str]]) -> None:
        self.graph = graph
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.found: list[list[str]] = []
        for root in sorted(graph):
            if root not in self.index:
                self._visit(root)

    def _enter(self, node: str) -> Iterator[str]:
        self.index[node] = self.low[node] = len(self.index)
        self.stack.append(node)
        return iter(sorted(self.graph[node]))

    def _visit(self, root: str) -> None:
        work = [(root, self._enter(root))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    self.low[parent] = min(self.low[parent], self.low[node])
                self._close(node)
            elif child not in self.index:
                work.append((child, self._enter(child)))
            elif child in self.stack:
                self.low[node] = min(self.low[node], self.index[child])

    def _close(self, node: str) -> None:
        if self.low[node] != self.index[node]:
            return
        at = self.stack.index(node)
        component, self.stack[at:] = self.stack[at:], []
        if len(component) > 1:
            self.found.append(sorted(component))


def test_no_import_cycles() -> None:
    edges = import_edges()
    report = []
    for component in cycles(edges):
        members = set(component)
        inner = [str(e) for e in edges if e.source in members and e.target in members]
        report.append(" <-> ".join(component) + "\n    " + "\n    ".join(inner))
    assert not report, "import cycles:\n  " + "\n  ".join(report)


def test_the_checks_see_lazy_imports() -> None:
    """The parser finds lazy and type-only imports, and cycles (checks of the checks)."""
    edges = import_edges()
    assert any(e.source == "radixmesh.cli" for e in edges)
    code = "if TYPE_CHECKING:\n    import a\nelse:\n    import b\ndef f():\n    import c\n"
    tree = ast.parse(code)
    assert [(n.lineno, only) for n, only in _imports(tree)] == [(2, True), (4, False), (6, False)]
    assert cycles([Edge("a", "b", 1), Edge("b", "c", 1), Edge("c", "a", 1)]) == [["a", "b", "c"]]


CORE = SRC / ROOT_PACKAGE / "core"
MAX_FUNCTION_LINES = 40
MAX_FILE_LINES = 400
LONG_MARK = "# long:"  # on a def line, with a reason: exempt from the length rule


def private_reads(code: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each ``obj._name`` whose ``obj`` is not ``self`` or ``cls``
    (dunders such as ``__class__`` are public)."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def long_functions(code: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str, int]]:
    """``(line, name, length)`` of each function longer than ``limit`` lines, less those
    marked ``# long: <reason>`` on their ``def`` line."""
    lines = code.splitlines()
    found = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        marked = LONG_MARK in lines[node.lineno - 1]
        if length > limit and not marked:
            found.append((node.lineno, node.name, length))
    return found


def _core_files() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def test_no_core_part_reads_another_objects_private_attributes() -> None:
    bad = [f"{p.name}:{line}: {text}" for p in _core_files()
           for line, text in private_reads(p.read_text(encoding="utf-8"))]
    assert not bad, "private attributes read from outside their object:\n  " + "\n  ".join(bad)


def _source_files() -> list[Path]:
    return sorted((SRC / ROOT_PACKAGE).rglob("*.py"))


def test_no_function_is_over_the_length_limit() -> None:
    bad = [f"{p.relative_to(SRC)}:{line}: {name} ({length} lines)" for p in _source_files()
           for line, name, length in long_functions(p.read_text(encoding="utf-8"))]
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(bad)


def says_why_it_is_long(code: str) -> bool:
    """A file over ``MAX_FILE_LINES`` whose module docstring gives its reason."""
    doc = " ".join((ast.get_docstring(ast.parse(code)) or "").split()).lower()
    return "over 400 lines" in doc or "why 400 lines" in doc


def test_every_file_over_the_limit_says_why_at_the_top() -> None:
    silent = [str(p.relative_to(SRC)) for p in _source_files()
              if (code := p.read_text(encoding="utf-8")).count("\n") > MAX_FILE_LINES
              and not says_why_it_is_long(code)]
    assert not silent, f"over {MAX_FILE_LINES} lines without their reason: {silent}"


def test_the_core_checks_see_what_they_must() -> None:
    """Checks of the checks: a foreign private read, a long function, an exemption."""
    code = "class A:\n    def f(self, o):\n        return self._x, o._y, o.__class__, cls._z\n"
    assert private_reads(code) == [(3, "o._y")]
    body = "".join(f"    x{i} = {i}\n" for i in range(3))
    assert long_functions(f"def f():\n{body}", limit=3) == [(1, "f", 4)]
    assert long_functions(f"def f():  {LONG_MARK} a table\n{body}", limit=3) == []
    assert says_why_it_is_long('"""A.\n\nWhy one file over 400 lines: one protocol."""\n')
    assert not says_why_it_is_long('"""A module of 400 lines and more."""\n')


DOCS = Path(__file__).resolve().parents[1] / "docs" / "modules.md"
# each must appear in a row's decision (the brief's list of request decisions)
REQUIRED_DECISIONS = ("where a request goes", "forwardability", "sample affinity",
                      "nothing can serve", "accept or refuse a peer's forward", "push back",
                      "suspect a peer", "retry the next peer")


def decision_table(text: str) -> list[tuple[str, str]]:
    """``(decision, dotted name)`` rows of docs/modules.md's "Request decisions" table."""
    section = text.split("## Request decisions", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("`") and cells[1].endswith("`"):
            rows.append((cells[0], cells[1].strip("`")))
    return rows


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_decision_table_names_functions_that_exist() -> None:
    rows = decision_table(DOCS.read_text(encoding="utf-8"))
    assert len(rows) >= len(REQUIRED_DECISIONS)
    missing = [need for need in REQUIRED_DECISIONS
               if not any(need in decision.lower() for decision, _ in rows)]
    assert not missing, f"decisions without a row: {missing}"
    bad = []
    for decision, dotted in rows:
        try:
            if not callable(resolve(dotted)):
                bad.append(f"{dotted} ({decision}): not a function")
        except (ImportError, AttributeError) as exc:
            bad.append(f"{dotted} ({decision}): {exc}")
    assert not bad, "docs/modules.md names what does not exist:\n  " + "\n  ".join(bad)


def test_the_decision_table_parser_sees_rows_and_catches_a_wrong_name() -> None:
    text = "## Request decisions\n\n| decision | fn |\n| --- | --- |\n| a | `m.f` |\n## Next\n"
    assert decision_table(text) == [("a", "m.f")]
    assert resolve("radixmesh.core.node.NodeCore.serve") is not None
    with pytest.raises(AttributeError):
        resolve("radixmesh.core.node.NodeCore.no_such_method")


TYPE_NAME = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")  # CamelCase, not a CONSTANT


def _type_names(node: ast.stmt) -> list[str]:
    """The public type names a top-level statement defines: a class, or an alias
    (``Row = dict[str, Any]``)."""
    if isinstance(node, ast.ClassDef):
        names = [node.name]
    elif isinstance(node, ast.Assign):
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        names = [node.target.id]
    else:
        names = []
    return [n for n in names if TYPE_NAME.fullmatch(n)]


def _public_type_names() -> dict[str, list[str]]:
    """Every public top-level class or type alias under src/, by name: the modules defining it."""
    where: dict[str, list[str]] = {}
    for path in _source_files():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            for name in _type_names(node):
                where.setdefault(name, []).append(str(path.relative_to(SRC)))
    return where


def test_no_two_public_type_names_alike() -> None:
    """One meaning per name: a class or type alias name names one type in the whole package
    (an event and a wire message, or a core record and a chaos helper, once shared names)."""
    twice = {name: mods for name, mods in _public_type_names().items() if len(mods) > 1}
    assert not twice, f"type names defined in more than one module: {twice}"


def test_the_type_name_check_sees_every_module() -> None:
    found = _public_type_names()
    assert found["NodeCore"] == ["radixmesh/core/node.py"]
    assert "ForwardAccepted" in found and "ForwardAdmitted" in found
    assert found["Row"] == ["radixmesh/results/run_summary.py"]  # an alias counts too
    assert "HEARTBEAT_MAX_S" not in found  # a constant does not
