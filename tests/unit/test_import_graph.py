"""The package's modules import each other without a cycle, and none is over 400 lines.

Every import of ``kvrag_integrations.*`` counts, wherever it is: at the top, in
a function (lazy) or under ``if TYPE_CHECKING:``. A cycle hidden in a function
or an annotation still ties two modules into one: neither can be read, tested
or moved without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvrag_integrations

PACKAGE = Path(kvrag_integrations.__file__).parent
ROOT = "kvrag_integrations"
MAX_LINES = 400

# Cycles known and accepted (none): a new one fails the test with its path.
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(
    name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]
) -> list[str]:
    """The dotted names ``node`` imports: ``from pkg import sub`` is ``pkg.sub``
    where ``sub`` is a submodule, else ``pkg``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import counted."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(name, path, node, modules):
                if target != ROOT and not target.startswith(ROOT + "."):
                    continue
                while target not in modules:  # a name from a module: the module
                    target = target.rpartition(".")[0]
                edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module, each
    as one cycle through them (``[a, b, ..., a]``), sorted."""
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
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(_cycle_through(graph, component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One cycle inside ``component`` (strongly connected), from its first module."""
    start = min(component)
    paths = {start: [start]}
    todo = [start]
    while todo:  # breadth first: a shortest way back to start
        node = todo.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                todo.append(nxt)
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    # At the top, a submodule by ``from package import name``, in a function, typing only:
    assert "kvrag_integrations.engine.frontend" in graph["kvrag_integrations.engine.engine"]
    assert "kvrag_integrations.engine.registry" in graph["kvrag_integrations.engine.engine"]
    assert (
        "kvrag_integrations.vllm.client.start"
        in graph["kvrag_integrations.vllm.client.vllm_engine"]
    )
    assert "kvrag_integrations.store" in graph["kvrag_integrations.engine.registry"]
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(toy) == [["a", "b", "c", "a"]]


def test_no_module_imports_itself_back() -> None:
    found = cycles(import_graph())
    new = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles: " + "; ".join(" -> ".join(c) for c in new)
    gone = KNOWN_CYCLES - {frozenset(c) for c in found}
    assert not gone, f"no longer a cycle, delete it from KNOWN_CYCLES: {sorted(map(sorted, gone))}"


def test_no_module_is_over_400_lines() -> None:
    lengths = {
        str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
