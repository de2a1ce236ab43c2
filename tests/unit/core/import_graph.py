"""The import graph of a package, checked against the floors listed in docs/architecture.md.

Static: `ast` over every module, so nothing is imported to find what imports what. Edges counted:

- module-level imports;
- imports inside functions and methods (deferred imports still load the module; they hide cycles);
- imports under `if TYPE_CHECKING:` (a type-only import still ties the lower floor to the higher one, and a
  lazy package `__init__` declares what it loads on first use there);
- the package `__init__` that importing `a.b.c` runs first (`a.b`), when that `__init__` itself imports
  modules of the package at run time; a package with a lazy or docstring-only `__init__` loads nothing more.
  A module's own ancestors are skipped: Python has started them before the module runs.

Not seen: `__import__` and `importlib.import_module`, whose names are computed; `hidden_imports` finds
every such call, and the only ones allowed are a package `__init__`'s PEP 562 `__getattr__` (picking's and
usage's), which mirrors each of its lazy loads under TYPE_CHECKING, so those are counted.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

BEGIN = "<!-- floors:begin -->"
END = "<!-- floors:end -->"
_FLOOR = re.compile(r"^(\d+)\s+([\w-]+):(.*)$")
_ALLOW = re.compile(r"^allow:\s*([\w.]+)\s*->\s*([\w.]+)")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    line: int
    kind: str  # "top", "function", "type-checking" or "package-init"


@dataclass(frozen=True)
class Floors:
    """The doc's list: unit -> floor number; units on one floor import each other only where allowed."""

    root: str
    floor_of: Mapping[str, int]
    names: Mapping[int, str]
    allowed: frozenset[tuple[str, str]] = field(default_factory=frozenset)

    def unit_of(self, module: str) -> str | None:
        # The longest listed unit that contains the module: `picking.config` before `picking`.
        best: str | None = None
        if module == self.root:  # the root unit is the root package's own __init__, nothing under it
            return self.root if self.root in self.floor_of else None
        for unit in self.floor_of:
            full = f"{self.root}.{unit}"
            if (module == full or module.startswith(full + ".")) and (best is None or len(unit) > len(best)):
                best = unit
        return best


