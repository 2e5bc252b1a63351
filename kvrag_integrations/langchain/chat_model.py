"""ChatKVRAG: a LangChain chat model that reuses the KV caches of retrieved chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, ModelProfile
from langchain_core.language_models.chat_models import generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from kvrag_integrations.engine import GenerationResult, KVRAGEngine
from kvrag_integrations.engine.prompting.prompts import PROMPT_ARGS
from kvrag_integrations.engine.protocol import RAGEngine, check_engine
from kvrag_integrations.engine.request import RequestOptions
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.langchain.hooks import install_hooks
from kvrag_integrations.langchain.messages import to_engine_messages
from kvrag_integrations.langchain.tools import (
    bind_tools,
    invalid_tool_calls,
    tool_call_chunks,
    tool_calls,
)

# LangChain parameter name -> engine argument name.
_SAMPLING = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
}


class ChatKVRAG(BaseChatModel):
    """A local chat model whose prompt cache is assembled from stored chunk caches.

    Chunks of the messages that this process's retriever or ingestion encoded
    (``engine.chunk_index``), documents passed as ``documents=`` and content
    blocks carrying ``extras["kvrag_cache_key"]`` reuse their precomputed KV
    caches; the rest of the prompt is prefilled. The chat template of the model
    is applied around them.

    Attributes:
        engine: a ``KVRAGEngine`` or a ``VLLMEngine`` (any ``engine.protocol.RAGEngine``);
            by default ``KVRAGEngine.shared(model, ...)``,
            so that every instance built from one model name shares its weights.
        model: HF id, local directory or ``.gguf`` file (None: bundled SmolLM2);
            with ``device`` and ``dtype``, used only when ``engine`` is not given.
        strategy: ``"turbo"`` (default: ``DEFAULT_STRATEGY``), ``"blend"`` or ``"full"``;
            ``strategy_options`` are its options, e.g. ``{"recompute_ratio": 0.15}``
            for blend.
        max_tokens: the most tokens to generate.
        temperature: sampling temperature (``0`` is greedy).
        top_p: nucleus sampling mass (1.0: off).
        top_k: keep only the ``top_k`` likeliest tokens (0: off).
        repetition_penalty: penalty on tokens already seen (1.0: off).
        seed: sampling seed.
        stop: strings that end the answer.

    Per call: ``documents=[Document, ...]``, ``strategy=``, the sampling names,
    ``model=`` (another shared engine) and strategy options as keywords.

    Examples:
        >>> llm = ChatKVRAG(strategy="turbo", max_tokens=32)  # doctest: +SKIP
        >>> llm.invoke("Capital of France?", documents=docs).usage_metadata  # doctest: +SKIP
        {'input_tokens': 71, 'output_tokens': 3, 'total_tokens': 74,
         'input_token_details': {'cache_read': 38}}
    """

    model_config = ConfigDict(populate_by_name=True)

    engine: Any = Field(default=None, exclude=True, repr=False)  # a RAGEngine
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    strategy: str = DEFAULT_STRATEGY
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    streaming: bool = False
    """Whether ``invoke`` goes through ``_stream`` (LangChain's standard switch)."""

    _last_result: GenerationResult | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _load_engine(self) -> ChatKVRAG:
        self._request_defaults()  # a bad strategy, option or sampling value fails here
        if self.engine is not None:
            check_engine(self.engine)
        self._ensure_engine().use_strategy(self.strategy)  # (ingestion stores what it reads)
        install_hooks()  # retrievers' and vector store searches' documents become known chunks
        return self

    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """This model with ``tools`` bound (``langchain.tools.bind_tools``): rendered by
        the model's chat template, or the fallback tool prompt where it has none;
        calls come back as ``AIMessage.tool_calls`` (streamed: ``tool_call_chunks``).

        ``tool_choice``: ``"auto"`` (None), ``"required"`` / ``"any"`` / True, ``"none"``
        or a tool's name; a required or named call is always a valid call
        (constrained decoding).
        """
        return bind_tools(self, tools, tool_choice, kwargs)

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        """Refused: no structured (JSON-schema) output mode."""
        raise UnsupportedInputError(
            "ChatKVRAG does not support structured output (with_structured_output); "
            "parse its text with an output parser instead"
        )

    def _ensure_engine(self) -> RAGEngine:
        if self.engine is None:
            self.engine = KVRAGEngine.shared(self.model, device=self.device, dtype=self.dtype)
        return self.engine

    def _resolve_model_profile(self) -> ModelProfile | None:
        return ModelProfile(
            max_input_tokens=self._ensure_engine().context_window,
            text_inputs=True,
            image_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            pdf_inputs=False,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            structured_output=False,
        )

    # ------------------------------------------------------------- identity
    @property
    def model_name(self) -> str:
        """The engine's model name, e.g. ``"SmolLM2-135M-Instruct"``."""
        return self._ensure_engine().model_name

    @property
    def last_result(self) -> GenerationResult | None:
        """The engine's ``GenerationResult`` of the latest call (first-token logits too).

        With concurrent calls on one instance it is whichever finished last.
        """
        return self._last_result

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "strategy": self.strategy,
            "strategy_options": dict(self.strategy_options),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        override = kwargs.get("model")
        params = LangSmithParams(
            ls_provider="kvrag",
            ls_model_name=override if isinstance(override, str) else self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ------------------------------------------------------------- requests
    def engine_for(self, model: str | None = None) -> RAGEngine:
        """This model's engine, or the shared engine of ``model`` (a per-call override)."""
        if model is None or model == self.model:
            return self._ensure_engine()
        return KVRAGEngine.shared(model, device=self.device, dtype=self.dtype)

    def engine_request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None = None, **kwargs: Any
    ) -> tuple[RAGEngine, dict[str, Any]]:
        """The engine and the ``engine.stream`` arguments of one call.

        A per-call ``strategy`` other than this model's does not inherit its
        ``strategy_options``. ``engine.prefill(messages=..., known_chunks=...,
        strategy=...)`` with the returned values builds the same prompt cache.
        """
        kwargs = dict(kwargs)
        kwargs.pop("stream", None)
        if kwargs.pop("n", 1) != 1:
            raise UnsupportedInputError(
                "ChatKVRAG returns one completion per call (n > 1 is not supported); "
                "call it once per completion (with different seeds when sampling)"
            )
        engine = self.engine_for(kwargs.pop("model", None))
        documents = kwargs.pop("documents", None)
        for name, arg in _SAMPLING.items():  # LangChain's names to the engine's
            value = kwargs.pop(name, None)
            if value is not None:  # None (or absent): this model's own setting
                kwargs.setdefault(arg, value)  # the engine's name, if given too, wins
        if stop is not None:
            kwargs["stop"] = stop
        prompt = {name: kwargs.pop(name) for name in PROMPT_ARGS if name in kwargs}
        # What is left (strategy, strategy_options, on_miss, strategy options as
        # keywords) is under the engine's names already.
        options = self._request_defaults().merged(kwargs)  # bad values fail here
        eng_messages, known = to_engine_messages(messages, engine, documents)
        request = {"messages": eng_messages, "known_chunks": known, **prompt}
        return engine, {**request, **options.as_kwargs()}

    def _request_defaults(self) -> RequestOptions:
        """This model's settings over the engine's defaults (checked)."""
        settings = {arg: getattr(self, name) for name, arg in _SAMPLING.items()}
        settings.update(strategy=self.strategy, strategy_options=self.strategy_options)
        return RequestOptions().merged({**settings, "stop": self.stop})

    def _chunks(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[ChatGenerationChunk]:
        """Stream one call: text pieces, then an empty last chunk with usage and metadata."""
        engine, request = self.engine_request(messages, stop, **kwargs)
        with engine.stream(**request) as stream:  # stopped early: decoding stops
            for piece in stream:
                yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        yield self._last_chunk(engine, stream.result)

    async def _achunks(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> AsyncIterator[ChatGenerationChunk]:
        """``_chunks`` over the engine's ``astream`` (the event loop never blocks)."""
        engine, request = self.engine_request(messages, stop, **kwargs)
        async with engine.astream(**request) as stream:
            async for piece in stream:
                yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        yield self._last_chunk(engine, stream.result)

    def _last_chunk(self, engine: RAGEngine, result: GenerationResult) -> ChatGenerationChunk:
        """The empty last chunk, with usage and metadata."""
        self._last_result = result
        last = AIMessageChunk(
            content="",
            tool_call_chunks=tool_call_chunks(result),
            usage_metadata=_usage(result),
            response_metadata=_metadata(engine, result),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=last)

    # ------------------------------------------------------------- LangChain
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        engine, request = self.engine_request(messages, stop, **kwargs)
        result = engine.generate(**request)
        self._last_result = result
        message = AIMessage(
            content=result.text,
            tool_calls=tool_calls(result),
            invalid_tool_calls=invalid_tool_calls(result),
            usage_metadata=_usage(result),
            response_metadata=_metadata(engine, result),
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # LangChain reports each chunk to the callbacks itself (on_llm_new_token).
        yield from self._chunks(messages, stop, kwargs)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(messages, stop, kwargs):
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = [c async for c in self._astream(messages, stop, None, **kwargs)]
        return generate_from_stream(iter(chunks))


def _usage(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=result.prompt_tokens,
        output_tokens=result.generated_tokens,
        total_tokens=result.prompt_tokens + result.generated_tokens,
        input_token_details=InputTokenDetails(cache_read=result.reused_tokens),
    )


def _metadata(engine: RAGEngine, result: GenerationResult) -> dict[str, Any]:
    return {"model_name": engine.model_name, **result.stats}
