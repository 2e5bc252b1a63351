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
from typing import Any, Protocol, runtime_checkable

from kvrag_integrations.engine.caching.entries import ChunkRef
from kvrag_integrations.engine.prompting.spans import ChunkIndex
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.streaming import AsyncGenerationStream, GenerationStream


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
