"""Both engines offer the adapters the same interface (``engine.protocol.RAGEngine``):
the same methods and signatures, one front door (``EngineFrontend``), and every
option of ``generate`` / ``stream`` / ``astream`` taken or refused alike,
``logprobs`` included."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from corpus import SEARCH_TOOL, TOWER
from corpus import TOWER_QUESTION as QUESTION

from kvrag_integrations import (
    Chunk,
    ContextWindowExceededError,
    KVRAGEngine,
    Text,
    UnknownStrategyError,
    UnsupportedInputError,
)
from kvrag_integrations.engine.frontend import EngineFrontend
from kvrag_integrations.engine.modeling.sampling import SAMPLING_ARGS
from kvrag_integrations.engine.prompting.prompts import PROMPT_ARGS
from kvrag_integrations.engine.protocol import ENGINE_MEMBERS, RAGEngine, check_engine
from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine


def _parameters(cls: type, name: str) -> list[tuple[str, object]] | None:
    member = inspect.getattr_static(cls, name)
    if isinstance(member, property):
        return None
    target = getattr(cls, name)
    params = list(inspect.signature(target).parameters.values())
    return [(p.name, p.kind) for p in params]


@pytest.mark.parametrize("engine_class", [KVRAGEngine, VLLMEngine])
@pytest.mark.parametrize("name", ENGINE_MEMBERS)
def test_every_engine_implements_the_protocol_alike(engine_class: type, name: str) -> None:
    assert inspect.getattr_static(engine_class, name, None) is not None, name
    want = _parameters(RAGEngine, name)
    assert _parameters(engine_class, name) == want


def test_the_members_are_what_the_adapters_use() -> None:
    assert set(ENGINE_MEMBERS) == {
        "model_name",
        "context_window",
        "fingerprint",
        "chunk_index",
        "encode_chunks",
        "prefetch",
        "use_strategy",
        "generate",
        "stream",
        "astream",
    }


def test_a_non_engine_is_refused_by_name(engine: KVRAGEngine) -> None:
    assert check_engine(engine) is engine
    with pytest.raises(TypeError, match="must be a KVRAGEngine or VLLMEngine"):
        check_engine("SmolLM2-135M-Instruct")


def test_the_adapters_refuse_a_non_engine() -> None:
    from kvrag_integrations.langchain import ChatKVRAG
    from kvrag_integrations.llama_index import KVRAGLLM, KVCacheTransform

    for build in (lambda: KVRAGLLM(object()), lambda: KVCacheTransform(object())):
        with pytest.raises(TypeError, match="RAGEngine"):
            build()
    with pytest.raises(Exception, match="RAGEngine"):
        ChatKVRAG(engine=object())


# ---------------------------------------------------------------- every method
# Public members beyond the protocol: the shared front door (inherited as is),
# the hooks each engine supplies, and each engine's own, named here so that a
# new public method is placed deliberately (and added to both, or the protocol).
FRONT_DOOR = {
    "astream",
    "build_segments",
    "check_fits",
    "chunk_index",
    "generate",
    "open_request",
    "prepare",
    "stream",
    "strategy_for",
    "tokenize",
}
HOOKS = {"blend_options", "check_options", "context_window", "forced_lead", "request_job"}
BOTH = {"from_pretrained", "wait_for_encoding"}
SCORING = {"scoring_fingerprint", "encode_documents", "score_documents"}  # DocumentScorer
OWN = {
    KVRAGEngine: {
        "cache_precision",
        "calibrations",
        "chunk_key",
        "default_class",
        "device",
        "dtype",
        "entry_contexts",
        "eos_token_ids",
        "exclusive",
        "prefill",
        "prefix_store",
        "queue_deferred",
        "shared",
        "store",
    },
    VLLMEngine: {"close", "connect", "encode_in_background", "tenant"},  # (tenant: deprecated)
}


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("engine_class", [KVRAGEngine, VLLMEngine])
def test_every_public_member_is_placed(engine_class: type) -> None:
    placed = set(ENGINE_MEMBERS) | FRONT_DOOR | HOOKS | BOTH | SCORING | OWN[engine_class]
    assert _public(engine_class) == placed


@pytest.mark.parametrize("engine_class", [KVRAGEngine, VLLMEngine])
@pytest.mark.parametrize("name", sorted(SCORING))
def test_every_engine_scores_documents_alike(engine_class: type, name: str) -> None:
    from kvrag_integrations.engine.protocol import DocumentScorer

    assert _parameters(engine_class, name) == _parameters(DocumentScorer, name)


@pytest.mark.parametrize("engine_class", [KVRAGEngine, VLLMEngine])
@pytest.mark.parametrize("name", sorted(FRONT_DOOR))
def test_the_front_door_is_one_for_both(engine_class: type, name: str) -> None:
    """Neither engine overrides what the frontend does for both."""
    assert inspect.getattr_static(engine_class, name) is inspect.getattr_static(
        EngineFrontend, name
    )


def test_both_wait_for_encoding_alike() -> None:
    assert _parameters(KVRAGEngine, "wait_for_encoding") == _parameters(
        VLLMEngine, "wait_for_encoding"
    )
    for cls in (KVRAGEngine, VLLMEngine):
        params = inspect.signature(cls.__init__).parameters
        assert params["max_pending"].default == 256, cls


# ---------------------------------------------------------------- every option
class _Backend:
    """A vLLM stand-in: one event per request (the first token and its logprobs)."""

    model_name = "tiny"

    def __init__(self, context_window: int) -> None:
        self.context_window = context_window
        self.requests: list[BackendRequest] = []

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        self.requests.append(request)
        logprobs = {7: -0.25, 9: -1.5} if request.logprobs else None
        yield BackendEvent("x", [7], 0, "length", None, logprobs)

    def close(self) -> None:
        pass


@pytest.fixture
def engines(engine: KVRAGEngine) -> dict[str, object]:
    """The in-process engine and a VLLMEngine on the same tokenizer (a stand-in vLLM)."""
    vllm = VLLMEngine(_Backend(engine.context_window), engine.tokenizer)
    return {"KVRAGEngine": engine, "VLLMEngine": vllm}


OK = None
# (call keywords, what both engines do: OK, or the error both raise; or per engine)
OPTION_CASES: list[tuple[dict[str, Any], Any]] = [
    ({}, OK),
    ({"strategy": "full"}, OK),
    ({"strategy": "turbo"}, OK),
    ({"strategy": "nope"}, UnknownStrategyError),
    ({"strategy": "blend"}, OK),
    ({"strategy": "blend", "recompute_ratio": 0.3, "selection": "query"}, OK),
    (
        {"strategy": "blend", "check_layer": 2},
        {"KVRAGEngine": OK, "VLLMEngine": UnsupportedInputError},
    ),
    ({"strategy": "blend", "recompute_ratio": 2.0}, ValueError),
    (
        {"strategy_options": {"positions": "composite"}},
        {"KVRAGEngine": OK, "VLLMEngine": UnsupportedInputError},
    ),
    ({"positions": "composite"}, {"KVRAGEngine": OK, "VLLMEngine": UnsupportedInputError}),
    ({"no_such_option": 1}, TypeError),
    ({"strategy_options": "composite"}, TypeError),
    ({"max_new_tokens": 4}, OK),
    ({"max_new_tokens": -1}, ValueError),
    ({"max_new_tokens": 10**6}, ContextWindowExceededError),
    ({"temperature": 0.7, "seed": 3}, OK),
    ({"temperature": -1.0}, ValueError),
    ({"top_p": 0.9, "top_k": 5}, OK),
    ({"top_p": 0.0}, ValueError),
    ({"top_k": 2.5}, TypeError),
    ({"repetition_penalty": 1.1}, OK),
    ({"repetition_penalty": 0.0}, ValueError),
    ({"seed": "x"}, TypeError),
    ({"stop": ["\n"], "stop_token_ids": [5]}, OK),
    ({"on_miss": "defer"}, OK),
    ({"on_miss": "encode"}, OK),
    ({"on_miss": "auto"}, OK),
    ({"on_miss": "never"}, ValueError),
    ({"logprobs": 3}, OK),
    ({"logprobs": 0}, ValueError),
    ({"logprobs": 1.5}, TypeError),
    ({"logprobs": True}, TypeError),
    ({"system_prompt": "Be brief."}, OK),
    ({"chat_template": False}, OK),
    ({"question": None, "chunks": None, "segments": [Chunk(TOWER), Text("When?")]}, OK),
    ({"question": None, "chunks": None, "messages": [{"role": "user", "content": TOWER}]}, OK),
    (
        {
            "question": None,
            "chunks": None,
            "messages": [{"role": "user", "content": f"{TOWER} When?"}],
            "known_chunks": [TOWER],
        },
        OK,
    ),
    ({"question": None, "chunks": None}, ValueError),
    ({"chunks": TOWER}, TypeError),
    ({"tools": [SEARCH_TOOL]}, OK),
    ({"tools": [SEARCH_TOOL], "tool_choice": "required"}, OK),
    ({"tools": [SEARCH_TOOL], "tool_choice": "search"}, OK),
    (
        {
            "tools": [SEARCH_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "search"}},
        },
        OK,
    ),
    ({"tools": [SEARCH_TOOL], "tool_choice": "none"}, OK),
    ({"tools": [SEARCH_TOOL], "tool_choice": "other"}, ValueError),
    ({"tool_choice": "required"}, ValueError),
    ({"tools": SEARCH_TOOL}, TypeError),
    ({"tools": [{"type": "function", "function": {}}]}, ValueError),
    ({"tools": [SEARCH_TOOL], "tool_choice": 3}, TypeError),
    ({"tools": [SEARCH_TOOL], "parallel_tool_calls": False}, OK),
    ({"tools": [SEARCH_TOOL], "parallel_tool_calls": "no"}, TypeError),
    ({"min_new_tokens": 2}, OK),
    ({"min_new_tokens": -1}, ValueError),
    ({"min_new_tokens": 1.5}, TypeError),
]


def test_the_cases_cover_every_option() -> None:
    named = {name for kwargs, _ in OPTION_CASES for name in kwargs}
    options = {"strategy", "strategy_options", "on_miss", "logprobs", "tools", "tool_choice"}
    options.add("parallel_tool_calls")
    assert named >= options | set(SAMPLING_ARGS) | set(PROMPT_ARGS)


@pytest.mark.parametrize(("kwargs", "expected"), OPTION_CASES)
def test_both_engines_take_or_refuse_every_option_alike(
    engines: dict[str, Any], kwargs: dict[str, Any], expected: Any
) -> None:
    """Checked at the call (``open_request``: nothing runs), the same way on both:
    accepted, or refused with the same error; what one engine cannot run is an
    ``UnsupportedInputError`` (``engine.protocol.RAGEngine``)."""
    call = {"question": QUESTION, "chunks": [TOWER], **kwargs}
    question, chunks = call.pop("question"), call.pop("chunks")
    for name, eng in engines.items():
        want = expected[name] if isinstance(expected, dict) else expected
        if want is OK:
            _, result = eng.open_request(question, chunks, call)
            assert result.text == "", name
        else:
            with pytest.raises(want):
                eng.open_request(question, chunks, call)


def test_a_vllm_that_cannot_blend_refuses_it_at_the_call(engine: KVRAGEngine) -> None:
    backend = _Backend(engine.context_window)
    backend.blend_refused = "GPT2LMHeadModel layer 0 uses ALiBi"
    vllm = VLLMEngine(backend, engine.tokenizer)
    with pytest.raises(UnsupportedInputError, match="ALiBi"):
        vllm.open_request(QUESTION, [TOWER], {"strategy": "blend"})
    vllm.open_request(QUESTION, [TOWER], {"strategy": "turbo"})  # turbo still runs


# ---------------------------------------------------------------- logprobs
@torch.no_grad()
def test_kvrag_logprobs_are_a_log_softmax_of_the_models_own_forward(
    engine: KVRAGEngine,
) -> None:
    """``logprobs=k``: the first token's top-k log-probabilities, as VLLMEngine
    reports them (``{token id: logprob}``), from transformers' own forward."""
    kw = {"question": QUESTION, "chunks": [TOWER]}
    result = engine.generate(**kw, strategy="full", max_new_tokens=2, logprobs=5)
    prompt = engine.tokenize(engine.build_segments(**kw))
    logits = engine.model(prompt.input_ids[None].to(engine.device)).logits[0, -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    values, ids = reference.topk(5)
    got = result.first_token_logprobs
    assert got is not None and list(got) == ids.tolist()  # greedy: its token is the top 1
    assert torch.allclose(torch.tensor(list(got.values())), values, atol=1e-4)
    assert result.token_ids[0] == ids[0]

    # Any strategy: the log-softmax of the logits it decoded from.
    turbo = engine.generate(**kw, strategy="turbo", max_new_tokens=1, logprobs=3)
    own = torch.log_softmax(turbo.first_token_logits.float(), dim=-1)
    assert turbo.first_token_logprobs is not None and len(turbo.first_token_logprobs) == 3
    for token, logprob in turbo.first_token_logprobs.items():
        assert logprob == pytest.approx(float(own[token]), abs=1e-5)
    assert engine.generate(**kw, max_new_tokens=1).first_token_logprobs is None


def test_kvrag_logprobs_hold_the_sampled_token_as_vllm_does(engine: KVRAGEngine) -> None:
    kw = {"question": QUESTION, "chunks": [TOWER], "max_new_tokens": 1, "logprobs": 1}
    for seed in range(4):
        result = engine.generate(**kw, temperature=2.0, seed=seed)
        own = torch.log_softmax(result.first_token_logits.float(), dim=-1)
        got = result.first_token_logprobs
        assert got is not None and result.token_ids[0] in got and int(own.argmax()) in got
        assert got[result.token_ids[0]] == pytest.approx(float(own[result.token_ids[0]]))


def test_vllm_logprobs_reach_vllm_and_come_back(engines: dict[str, Any]) -> None:
    vllm = engines["VLLMEngine"]
    result = vllm.generate(QUESTION, [TOWER], strategy="full", max_new_tokens=1, logprobs=2)
    assert vllm.backend.requests[-1].logprobs == 2
    assert result.first_token_logprobs == {7: -0.25, 9: -1.5}
    assert vllm.generate(QUESTION, [TOWER], strategy="full").first_token_logprobs is None
