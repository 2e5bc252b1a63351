"""One engine per model in a process, visibly.

Two registries, both process-wide:

- the **shared engines**: one per ``(model, device, dtype)``, what adapters built
  without an engine use (``KVRAGEngine.shared``). ``KVRAGEngine.from_pretrained``
  registers the engine it loads here when none is registered for that model yet,
  so ``engine = KVRAGEngine.from_pretrained()`` for ingestion followed by a
  default ``KVRAGLLM()`` / ``ChatKVRAG()`` uses the same weights and store.
- the **live engines** (weak references): a new engine whose weights have the
  same fingerprint as a live engine's but are another copy (loaded twice) logs a
  warning naming both: twice the memory, and two stores that don't see each
  other's caches. Engines built on the same ``LoadedModel`` (tests, several
  stores on one model) share the weights and are not warned about.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("kvrag_integrations.engine.engine")

SharedKey = tuple[str, str, str]

_SHARED: dict[SharedKey, Any] = {}
_LOCK = threading.RLock()
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def shared_key(model: str | os.PathLike | None, device: Any, dtype: Any) -> SharedKey:
    """The registry key of a model as named (None: the default model)."""
    return (str(model), str(device), str(dtype))


def get_or_load(key: SharedKey, load: Callable[[], Any]) -> Any:
    """The shared engine under ``key``, loading (and registering) it on first use."""
    with _LOCK:
        if key not in _SHARED:
            _SHARED[key] = load()
        return _SHARED[key]


def register_shared(key: SharedKey, engine: Any, *, replace: bool = False) -> bool:
    """Make ``engine`` the shared engine for ``key`` (if none is, or ``replace``)."""
    with _LOCK:
        if key in _SHARED and not replace:
            return False
        _SHARED[key] = engine
        return True


def shared_engines() -> dict[SharedKey, Any]:
    """A copy of the shared-engine registry: ``{(model, device, dtype): engine}``."""
    with _LOCK:
        return dict(_SHARED)


def note_engine(engine: Any) -> None:
    """Track ``engine``; warn if another live engine holds another copy of its weights."""
    with _LOCK:
        live = list(_LIVE)
        if any(other.model is engine.model for other in live):
            _LIVE.add(engine)  # another engine on weights already loaded: no new copy
            return
        for other in live:
            if other.loaded.fingerprint == engine.loaded.fingerprint:
                logger.warning(
                    "the same weights are loaded twice in this process: %r and %r "
                    "(fingerprint %s). Each copy costs memory and has its own store; "
                    "pass the first engine to the adapters, or use KVRAGEngine.shared().",
                    other,
                    engine,
                    engine.loaded.fingerprint[:12],
                )
                break
        _LIVE.add(engine)


def prefetch(texts: list[str]) -> None:
    """Start loading the caches of ``texts`` in every live engine whose store reads
    from disk or network (what the adapters' retrieval hooks call)."""
    if not texts:
        return
    with _LOCK:
        engines = [e for e in _LIVE if e.store.parallel_reads]
    for engine in engines:
        try:
            engine.prefetch(texts)
        except Exception:  # a hint only: a failed prefetch must not fail retrieval
            logger.debug("prefetch failed", exc_info=True)
