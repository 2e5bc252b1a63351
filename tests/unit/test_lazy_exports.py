"""The packages that export names lazily (``lazy_exports``) give every name of
``__all__`` as its defining module has it, list each for type checkers too, and
``import kvrag_integrations`` alone imports neither torch nor transformers (nor
does the server's launcher import transformers)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

LAZY_PACKAGES = ("kvrag_integrations", "kvrag_integrations.vllm")


def _type_checking_names(package: str) -> set[str]:
    """The names the package's ``if TYPE_CHECKING:`` block imports."""
    tree = ast.parse(Path(importlib.import_module(package).__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    names.update(alias.asname or alias.name for alias in stmt.names)
    return names


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_is_its_modules_object(package: str) -> None:
    module = importlib.import_module(package)
    exports = module._EXPORTS
    lazy = {name for names in exports.values() for name in names}
    assert set(module.__all__) - {"__version__"} == lazy
    assert _type_checking_names(package) == lazy
    for source, names in exports.items():
        for name in names:
            assert getattr(module, name) is getattr(importlib.import_module(source), name)
    assert lazy <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'NotExported'"):
        module.NotExported  # noqa: B018


# What a light entry point must not import: the packages (a client; vLLM's processes
# loading the connector) nothing heavy; the server's launcher no transformers (it
# execs vLLM's server, which imports it again: ~4.5 s of CPU a start).
LIGHT = {
    "kvrag_integrations, kvrag_integrations.vllm": ("torch", "transformers", "vllm"),
    "kvrag_integrations.vllm.server.command, kvrag_integrations.model_files": (
        "transformers",
        "vllm",
    ),
}


@pytest.mark.parametrize("modules", LIGHT)
def test_light_entry_points_import_nothing_heavy(modules: str) -> None:
    heavy = LIGHT[modules]
    code = f"import sys, {modules}\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
