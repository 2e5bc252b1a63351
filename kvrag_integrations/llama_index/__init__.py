"""LlamaIndex adapters: ingest with KV caches, answer with cache reuse.

Examples:
    >>> from kvrag_integrations.llama_index import KVCacheTransform, KVRAGLLM  # doctest: +SKIP
    >>> index = VectorStoreIndex.from_documents(
    ...     docs, embed_model=MiniLMEmbedding(),
    ...     transformations=[SentenceSplitter(chunk_size=256), KVCacheTransform(engine)],
    ... )  # doctest: +SKIP
    >>> index.as_query_engine(llm=KVRAGLLM(engine)).query("...")  # doctest: +SKIP

See ``docs/llama_index.md``.
"""

from __future__ import annotations

from kvrag_integrations.chunk_kv import CACHE_KEY_FIELD
from kvrag_integrations.llama_index.embedding import MiniLMEmbedding
from kvrag_integrations.llama_index.hooks import (
    install_hooks,
    known_chunks,
    note_nodes,
    recent_chunks,
    request_chunks,
)
from kvrag_integrations.llama_index.llm import KVRAGLLM
from kvrag_integrations.llama_index.postprocessor import KVRerankPostprocessor
from kvrag_integrations.llama_index.retriever import KVRAGRetriever
from kvrag_integrations.llama_index.transform import KVCacheTransform

__all__ = [
    "CACHE_KEY_FIELD",
    "KVRAGLLM",
    "KVCacheTransform",
    "KVRAGRetriever",
    "KVRerankPostprocessor",
    "MiniLMEmbedding",
    "install_hooks",
    "known_chunks",
    "note_nodes",
    "recent_chunks",
    "request_chunks",
]
