"""The second request reuses, without waiting for the background worker.

The frameworks' documented RAG patterns over documents the engine has never
seen (an ordinary vector store filled by its own ``add_documents``, a LlamaIndex
index built without ``KVCacheTransform``), with the default engine
(``on_miss="auto"``), the same question twice in a row: the first request may
defer its chunks to the background worker, and the second takes that work over
(or finds it done) and reuses at least half of its prompt. No chunk is encoded
twice, whoever encodes it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from corpus import LCEL_DOCS as DOCS
from corpus import LCEL_QUESTION as QUESTION
from corpus import LCEL_TEMPLATE as TEMPLATE
from corpus import format_docs
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.bench.common import count_encodings
from kvrag_integrations.engine.prompting.spans import MAX_RECENT_CHUNKS, ChunkIndex
from kvrag_integrations.langchain import ChatKVRAG, MiniLMEmbeddings, hooks


@pytest.fixture()
def fresh(engine: KVRAGEngine, monkeypatch: pytest.MonkeyPatch) -> KVRAGEngine:
    """The session's weights, an empty store, the default miss policy, and no
    recently retrieved texts from earlier tests."""
    hooks.install_hooks()
    monkeypatch.setattr(hooks, "_RECENT", ChunkIndex(max_chunks=MAX_RECENT_CHUNKS))
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    assert e.on_miss == "auto"
    return e


# ------------------------------------------------------------------- LangChain


@pytest.mark.parametrize("call", ["invoke", "stream"])
def test_lcel_twice_in_a_row_reuses_on_the_second(fresh: KVRAGEngine, call: str) -> None:
    """LangChain's LCEL RAG chain over an InMemoryVectorStore filled by its own
    add_documents, only the model swapped: the second response reads at least
    half of its input tokens from cache (usage_metadata), without waiting."""
    counts = count_encodings(fresh)
    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    vector_store.add_documents([Document(page_content=t) for t in DOCS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    llm = ChatKVRAG(engine=fresh, max_tokens=8)
    prompt = ChatPromptTemplate.from_template(TEMPLATE)
    rag = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt
    chain = rag | llm
    usages = []
    for _ in range(2):
        if call == "invoke":
            message = chain.invoke(QUESTION)
        else:
            message = None
            for piece in chain.stream(QUESTION):
                message = piece if message is None else message + piece
        usages.append((message.usage_metadata, llm.last_result))
    (first, _), (second, r2) = usages
    assert first["input_tokens"] == second["input_tokens"] > 0
    assert second["input_token_details"]["cache_read"] >= 0.5 * second["input_tokens"]
    assert r2.fallback is None and r2.reused_chunk_tokens > 0
    # The first deferred (or encoded); the second took over, waited, or read.
    chunks = r2.reused_chunks + r2.awaited_chunks + r2.taken_over_chunks + r2.encoded_chunks
    assert chunks == 2 and r2.encoded_chunks == 0
    assert max(counts.values()) == 1  # no chunk (or leading text) encoded twice
    assert (chain | StrOutputParser()).invoke(QUESTION)  # a third, reading them all
    assert llm.last_result.reused_chunks == 2 and max(counts.values()) == 1


# ------------------------------------------------------------------ LlamaIndex
CAPITALS = {
    "australia.txt": "Canberra is the capital city of Australia. It was chosen in 1908 as a "
    "compromise between Sydney and Melbourne, and Parliament first met there in 1927.",
    "canada.txt": "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario, "
    "across from Gatineau, and was chosen by Queen Victoria in 1857.",
    "new_zealand.txt": "Wellington is the capital of New Zealand, at the southern tip of the "
    "North Island; it replaced Auckland as the capital in 1865.",
}
CAPITAL_QUESTION = "What is the capital of Australia?"


def rag_workflow(llm: Any, streaming: bool) -> Any:
    """LlamaIndex's documented RAG workflow: a retrieve step, then a synthesize
    step with CompactAndRefine (the rerank step of the example left out)."""
    from llama_index.core.response_synthesizers import CompactAndRefine
    from llama_index.core.schema import NodeWithScore
    from llama_index.core.workflow import Context, Event, StartEvent, StopEvent, Workflow, step

    class RetrieverEvent(Event):
        """Result of running retrieval"""

        nodes: list[NodeWithScore]

    class RAGWorkflow(Workflow):
        @step
        async def retrieve(self, ctx: Context, ev: StartEvent) -> RetrieverEvent | None:
            query = ev.get("query")
            index = ev.get("index")
            if not query or index is None:
                return None
            await ctx.store.set("query", query)
            retriever = index.as_retriever(similarity_top_k=2)
            nodes = await retriever.aretrieve(query)
            return RetrieverEvent(nodes=nodes)

        @step
        async def synthesize(self, ctx: Context, ev: RetrieverEvent) -> StopEvent:
            summarizer = CompactAndRefine(llm=llm, streaming=streaming, verbose=True)
            query = await ctx.store.get("query", default=None)
            response = await summarizer.asynthesize(query, nodes=ev.nodes)
            return StopEvent(result=response)

    return RAGWorkflow()


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "not-streamed"])
def test_llama_index_workflow_twice_in_a_row_reuses_on_the_second(
    fresh: KVRAGEngine, streaming: bool
) -> None:
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex

    from kvrag_integrations.llama_index import KVRAGLLM, MiniLMEmbedding

    counts = count_encodings(fresh)
    documents = [LIDocument(text=t, metadata={"file": n}) for n, t in CAPITALS.items()]
    index = VectorStoreIndex.from_documents(documents, embed_model=MiniLMEmbedding())
    llm = KVRAGLLM(fresh, max_new_tokens=8)

    async def main() -> list[dict[str, Any]]:
        w = rag_workflow(llm, streaming)
        turns = []
        for _ in range(2):  # no waiting in between
            result = await w.run(query=CAPITAL_QUESTION, index=index)
            if streaming:
                text = "".join([chunk async for chunk in result.async_response_gen()])
            else:
                text = str(result)
            turns.append({"text": text, **llm.last_stats})
        return turns

    first, second = asyncio.run(main())
    assert first["prompt_tokens"] == second["prompt_tokens"]
    assert second["fallback"] is None and second["strategy"] == "turbo"
    assert second["reused_tokens"] >= 0.5 * second["prompt_tokens"], second
    assert second["encoded_chunks"] == 0 and second["deferred_chunks"] == 0
    assert max(counts.values()) == 1
