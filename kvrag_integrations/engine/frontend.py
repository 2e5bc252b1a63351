"""What every engine does the same way in front of its model: the one front door.

``EngineFrontend`` is the request-facing half that ``KVRAGEngine`` (transformers,
in process) and ``VLLMEngine`` (vLLM, in process or a server) share: a call's
options merged and checked (``RequestOptions``), the prompt built from a
question and chunks, segments or messages (``prompts``), its tokenization into
pieces pointed at their entries (``PromptTokenizer``), the context-window check
(``prepare``, ``open_request``), and ``generate`` / ``stream`` / ``astream``.
Each engine supplies only its job: ``request_job`` (the work that answers a
prepared ``Request``) and, where it cannot run something, ``check_options``.
The adapters depend on the protocol only (``engine.protocol.RAGEngine``), never
on which engine answers.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.prompting import prompts
from kvrag_integrations.engine.prompting.prompts import PROMPT_ARGS
from kvrag_integrations.engine.prompting.segments import (
    DEFAULT_INSTRUCTION,
    Segment,
    Text,
    TokenizedPrompt,
)
from kvrag_integrations.engine.prompting.spans import ChunkIndex
from kvrag_integrations.engine.request import Request, RequestOptions
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.strategies import Strategy, make_strategy
from kvrag_integrations.engine.streaming import AsyncGenerationStream, GenerationStream, Job
from kvrag_integrations.engine.tool_answers import with_tool_calls
from kvrag_integrations.engine.tools.plan import ToolPlan, plan_tools
from kvrag_integrations.errors import check_fits


class EngineFrontend(ABC):
    """Options, prompts, the context window and the three ways to answer.

    A subclass sets ``tokenizer``, ``prompts`` (its ``PromptTokenizer``),
    ``on_miss`` (its default miss policy) and ``context_window``, and
    implements ``request_job``.
    """

    tokenizer: Any
    prompts: PromptTokenizer
    on_miss: str

    @property
    @abstractmethod
    def context_window(self) -> int:
        """The most prompt and answer tokens a request may hold."""

    @abstractmethod
    def request_job(self, request: Request, result: GenerationResult) -> Job:
        """This engine's work for a prepared request: run by a stream's worker (or
        ``generate``'s caller), it yields text pieces and fills ``result``."""

    def check_options(self, options: RequestOptions) -> None:  # noqa: B027 (a hook)
        """Refuse, at the call, options this engine cannot honour
        (``UnsupportedInputError``); every engine takes the rest."""

    def use_strategy(self, strategy: str) -> None:  # noqa: B027 (a hook)
        """Note that requests will use ``strategy`` (an adapter made for it calls
        this): an engine whose strategies read entries of their own stores those
        too when it encodes chunks; none here."""

    def blend_options(self, prompt: TokenizedPrompt) -> dict[str, Any]:
        """Blend's options for ``prompt`` where a call names none: the model's
        calibrated settings for its chunk length (``engine.blend_settings``); none
        here (an engine whose blend runs elsewhere resolves them there)."""
        return {}

    def strategy_for(self, options: RequestOptions, prompt: TokenizedPrompt) -> Strategy:
        """The request's strategy: ``"blend"`` by name takes ``blend_options`` for the
        prompt, under the call's own options; any other as the options say."""
        if options.strategy == "blend":
            tuned = {**self.blend_options(prompt), **options.strategy_options}
            return make_strategy("blend", **tuned)
        return make_strategy(options.strategy, **options.strategy_options)

    def forced_lead(self, plan: ToolPlan) -> str:
        """The forced call's start the prompt ends with past its opening markup: the
        in-process engine writes ``{"name": "<tool>", "<args key>": `` and
        constrains the rest (``tools.constraint``); an engine with its own
        constrained decoding (vLLM's structured outputs) writes none."""
        return plan.forced_start()[0]

    # ------------------------------------------------------------- requests
    def open_request(
        self, question: str | None, chunks: Sequence[str] | None, kwargs: dict[str, Any]
    ) -> tuple[Job, GenerationResult]:
        """Check a request (options first, then the prompt: a bad one raises here,
        on the caller's thread) and return the work a stream's worker runs, with
        the result that work fills."""
        kwargs = dict(kwargs)
        prompt = {name: kwargs.pop(name) for name in PROMPT_ARGS if name in kwargs}
        options = RequestOptions().merged(kwargs)
        request = self.prepare(options, question=question, chunks=chunks, **prompt)
        result = GenerationResult(strategy=request.strategy.name)
        job = self.request_job(request, result)
        if request.tools is not None:
            job = with_tool_calls(job, request, result, self.tokenizer)
        return job, result

    def prepare(
        self,
        options: RequestOptions,
        *,
        segments: Sequence[Segment] | None = None,
        question: str | None = None,
        chunks: Sequence[str] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        known_chunks: Sequence[str] = (),
        system_prompt: str | None = None,
        chat_template: bool = True,
    ) -> Request:
        """Check ``options`` (``check_options``) and tokenize the prompt; no store
        read, no forward. The prompt must fit with ``max_new_tokens`` to spare."""
        started = time.perf_counter()
        self.check_options(options)
        tools = plan_tools(
            self.tokenizer, options.tools, options.tool_choice, options.parallel_tool_calls
        )
        segs = self.build_segments(
            question=question,
            chunks=chunks,
            segments=segments,
            messages=messages,
            known_chunks=known_chunks,
            system_prompt=system_prompt,
            chat_template=chat_template,
            tools=tools,
        )
        lead = ""
        if tools is not None and tools.forced:  # the call's start: computed text
            lead = self.forced_lead(tools)
            tail = [Text(tools.prompt_tail, markup=True), Text(lead)]
            segs = [*segs, *(t for t in tail if t.text)]
        prompt = self.tokenize(segs)
        if prompt.num_tokens == 0:
            raise ValueError("the prompt is empty")
        self.check_fits(prompt.num_tokens, "the prompt", options.sampling.max_new_tokens)
        on_miss = self.on_miss if options.on_miss is None else options.on_miss
        strategy = self.strategy_for(options, prompt)
        return Request(
            strategy,
            prompt,
            on_miss,
            started,
            options.sampling,
            options.logprobs,
            tools,
            lead,
            dict(options.strategy_options),
        )

    # ------------------------------------------------------------- prompts
    def build_segments(
        self,
        *,
        question: str | None = None,
        chunks: Sequence[str] | None = None,
        segments: Sequence[Segment] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        known_chunks: Sequence[str] = (),
        system_prompt: str | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        chat_template: bool = True,
        tools: ToolPlan | None = None,
    ) -> list[Segment]:
        """The prompt as segments, chat template applied (``prompts.build_segments``
        with this engine's tokenizer and chunk index: its arguments and checks)."""
        return prompts.build_segments(
            self.tokenizer,
            self.chunk_index,
            question=question,
            chunks=chunks,
            segments=segments,
            messages=messages,
            known_chunks=known_chunks,
            system_prompt=system_prompt,
            instruction=instruction,
            chat_template=chat_template,
            tools=tools,
        )

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
                ``min_new_tokens`` (0; end-of-answer ids are masked before),
                ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``,
                ``stop``, ``stop_token_ids``, ``on_miss``, ``logprobs`` (the first
                token's top-k log-probabilities in ``first_token_logprobs``),
                ``tools`` (OpenAI function schemas) with ``tool_choice`` ("auto",
                "required", "none" or a tool's name; calls in ``tool_calls``,
                malformed ones in ``invalid_tool_calls``) and ``parallel_tool_calls``
                (False: the first call only), and
                strategy options (e.g. ``positions="composite"`` for turbo).

        Returns:
            A ``GenerationResult`` with text, TTFT and token accounting.
        """
        job, result = self.open_request(question, chunks, kwargs)
        for _ in job(threading.Event()):  # a stream's work, run on this thread
            pass
        return result
