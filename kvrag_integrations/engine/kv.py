"""Backward-compatible re-export: these names now live in ``kvrag_integrations.chunk_kv``.

``ChunkKV`` and ``cache_key`` moved to a framework-free top-level module so the
stores need not import the engine. Import them from there in new code.
"""

from kvrag_integrations.chunk_kv import CACHE_KEY_FIELD, FORMAT_VERSION, ChunkKV, cache_key

__all__ = ["CACHE_KEY_FIELD", "FORMAT_VERSION", "ChunkKV", "cache_key"]
