"""The decoder reranker (HyperRAG) on vLLM: the same scores as in process, each
document's stored entry loaded at position 0, every candidate in one batch.

Scores are compared with the in-process reranker (float32, entries at model
precision) on held-out MuSiQue lists of 10 passages; the frameworks' rerank
patterns run over the vLLM engine and reuse every document on a second call.
"""

from __future__ import annotations

import pytest
from vllm_helpers import TOOLS_SERVER, Corpus, VLLMServer, needs_vllm

from kvrag_integrations.engine import KVRAGEngine
from kvrag_integrations.rerank import KVReranker
from kvrag_integrations.vllm.client.scoring import by_token_pays
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()

pytestmark = pytest.mark.vllm_server(*TOOLS_SERVER)  # (test_a_connected_engine_...)

HELD_OUT = (101, 102)  # MuSiQue items no other vLLM test reads
TOLERANCE = 1e-3


def _ranking(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


@pytest.mark.parametrize("scoring", ["judge", "query_likelihood"])
def test_scores_equal_the_in_process_reranker(
    scoring: str, vllm_engine: VLLMEngine, engine: KVRAGEngine, musique: Corpus
) -> None:
    """Cold (entries encoded by this call) and warm (loaded at position 0) scores
    on vLLM equal the in-process reranker's within 1e-3; the rankings are the same."""
    on_vllm = KVReranker(vllm_engine, scoring=scoring)
    in_process = KVReranker(engine, scoring=scoring)
    worst = 0.0
    for item in HELD_OUT:
        question = musique.item(item).question
        docs = musique.chunks(item, 10, tag=f"rerank-{scoring}")
        want = in_process.score(question, docs)
        reused = on_vllm.stats.prefixes_reused
        cold = on_vllm.score(question, docs)
        warm = on_vllm.score(question, docs)
        assert on_vllm.stats.prefixes_reused - reused >= len(set(docs)), on_vllm.stats
        for got in (cold, warm):
            worst = max(worst, *(abs(a - b) for a, b in zip(got, want)))
            assert _ranking(got) == _ranking(want), (got, want)
    assert worst < TOLERANCE, worst
    print(f"{scoring}: max |vLLM - in process| = {worst:.2e}")


def test_llama_index_query_engine_reranks_on_vllm_and_reuses(vllm_engine: VLLMEngine) -> None:
    """LlamaIndex's retriever query engine with KVRerankPostprocessor, the reranker
    and the LLM on the vLLM engine: the second query reuses every document."""
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex

    from kvrag_integrations.llama_index import KVRAGLLM, KVRerankPostprocessor, MiniLMEmbedding

    texts = [f"(li-rerank) {t}" for t in _CAPITALS]
    index = VectorStoreIndex.from_documents(
        [LIDocument(text=t) for t in texts], embed_model=MiniLMEmbedding()
    )
    reranker = KVReranker(vllm_engine, scoring="query_likelihood")
    query_engine = index.as_query_engine(
        llm=KVRAGLLM(vllm_engine, max_new_tokens=4),
        similarity_top_k=3,
        node_postprocessors=[KVRerankPostprocessor(reranker, top_n=2)],
    )
    query_engine.query("What is the capital of Australia?")
    before = reranker.stats.prefixes_reused
    answer = query_engine.query("What is the capital of Australia?")
    assert len(answer.source_nodes) == 2
    assert reranker.stats.prefixes_reused - before == 3, reranker.stats


def test_langchain_compression_retriever_reranks_on_vllm_and_reuses(
    vllm_engine: VLLMEngine,
) -> None:
    """LangChain's ContextualCompressionRetriever with KVRerankCompressor on the vLLM
    engine: the second call reuses every document."""
    from langchain_classic.retrievers import ContextualCompressionRetriever
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvrag_integrations.langchain import KVRerankCompressor, MiniLMEmbeddings

    store = InMemoryVectorStore(MiniLMEmbeddings())
    store.add_documents([Document(page_content=f"(lc-rerank) {t}") for t in _CAPITALS])
    compressor = KVRerankCompressor(engine=vllm_engine, top_n=2)
    retriever = ContextualCompressionRetriever(
        base_compressor=compressor, base_retriever=store.as_retriever(search_kwargs={"k": 3})
    )
    retriever.invoke("What is the capital of Canada?")
    stats = compressor.reranker.stats
    before = stats.prefixes_reused
    docs = retriever.invoke("What is the capital of Canada?")
    assert len(docs) == 2 and "relevance_score" in docs[0].metadata
    assert stats.prefixes_reused - before == 3, stats


_CAPITALS = [
    "Canberra is the capital city of Australia, chosen in 1908 as a compromise.",
    "Ottawa is the capital of Canada, on the Ottawa River in Ontario.",
    "Wellington is the capital of New Zealand, at the tip of the North Island.",
]


def test_bench_rerank_vllm_column_smoke(
    vllm_engine: VLLMEngine, engine: KVRAGEngine, musique: Corpus
) -> None:
    """``bench rerank --vllm`` at smoke size, on the session's vLLM (figures are not
    asserted: only that the column is filled and agrees with in process)."""
    from kvrag_integrations.bench import rerank

    items = [musique.item(i) for i in (111, 112)]
    result = rerank.run(engine, items, **rerank.QUICK, vllm_engine=vllm_engine)
    assert result["vllm_warm_cands_per_s"] > 0 and result["vllm_concurrent_cands_per_s"] > 0
    assert result["vllm_prefixes_reused_warm"] >= 8
    assert result["vllm_max_abs_score_gap"] < TOLERANCE
    assert "vLLM, warm" in rerank.table(result)


def test_a_connected_engine_scores_as_in_process(
    vllm_server: VLLMServer, connect, engine: KVRAGEngine, musique: Corpus
) -> None:  # type: ignore[no-untyped-def]
    """Over HTTP (VLLMEngine.connect): both scorings, cold and warm, equal in process,
    on the run's server with entries at model precision (``TOOLS_SERVER``)."""
    client = connect(vllm_server.url)
    question = musique.item(104).question
    docs = musique.chunks(104, 10, tag="rerank-server")
    for scoring in ("judge", "query_likelihood"):
        on_server = KVReranker(client, scoring=scoring)
        want = KVReranker(engine, scoring=scoring).score(question, docs)
        cold = on_server.score(question, docs)
        warm = on_server.score(question, docs)
        if scoring == "judge" or _loads_pay(on_server, question, docs):
            assert on_server.stats.prefixes_reused >= len(set(docs)), on_server.stats
        else:  # (the sample corpus's passages): plain prefill, as without reuse
            assert (on_server.stats.prefixes_reused, on_server.stats.prefixes_encoded) == (0, 0)
        for got in (cold, warm):
            assert max(abs(a - b) for a, b in zip(got, want)) < TOLERANCE, (scoring, got, want)
            assert _ranking(got) == _ranking(want)


def _loads_pay(reranker: KVReranker, question: str, docs: list[str]) -> bool:
    """Whether query likelihood over HTTP loads these documents (one request per
    query token) rather than prefilling each prompt: long documents (MuSiQue's
    ~620 tokens) do, the bundled sample corpus's ~280 do not."""
    lead, query = reranker.prompt.query_ids(question)
    heads = [reranker.prefix_ids(d).tolist() for d in docs]
    return by_token_pays(heads, lead.numel() + query.numel(), query.numel())
