"""KVRerankCompressor: rerank documents with the KV-reusing decoder reranker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import ConfigDict, Field, model_validator

from kvrag_integrations.engine import KVRAGEngine
from kvrag_integrations.rerank import KVReranker


class KVRerankCompressor(BaseDocumentCompressor):
    """Keep the ``top_n`` documents most relevant to the query, best first.

    Scores come from ``KVReranker`` (HyperRAG: each document's prompt prefix
    cache is stored and reused across queries) and land in
    ``metadata[score_key]``.

    Attributes:
        engine: the engine to score with (default: the reranker's, else the shared one).
        reranker: a ``KVReranker`` (default: ``KVReranker(engine)``).
        top_n: documents kept (None: all, reordered).
        score_key: the metadata field for the score.

    Examples:
        >>> compressor = KVRerankCompressor(engine=engine, top_n=2)  # doctest: +SKIP
        >>> compressor.compress_documents(docs, "Who wrote it?")  # doctest: +SKIP
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = Field(default=None, exclude=True, repr=False)  # KVRAGEngine or VLLMEngine
    reranker: Any = Field(default=None, exclude=True, repr=False)
    top_n: int | None = Field(default=3, ge=1)
    score_key: str = "relevance_score"

    @model_validator(mode="after")
    def _defaults(self) -> KVRerankCompressor:
        if self.engine is None:
            self.engine = (
                self.reranker.engine if self.reranker is not None else KVRAGEngine.shared()
            )
        if self.reranker is None:
            self.reranker = KVReranker(self.engine)
        return self

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """Rerank ``documents`` against ``query``; copies carry the score."""
        docs = list(documents)
        if not docs:
            return []
        ranked = self.reranker.rerank(query, [d.page_content for d in docs], top_n=self.top_n)
        return [
            Document(
                page_content=docs[i].page_content,
                metadata={**docs[i].metadata, self.score_key: score},
                id=docs[i].id,
            )
            for i, score in ranked
        ]
