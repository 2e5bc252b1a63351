"""The framework-free core: torch and transformers only."""

from kvrag_integrations.chunk_kv import CACHE_KEY_FIELD, ChunkKV, cache_key
from kvrag_integrations.engine.caching.entries import ChunkRef
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.modeling.sampling import SamplingParams
from kvrag_integrations.engine.prompting.segments import Chunk, Segment, Text
from kvrag_integrations.engine.request import RequestOptions
from kvrag_integrations.engine.results import GenerationResult, PrefillResult
from kvrag_integrations.engine.strategies import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Strategy,
    make_strategy,
)
from kvrag_integrations.engine.streaming import AsyncGenerationStream, GenerationStream

__all__ = [
    "CACHE_KEY_FIELD",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
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
    "Segment",
    "Strategy",
    "Text",
    "cache_key",
    "make_strategy",
]
