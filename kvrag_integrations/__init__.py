"""Fast RAG on local models by reusing precomputed KV caches of retrieved chunks.

Examples:
    >>> from kvrag_integrations import KVRAGEngine  # doctest: +SKIP
    >>> engine = KVRAGEngine.from_pretrained()  # doctest: +SKIP
    >>> result = engine.generate(question="Who?", chunks=["Ada wrote it."])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag_integrations.lazy_exports import lazy_exports

# What the package exports, by the module that defines it, imported on first use
# (``lazy_exports``).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvrag_integrations.engine": (
        "CACHE_KEY_FIELD",
        "DEFAULT_STRATEGY",
        "AsyncGenerationStream",
        "Chunk",
        "ChunkKV",
        "ChunkRef",
        "GenerationResult",
        "GenerationStream",
        "KVRAGEngine",
        "PrefillResult",
        "RequestOptions",
        "SamplingParams",
        "Strategy",
        "Text",
        "cache_key",
        "make_strategy",
    ),
    "kvrag_integrations.engine.registry": (
        "SharedEngines",
        "shared_engines",
    ),
    "kvrag_integrations.errors": (
        "CacheEntryError",
        "ConnectorMissingError",
        "ContextWindowExceededError",
        "InvalidChunkError",
        "KVRAGError",
        "PagedLayoutError",
        "ServerError",
        "StoreWriteError",
        "ToolCallError",
        "TransferParamsError",
        "UnknownStrategyError",
        "UnsupportedInputError",
        "UnsupportedModelError",
    ),
    "kvrag_integrations.rerank": ("KVReranker",),
    "kvrag_integrations.store": (
        "DiskKVStore",
        "KVStore",
        "MemoryKVStore",
        "RedisKVStore",
        "TieredKVStore",
    ),
}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from kvrag_integrations.engine import (
        CACHE_KEY_FIELD,
        DEFAULT_STRATEGY,
        AsyncGenerationStream,
        Chunk,
        ChunkKV,
        ChunkRef,
        GenerationResult,
        GenerationStream,
        KVRAGEngine,
        PrefillResult,
        RequestOptions,
        SamplingParams,
        Strategy,
        Text,
        cache_key,
        make_strategy,
    )
    from kvrag_integrations.engine.registry import SharedEngines, shared_engines
    from kvrag_integrations.errors import (
        CacheEntryError,
        ConnectorMissingError,
        ContextWindowExceededError,
        InvalidChunkError,
        KVRAGError,
        PagedLayoutError,
        ServerError,
        StoreWriteError,
        ToolCallError,
        TransferParamsError,
        UnknownStrategyError,
        UnsupportedInputError,
        UnsupportedModelError,
    )
    from kvrag_integrations.rerank import KVReranker
    from kvrag_integrations.store import (
        DiskKVStore,
        KVStore,
        MemoryKVStore,
        RedisKVStore,
        TieredKVStore,
    )

__version__ = "0.1.0"

__all__ = [
    "CACHE_KEY_FIELD",
    "DEFAULT_STRATEGY",
    "AsyncGenerationStream",
    "CacheEntryError",
    "Chunk",
    "ChunkKV",
    "ChunkRef",
    "ConnectorMissingError",
    "ContextWindowExceededError",
    "DiskKVStore",
    "GenerationResult",
    "GenerationStream",
    "InvalidChunkError",
    "KVRAGEngine",
    "KVRAGError",
    "KVReranker",
    "KVStore",
    "MemoryKVStore",
    "PagedLayoutError",
    "PrefillResult",
    "RedisKVStore",
    "RequestOptions",
    "SamplingParams",
    "ServerError",
    "SharedEngines",
    "StoreWriteError",
    "Strategy",
    "Text",
    "TieredKVStore",
    "ToolCallError",
    "TransferParamsError",
    "UnknownStrategyError",
    "UnsupportedInputError",
    "UnsupportedModelError",
    "__version__",
    "cache_key",
    "make_strategy",
    "shared_engines",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
