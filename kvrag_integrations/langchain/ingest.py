"""add_documents: fill a vector store (any LangChain ``VectorStore``, or a raw chromadb
collection) and precompute the documents' KV caches."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore
from tqdm.auto import tqdm

from kvrag_integrations.engine import CACHE_KEY_FIELD, KVRAGEngine
from kvrag_integrations.engine.protocol import RAGEngine, check_engine
from kvrag_integrations.errors import InvalidChunkError
from kvrag_integrations.langchain.embeddings import MiniLMEmbeddings


def document_id(text: str) -> str:
    """The collection id of a document: sha256 of its text, so re-adding is idempotent.

    Examples:
        >>> document_id("Paris is the capital of France.")[:12]
        '557be7eca214'
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def add_documents(
    collection: Any,
    documents: Iterable[Document | str],
    engine: RAGEngine | None = None,
    embeddings: Embeddings | None = None,
    *,
    batch_size: int = 32,
    show_progress: bool = True,
) -> list[str]:
    """Add documents to a vector store and store their KV caches.

    Ids come from the text (``document_id``), so adding the same documents again
    changes nothing (metadata is refreshed); duplicates in one call are stored
    once. Each document's metadata gets ``CACHE_KEY_FIELD``; chroma takes only
    scalar (and list) metadata values. The texts join the engine's chunk index,
    so ``ChatKVRAG`` on that engine finds them in any prompt from the first
    request on, however they were retrieved (a retriever, or ``similarity_search``
    inside an agent's middleware).

    Args:
        collection: any LangChain ``VectorStore`` (``InMemoryVectorStore``,
            langchain-chroma's ``Chroma``, FAISS, PGVector...; it embeds with its
            own embeddings), or a raw chromadb ``Collection``.
        documents: ``Document``s or strings; each text is one chunk.
        engine: where the caches are computed and stored (default: the shared engine).
        embeddings: for a raw chromadb collection, a LangChain ``Embeddings``
            (default: the packaged MiniLM); a ``VectorStore`` uses its own.
        batch_size: documents embedded and upserted per step.
        show_progress: a tqdm progress bar.

    Returns:
        The id of each input document, in order.

    Raises:
        InvalidChunkError: a document's text is empty or whitespace.

    Examples:
        >>> ids = add_documents(collection, docs, engine)  # doctest: +SKIP
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(documents, (str, Document)):
        raise TypeError("documents must be a list of Documents or strings")
    docs = [d if isinstance(d, Document) else Document(page_content=d) for d in documents]
    for i, doc in enumerate(docs):
        if not isinstance(doc.page_content, str) or not doc.page_content.strip():
            raise InvalidChunkError(f"documents[{i}] has no text")
    engine = check_engine(engine) if engine is not None else KVRAGEngine.shared()
    ids = [document_id(d.page_content) for d in docs]
    unique = list(dict(zip(ids, docs)).items())  # one entry per id, the last one wins
    if isinstance(collection, VectorStore):
        if embeddings is not None:
            raise TypeError("a LangChain VectorStore embeds with its own embeddings")
        refs = engine.encode_chunks(
            [d.page_content for _, d in unique], show_progress=show_progress
        )
        collection.add_documents(
            [
                Document(
                    page_content=d.page_content, metadata={**d.metadata, CACHE_KEY_FIELD: r.key}
                )
                for (_, d), r in zip(unique, refs)
            ],
            ids=[doc_id for doc_id, _ in unique],
        )
        return ids
    embeddings = embeddings if embeddings is not None else MiniLMEmbeddings()
    with tqdm(
        total=len(unique), desc="Adding documents", unit="doc", disable=not show_progress
    ) as bar:
        for start in range(0, len(unique), batch_size):
            batch = unique[start : start + batch_size]
            texts = [doc.page_content for _, doc in batch]
            refs = engine.encode_chunks(texts, show_progress=False)
            collection.upsert(
                ids=[doc_id for doc_id, _ in batch],
                documents=texts,
                embeddings=embeddings.embed_documents(texts),
                metadatas=[
                    {**doc.metadata, CACHE_KEY_FIELD: ref.key} for (_, doc), ref in zip(batch, refs)
                ],
            )
            bar.update(len(batch))
    return ids
