"""MiniLMEmbedding: the packaged all-MiniLM-L6-v2 as a LlamaIndex embedding model."""

from __future__ import annotations

import asyncio

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from pydantic import Field

from kvrag_integrations.embeddings import embed_texts


class MiniLMEmbedding(BaseEmbedding):
    """Sentence embeddings from the packaged all-MiniLM-L6-v2 (offline, 384 dims).

    Vectors are L2-normalized; queries and passages share one encoder.

    Attributes:
        path: a sentence-transformers model folder (default: the packaged MiniLM).
        embed_batch_size: texts per forward.

    Examples:
        >>> embed_model = MiniLMEmbedding()
        >>> len(embed_model.get_text_embedding("Paris is in France."))  # doctest: +SKIP
        384
    """

    model_name: str = Field(default="all-MiniLM-L6-v2")
    path: str | None = Field(default=None, description="Model folder; None: the packaged one.")
    embed_batch_size: int = Field(default=32, gt=0, le=2048)

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return embed_texts([query], self.path, self.embed_batch_size)[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.to_thread(self._get_query_embedding, query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return embed_texts([text], self.path, self.embed_batch_size)[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return await asyncio.to_thread(self._get_text_embedding, text)

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return embed_texts(list(texts), self.path, self.embed_batch_size)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)
