"""One engine per model in a process, visibly.

- **Shared engines** (``SharedEngines``; the process's default instance is
  ``shared_engines``, also ``kvrag_integrations.shared_engines``): what adapters
  built without an engine use (``KVRAGEngine.shared``). An explicit object
  with ``get``, ``register``, ``engines`` and ``reset``, keyed by everything
  that makes engines differ: model, device, dtype and, when asked for, the
  store (by identity) and the cache precision. ``KVRAGEngine.from_pretrained``
  registers the engine it loads as the model's default (store and precision
  not named) when none is registered yet, so ``engine =
  KVRAGEngine.from_pretrained()`` for ingestion followed by a default
  ``KVRAGLLM()`` / ``ChatKVRAG()`` uses the same weights and store. An engine
  asked for with another store or precision is built on the weights already
  loaded for that model (one copy of the weights, one forward lock).
- **Live engines** (weak references): a new engine whose weights have the same
  fingerprint as a live engine's but are another copy (loaded twice) logs a
  warning naming both: twice the memory, and two stores that don't see each
  other's caches. Engines built on the same ``LoadedModel`` (tests, several
  stores on one model) share the weights and are not warned about.
- **Loading** (``EngineLoading``, a base of ``KVRAGEngine``): its
  ``from_pretrained`` (load, and register as the model's default) and
  ``shared`` (the registered engine) classmethods.

This module imports no engine: the class that loads a missing shared engine is
the one ``shared`` is called on, or ``EngineLoading``'s first subclass
(``KVRAGEngine``, which imports this module).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvrag_integrations.chunk_kv import DEFAULT_PRECISION

if TYPE_CHECKING:
    import torch

    from kvrag_integrations.store import KVStore

logger = logging.getLogger("kvrag_integrations.engine.engine")

# (model, device, dtype, id(store) or None, cache precision or None)
SharedKey = tuple[str, str, str, int | None, str | None]

_LOCK = threading.RLock()
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def shared_key(
    model: str | os.PathLike | None,
    device: Any,
    dtype: Any,
    store: Any = None,
    cache_precision: str | None = None,
) -> SharedKey:
    """The key of a shared engine: the model as named (None: the default model),
    device and dtype as given, the store's identity and the cache precision when
    given (None: the model's default engine, whichever store it has)."""
    store_id = None if store is None else id(store)
    return (str(model), str(device), str(dtype), store_id, cache_precision)


class SharedEngines:
    """Engines shared in a process, one per key (``shared_key``), loaded on first use.

    ``kvrag_integrations.shared_engines`` is the instance ``KVRAGEngine.shared``
    and the adapters use; tests can ``reset()`` it, and a server that wants its
    own set of engines can make another.

    Examples:
        >>> from kvrag_integrations.engine.registry import SharedEngines
        >>> engines = SharedEngines()
        >>> engine = engines.get()  # the default model, loaded once  # doctest: +SKIP
        >>> engines.get() is engine  # doctest: +SKIP
        True
        >>> engines.get(store=my_store).loaded is engine.loaded  # same weights  # doctest: +SKIP
        True
        >>> engines.reset()  # forget them all (they live on where still referenced)
    """

    def __init__(self) -> None:
        self._engines: dict[SharedKey, Any] = {}
        self._lock = threading.RLock()

    def get(
        self,
        model: str | os.PathLike | None = None,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        store: Any = None,
        cache_precision: str | None = None,
        engine_class: type[EngineLoading] | None = None,
    ) -> Any:
        """The shared engine for these arguments, built on first use.

        Without ``store`` and ``cache_precision``: the model's default engine.
        With them: an engine with that store (the same object) and precision.
        A new engine reuses the weights of any engine already shared for
        ``(model, device, dtype)``, and loads them only if there is none.
        ``engine_class`` builds it (default: ``KVRAGEngine``).
        """
        key = shared_key(model, device, dtype, store, cache_precision)
        with self._lock:
            engine = self._engines.get(key)
            if engine is not None and (store is None or engine.store is store):
                return engine
            engine = self._build(model, device, dtype, store, cache_precision, engine_class)
            self._engines[key] = engine
            return engine

    def _build(
        self,
        model: Any,
        device: Any,
        dtype: Any,
        store: Any,
        cache_precision: str | None,
        engine_class: type[EngineLoading] | None,
    ) -> Any:
        precision = cache_precision or DEFAULT_PRECISION
        named = shared_key(model, device, dtype)[:3]
        for key, engine in self._engines.items():
            if key[:3] == named:  # the weights are loaded: one copy, one forward lock
                build = engine_class or type(engine)
                return build(engine.loaded, store=store, cache_precision=precision)  # type: ignore[call-arg]
        build = engine_class or EngineLoading.default_class()
        return build.from_pretrained(
            model, device=device, dtype=dtype, store=store, cache_precision=precision, share=False
        )

    def register(
        self,
        engine: Any,
        model: str | os.PathLike | None = None,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        replace: bool = False,
    ) -> bool:
        """Make ``engine`` the default engine of ``(model, device, dtype)``.

        Returns False (and changes nothing) if one is registered and not ``replace``.
        """
        key = shared_key(model, device, dtype)
        with self._lock:
            if key in self._engines and not replace:
                return False
            self._engines[key] = engine
            return True

    def engines(self) -> dict[SharedKey, Any]:
        """A copy of the registry: ``{shared_key(...): engine}``."""
        with self._lock:
            return dict(self._engines)

    def reset(self, *keys: SharedKey) -> None:
        """Forget the engines under ``keys`` (all of them if none are given).

        The next ``get`` builds anew. Engines still referenced elsewhere keep
        working; nothing is closed.
        """
        with self._lock:
            if not keys:
                self._engines.clear()
            for key in keys:
                self._engines.pop(key, None)


shared_engines = SharedEngines()
"""The process's shared engines: what ``KVRAGEngine.shared`` and default adapters use."""


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


E = TypeVar("E", bound="EngineLoading")


class EngineLoading:
    """How engines come from a model name: ``KVRAGEngine``'s loading classmethods."""

    _first: ClassVar[type[EngineLoading] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if EngineLoading._first is None:  # KVRAGEngine: what SharedEngines loads by default
            EngineLoading._first = cls

    @staticmethod
    def default_class() -> type[EngineLoading]:
        """The engine class ``SharedEngines`` loads with unless told (``KVRAGEngine``)."""
        if EngineLoading._first is None:
            raise RuntimeError("no engine class is defined yet (import kvrag_integrations)")
        return EngineLoading._first

    @classmethod
    def from_pretrained(
        cls: type[E],
        model: str | os.PathLike | None = None,
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
        store: KVStore | None = None,
        adapter: str | os.PathLike | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        share: bool | None = None,
        cache_precision: str = DEFAULT_PRECISION,
        reuse: bool = True,
        **engine_options: Any,
    ) -> E:
        """Load a model (HF id, local path, ``.gguf`` file; None = bundled SmolLM2).

        Args:
            model: what to load; None for the default SmolLM2-135M-Instruct.
            device: ``"cpu"``, ``"cuda"``, ``"auto"``.
            dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``.
            store: where chunk caches live (default: an in-memory LRU).
            adapter: a PEFT adapter directory to merge (its caches get their own
                fingerprint).
            trust_remote_code: passed to transformers.
            attn_implementation: ``"sdpa"`` or ``"eager"``; None picks what the model
                supports (reuse strategies need one of these two).
            share: register the engine as the process's default shared engine for
                ``(model, device, dtype)`` in ``registry.shared_engines`` (what
                ``KVRAGEngine.shared`` and adapters built without an engine use):
                ``None`` (default) if none is registered yet, ``True`` replacing
                any, ``False`` never. An engine with an adapter is never
                registered by default.
            cache_precision: how chunk caches are stored: ``"float16"`` (default),
                ``"bfloat16"``, ``"int8"`` or ``"model"`` (full precision); see
                ``KVRAGEngine``.
            reuse: False turns KV reuse off (only ``strategy="full"`` answers) and
                skips the load-time self-check; see ``engine.model.load_model``.
            **engine_options: ``cache_prefix``, ``on_miss``, ``max_pending``,
                ``chunk_suffix``, ``chunk_context`` (see ``KVRAGEngine``).
        """
        from kvrag_integrations.engine.modeling.model import load_model

        loaded = load_model(
            model,
            device=device,
            dtype=dtype,
            adapter=adapter,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            reuse=reuse,
        )
        engine = cls(loaded, store=store, cache_precision=cache_precision, **engine_options)  # type: ignore[call-arg]
        if share or (share is None and adapter is None):
            shared_engines.register(engine, model, device=device, dtype=dtype, replace=bool(share))
        return engine

    @classmethod
    def shared(
        cls: type[E],
        model: str | os.PathLike | None = None,
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
        store: KVStore | None = None,
        cache_precision: str | None = None,
    ) -> E:
        """The process's shared engine for these arguments, loaded on first use.

        Adapters built without an engine (``KVRAGLLM()``, ``ChatKVRAG(model=...)``)
        use it, so that every instance shares one copy of the weights and one
        store. The first ``from_pretrained`` of a model registers itself as the
        model's default here, so an engine loaded for ingestion is the one a
        default adapter finds. With ``store`` or ``cache_precision``, the shared
        engine with that store and precision (on the same weights). Delegates
        to ``kvrag_integrations.shared_engines`` (``registry.SharedEngines``),
        whose ``reset()`` forgets them.
        """
        return shared_engines.get(
            model,
            device=device,
            dtype=dtype,
            store=store,
            cache_precision=cache_precision,
            engine_class=cls,
        )
