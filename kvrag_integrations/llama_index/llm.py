"""KVRAGLLM: a LlamaIndex LLM that reuses the KV caches of the chunks in its prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from pydantic import Field, PrivateAttr

from kvrag_integrations.engine.protocol import RAGEngine, check_engine
from kvrag_integrations.engine.request import RequestOptions
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.llama_index.hooks import install_hooks, known_chunks
from kvrag_integrations.llama_index.tools import (
    invalid_calls,
    message_tool_fields,
    openai_calls,
    prepare_chat_with_tools,
    tool_selections,
)

# LlamaIndex roles the chat template may not know, mapped to ones it does.
_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant", "function": "tool"}
# Per-call keyword arguments passed on to the engine, under the engine's names
# (others, e.g. ``formatted``, are ignored).
_CALL_OPTIONS = (
    "strategy",
    "strategy_options",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "on_miss",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
# The instance's fields that are request options (the engine's names).
_SETTINGS = tuple(
    name
    for name in _CALL_OPTIONS
    if name not in ("top_k", "on_miss", "tools", "tool_choice", "parallel_tool_calls")
)


@dataclass
class _Request:
    """One engine call: what the LLM received and how to answer it."""

    messages: list[dict[str, str]]
    known_chunks: tuple[str, ...]
    options: dict[str, Any]


class KVRAGLLM(FunctionCallingLLM):
    """A local LLM for LlamaIndex that builds its prompt cache from stored chunk caches.

    Synthesizers paste retrieved node texts into the prompt; the engine finds them
    there (chunks this engine encoded, plus the nodes retrieved or synthesized in
    this request, seen through LlamaIndex instrumentation) and reuses their KV
    caches with the chosen strategy. Text a synthesizer altered is just prefilled.
    Messages keep their roles; the engine applies the model's chat template.

    Each response carries the reuse stats (``reused_chunk_tokens`` and
    ``reused_prefix_tokens``, whose sum is ``reused_tokens``, ``recomputed_tokens``,
    ``prefilled_tokens``, ``fallback``, ``ttft_s``, ``strategy``, ...) in
    ``additional_kwargs`` and ``raw``; ``last_stats`` / ``last_result`` /
    ``last_messages`` keep the latest call's (per instance: under concurrency
    read the response instead).

    Args:
        engine: a ``KVRAGEngine`` or a ``VLLMEngine`` (any ``engine.protocol.RAGEngine``);
            or leave it out (optionally with ``model``,
            ``device``, ``dtype``) to use the process's shared engine for that model,
            ``KVRAGEngine.shared``: the engine ``from_pretrained`` loaded first for
            it, if any.
        **kwargs: the fields below (and LlamaIndex's own, e.g. ``system_prompt``).

    Attributes:
        model: the model to load when no engine is given (HF id, directory, ``.gguf``).
        device: the device for a model loaded by name.
        dtype: the dtype for a model loaded by name.
        strategy: ``"turbo"`` (default: ``DEFAULT_STRATEGY``), ``"blend"`` or ``"full"``.
        strategy_options: e.g. ``{"recompute_ratio": 0.15}`` for blend.
        max_new_tokens: the most tokens to generate.
        temperature: sampling temperature (``0`` is greedy).
        top_p: nucleus sampling mass (1.0: off).
        seed: sampling seed.
        stop: strings that end the answer.

    ``system_prompt`` is added by ``complete`` and, as LlamaIndex does, by
    ``predict``; ``chat`` sends the messages as given.

    A function-calling LLM (``FunctionAgent``, ``chat_with_tools``): tools are
    rendered by the model's chat template (or the engine's fallback tool
    prompt), calls come back in ``message.additional_kwargs["tool_calls"]``
    (``get_tool_calls_from_response``); ``tool_required`` forces a valid call.

    Examples:
        >>> llm = KVRAGLLM(engine, strategy="blend", max_new_tokens=64)  # doctest: +SKIP
        >>> query_engine = index.as_query_engine(llm=llm)  # doctest: +SKIP
        >>> print(query_engine.query("Who wrote it?"))  # doctest: +SKIP
        >>> llm.last_stats["reused_tokens"]  # doctest: +SKIP
        412
    """

    model: str | None = Field(default=None, description="Model to load when no engine is given.")
    device: str = Field(default="cpu", description="Device for a model loaded by name.")
    dtype: str | None = Field(default=None, description="Dtype for a model loaded by name.")
    strategy: str = Field(default=DEFAULT_STRATEGY, description='"turbo", "blend" or "full".')
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    max_new_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None)
    stop: list[str] = Field(default_factory=list)

    _engine: Any = PrivateAttr(default=None)
    _last_result: Any = PrivateAttr(default=None)
    _last_request: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is not None and kwargs.get("model") is not None:
            raise ValueError("pass an engine or a model name, not both")
        super().__init__(**kwargs)
        self._defaults()  # a bad strategy, option or sampling value fails here
        if engine is None:
            from kvrag_integrations.engine.engine import KVRAGEngine

            engine = KVRAGEngine.shared(self.model, device=self.device, dtype=self.dtype)
        self._engine = check_engine(engine)
        self._engine.use_strategy(self.strategy)  # (ingestion stores what it reads)
        install_hooks()

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGLLM"

    # --------------------------------------------------------------- facts
    @property
    def engine(self) -> RAGEngine:
        """The engine answering the calls."""
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._engine.model_name,
        )

    # --------------------------------------------------------------- tools
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        return prepare_chat_with_tools(
            tools, user_msg, chat_history, tool_required, kwargs, allow_parallel_tool_calls
        )

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls of a ``chat_with_tools`` response (``ToolSelection``s)."""
        return tool_selections(response.message, error_on_no_tool_call)

    @property
    def last_result(self) -> Any:
        """The latest call's ``GenerationResult`` (with ``first_token_logits``), or None."""
        return self._last_result

    @property
    def last_stats(self) -> dict[str, Any]:
        """The latest call's stats dict (empty before the first call)."""
        return dict(self._last_result.stats) if self._last_result is not None else {}

    @property
    def last_messages(self) -> list[dict[str, str]]:
        """The messages the latest call sent to the engine (system prompt included)."""
        return list(self._last_request.messages) if self._last_request is not None else []

    @property
    def last_known_chunks(self) -> tuple[str, ...]:
        """The request's node texts the latest call passed as ``known_chunks``."""
        return self._last_request.known_chunks if self._last_request is not None else ()

    # ------------------------------------------------------------ requests
    def _request(
        self, messages: list[dict[str, str]], kwargs: dict[str, Any], *, system: bool
    ) -> _Request:
        if system and self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        known = known_chunks(m["content"] for m in messages)
        return _Request(messages, known, self._options(kwargs))

    def _defaults(self) -> RequestOptions:
        """The instance's settings over the engine's defaults (checked)."""
        return RequestOptions().merged({name: getattr(self, name) for name in _SETTINGS})

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The engine options of one call: the instance's, overridden by the call's
        (``RequestOptions.merged``: bad values fail here, before any forward)."""
        call = {k: kwargs[k] for k in _CALL_OPTIONS if k in kwargs}
        return self._defaults().merged(call).as_kwargs()

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> _Request:
        dicts = []
        for message in messages:
            role = getattr(message.role, "value", message.role)
            content = _message_text(message)
            dicts.append(
                {"role": _ROLES.get(role, role), "content": content, **message_tool_fields(message)}
            )
        return self._request(dicts, kwargs, system=False)

    def _prompt_request(self, prompt: str, kwargs: dict[str, Any]) -> _Request:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        return self._request([{"role": "user", "content": prompt}], kwargs, system=True)

    def _open(self, request: _Request, *, asynchronous: bool = False) -> Any:
        """Start the engine's stream (``astream`` if ``asynchronous``).

        The request is checked and tokenized here (errors surface here); the
        prefill and decoding run on the stream's worker thread.
        """
        self._last_request = request
        start = self._engine.astream if asynchronous else self._engine.stream
        return start(
            messages=request.messages, known_chunks=request.known_chunks, **request.options
        )

    def _run(self, request: _Request) -> tuple[str, Any]:
        """The answer's text and result (this call's own: never another thread's)."""
        stream = self._open(request)
        text = "".join(stream)
        self._last_result = stream.result
        return text, stream.result

    async def _arun(self, request: _Request) -> tuple[str, Any]:
        stream = self._open(request, asynchronous=True)
        async with stream:
            text = "".join([piece async for piece in stream])
        self._last_result = stream.result
        return text, stream.result

    def _pieces(self, stream: Any) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """``(text so far, delta, stats)`` per piece, then a final ``delta=""`` with all stats.

        A consumer that stops early closes the stream: decoding stops.
        """
        text = ""
        with stream:
            for piece in stream:
                text += piece
                yield text, piece, stream.result.stats
        self._last_result = stream.result
        yield text, "", stream.result.stats

    async def _apieces(self, stream: Any) -> AsyncIterator[tuple[str, str, dict[str, Any]]]:
        """``_pieces`` over the engine's ``astream`` (the event loop never blocks)."""
        text = ""
        async with stream:
            async for piece in stream:
                text += piece
                yield text, piece, stream.result.stats
        self._last_result = stream.result
        yield text, "", stream.result.stats

    def _completion_gen(self, stream: Any) -> CompletionResponseGen:
        for text, delta, stats in self._pieces(stream):
            yield CompletionResponse(text=text, delta=delta, additional_kwargs=stats, raw=stats)

    async def _acompletion_gen(self, stream: Any) -> CompletionResponseAsyncGen:
        async for text, delta, stats in self._apieces(stream):
            yield CompletionResponse(text=text, delta=delta, additional_kwargs=stats, raw=stats)

    def _chat_gen(self, stream: Any) -> ChatResponseGen:
        for text, delta, _ in self._pieces(stream):
            yield _chat_response(text, stream.result, delta)

    async def _achat_gen(self, stream: Any) -> ChatResponseAsyncGen:
        async for text, delta, _ in self._apieces(stream):
            yield _chat_response(text, stream.result, delta)

    # ---------------------------------------------------------- completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt`` as one user message (after ``system_prompt`` if set)."""
        text, result = self._run(self._prompt_request(prompt, kwargs))
        return CompletionResponse(text=text, additional_kwargs=result.stats, raw=result.stats)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Like ``complete``, yielding pieces; the last response has ``delta=""``."""
        return self._completion_gen(self._open(self._prompt_request(prompt, kwargs)))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        text, result = await self._arun(self._prompt_request(prompt, kwargs))
        return CompletionResponse(text=text, additional_kwargs=result.stats, raw=result.stats)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        stream = self._open(self._prompt_request(prompt, kwargs), asynchronous=True)
        return self._acompletion_gen(stream)

    # ---------------------------------------------------------------- chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer the conversation; roles are kept and the chat template applied."""
        text, result = self._run(self._chat_request(messages, kwargs))
        return _chat_response(text, result)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like ``chat``, yielding pieces; the last response has ``delta=""``."""
        return self._chat_gen(self._open(self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        text, result = await self._arun(self._chat_request(messages, kwargs))
        return _chat_response(text, result)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        stream = self._open(self._chat_request(messages, kwargs), asynchronous=True)
        return self._achat_gen(stream)


def _message_text(message: ChatMessage) -> str:
    """A message's text; a block the text-only model cannot read is refused, not dropped."""
    parts = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif not isinstance(block, CachePoint):  # a cache hint carries no content
            kind = getattr(block, "block_type", type(block).__name__)
            raise UnsupportedInputError(
                f"KVRAGLLM reads text only; got a {type(block).__name__} ({kind!r}) "
                "in a chat message"
            )
    return "\n".join(parts)  # as ChatMessage.content joins them


def _chat_response(text: str, result: Any, delta: str | None = None) -> ChatResponse:
    """A chat response from a call's own result (its calls once it has them)."""
    stats = result.stats
    extra: dict[str, Any] = {}
    if result.tool_calls:
        extra["tool_calls"] = openai_calls(result.tool_calls)
    if result.invalid_tool_calls:
        extra["invalid_tool_calls"] = invalid_calls(result.invalid_tool_calls)
    message = ChatMessage(role=MessageRole.ASSISTANT, content=text, additional_kwargs=extra)
    return ChatResponse(message=message, delta=delta, additional_kwargs=stats, raw=stats)
