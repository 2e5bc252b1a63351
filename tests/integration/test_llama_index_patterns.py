"""LlamaIndex's documented patterns with only the LLM swapped, on uncached chunks.

Each runs twice on an engine that has never seen the documents (the index is built
without ``KVCacheTransform``, as the documentation builds it): the first request is
answered by plain prefill while its chunks are encoded in the background, the second
reads most of its chunk tokens from cache, with the same first-token logits as the
engine's own prefill of that prompt.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_index.core import Document, SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.response_synthesizers import CompactAndRefine
from llama_index.core.schema import NodeWithScore
from llama_index.core.workflow import (
    Context,
    Event,
    StartEvent,
    StopEvent,
    Workflow,
    step,
)

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.llama_index import KVRAGLLM, KVRerankPostprocessor, MiniLMEmbedding
from kvrag_integrations.rerank import KVReranker

DOCS = {
    "australia.txt": "Canberra is the capital city of Australia. It was chosen in 1908 as a "
    "compromise between Sydney and Melbourne, and Parliament first met there in 1927.",
    "canada.txt": "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario, "
    "across from Gatineau, and was chosen by Queen Victoria in 1857.",
    "new_zealand.txt": "Wellington is the capital of New Zealand, at the southern tip of the "
    "North Island; it replaced Auckland as the capital in 1865.",
}
QUESTION = "What is the capital of Australia?"


@pytest.fixture()
def cold(engine: KVRAGEngine) -> KVRAGEngine:
    """Deferred misses on an empty store (what the default "auto" does on CPU until
    its measured costs say encoding is cheaper; the second request without
    waiting: test_second_request_frameworks.py)."""
    return KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="defer")


def chunk_tokens_in_prompt(llm: KVRAGLLM) -> int:
    """Tokens of the noted chunk texts that occur verbatim in the last prompt."""
    prompt = "\n".join(m["content"] for m in llm.last_messages)
    texts = [t for t in llm.last_known_chunks if t in prompt]
    texts = [t for t in texts if not any(t != o and t in o for o in texts)]
    tok = llm.engine.tokenizer
    return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)


def assert_reused_exactly(llm: KVRAGLLM) -> None:
    """Most chunk tokens came from cache, and the logits are the engine's own.

    CacheBlend computes again the calibrated share of the cached tokens it found
    (40% on the bundled SmolLM2 choice): those were hits too."""
    stats = llm.last_stats
    assert stats["fallback"] is None and stats["deferred_chunks"] == 0
    in_prompt = chunk_tokens_in_prompt(llm)
    found = stats["reused_chunk_tokens"] + stats["recomputed_tokens"]
    assert in_prompt > 0 and found >= 0.8 * in_prompt
    assert stats["reused_chunk_tokens"] >= 0.5 * in_prompt
    assert stats["reused_tokens"] == stats["reused_chunk_tokens"] + stats["reused_prefix_tokens"]
    same = llm.engine.prefill(
        messages=llm.last_messages,
        known_chunks=llm.last_known_chunks,
        strategy=llm.strategy,
        **llm.strategy_options,
    )
    torch.testing.assert_close(llm.last_result.first_token_logits, same.logits, rtol=0, atol=0)


# ------------------------------------------ "RAG Workflow with Reranking", verbatim
# https://developers.llamaindex.ai/python/examples/workflow/rag (llama-index-core 0.14):
# only OpenAI(...) -> the KVRAGLLM given, OpenAIEmbedding -> MiniLMEmbedding, and a
# switch for the synthesizer's streaming (the documented workflow streams). The rerank
# step's LLMRerank(llm=OpenAI(...)) becomes KVRerankPostprocessor on the same model:
# LLMRerank's "Doc: n, Relevance: m" answer does not parse from the bundled 135M
# model, so it drops every node and the synthesizer never calls the LLM.
class RetrieverEvent(Event):
    """Result of running retrieval"""

    nodes: list[NodeWithScore]


class RerankEvent(Event):
    """Result of running reranking on retrieved nodes"""

    nodes: list[NodeWithScore]


def rag_workflow(llm: KVRAGLLM, streaming: bool = True) -> Workflow:
    class RAGWorkflow(Workflow):
        @step
        async def ingest(self, ctx: Context, ev: StartEvent) -> StopEvent | None:
            """Entry point to ingest a document, triggered by a StartEvent with `dirname`."""
            dirname = ev.get("dirname")
            if not dirname:
                return None

            documents = SimpleDirectoryReader(dirname).load_data()
            index = VectorStoreIndex.from_documents(
                documents=documents,
                embed_model=MiniLMEmbedding(),
            )
            return StopEvent(result=index)

        @step
        async def retrieve(self, ctx: Context, ev: StartEvent) -> RetrieverEvent | None:
            "Entry point for RAG, triggered by a StartEvent with `query`."
            query = ev.get("query")
            index = ev.get("index")

            if not query:
                return None

            print(f"Query the database with: {query}")

            # store the query in the global context
            await ctx.store.set("query", query)

            # get the index from the global context
            if index is None:
                print("Index is empty, load some documents before querying!")
                return None

            retriever = index.as_retriever(similarity_top_k=2)
            nodes = await retriever.aretrieve(query)
            print(f"Retrieved {len(nodes)} nodes.")
            return RetrieverEvent(nodes=nodes)

        @step
        async def rerank(self, ctx: Context, ev: RetrieverEvent) -> RerankEvent:
            # Rerank the nodes
            ranker = KVRerankPostprocessor(KVReranker(llm.engine), top_n=3)
            print(await ctx.store.get("query", default=None), flush=True)
            new_nodes = ranker.postprocess_nodes(
                ev.nodes, query_str=await ctx.store.get("query", default=None)
            )
            print(f"Reranked nodes to {len(new_nodes)}")
            return RerankEvent(nodes=new_nodes)

        @step
        async def synthesize(self, ctx: Context, ev: RerankEvent) -> StopEvent:
            """Return a streaming response using reranked nodes."""
            summarizer = CompactAndRefine(llm=llm, streaming=streaming, verbose=True)
            query = await ctx.store.get("query", default=None)

            response = await summarizer.asynthesize(query, nodes=ev.nodes)
            return StopEvent(result=response)

    return RAGWorkflow()


def write_docs(folder: Path) -> str:
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return str(folder)


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "not-streamed"])
def test_documented_workflow_rag_reuses_from_the_second_turn(cold, tmp_path, streaming) -> None:
    llm = KVRAGLLM(cold, strategy="turbo", max_new_tokens=8)
    dirname = write_docs(tmp_path / "data")

    async def main() -> list[dict[str, Any]]:
        w = rag_workflow(llm, streaming)
        index = await w.run(dirname=dirname)
        turns = []
        for _ in range(2):
            result = await w.run(query=QUESTION, index=index)
            if streaming:
                text = "".join([chunk async for chunk in result.async_response_gen()])
            else:
                text = str(result)
            turns.append({"text": text, **llm.last_stats})
            cold.wait_for_encoding(timeout=120)
        return turns

    first, second = asyncio.run(main())
    assert first["text"] == second["text"] and "Canberra" in second["text"]
    assert llm.last_messages[-1]["content"].count("Canberra is the capital") == 1  # synthesis
    assert first["fallback"] == "uncached" and first["strategy"] == "full"
    assert first["deferred_chunks"] > 0 and first["reused_chunk_tokens"] == 0
    assert second["strategy"] == "turbo"
    assert_reused_exactly(llm)


# ------------------------------------------------- a query engine, every response mode
MODES = ["compact", "refine", "tree_summarize", "simple_summarize", "accumulate",
         "compact_accumulate"]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_query_engine_response_modes_reuse_from_the_second_query(cold, mode) -> None:
    documents = [Document(text=text, metadata={"file": name}) for name, text in DOCS.items()]
    index = VectorStoreIndex.from_documents(documents, embed_model=MiniLMEmbedding())
    llm = KVRAGLLM(cold, strategy="blend", max_new_tokens=6)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2, response_mode=mode)
    first = query_engine.query(QUESTION)
    assert llm.last_stats["fallback"] == "uncached" and llm.last_stats["strategy"] == "full"
    assert cold.wait_for_encoding(timeout=120)
    second = query_engine.query(QUESTION)
    assert str(second) == str(first)
    assert_reused_exactly(llm)


# ------------------------------------------------------------- one engine per model
README_PATTERN = """
import json, logging
from llama_index.core import Document, VectorStoreIndex
from kvrag_integrations import KVRAGEngine
from kvrag_integrations.llama_index import KVCacheTransform, KVRAGLLM, MiniLMEmbedding

logging.basicConfig(level=logging.WARNING)
engine = KVRAGEngine.from_pretrained()  # for ingestion
docs = [Document(text=t) for t in %r]
index = VectorStoreIndex.from_documents(
    docs, embed_model=MiniLMEmbedding(), transformations=[KVCacheTransform(engine)]
)
llm = KVRAGLLM(max_new_tokens=4)  # no engine given: the process default
index.as_query_engine(llm=llm, similarity_top_k=2).query(%r)
print(json.dumps({"same": llm.engine is engine, **llm.last_stats}))
"""


def test_readme_pattern_uses_one_engine_and_reuses_on_the_first_query() -> None:
    import json
    import os
    import subprocess
    import sys

    code = README_PATTERN % (list(DOCS.values()), QUESTION)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        env=env,
    )
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["same"] and "loaded twice" not in run.stderr
    assert stats["fallback"] is None and stats["reused_chunk_tokens"] > 0
