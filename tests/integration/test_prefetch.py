"""Prefetch started by the frameworks' retrieval, on the real model: loads taken, none leaked.

Prefetch through the engine alone (same logits, bounded, misses) is tested on
the tiny model in tests/unit/test_loader.py.
"""

from __future__ import annotations

from pathlib import Path

from corpus import CAPITAL_QUESTION as QUESTION
from corpus import CAPITALS as CHUNKS
from corpus import on_disk
from llama_index.core import Document, VectorStoreIndex

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.llama_index import KVRAGLLM, KVCacheTransform, MiniLMEmbedding


def test_llama_index_retrieval_starts_the_loads_the_llm_takes(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    eng = on_disk(engine, tmp_path)
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in CHUNKS],
        embed_model=MiniLMEmbedding(),
        transformations=[KVCacheTransform(eng)],
    )
    llm = KVRAGLLM(eng, strategy="turbo", max_new_tokens=2)
    index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    loader = eng.caches.loader
    assert loader.prefetched == 2 and loader.taken == 2 and loader.staged == 0
    assert llm.last_stats["reused_chunk_tokens"] > 0


def test_langchain_search_starts_the_loads_the_chat_model_takes(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.vectorstores import InMemoryVectorStore

    from kvrag_integrations.langchain import ChatKVRAG, MiniLMEmbeddings, add_documents

    eng = on_disk(engine, tmp_path)
    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    add_documents(vector_store, CHUNKS, eng, show_progress=False)
    llm = ChatKVRAG(engine=eng, strategy="turbo", max_tokens=2)
    docs = vector_store.similarity_search(QUESTION, k=2)  # as an agent's middleware does
    loader = eng.caches.loader
    assert loader.prefetched == 2
    prompt = ChatPromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}")
    context = "\n\n".join(d.page_content for d in docs)
    llm.invoke(prompt.invoke({"context": context, "question": QUESTION}))
    assert loader.taken == 2 and loader.staged == 0
    assert llm.last_result.reused_chunk_tokens > 0
