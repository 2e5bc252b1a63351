"""MiniLMEmbeddings: the packaged all-MiniLM-L6-v2 as a LangChain ``Embeddings``."""

from __future__ import annotations

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field

from kvrag_integrations.embeddings import embed_texts


class MiniLMEmbeddings(BaseModel, Embeddings):
    """Normalized sentence embeddings from the packaged MiniLM (offline, CPU).

    Attributes:
        path: a sentence-transformers model folder (None: the packaged MiniLM).
        batch_size: texts per forward.

    Examples:
        >>> embeddings = MiniLMEmbeddings()
        >>> len(embeddings.embed_query("Where is Paris?"))
        384
    """

    model_config = ConfigDict(frozen=True)

    path: str | None = None
    batch_size: int = Field(default=32, ge=1)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed documents (one vector per text, in order)."""
        if not texts:
            return []
        return embed_texts(list(texts), path=self.path, batch_size=self.batch_size)

    def embed_query(self, text: str) -> list[float]:
        """Embed one query."""
        return embed_texts([text], path=self.path, batch_size=1)[0]
