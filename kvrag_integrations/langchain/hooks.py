"""Any LangChain retriever's documents become known chunks, in the same process.

A callback handler, injected into every LangChain run through
``register_configure_hook`` (the way LangSmith tracing injects itself), records
the ``page_content`` of each retriever's result in a bounded process-wide
registry (:func:`recent_chunks`). ``ChatKVRAG`` then
finds those texts verbatim in its prompt and passes them to the engine as
chunks: an LCEL chain or a LangGraph node over *any* vector store's
``as_retriever()`` reuses chunk caches, with nothing of ours in the chain but
the chat model. Only verbatim matches count, so a stale entry is harmless.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from kvrag_integrations.engine.spans import MAX_RECENT_CHUNKS, ChunkIndex

_RECENT = ChunkIndex(max_chunks=MAX_RECENT_CHUNKS)


def recent_chunks() -> ChunkIndex:
    """Texts LangChain retrievers returned in this process (bounded, least recent dropped)."""
    return _RECENT


class RetrievedDocumentsHandler(BaseCallbackHandler):
    """Records every retriever's documents as recent chunks (no other effect)."""

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        registry = recent_chunks()
        for doc in documents:
            text = getattr(doc, "page_content", None)
            if isinstance(text, str) and text.strip():
                registry.add(text)


# The default makes the hook active in every context (threads and tasks included).
_HANDLER = RetrievedDocumentsHandler()
_HOOK: ContextVar[RetrievedDocumentsHandler | None] = ContextVar(
    "kvrag_retrieved_documents", default=_HANDLER
)
_INSTALLED = False
_LOCK = threading.Lock()


def install_hooks() -> None:
    """Register the handler with LangChain's callback configuration (once per process)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        from langchain_core.tracers.context import register_configure_hook

        register_configure_hook(_HOOK, inheritable=True)
        _INSTALLED = True
