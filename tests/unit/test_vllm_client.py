"""VLLMEngine's client side without vLLM: the server's events and the result's accounting.

``remote._sse_event`` reads what vLLM's OpenAI server streams (text, token
ids, the first token's log-probabilities, the usage's cached-token count);
``turbo.account`` turns vLLM's count of cached prompt tokens into the result's
accounting and says which stored pieces vLLM had to compute.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt, cache_leading_text
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.client.remote import _sse_event
from kvrag_integrations.vllm.client.reuse import account, load_run
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine


def sse(payload: object) -> str:
    return "data: " + json.dumps(payload)


def test_an_event_carries_text_ids_and_the_first_tokens_logprobs() -> None:
    line = sse(
        {
            "choices": [
                {
                    "text": " Paris",
                    "token_ids": [7042],
                    "finish_reason": None,
                    "logprobs": {"top_logprobs": [{"token_id:7042": -0.25, "token_id:11": -2.0}]},
                }
            ]
        }
    )
    event = _sse_event(line, first=True)
    assert (event.text, event.token_ids, event.finish_reason) == (" Paris", [7042], None)
    assert event.logprobs == {7042: -0.25, 11: -2.0}
    assert _sse_event(line, first=False).logprobs is None  # only the first token's


def test_the_last_event_carries_the_usage_and_the_finish() -> None:
    usage = {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 288}}
    event = _sse_event(sse({"choices": [], "usage": usage}), first=False)
    assert event.cached_tokens == 288 and event.token_ids == []
    done = _sse_event(sse({"choices": [{"text": "", "finish_reason": "stop"}]}), first=False)
    assert done.finish_reason == "stop"


@pytest.mark.parametrize("line", ["data: [DONE]", ": keep-alive", "", "event: ping"])
def test_lines_that_are_not_events_are_skipped(line: str) -> None:
    assert _sse_event(line, first=True) is None


class _Silent:
    """A backend that is never called: the tests below only build prompts."""

    model_name = "tiny"

    def __init__(self, context_window: int) -> None:
        self.context_window = context_window

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        raise AssertionError("no request is sent")

    def close(self) -> None:
        return None


@pytest.fixture()
def turbo_prompt(engine: KVRAGEngine) -> tuple[VLLMEngine, TokenizedPrompt]:
    vllm = VLLMEngine(_Silent(engine.context_window), engine.tokenizer)
    chunks = ["Ada Lovelace wrote the first program.", "Charles Babbage designed the engine."]
    segments = vllm.build_segments(question="Who wrote the first program?", chunks=chunks)
    return vllm, cache_leading_text(vllm.tokenize(segments))


def test_every_stored_piece_counted(turbo_prompt: tuple[VLLMEngine, TokenizedPrompt]) -> None:
    vllm, prompt = turbo_prompt
    run = load_run(vllm.prompts, prompt)
    assert [p.kind for p in prompt.cached_pieces] == ["prefix", "chunk", "chunk"]
    result = GenerationResult(strategy="turbo")
    assert account(result, prompt, run, run[-1].end, "auto") == []
    assert result.reused_chunks == 2 and result.fallback is None
    assert result.reused_prefix_tokens == run[0].rows
    assert result.reused_tokens + result.prefilled_tokens == prompt.num_tokens


def test_pieces_vllm_computed_are_named_for_the_background(
    turbo_prompt: tuple[VLLMEngine, TokenizedPrompt],
) -> None:
    vllm, prompt = turbo_prompt
    run = load_run(vllm.prompts, prompt)
    result = GenerationResult(strategy="turbo")
    missing = account(result, prompt, run, run[1].end, "auto")  # the last chunk not stored
    assert missing == [run[2]]
    assert result.reused_chunks == 1 and result.fallback == "uncached"
    assert "1 piece(s) not stored" in result.miss_reason
    exact = GenerationResult(strategy="full")
    assert account(exact, prompt, (), 0, "auto") == []
    assert exact.reused_tokens == 0 and "reads no chunk caches" in exact.miss_reason
