"""Dependencies point one way: frameworks on the engine, and inside the engine,
each sub-package only on those below it (docs/architecture.md, "Layers").

Imports under ``TYPE_CHECKING`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvrag_integrations

ENGINE = Path(kvrag_integrations.__file__).parent / "engine"

# What each engine sub-package may import from the engine besides itself.
ALLOWED = {
    "scheduling": set(),
    "prompting": set(),
    "modeling": {"scheduling"},
    "caching": {"scheduling", "prompting", "modeling"},
    "strategies": {"prompting", "modeling"},
}
FRAMEWORKS = ("llama_index", "langchain", "langchain_core", "chromadb", "redis")


def _runtime_imports(path: Path) -> list[str]:
    """Modules imported at run time (not inside ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def _engine_part(module: str) -> str | None:
    """The engine sub-package (or top-level module) a dotted name points into."""
    parts = module.split(".")
    if parts[:2] != ["kvrag_integrations", "engine"] or len(parts) < 3:
        return None
    return parts[2]


def test_the_engine_imports_no_framework() -> None:
    offenders = {
        str(path.relative_to(ENGINE)): hits
        for path in ENGINE.rglob("*.py")
        if (hits := [m for m in _runtime_imports(path) if m.split(".")[0] in FRAMEWORKS])
    }
    assert offenders == {}


def test_engine_sub_packages_depend_one_way() -> None:
    offenders = {}
    for package, allowed in ALLOWED.items():
        for path in (ENGINE / package).rglob("*.py"):
            parts = {_engine_part(m) for m in _runtime_imports(path)} - {None, package}
            if bad := parts - allowed:
                offenders[str(path.relative_to(ENGINE))] = sorted(bad)
    assert offenders == {}
    # The scan does see engine imports: the cache layer reads the model's.
    assert "modeling" in {
        _engine_part(m) for m in _runtime_imports(ENGINE / "caching" / "chunks.py")
    }
