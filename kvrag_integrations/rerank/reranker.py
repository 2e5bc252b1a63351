"""A decoder-only reranker that reuses each document's KV cache (HyperRAG).

Two scorings, both with the document first. ``scoring="query_likelihood"`` (UPR,
arXiv 2204.07496; the default): relevance is the mean
``log P(query token | document, earlier query tokens)`` after
``[instruction][document]["Please write a question ..."]``. ``scoring="judge"``
(the default when a judging template is given): relevance is
``log P("yes") - log P("no")`` for the token after a judging prompt laid out
``[instruction][document][query + "Answer Yes or No"]``. The instruction
and the document come first, so their KV cache is an exact prefix of every prompt
that judges this document: it is encoded once (positions ``0..P-1``), stored, and
for each query only the suffix (``P..P+S-1``) runs through the model. Scores with
reuse equal scores without it up to float rounding.

The engine scores (``engine.protocol.DocumentScorer``): ``KVRAGEngine`` in
batches with a static padded layout over the cached prefixes (``rerank.scoring``),
``VLLMEngine`` with one request per candidate, each loading its document's entry
at position 0, all in flight at once (``vllm.scoring``; docs/vllm.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.engine.prompting.segments import check_text, check_texts
from kvrag_integrations.engine.protocol import DocumentScorer, check_scorer
from kvrag_integrations.rerank.templates import (
    UPR_TEMPLATE,
    RerankTemplate,
    TokenizedTemplate,
    get_template,
)
from kvrag_integrations.store import KVStore

logger = logging.getLogger(__name__)

_KEEP = object()  # "use the reranker's own top_n"
SCORINGS = ("judge", "query_likelihood")
# Below this size a decoder is a weak reranker: SmolLM2-135M-Instruct's yes/no judge
# ranked worse than the retriever it reranked (docs/concepts.md, the reranker).
SMALL_MODEL_PARAMS = 300_000_000
_SMALL_MODEL_NOTE = {
    "judge": "its yes/no judge ranked worse than the retriever's own order (MuSiQue: "
    "recall@1 0.10 against MiniLM's 0.25); use scoring='query_likelihood' or a larger model",
    "query_likelihood": "query-likelihood scoring is the better choice for it (MuSiQue: "
    "recall@1 0.35 against MiniLM's 0.25, on only 20 questions), but a larger instruct "
    "model ranks better",
}


@dataclass
class RerankStats:
    """Running counters of a reranker (read ``reranker.stats``)."""

    candidates: int = 0  # documents asked to score (duplicates and empty ones included)
    scored: int = 0  # distinct non-empty documents scored by the model
    prefixes_reused: int = 0  # prefix caches found in the store
    prefixes_encoded: int = 0  # prefix caches computed and stored
    forward_s: float = 0.0  # seconds in model forwards (encoding included)


def _check_top_n(top_n: Any) -> int | None:
    if top_n is None:
        return None
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise ValueError(f"top_n must be a positive int or None, got {top_n!r}")
    return top_n


def _num_parameters(engine: Any) -> int | None:
    """The model's parameter count where the engine holds its weights (None: vLLM)."""
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "parameters"):
        return None
    return sum(p.numel() for p in model.parameters())


