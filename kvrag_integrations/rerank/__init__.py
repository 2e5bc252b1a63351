"""Decoder reranking with document-KV reuse (HyperRAG, arXiv 2504.02921).

Examples:
    >>> from kvrag_integrations.rerank import KVReranker  # doctest: +SKIP
    >>> reranker = KVReranker(engine, top_n=3)  # doctest: +SKIP
    >>> reranker.rerank("Who wrote it?", ["Ada wrote it.", "Bob ate it."])  # doctest: +SKIP
    [(0, 1.2...), (1, -0.8...)]
"""

from __future__ import annotations

from kvrag_integrations.rerank.reranker import KVReranker, RerankStats
from kvrag_integrations.rerank.templates import (
    BGE_GEMMA_TEMPLATE,
    DEFAULT_TEMPLATE,
    NO_VARIANTS,
    QWEN3_RERANKER_TEMPLATE,
    TEMPLATES,
    UPR_TEMPLATE,
    YES_VARIANTS,
    RenderedTemplate,
    RerankTemplate,
    TokenizedTemplate,
    answer_token_ids,
    get_template,
)

__all__ = [
    "BGE_GEMMA_TEMPLATE",
    "DEFAULT_TEMPLATE",
    "NO_VARIANTS",
    "QWEN3_RERANKER_TEMPLATE",
    "TEMPLATES",
    "UPR_TEMPLATE",
    "YES_VARIANTS",
    "KVReranker",
    "RenderedTemplate",
    "RerankStats",
    "RerankTemplate",
    "TokenizedTemplate",
    "answer_token_ids",
    "get_template",
]
