"""What every engine does the same way in front of its model: prompts and streams.

``EngineFrontend`` is the request-facing half that ``KVRAGEngine`` (transformers,
in process) and ``VLLMEngine`` (vLLM, in process or a server) share: the prompt
built from a question and chunks, segments or messages (``prompts``), its
tokenization into pieces pointed at their entries (``PromptTokenizer``), the
context-window check, and ``generate`` / ``stream`` / ``astream`` over one
``open_request`` each engine implements. The adapters depend on these methods
only (``engine.protocol.RAGEngine``), never on which engine answers.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.prompting import prompts
from kvrag_integrations.engine.prompting.segments import Segment, TokenizedPrompt
from kvrag_integrations.engine.prompting.spans import ChunkIndex
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.streaming import AsyncGenerationStream, GenerationStream, Job
from kvrag_integrations.errors import check_fits


class EngineFrontend(ABC):
    """Prompts, the context window and the three ways to answer, over ``open_request``.

    A subclass sets ``tokenizer``, ``prompts`` (its ``PromptTokenizer``) and
    ``context_window``, and implements ``open_request``.
    """

    tokenizer: Any
    prompts: PromptTokenizer

    @property
    @abstractmethod
    def context_window(self) -> int:
        """The most prompt and answer tokens a request may hold."""

    @abstractmethod
    def open_request(
        self, question: str | None, chunks: Sequence[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Job, GenerationResult]:
        """Check a request (options first, then the prompt: a bad one raises here,
        on the caller's thread) and return the work a stream's worker runs, with
        the result that work fills."""

    # ------------------------------------------------------------- prompts
    # The prompt as segments, chat template applied (its arguments and checks:
    # prompts.build_segments, which takes the engine as its first argument).
    build_segments = prompts.build_segments

    @property
    def chunk_index(self) -> ChunkIndex:
        """Texts of chunks this engine encoded or read, to find them in flat prompts."""
        return self.prompts.index

    def tokenize(self, segments: Sequence[Segment]) -> TokenizedPrompt:
        """Tokenize segments (each alone) into the prompt as the reuse strategies read
        it (``PromptTokenizer.tokenize``: chunks pointed at their entries)."""
        return self.prompts.tokenize(segments)

    def check_fits(self, n_tokens: int, what: str, new_tokens: int = 0) -> None:
        """Raise ``ContextWindowExceededError`` naming ``what`` if ``n_tokens`` prompt
        tokens plus ``new_tokens`` to generate exceed the context window."""
        check_fits(n_tokens, self.context_window, what, new_tokens)

    # ------------------------------------------------------------- generate
    def stream(
        self, question: str | None = None, chunks: Sequence[str] | None = None, **kwargs: Any
    ) -> GenerationStream:
        """Like ``generate`` (same arguments) but returns an iterator of text pieces.

        Every argument is checked and the prompt tokenized here (a bad request
        raises at the call); the request then runs on a worker thread that hands
        pieces over a queue (``engine.streaming``). The returned
        ``GenerationStream`` has ``.result`` (a ``GenerationResult``), complete
        once the iterator is exhausted; ``close()``, or dropping the stream,
        stops decoding.
        """
        return GenerationStream(*self.open_request(question, chunks, kwargs))

    def astream(
        self, question: str | None = None, chunks: Sequence[str] | None = None, **kwargs: Any
    ) -> AsyncGenerationStream:
        """``stream`` for asyncio: ``async for piece in engine.astream(...)``.

        The same worker and queue; awaiting a piece never blocks the event loop.
        ``aclose()`` (or dropping the stream) stops decoding.
        """
        return AsyncGenerationStream(*self.open_request(question, chunks, kwargs))

    def generate(
        self,
        question: str | None = None,
        chunks: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Answer ``question`` over ``chunks`` (or a ``segments`` prompt), reusing caches.

        Args:
            question: the user's question.
            chunks: retrieved chunk texts, in prompt order.
            **kwargs: ``segments`` or ``messages`` (with ``known_chunks``) instead of
                question/chunks, ``strategy`` ("full", "turbo" (default), "blend"),
                ``system_prompt``, ``chat_template``, ``max_new_tokens`` (256),
                ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``,
                ``stop``, ``stop_token_ids``, ``on_miss`` and strategy options (e.g.
                ``positions="composite"`` for turbo).

        Returns:
            A ``GenerationResult`` with text, TTFT and token accounting.
        """
        job, result = self.open_request(question, chunks, kwargs)
        for _ in job(threading.Event()):  # a stream's work, run on this thread
            pass
        return result
