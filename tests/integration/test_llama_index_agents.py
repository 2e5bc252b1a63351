"""LlamaIndex's function agents on KVRAGLLM, as LlamaIndex's docs write them: a
``FunctionAgent`` with a ``QueryEngineTool`` over a ``VectorStoreIndex``, and a
retriever tool whose nodes come back in the tool output and are reused."""

from __future__ import annotations

import asyncio

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.tools import QueryEngineTool, RetrieverTool

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.llama_index import KVRAGLLM, KVCacheTransform, MiniLMEmbedding

TEXTS = [
    "Canberra is the capital of Australia. It was purpose-built as a compromise "
    "between Sydney and Melbourne, and Parliament first met there in 1927.",
    "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario.",
]
QUESTION = "What is the capital of Australia?"


def _index(engine: KVRAGEngine) -> VectorStoreIndex:
    docs = [Document(text=t) for t in TEXTS]
    return VectorStoreIndex.from_documents(
        docs, embed_model=MiniLMEmbedding(), transformations=[KVCacheTransform(engine)]
    )


async def _run(agent: FunctionAgent) -> tuple[str, list[ToolCallResult]]:
    handler = agent.run(QUESTION)
    calls = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
    return str(await handler), calls


def test_a_function_agent_with_a_query_engine_tool_runs(engine: KVRAGEngine) -> None:
    fresh = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    llm = KVRAGLLM(fresh, max_new_tokens=24)
    assert llm.metadata.is_function_calling_model
    query_engine = _index(fresh).as_query_engine(llm=llm, similarity_top_k=2)
    tool = QueryEngineTool.from_defaults(
        query_engine, name="capitals", description="Answers questions about capitals."
    )
    agent = FunctionAgent(
        tools=[tool], llm=llm, system_prompt="Use the tool.", initial_tool_choice="capitals"
    )
    answer, calls = asyncio.run(_run(agent))
    assert [c.tool_name for c in calls] == ["capitals"]
    assert isinstance(calls[0].tool_kwargs.get("input"), str)
    assert isinstance(answer, str)


def test_the_retrieved_nodes_in_a_tool_output_are_reused(engine: KVRAGEngine) -> None:
    fresh = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    llm = KVRAGLLM(fresh, max_new_tokens=8)
    retriever = _index(fresh).as_retriever(similarity_top_k=2)
    tool = RetrieverTool.from_defaults(retriever, name="search", description="Finds passages.")
    agent = FunctionAgent(
        tools=[tool], llm=llm, system_prompt="Use the tool.", initial_tool_choice="search"
    )
    _, calls = asyncio.run(_run(agent))
    assert [c.tool_name for c in calls] == ["search"]
    stats = llm.last_stats  # the call after the tool: its output holds the nodes
    tok = fresh.tokenizer
    node_tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS)
    assert stats["fallback"] is None
    assert stats["reused_chunk_tokens"] >= 0.8 * node_tokens
