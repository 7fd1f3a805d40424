"""The static import graph of a package tree, and the layering checks over it (test_layering.py).

Every import statement counts, wherever it sits (module top, inside a function, under
`if TYPE_CHECKING:`). `from pkg import name` imports the submodule `pkg.name` when that file
exists, else `pkg` itself. A module's parent packages are not counted as imported: their
`__init__` files run first, but no design rule is about them.
"""
from __future__ import annotations

import ast
import functools
import pathlib


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file for every .py under root; a package is named by its folder."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[list[str]]:
    """Candidate names of one import statement, each most specific first."""
    if isinstance(node, ast.Import):
        return [[a.name] for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([base] if base else []))
    return [[f"{base}.{a.name}", base] for a in node.names]


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (no self-edges); cached, do not mutate."""
    known = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for candidates in _imported(node, module, is_package):
                exact = [name for name in candidates if name in known]
                target = exact[0] if exact else _resolve(candidates[-1], known)
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth = longest import chain, a few dozen
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def unit_of(module: str) -> str:
    """The layering unit: the top-level subpackage or root module ('engine', 'config');
    the top package's own __init__ is its bare name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Unit -> the other units it imports."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = unit_of(module)
        units.setdefault(mine, set()).update(unit_of(t) for t in targets if unit_of(t) != mine)
    return units


def edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets)


def forbidden_imports(root: pathlib.Path, forbidden: dict[str, set[str]]) -> list[str]:
    """'a.b imports c.d' for every import from a unit into one of its forbidden units."""
    return [f"{m} imports {t}" for m, t in edges(module_graph(root))
            if unit_of(t) in forbidden.get(unit_of(m), ())]


def upward_imports(root: pathlib.Path, roots: set[str], exceptions: set[tuple[str, str]]) -> list[str]:
    """'a imports b' for every import from a root module (a file directly under root, not one of
    the composition roots named in `roots`) into a subpackage, and from anywhere but a composition
    root into a composition root; (importing unit, imported module) pairs in `exceptions` pass."""
    known = modules(root)
    subpackages = {unit_of(m) for m, p in known.items() if p.parent != root}
    bad = []
    for m, t in edges(module_graph(root)):
        if unit_of(m) in roots or (unit_of(m), t) in exceptions:
            continue
        if (known[m].parent == root and unit_of(t) in subpackages) or unit_of(t) in roots:
            bad.append(f"{m} imports {t}")
    return bad
