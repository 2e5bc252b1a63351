"""LangChain parts: chat model, retriever, document compressor, embeddings, ingestion.

Examples:
    >>> from kvrag_integrations.langchain import ChatKVRAG, KVRAGRetriever  # doctest: +SKIP
    >>> llm = ChatKVRAG(strategy="turbo")  # doctest: +SKIP
    >>> retriever = KVRAGRetriever(collection=collection, engine=llm.engine, k=5)  # doctest: +SKIP
"""

from __future__ import annotations

from kvrag_integrations.chunk_kv import CACHE_KEY_FIELD
from kvrag_integrations.langchain.chat_model import ChatKVRAG
from kvrag_integrations.langchain.compressor import KVRerankCompressor
from kvrag_integrations.langchain.embeddings import MiniLMEmbeddings
from kvrag_integrations.langchain.ingest import add_documents, document_id
from kvrag_integrations.langchain.messages import to_engine_messages
from kvrag_integrations.langchain.retriever import KVRAGRetriever

__all__ = [
    "CACHE_KEY_FIELD",
    "ChatKVRAG",
    "KVRAGRetriever",
    "KVRerankCompressor",
    "MiniLMEmbeddings",
    "add_documents",
    "document_id",
    "to_engine_messages",
]
