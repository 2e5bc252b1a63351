"""LangChain's own unit suites: ChatKVRAG around the tiny model, MiniLMEmbeddings unloaded.

As langchain-huggingface keeps them apart: these check construction, standard
parameters and serialization without real weights; the integration suites
(tests/integration/test_langchain_standard.py) generate with the real model.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_suites import ChatKVRAGFlags
from langchain_tests.unit_tests import ChatModelUnitTests, EmbeddingsUnitTests

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.langchain import MiniLMEmbeddings


class TestChatKVRAGUnit(ChatKVRAGFlags, ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _tiny_engine(self, engine: KVRAGEngine) -> None:
        self.tiny = engine  # the unit tier's tiny model: no weights are loaded

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": self.tiny}  # the unit suite passes max_tokens and stop itself


class TestMiniLMEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[MiniLMEmbeddings]:
        return MiniLMEmbeddings
