"""The frameworks' documented RAG patterns with the vLLM engine swapped in.

Only the engine changes: the same ``ChatKVRAG`` and ``KVRAGLLM`` over an
ordinary vector store the engine has never seen, the same question twice in a
row. The second request reads at least half of its prompt from cache.
"""

from __future__ import annotations

from corpus import LCEL_DOCS, LCEL_QUESTION, LCEL_TEMPLATE, format_docs
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from vllm_helpers import needs_vllm

from kvrag_integrations.langchain import ChatKVRAG, MiniLMEmbeddings
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()

CAPITALS = [
    "Canberra is the capital city of Australia. It was chosen in 1908 as a compromise "
    "between Sydney and Melbourne, and Parliament first met there in 1927.",
    "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario, across from "
    "Gatineau, and was chosen by Queen Victoria in 1857.",
    "Wellington is the capital of New Zealand, at the southern tip of the North Island; it "
    "replaced Auckland as the capital in 1865.",
]


def test_lcel_chain_on_vllm_reuses_on_the_second_request(vllm_engine: VLLMEngine) -> None:
    """LangChain's LCEL RAG chain over an InMemoryVectorStore filled by its own
    add_documents, the chat model on the vLLM engine."""
    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    vector_store.add_documents([Document(page_content=t) for t in LCEL_DOCS])
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    llm = ChatKVRAG(engine=vllm_engine, max_tokens=8)
    prompt = ChatPromptTemplate.from_template(LCEL_TEMPLATE)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    first = chain.invoke(LCEL_QUESTION).usage_metadata
    second = chain.invoke(LCEL_QUESTION).usage_metadata
    assert first["input_tokens"] == second["input_tokens"] > 0
    assert second["input_token_details"]["cache_read"] >= 0.5 * second["input_tokens"]
    assert llm.last_result.reused_chunks == 2


def test_llama_index_query_engine_on_vllm_reuses_on_the_second_request(
    vllm_engine: VLLMEngine,
) -> None:
    """LlamaIndex's starter pattern (VectorStoreIndex.from_documents, as_query_engine),
    the LLM on the vLLM engine, no KVCacheTransform."""
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex

    from kvrag_integrations.llama_index import KVRAGLLM, MiniLMEmbedding

    index = VectorStoreIndex.from_documents(
        [LIDocument(text=t) for t in CAPITALS], embed_model=MiniLMEmbedding()
    )
    llm = KVRAGLLM(vllm_engine, max_new_tokens=8)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    query_engine.query("What is the capital of Australia?")
    first = llm.last_stats
    answer = query_engine.query("What is the capital of Australia?")
    second = llm.last_stats
    assert str(answer).strip()
    assert first["prompt_tokens"] == second["prompt_tokens"]
    assert second["fallback"] is None and second["strategy"] == "turbo"
    assert second["reused_tokens"] >= 0.5 * second["prompt_tokens"], second


def test_llama_index_ingestion_encodes_through_vllm_and_the_first_query_reuses(
    vllm_engine: VLLMEngine,
) -> None:
    """An IngestionPipeline with KVCacheTransform on the vLLM engine: each node's
    cache is prefilled by vLLM and stored by the connector, its key recorded;
    the first query over the index reads the nodes from cache."""
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from kvrag_integrations import CACHE_KEY_FIELD
    from kvrag_integrations.llama_index import KVRAGLLM, KVCacheTransform, MiniLMEmbedding

    transform = KVCacheTransform(vllm_engine)
    assert transform.engine_fingerprint == vllm_engine.fingerprint
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=16), transform]
    )
    nodes = pipeline.run(documents=[LIDocument(text=f"(ingested) {t}") for t in CAPITALS])
    assert all(len(n.metadata[CACHE_KEY_FIELD]) == 64 for n in nodes)
    index = VectorStoreIndex(nodes, embed_model=MiniLMEmbedding())
    llm = KVRAGLLM(vllm_engine, max_new_tokens=8)
    index.as_query_engine(llm=llm, similarity_top_k=2).query("What is the capital of Canada?")
    stats = llm.last_stats
    assert stats["reused_chunks"] == 2 and stats["fallback"] is None
    assert stats["reused_tokens"] >= 0.5 * stats["prompt_tokens"], stats
