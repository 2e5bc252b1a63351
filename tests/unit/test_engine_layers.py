"""Dependencies point one way: frameworks on the engine, and inside the engine,
each sub-package only on those below it (docs/architecture.md, "Layers").

Imports under ``TYPE_CHECKING`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvrag_integrations

ENGINE = Path(kvrag_integrations.__file__).parent / "engine"

# What each engine sub-package may import from the engine besides itself
# ("results": the result types, engine/results.py, which import nothing of the
# engine at run time).
ALLOWED = {
    "scheduling": set(),
    "tools": set(),
    "prompting": {"tools"},
    "modeling": {"scheduling"},
    "caching": {"scheduling", "prompting", "modeling"},
    "strategies": {"prompting", "modeling", "results"},
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
    results = {_engine_part(m) for m in _runtime_imports(ENGINE / "results.py")} - {None}
    assert results == set()
    # The scan does see engine imports: the cache layer reads the model's.
    assert "modeling" in {
        _engine_part(m) for m in _runtime_imports(ENGINE / "caching" / "chunks.py")
    }


VLLM = Path(kvrag_integrations.__file__).parent / "vllm"


def test_the_vllm_package_depends_on_the_engine_not_on_frameworks() -> None:
    """The connector and VLLMEngine sit beside the engine: no adapter, no framework."""
    offenders = {
        path.name: hits
        for path in VLLM.rglob("*.py")
        if (
            hits := [
                m
                for m in _runtime_imports(path)
                if m.split(".")[0] in FRAMEWORKS
                or m.startswith(("kvrag_integrations.llama_index", "kvrag_integrations.langchain"))
            ]
        )
    }
    assert offenders == {}


def _top_level_vllm_imports(path: Path) -> bool:
    return any(
        isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            name.split(".")[0] == "vllm"
            for name in (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
        )
        for node in ast.parse(path.read_text()).body
    )


def test_only_the_connector_package_imports_vllm_at_load() -> None:
    """A client of a vLLM server needs no vLLM: only the module vLLM itself loads
    imports it at the top; the in-process backend imports it when it starts one."""
    top_level = {
        str(path.relative_to(VLLM)) for path in VLLM.rglob("*.py") if _top_level_vllm_imports(path)
    }
    assert top_level == {"connector/kv_connector.py"}


# vllm/ by the process each part runs in: what all share, and each process's own.
PROCESSES = ("connector", "server", "client")
# The front doors, which may import any part: the package's (VLLMEngine) and the command's.
FRONTS = {"__init__.py", "serve.py"}


def _vllm_part(module: str) -> str | None:
    """The part of vllm/ a dotted name points into ("shared": a module at its top)."""
    parts = module.split(".")
    if parts[:2] != ["kvrag_integrations", "vllm"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in PROCESSES else "shared"


def test_the_vllm_parts_import_only_what_is_shared() -> None:
    """connector/, server/ and client/ each import only vllm/'s shared modules (and
    their own), never each other; a shared module imports none of them, lazily
    or not (a process's code is then never loaded into another by accident)."""
    offenders = {}
    for path in VLLM.rglob("*.py"):
        relative = path.relative_to(VLLM)
        if str(relative) in FRONTS:
            continue
        own = relative.parts[0] if len(relative.parts) > 1 else "shared"
        parts = {_vllm_part(m) for m in _runtime_imports(path)} - {None, own, "shared"}
        if parts:
            offenders[str(relative)] = sorted(parts)
    assert offenders == {}
    # The scan does see the parts: the connector imports the shared params.
    assert "shared" in {
        _vllm_part(m) for m in _runtime_imports(VLLM / "connector" / "scheduler_side.py")
    }
