"""KVRAGRetriever: chromadb retrieval that makes sure every hit has a KV cache."""

from __future__ import annotations

import asyncio
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from pydantic import Field, model_validator

from kvrag_integrations.engine import CACHE_KEY_FIELD, KVRAGEngine
from kvrag_integrations.engine.protocol import check_engine
from kvrag_integrations.langchain.embeddings import MiniLMEmbeddings


class KVRAGRetriever(BaseRetriever):
    """Top-``k`` documents from a chromadb collection, each with a stored KV cache.

    Queries are embedded with ``embeddings`` (default: the packaged MiniLM; use
    the one the collection was filled with). Every returned document's cache is
    made sure of (``engine.encode_chunks`` skips stored ones) and its text is
    registered in ``engine.chunk_index``, so a ``ChatKVRAG`` on the same engine
    finds it in prompts. ``metadata[CACHE_KEY_FIELD]`` holds the cache key and
    ``metadata["distance"]`` chroma's distance.

    Attributes:
        collection: a chromadb ``Collection``.
        engine: the engine whose store holds the caches (default: the shared one).
        embeddings: any LangChain ``Embeddings``.
        k: documents per query (also a per-call keyword: ``invoke(q, k=3)``).
        where: a chroma metadata filter (also per call).

    Examples:
        >>> retriever = KVRAGRetriever(collection=collection, engine=engine, k=5)  # doctest: +SKIP
        >>> retriever.invoke("Who wrote it?")[0].metadata["kvrag_cache_key"]  # doctest: +SKIP
        '3f1c...'
    """

    collection: Any = Field(exclude=True)
    engine: Any = Field(default=None, exclude=True, repr=False)  # a RAGEngine
    embeddings: Embeddings | None = Field(default=None, exclude=True, repr=False)
    k: int = Field(default=4, ge=1)
    where: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _defaults(self) -> KVRAGRetriever:
        self.engine = KVRAGEngine.shared() if self.engine is None else check_engine(self.engine)
        if self.embeddings is None:
            self.embeddings = MiniLMEmbeddings()
        return self

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        k: int | None = None,
        where: dict[str, Any] | None = None,
    ) -> list[Document]:
        n = self.k if k is None else k
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"k must be a positive int, got {n!r}")
        assert self.engine is not None and self.embeddings is not None  # set by the validator
        found = self.collection.query(
            query_embeddings=[self.embeddings.embed_query(query)],
            n_results=n,
            where=where if where is not None else self.where,
            include=["documents", "metadatas", "distances"],
        )
        ids = found["ids"][0]
        texts = (found.get("documents") or [[]])[0] or [None] * len(ids)
        metas = (found.get("metadatas") or [[]])[0] or [None] * len(ids)
        dists = (found.get("distances") or [[]])[0] or [None] * len(ids)
        docs = [
            Document(page_content=text, metadata={**(meta or {}), "distance": dist}, id=doc_id)
            for doc_id, text, meta, dist in zip(ids, texts, metas, dists)
            if isinstance(text, str) and text.strip()
        ]
        if docs:
            refs = self.engine.encode_chunks([d.page_content for d in docs], show_progress=False)
            for doc, ref in zip(docs, refs):
                doc.metadata[CACHE_KEY_FIELD] = ref.key
        return docs

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        k: int | None = None,
        where: dict[str, Any] | None = None,
    ) -> list[Document]:
        return await asyncio.to_thread(
            self._get_relevant_documents,
            query,
            run_manager=run_manager.get_sync(),
            k=k,
            where=where,
        )
