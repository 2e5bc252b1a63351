"""The one engine interface the framework adapters depend on.

``KVRAGEngine`` (transformers, one process) and
``kvrag_integrations.vllm.VLLMEngine`` (vLLM through its KV-connector API, in
process or as a client of a vLLM OpenAI server) both implement it, so
``KVRAGLLM``, ``ChatKVRAG``, the retrievers and the ingestion transforms take
either, with no branch on which one it is. Anything an adapter needs goes
here first, and then into both engines (``tests/unit/test_engine_protocol.py``
checks that they keep the same signatures).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvrag_integrations.engine.caching.entries import ChunkRef
from kvrag_integrations.engine.prompting.spans import ChunkIndex
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.streaming import AsyncGenerationStream, GenerationStream
from kvrag_integrations.errors import UnsupportedEngineError


@runtime_checkable
class RAGEngine(Protocol):
    """What an engine offers the adapters: facts, chunk encoding, and answers.

    ``generate`` / ``stream`` / ``astream`` take the same arguments on every
    engine (``EngineFrontend.generate``); an engine that cannot honour one
    (a strategy, an option) raises ``UnsupportedInputError`` at the call.
    """

    @property
    def model_name(self) -> str:
        """The model's name as the adapters report it."""
        ...

    @property
    def context_window(self) -> int:
        """The most prompt and answer tokens a request may hold."""
        ...

    @property
    def fingerprint(self) -> str:
        """What chunk entries are keyed and checked by (model, precision, context)."""
        ...

    @property
    def chunk_index(self) -> ChunkIndex:
        """Chunk texts this engine encoded or read, found inside flat prompts."""
        ...

    def encode_chunks(
        self,
        chunks: Sequence[str],
        *,
        batch_size: int = 8,
        show_progress: bool = True,
        overwrite: bool = False,
    ) -> list[ChunkRef]:
        """Precompute and store each chunk's cache; one ``ChunkRef`` per chunk."""
        ...

    def prefetch(self, chunks: Sequence[str]) -> int:
        """Start loading the caches of ``chunks`` ahead of the request; how many."""
        ...

    def use_strategy(self, strategy: str) -> None:
        """Note that requests will use ``strategy`` (``encode_chunks`` then stores the
        entries it reads too)."""
        ...

    def generate(
        self, question: str | None = None, chunks: Sequence[str] | None = None, **kwargs: Any
    ) -> GenerationResult:
        """Answer, reusing chunk caches."""
        ...

    def stream(
        self, question: str | None = None, chunks: Sequence[str] | None = None, **kwargs: Any
    ) -> GenerationStream:
        """``generate`` as an iterator of text pieces."""
        ...

    def astream(
        self, question: str | None = None, chunks: Sequence[str] | None = None, **kwargs: Any
    ) -> AsyncGenerationStream:
        """``stream`` for asyncio."""
        ...


def check_engine(engine: Any, what: str = "engine") -> RAGEngine:
    """``engine`` if it implements ``RAGEngine``, else a ``TypeError`` naming what is missing.

    Examples:
        >>> check_engine(object())
        Traceback (most recent call last):
        ...
        TypeError: engine must be a KVRAGEngine or VLLMEngine (an engine.protocol.RAGEngine); \
object lacks astream, chunk_index, context_window, ...
    """
    # Looked up statically: reading a property may cost a request (a remote
    # engine's fingerprint), and isinstance() on a Protocol reads them all.
    missing = sorted(n for n in ENGINE_MEMBERS if inspect.getattr_static(engine, n, None) is None)
    if not missing:
        return engine
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    raise TypeError(
        f"{what} must be a KVRAGEngine or VLLMEngine (an engine.protocol.RAGEngine); "
        f"{type(engine).__name__} lacks {shown}"
    )


ENGINE_MEMBERS = tuple(
    name for name in vars(RAGEngine) if not name.startswith("_") and name != "check_engine"
)
"""The names every engine implements (what ``check_engine`` looks for)."""


@dataclass
class DocumentScores:
    """What ``score_documents`` returns: one score per prefix, in order, and counts.

    Attributes:
        scores: the scores (see ``DocumentScorer.score_documents``).
        reused: prefixes whose stored cache was loaded, not computed.
        encoded: prefixes encoded and stored by this call.
        forward_s: seconds in model forwards or vLLM requests (encoding included).
    """

    scores: list[float] = field(default_factory=list)
    reused: int = 0
    encoded: int = 0
    forward_s: float = 0.0


@runtime_checkable
class DocumentScorer(Protocol):
    """What the decoder reranker (``rerank.KVReranker``) asks of an engine: score
    document-first prompts ``[prefix][suffix]`` reusing each prefix's stored cache
    (loaded at position 0: exact). Both engines implement it."""

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (prompts are tokenized by the caller)."""
        ...

    @property
    def context_window(self) -> int: ...

    def scoring_fingerprint(self, key_space: str) -> str:
        """The fingerprint document prefix entries are keyed by, for ``key_space``
        (the reranking template's name; an engine may share chunk entries)."""
        ...

    def score_documents(
        self,
        prefixes: Sequence[Sequence[int]],
        suffix: Sequence[int],
        *,
        n_query: int = 0,
        answer_ids: tuple[Sequence[int], Sequence[int]] = ((), ()),
        reuse: bool = True,
        key_space: str = "",
        store: Any = None,
        batch_size: int = 16,
    ) -> DocumentScores:
        """Score ``prefix + suffix`` for every prefix, all at once.

        ``n_query > 0``: the mean log-probability of the suffix's last ``n_query``
        ids (query likelihood); else ``logsumexp log P(answer_ids[0]) -
        logsumexp log P(answer_ids[1])`` for the token after the prompt (judge).
        ``reuse``: load stored prefix caches (and store the missing ones); False
        computes every prompt whole (the reference). ``store``: where prefix
        caches live (None: the engine's own).
        """
        ...

    def encode_documents(
        self,
        prefixes: Sequence[Sequence[int]],
        *,
        key_space: str = "",
        store: Any = None,
        batch_size: int = 16,
    ) -> DocumentScores:
        """Store the caches of ``prefixes`` not stored yet (``encoded``: how many)."""
        ...


SCORER_MEMBERS = ("tokenizer", "context_window", "scoring_fingerprint", "score_documents")


def check_scorer(engine: Any, what: str = "the reranker's engine") -> DocumentScorer:
    """``engine`` if it implements ``DocumentScorer``, else an ``UnsupportedEngineError``
    naming what it lacks (raised at the reranker's construction, not deep inside).

    Examples:
        >>> check_scorer(object())
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.UnsupportedEngineError: the reranker's engine must be \
a KVRAGEngine or VLLMEngine (an engine.protocol.DocumentScorer); object lacks \
context_window, encode_documents, score_documents, scoring_fingerprint, tokenizer
    """
    names = (*SCORER_MEMBERS, "encode_documents")
    missing = sorted(n for n in names if inspect.getattr_static(engine, n, None) is None)
    if not missing:
        return engine
    raise UnsupportedEngineError(
        f"{what} must be a KVRAGEngine or VLLMEngine (an engine.protocol.DocumentScorer); "
        f"{type(engine).__name__} lacks {', '.join(missing)}"
    )
