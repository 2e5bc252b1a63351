"""A package's exports imported on first use (PEP 562's module ``__getattr__``).

``import kvrag_integrations`` then costs nothing: a process that needs one part
(vLLM's launcher, a worker loading the connector, a client of a server) does not
pay for the engine, torch and transformers (about 4 s of CPU each time).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def lazy_exports(
    namespace: MutableMapping[str, Any], exports: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` of the package whose globals are ``namespace``:
    ``exports`` maps each defining module to the names it gives the package."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
