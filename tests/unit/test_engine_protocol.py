"""Both engines offer the adapters the same interface (``engine.protocol.RAGEngine``)."""

from __future__ import annotations

import inspect

import pytest

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.engine.protocol import ENGINE_MEMBERS, RAGEngine, check_engine
from kvrag_integrations.vllm.engine import VLLMEngine


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
