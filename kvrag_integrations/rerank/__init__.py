"""Decoder reranking with document-KV reuse (HyperRAG, arXiv 2504.02921).

Example:
    >>> from kvrag_integrations.rerank import KVReranker  # doctest: +SKIP
    >>> reranker = KVReranker(engine, top_n=3)  # doctest: +SKIP
    >>> reranker.rerank("Who wrote it?", ["Ada wrote it.", "Bob ate it."])  # doctest: +SKIP
    [(0, 1.2...), (1, -0.8...)]
"""

from __future__ import annotations

from kvrag_integrations.rerank.reranker import (
    NO_VARIANTS,
    YES_VARIANTS,
    KVReranker,
    RerankStats,
    answer_token_ids,
)
from kvrag_integrations.rerank.templates import (
    BGE_GEMMA_TEMPLATE,
    DEFAULT_TEMPLATE,
    QWEN3_RERANKER_TEMPLATE,
    TEMPLATES,
    RenderedTemplate,
    RerankTemplate,
    get_template,
)

__all__ = [
    "BGE_GEMMA_TEMPLATE",
    "DEFAULT_TEMPLATE",
    "NO_VARIANTS",
    "QWEN3_RERANKER_TEMPLATE",
    "TEMPLATES",
    "YES_VARIANTS",
    "KVReranker",
    "RenderedTemplate",
    "RerankStats",
    "RerankTemplate",
    "answer_token_ids",
    "get_template",
]
