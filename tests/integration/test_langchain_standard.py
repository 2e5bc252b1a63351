"""LangChain's own integration suites on the real default model and a real chromadb.

Their unit suites (construction, standard params, no weights) run on the tiny
model in tests/unit/test_langchain_standard_unit.py.

Features the model does not have (structured output, JSON mode,
image/audio/PDF/video inputs) are off through the suites' property flags;
tool calling is on (forced choices make even the 135M model's calls valid).
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import chromadb
import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_suites import ChatKVRAGFlags
from langchain_tests.integration_tests import (
    ChatModelIntegrationTests,
    EmbeddingsIntegrationTests,
    RetrieversIntegrationTests,
)

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.langchain import (
    ChatKVRAG,
    KVRAGRetriever,
    MiniLMEmbeddings,
    add_documents,
)

pytestmark = pytest.mark.anyio  # the suites' async tests run on asyncio

CHAT_PARAMS = {"max_tokens": 24}  # short answers keep the integration suite quick
SEED_DOCS = [
    "Paris is the capital and largest city of France.",
    "Canberra is the capital city of Australia.",
    "The Nile is a major river in northeastern Africa.",
    "Mount Everest is the highest mountain above sea level.",
    "Python is a programming language created by Guido van Rossum.",
]
CACHED_DOC = "The Eiffel Tower in Paris was completed in 1889 for the World's Fair."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@functools.lru_cache(maxsize=1)
def seeded_collection() -> Any:
    """A chromadb EphemeralClient collection with a few short documents (once per run)."""
    client = chromadb.EphemeralClient()
    collection = client.create_collection(
        f"kvrag-std-{uuid.uuid4().hex[:8]}", embedding_function=None
    )
    add_documents(collection, SEED_DOCS, KVRAGEngine.shared(), show_progress=False)
    return collection


class _ChatParams(ChatKVRAGFlags):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return dict(CHAT_PARAMS)

    @property
    def model_override_value(self) -> str:
        # The same weights under another name: the default model's local folder.
        return str(KVRAGEngine.shared().model.name_or_path)


class TestChatKVRAGIntegration(_ChatParams, ChatModelIntegrationTests):
    # LangChain's documented way to mark a standard test the model cannot pass:
    # override it, mark it, call super().
    @pytest.mark.xfail(
        reason="tool_choice 'auto': the bundled SmolLM2-135M answers in text instead of "
        "calling get_weather (a limit of the 135M model, not of bind_tools; forced "
        "choices are tested in test_tool_choice and the unit tier)",
        strict=False,
    )
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="the forced call parses, but the bundled SmolLM2-135M writes an English "
        "argument ('Hello Group') where the test asks it to copy Chinese text",
        strict=False,
    )
    def test_unicode_tool_call_integration(
        self,
        model: BaseChatModel,
        *,
        tool_choice: str | None = None,
        force_tool_call: bool = True,
    ) -> None:
        super().test_unicode_tool_call_integration(
            model, tool_choice=tool_choice, force_tool_call=force_tool_call
        )

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVRAG(**self.chat_model_params)
        assert llm.engine is not None
        llm.engine.encode_chunks([CACHED_DOC], show_progress=False)
        messages = [HumanMessage(f"{CACHED_DOC}\n\nWhen was the Eiffel Tower completed?")]
        if not stream:
            return llm.invoke(messages)
        full: Any = None
        for chunk in llm.stream(messages):
            full = chunk if full is None else full + chunk
        return full


class TestKVRAGRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[KVRAGRetriever]:
        return KVRAGRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"collection": seeded_collection(), "engine": KVRAGEngine.shared(), "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "What is the capital of France?"


class TestMiniLMEmbeddingsIntegration(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[MiniLMEmbeddings]:
        return MiniLMEmbeddings