def parse_floors(text: str, root: str) -> Floors:
    """Read the list between the floors markers: `N name: unit unit ...` lines and `allow: a -> b` lines."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no {BEGIN} ... {END} block")
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    floor_of: dict[str, int] = {}
    names: dict[int, str] = {}
    allowed: set[tuple[str, str]] = set()
    for raw in block.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("```"):  # the block's code fence
            continue
        floor = _FLOOR.match(line)
        allow = _ALLOW.match(line)
        if floor:
            number = int(floor.group(1))
            names[number] = floor.group(2)
            for unit in floor.group(3).replace(",", " ").split():
                if unit in floor_of:
                    raise ValueError(f"unit {unit} is listed on two floors")
                floor_of[unit] = number
        elif allow:
            allowed.add((allow.group(1), allow.group(2)))
        else:
            raise ValueError(f"cannot read floors line: {raw!r}")
    for source, target in allowed:
        if floor_of.get(source) is None or floor_of.get(source) != floor_of.get(target):
            raise ValueError(f"allow: {source} -> {target} must name two listed units on one floor")
    return Floors(root, floor_of, names, frozenset(allowed))


def module_names(package_dir: Path) -> dict[str, Path]:
    root = package_dir.name
    names: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [root, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: Iterable[str], root: str) -> None:
        self.module, self.is_package, self.known, self.root = module, is_package, set(known), root
        self.depth = 0
        self.typing = 0
        self.found: list[Edge] = []

    def _add(self, target: str, line: int) -> None:
        if target == self.root or target.startswith(self.root + "."):
            kind = "type-checking" if self.typing else "function" if self.depth else "top"
            self.found.append(Edge(self.module, target, line, kind))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.typing += 1
        for child in node.body:
            self.visit(child)
        self.typing -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        for alias in node.names:
            # `from a.b import c` names module a.b.c when there is one, else a name in a.b.
            candidate = f"{source}.{alias.name}"
            self._add(candidate if candidate in self.known else source, node.lineno)


def import_edges(package_dir: Path) -> list[Edge]:
    modules = module_names(package_dir)
    root = package_dir.name
    direct: list[Edge] = []
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py", modules, root)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        direct.extend(edge for edge in visitor.found if edge.target in modules and edge.target != name)
    # A package __init__ that loads modules at run time is loaded by every import of its submodules.
    loading = {e.source for e in direct if e.kind != "type-checking" and modules[e.source].name == "__init__.py"}
    implicit: list[Edge] = []
    for edge in direct:
        parts = edge.target.split(".")
        for cut in range(1, len(parts)):
            package = ".".join(parts[:cut])
            own_ancestor = edge.source == package or edge.source.startswith(package + ".")
            if package in loading and not own_ancestor:
                implicit.append(Edge(edge.source, package, edge.line, "package-init"))
    return sorted(set(direct + implicit), key=lambda e: (e.source, e.target, e.line, e.kind))


def hidden_imports(package_dir: Path) -> list[str]:
    """Imports by computed name (`__import__`, `import_module`), which the walk cannot see. The one place
    allowed is a package `__init__`'s PEP 562 `__getattr__`, which mirrors its loads under TYPE_CHECKING."""
    found: list[str] = []
    for name, path in module_names(package_dir).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        allowed: set[int] = set()
        if path.name == "__init__.py":
            for statement in tree.body:
                if isinstance(statement, ast.FunctionDef) and statement.name == "__getattr__":
                    allowed |= {id(inner) for inner in ast.walk(statement)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in allowed:
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in {"__import__", "import_module"}:
                found.append(f"{name} line {node.lineno}: {called}(...)")
    return found


def strongly_connected(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's components with more than one node: each is a cycle (or several sharing nodes)."""
    graph: dict[str, set[str]] = {node: set() for node in nodes}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@dataclass(frozen=True)
class Report:
    unplaced: list[str]  # modules no listed unit contains
    empty_units: list[str]  # listed units that contain no module
    crossings: list[tuple[Edge, str]]  # edge, why ("upward: ..." or "sideways: ...")
    module_cycles: list[list[str]]
    unit_cycles: list[list[str]]

    def lines(self) -> Iterator[str]:
        yield from (f"no floor for module {m}: add it (or its room) to docs/architecture.md" for m in self.unplaced)
        yield from (f"listed unit {u} has no module: remove it from docs/architecture.md" for u in self.empty_units)
        for edge, why in self.crossings:
            yield f"{edge.source} -> {edge.target} (line {edge.line}, {edge.kind}): {why}"
        yield from ("module cycle: " + " <-> ".join(c) for c in self.module_cycles)
        yield from ("room cycle: " + " <-> ".join(c) for c in self.unit_cycles)


def check(package_dir: Path, floors: Floors) -> Report:
    modules = module_names(package_dir)
    edges = import_edges(package_dir)
    unit_of = {m: floors.unit_of(m) for m in modules}
    unplaced = sorted(m for m, u in unit_of.items() if u is None)
    empty = sorted(set(floors.floor_of) - {u for u in unit_of.values() if u is not None})
    crossings: list[tuple[Edge, str]] = []
    unit_edges: set[tuple[str, str]] = set()
    for edge in edges:
        source, target = unit_of[edge.source], unit_of[edge.target]
        if source is None or target is None or source == target:
            continue
        unit_edges.add((source, target))
        low, high = floors.floor_of[source], floors.floor_of[target]
        if high > low:
            crossings.append((edge, f"upward: {source} ({floors.names[low]}) imports {target} ({floors.names[high]})"))
        elif high == low and (source, target) not in floors.allowed:
            crossings.append((edge, f"sideways: {source} and {target} share floor {floors.names[low]}, not allowed"))
    return Report(
        unplaced,
        empty,
        crossings,
        strongly_connected(modules, ((e.source, e.target) for e in edges)),
        strongly_connected(floors.floor_of, unit_edges),
    )
