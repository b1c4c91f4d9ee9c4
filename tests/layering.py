"""Checks a package's imports against a layer order (specstack/layers.py, DESIGN §1).

Terms: an *edge* is one import statement naming a module of the package (file, line, importer,
imported module); a module's *unit* is the LAYERS entry that owns it, its longest listed prefix
(``specstack.bench``, ``specstack.prompts``). ``check`` reads every file with ``ast`` (nothing is
imported, so a broken module still gets checked) and lists four kinds of problem: a module in no
layer, an edge to a higher layer, a circle of modules, a circle of units (``bench <-> throughput``).
"""
from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specstack.layers import LAYERS

Layers = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Edge:
    path: Path  # the importing file, relative to the package's parent folder
    line: int
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    where: str  # "top", "function" or "TYPE_CHECKING"

    def at(self) -> str:
        return f"{self.path}:{self.line}"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package folder `root` by dotted name (a package by its __init__.py)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def statements(node: ast.AST, where: str = "top") -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement below `node`, with where it sits: "top", "function" or "TYPE_CHECKING"."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, where
        return
    if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
        for child in node.body:
            yield from statements(child, "TYPE_CHECKING")
        for child in node.orelse:
            yield from statements(child, where)
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        where = "function"
    for child in ast.iter_child_nodes(node):
        yield from statements(child, where)


def imports(name: str, path: Path, known: dict[str, Path], root: Path) -> Iterator[Edge]:
    """The edges of module `name`; `from a import b` names a.b when b is a module of the tree."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node, where in statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = {alias.name for alias in node.names}
        else:
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` climbs level - 1 packages from this one
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        for dst in sorted(targets):
            if dst == root.name or dst.startswith(root.name + "."):
                yield Edge(path.relative_to(root.parent), node.lineno, name, dst, where)


def owner(module: str, layers: Layers, top: str) -> tuple[int, str] | None:
    """(layer index, owning prefix) by specstack.layers.layer_of's rule, or None for no layer.

    The package itself (its __init__) runs before any of its modules, so it counts as the bottom
    layer: it may import only foundation modules, or every import of the package would pull more.
    """
    if module == top:
        return 0, top
    hits = [(len(p), i, p) for i, (_, owned) in enumerate(layers) for p in owned
            if module == p or module.startswith(p + ".")]
    return max(hits)[1:] if hits else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle through the first node (sorted) of each strongly connected component."""
    def reach(start: str) -> dict[str, str]:  # node -> its predecessor on a shortest path from start
        parent, queue = {}, deque([start])
        while queue:
            node = queue.popleft()
            for nxt in sorted(graph.get(node, ())):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        return parent

    reached = {n: reach(n) for n in graph}
    done: set[str] = set()
    found = []
    for n in sorted(graph):
        if n in done or n not in reached[n]:
            continue
        done |= {m for m in reached[n] if n in reached.get(m, {})}
        path = [n]
        while path[-1] != n or len(path) == 1:
            path.append(reached[n][path[-1]])
        found.append(path[::-1])
    return found


def check(root: Path, layers: Layers = LAYERS) -> list[str]:
    """Every layering problem of the package folder `root`, one readable line each."""
    known = modules(root)
    edges = [e for name, path in known.items() for e in imports(name, path, known, root)]
    problems = []
    place = {m: owner(m, layers, root.name) for m in {*known, *(e.dst for e in edges)}}
    for name, path in known.items():
        if place[name] is None:
            problems.append(f"{path.relative_to(root.parent)}:1  {name} belongs to no layer")
    names = [name for name, _ in layers]
    first: dict[tuple[str, str], Edge] = {}  # (importer, imported), modules or units -> first edge
    modules_graph: dict[str, set[str]] = {}
    units_graph: dict[str, set[str]] = {}
    for e in edges:
        src, dst = place[e.src], place[e.dst]
        if dst is None and e.dst not in known:  # a module of the tree is reported once, above
            problems.append(f"{e.at()}  {e.src} -> {e.dst}, which belongs to no layer")
        # Imports inside functions and under `if TYPE_CHECKING:` count like any other: the first only
        # defer the dependency to a call, the second hide it from the interpreter, not from a reader
        # (an annotation naming a higher layer's type ties the lower layer's API to that layer).
        if src and dst and src[0] < dst[0]:
            problems.append(f"{e.at()}  {e.src} ({names[src[0]]}) -> {e.dst} ({names[dst[0]]})"
                            + ("" if e.where == "top" else f"  [{e.where}]"))
        # a module in no layer is its own unit, so circles through it are still found
        units = (src[1] if src else e.src, dst[1] if dst else e.dst)
        for graph, a, b in ((modules_graph, e.src, e.dst), (units_graph, *units)):
            if a != b:
                graph.setdefault(a, set()).add(b)
                first.setdefault((a, b), e)
    for kind, graph in (("modules", modules_graph), ("packages", units_graph)):
        for circle in cycles(graph):
            hops = "  ->  ".join(f"{b} ({first[a, b].at()})" for a, b in zip(circle, circle[1:], strict=False))
            problems.append(f"circle of {kind}: {circle[0]}  ->  {hops}")
    return problems
