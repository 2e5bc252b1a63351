"""What ``VLLMEngine`` asks of a vLLM, wherever it runs: one request in, its events out.

Two backends implement ``Backend``: ``local.LocalBackend`` (vLLM's ``AsyncLLM``
in this process, on a thread of its own) and ``remote.ServerBackend`` (a
running vLLM OpenAI server, over HTTP). The engine builds every request the
same way for both: prompt token ids (its own tokenization), vLLM's sampling
arguments, the turbo salt and the connector's params.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrag_integrations.engine.modeling.sampling import SamplingParams
from kvrag_integrations.vllm.reply import Reply


@dataclass(frozen=True)
class BackendRequest:
    """One request as vLLM takes it.

    Attributes:
        prompt_ids: the prompt's token ids (the engine tokenized it).
        sampling: vLLM's sampling arguments (``sampling_args``).
        salt: the request's ``cache_salt`` (None: none; exact requests).
        params: its ``kv_transfer_params`` (None: none).
        logprobs: the top log-probabilities to return per token (None: none).
        stream: answer as it is generated; False answers whole (chunk encoding:
            over HTTP only a whole answer carries the connector's reply).
        logprob_token_ids: ids whose log-probabilities to return for the first
            new token (raw: before any sampling processor), besides the sampled one.
        prompt_logprobs: return each prompt token's log-probability (answers
            whole; rows vLLM did not compute, loaded or cached, are meaningless).
        json_schema: the answer must be JSON of this schema (vLLM's structured
            outputs: a forced tool call).
    """

    prompt_ids: list[int]
    sampling: dict[str, Any]
    salt: str | None = None
    params: dict[str, Any] | None = None
    logprobs: int | None = None
    stream: bool = True
    logprob_token_ids: tuple[int, ...] = ()
    prompt_logprobs: bool = False
    json_schema: dict[str, Any] | None = None


@dataclass
class BackendEvent:
    """New output of a request: text and tokens since the last event; on the last
    one, ``finish_reason`` and the connector's ``reply`` (where the backend sees it)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # vLLM's count of prompt tokens not computed
    finish_reason: str | None = None
    reply: Reply | None = None
    logprobs: dict[int, float] | None = None  # of the first new token, when asked
    # Where asked: per prompt position, the log-probability of the prompt's token
    # there (None at 0, and meaningless where vLLM did not compute the row).
    prompt_logprobs: list[float | None] | None = None


class Backend(Protocol):
    """A vLLM that answers ``BackendRequest``s."""

    model_name: str
    context_window: int

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        """Run one request; events until its end. Setting ``cancel`` aborts it."""
        ...

    def close(self) -> None:
        """Release the engine or connection."""
        ...


def sampling_args(params: SamplingParams, eos_token_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` arguments for ours.

    The end-of-answer ids are the in-process engine's (every EOS the generation
    config, config or tokenizer names), passed as stop ids; a request with no
    new tokens is run for one (vLLM always samples one) whose text is dropped.
    """
    return {
        "max_tokens": max(1, params.max_new_tokens),
        "min_tokens": min(params.min_new_tokens, max(1, params.max_new_tokens)),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0: off, as ours
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": sorted({*params.stop_token_ids, *eos_token_ids}),
        "skip_special_tokens": True,
    }
