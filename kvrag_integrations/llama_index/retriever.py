"""KVRAGRetriever: any retriever, with every returned node's KV cache guaranteed."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle

from kvrag_integrations.engine.protocol import check_engine
from kvrag_integrations.llama_index._nodes import attach_cache_keys


class KVRAGRetriever(BaseRetriever):
    """Wraps a retriever (or a ``VectorStoreIndex``) and prepares its nodes for reuse.

    For each returned node it makes sure the node's LLM text has a stored cache
    (``engine.encode_chunks``, which skips what is stored: only missing chunks are
    encoded, and registers every text in ``engine.chunk_index`` so the LLM finds it
    in the prompt, even in a fresh process or another thread) and records the key
    in ``node.metadata[CACHE_KEY_FIELD]`` (hidden from prompts and embeddings).
    A node longer than the context window is returned uncached (it is prefilled).

    Args:
        engine: the engine the LLM uses (``KVRAGEngine`` or ``VLLMEngine``).
        retriever: a ``BaseRetriever``, or an index with ``as_retriever``.
        similarity_top_k: passed to ``index.as_retriever`` when an index is given.
        batch_size: chunks per forward when encoding missing caches.

    Examples:
        >>> from llama_index.core.query_engine import RetrieverQueryEngine  # doctest: +SKIP
        >>> retriever = KVRAGRetriever(engine, index, similarity_top_k=3)  # doctest: +SKIP
        >>> query_engine = RetrieverQueryEngine.from_args(
        ...     retriever, llm=KVRAGLLM(engine))  # doctest: +SKIP
    """

    def __init__(
        self,
        engine: Any,
        retriever: Any,
        *,
        similarity_top_k: int | None = None,
        batch_size: int = 8,
        **kwargs: Any,
    ) -> None:
        if not isinstance(retriever, BaseRetriever):
            if not hasattr(retriever, "as_retriever"):
                raise TypeError("retriever must be a BaseRetriever or an index")
            extra = {} if similarity_top_k is None else {"similarity_top_k": similarity_top_k}
            retriever = retriever.as_retriever(**extra)
        elif similarity_top_k is not None:
            raise ValueError("similarity_top_k applies to an index, not to a retriever")
        super().__init__(**kwargs)
        self.engine = check_engine(engine)
        self.retriever: BaseRetriever = retriever
        self.batch_size = batch_size

    def _prepare(self, nodes: list[NodeWithScore]) -> list[NodeWithScore]:
        # encode_chunks registers each text in engine.chunk_index (stored ones too)
        attach_cache_keys(self.engine, nodes, batch_size=self.batch_size, strict=False)
        return nodes

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._prepare(self.retriever.retrieve(query_bundle))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = await self.retriever.aretrieve(query_bundle)
        return await asyncio.to_thread(self._prepare, nodes)
