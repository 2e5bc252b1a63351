"""Any LangChain retriever's documents become known chunks, in the same process.

A callback handler, injected into every LangChain run through
``register_configure_hook`` (the way LangSmith tracing injects itself), records
the ``page_content`` of each retriever's result in a bounded process-wide
registry (:func:`recent_chunks`). ``ChatKVRAG`` then
finds those texts verbatim in its prompt and passes them to the engine as
chunks: an LCEL chain or a LangGraph node over *any* vector store's
``as_retriever()`` reuses chunk caches, with nothing of ours in the chain but
the chat model. Only verbatim matches count, so a stale entry is harmless.

A vector store searched directly (``similarity_search`` in an agent's
middleware or a graph node) runs no callback: :func:`install_hooks` also wraps
the search methods of every ``VectorStore`` class (``langchain.vectorstores``)
to record their results in the same registry, unless the environment variable
``KVRAG_LANGCHAIN_RECORD_SEARCHES`` is ``0`` when the hooks are installed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from kvrag_integrations.engine import registry
from kvrag_integrations.engine.prompting.spans import MAX_RECENT_CHUNKS, ChunkIndex

_RECENT = ChunkIndex(max_chunks=MAX_RECENT_CHUNKS)
RECORD_SEARCHES_ENV = "KVRAG_LANGCHAIN_RECORD_SEARCHES"


def recent_chunks() -> ChunkIndex:
    """Texts LangChain retrievers and vector store searches returned in this process
    (bounded, least recent dropped)."""
    return _RECENT


def record_text(text: object) -> None:
    """Remember one retrieved text (blank ones are skipped) and start loading its
    cache where a store reads from disk or network (``engine.prefetch``)."""
    if isinstance(text, str) and text.strip():
        recent_chunks().add(text)
        registry.prefetch([text])


def searches_recorded() -> bool:
    """Whether vector store searches are to be recorded (``KVRAG_LANGCHAIN_RECORD_SEARCHES``)."""
    value = os.environ.get(RECORD_SEARCHES_ENV, "1").strip().lower()
    return value not in {"0", "false", "no", "off"}


class RetrievedDocumentsHandler(BaseCallbackHandler):
    """Records every retriever's documents as recent chunks (no other effect)."""

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        for doc in documents:
            record_text(getattr(doc, "page_content", None))


# The default makes the hook active in every context (threads and tasks included).
_HANDLER = RetrievedDocumentsHandler()
_HOOK: ContextVar[RetrievedDocumentsHandler | None] = ContextVar(
    "kvrag_retrieved_documents", default=_HANDLER
)
_INSTALLED = False
_LOCK = threading.Lock()


def install_hooks() -> None:
    """Register the handler with LangChain's callback configuration and wrap the
    vector stores' search methods (once per process)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from langchain_core.tracers.context import register_configure_hook

        register_configure_hook(_HOOK, inheritable=True)
        if searches_recorded():
            from kvrag_integrations.langchain.vectorstores import record_searches

            record_searches(record_text)
        _INSTALLED = True