class KVReranker:
    """Scores documents against a query with a decoder LM, reusing document caches.

    Args:
        engine: a ``KVRAGEngine`` or a ``VLLMEngine`` (in process or connected to a
            server): anything implementing ``engine.protocol.DocumentScorer``.
            Another object raises ``UnsupportedEngineError`` here.
        top_n: how many ``(index, score)`` pairs ``rerank`` returns (None: all).
        template: a preset name (``"default"``, ``"qwen3-reranker"``,
            ``"bge-gemma"``) or a ``RerankTemplate``.
        store: where prefix caches live in process (default: ``engine.store``).
            Their keys live in their own space, so sharing the engine's store is
            safe. On vLLM, None: entries live in the connector's store.
        batch_size: candidates per forward in process (vLLM batches every
            candidate of a call, and of concurrent calls, itself).
        scoring: ``"query_likelihood"`` (UPR: mean ``log P(query | document)``,
            template ``"upr"``) or ``"judge"`` (``log P(yes) - log P(no)``). None
            (default): ``"judge"`` when a judging ``template`` is given, else
            ``"query_likelihood"``, which ranked better than the judge and than
            the retriever's own order in our evaluation (docs/concepts.md).

    Examples:
        >>> engine = KVRAGEngine.from_pretrained()  # doctest: +SKIP
        >>> reranker = KVReranker(engine, top_n=1)  # doctest: +SKIP
        >>> docs = ["Pasta is Italian.", "Canberra is the capital of Australia."]
        >>> [i for i, _ in reranker.rerank("Capital of Australia?", docs)]  # doctest: +SKIP
        [1]
    """

    def __init__(
        self,
        engine: Any,
        *,
        top_n: int | None = None,
        template: str | RerankTemplate | None = None,
        store: KVStore | None = None,
        batch_size: int = 16,
        scoring: str | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if scoring is None:
            judging = template is not None and get_template(template) is not UPR_TEMPLATE
            scoring = "judge" if judging else "query_likelihood"
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        self.engine: DocumentScorer = check_scorer(engine)
        self.scoring = scoring
        self.top_n = _check_top_n(top_n)
        if template is None and scoring == "query_likelihood":
            template = UPR_TEMPLATE
        self.template = get_template(template)
        # In process, prefix caches live in ``store`` (default: the engine's); on vLLM
        # in the connector's store (``store`` must then be None).
        self.store: KVStore | None = store if store is not None else getattr(engine, "store", None)
        self.batch_size = batch_size
        self.stats = RerankStats()
        self.prompt = TokenizedTemplate(self.template, engine.tokenizer)
        n_params = _num_parameters(engine)
        if n_params is not None and n_params < SMALL_MODEL_PARAMS:
            logger.warning(
                "reranking with %s (%dM parameters), a weak reranker: %s.",
                getattr(engine, "model_name", "this model"),
                n_params // 1_000_000,
                _SMALL_MODEL_NOTE[scoring],
            )

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
        store: KVStore | None = None,
        top_n: int | None = None,
        template: str | RerankTemplate | None = None,
        batch_size: int = 16,
        scoring: str | None = None,
    ) -> KVReranker:
        """Load a model for reranking (None: the bundled SmolLM2-135M-Instruct).

        Examples:
            >>> reranker = KVReranker.from_pretrained(top_n=3)  # doctest: +SKIP
        """
        from kvrag_integrations.engine.engine import KVRAGEngine

        engine = KVRAGEngine.from_pretrained(model, device=device, dtype=dtype, store=store)
        return cls(engine, top_n=top_n, template=template, batch_size=batch_size, scoring=scoring)

    # ------------------------------------------------------------------ keys
    @property
    def fingerprint(self) -> str:
        """The fingerprint of prefix caches (``engine.scoring_fingerprint``): in process
        the model's plus ``|rerank|<template>``; on vLLM the connector's (shared with
        chunk entries whose ids agree)."""
        return self.engine.scoring_fingerprint(self.template.name)

    def prefix_ids(self, document: str) -> torch.Tensor:
        """Token ids of ``[instruction][document]`` (see ``TokenizedTemplate``)."""
        return self.prompt.prefix_ids(document)

    def suffix_ids(self, query: str) -> torch.Tensor:
        """Token ids of everything after the document (never cached)."""
        return self.prompt.suffix_ids(query)

    def prefix_key(self, document: str) -> str:
        """The store key of ``document``'s prefix cache."""
        return cache_key(self.fingerprint, self.prefix_ids(document))

    # ------------------------------------------------------------ public API
    def encode_documents(self, documents: Sequence[str]) -> int:
        """Precompute and store prefix caches (e.g. at ingestion); returns how many were new.

        Empty documents are skipped: they are never scored by the model.

        Examples:
            >>> reranker.encode_documents(["Canberra is the capital."])  # doctest: +SKIP
            1
        """
        docs = check_texts(documents, "documents")
        unique = list(dict.fromkeys(d for d in docs if d.strip()))
        result = self.engine.encode_documents(
            [self.prefix_ids(d).tolist() for d in unique],
            key_space=self.template.name,
            store=self.store,
            batch_size=self.batch_size,
        )
        self._count(result)
        return result.encoded

    def score(self, query: str, documents: Sequence[str], *, reuse: bool = True) -> list[float]:
        """Relevance scores, in input order: ``log P(yes) - log P(no)`` (judge) or
        the query's mean token log-probability (query likelihood).

        Args:
            query: the question.
            documents: candidate texts.
            reuse: use (and fill) the stored prefix caches; False runs the plain
                full forward of every prompt (the reference).

        Returns:
            One float per document. An empty or whitespace-only document scores
            ``-inf`` without running the model; duplicates are scored once.

        Raises:
            TypeError: ``query`` or a document is not a str, or ``documents`` is one str.
            ValueError: ``query`` is empty, whitespace only or not valid Unicode.
            ContextWindowExceededError: a prompt does not fit the model's context.

        Examples:
            >>> reranker.score("Capital of Australia?", ["Canberra is.", ""])  # doctest: +SKIP
            [-1.9..., -inf]
        """
        if not check_text(query, "query").strip():
            raise ValueError("query must contain non-whitespace text")
        docs = check_texts(documents, "documents")
        self.stats.candidates += len(docs)
        scores = [-math.inf] * len(docs)
        where: dict[str, list[int]] = {}
        for i, doc in enumerate(docs):
            if doc.strip():
                where.setdefault(doc, []).append(i)
        if not where:
            return scores
        prefixes = [self.prefix_ids(d) for d in where]
        n_query = 0
        if self.scoring == "query_likelihood":
            lead, query_ids = self.prompt.query_ids(query)
            suffix, n_query = torch.cat([lead, query_ids]), query_ids.numel()
        else:
            suffix = self.suffix_ids(query)
        result = self.engine.score_documents(
            [p.tolist() for p in prefixes],
            suffix.tolist(),
            n_query=n_query,
            answer_ids=(self.prompt.yes_ids, self.prompt.no_ids),
            reuse=reuse,
            key_space=self.template.name,
            store=self.store,
            batch_size=self.batch_size,
        )
        self._count(result)
        values = result.scores
        self.stats.scored += len(values)
        for indices, value in zip(where.values(), values, strict=True):
            for i in indices:
                scores[i] = value
        return scores

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: Any = _KEEP,
        reuse: bool = True,
    ) -> list[tuple[int, float]]:
        """``(index, score)`` pairs, best first, cut to ``top_n``.

        Ties keep input order; empty documents (``-inf``) come last.

        Examples:
            >>> reranker.rerank("Capital of Australia?", docs, top_n=2)  # doctest: +SKIP
            [(3, -1.9...), (0, -2.4...)]
        """
        limit = self.top_n if top_n is _KEEP else _check_top_n(top_n)
        scores = self.score(query, documents, reuse=reuse)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [(i, scores[i]) for i in order[:limit]]

    # ------------------------------------------------------------- internals
    def _count(self, result: Any) -> None:
        self.stats.prefixes_reused += result.reused
        self.stats.prefixes_encoded += result.encoded
        self.stats.forward_s += result.forward_s


__all__ = ["KVReranker", "RerankStats"]
