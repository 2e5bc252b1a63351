"""LangChain's own RAG patterns over an ordinary vector store, only the chat model swapped.

The LCEL chain is the one LangChain's RAG docs show (retriever | format_docs |
prompt | model | parser), over ``InMemoryVectorStore`` filled with its own
``add_documents``: nothing of ours but ``ChatKVRAG`` (and the packaged MiniLM as
the embedding model). The retriever's documents are recognised through the
callback hook; the first request answers by plain prefill and queues their
caches, the second reuses them.
"""

from __future__ import annotations

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from kvrag_integrations import Chunk, KVRAGEngine, MemoryKVStore
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.langchain import ChatKVRAG, MiniLMEmbeddings, add_documents

DOCS = [
    "The Rosetta Stone was found in 1799 by French soldiers near Rashid, in the Nile "
    "delta. It carries one decree in hieroglyphic, Demotic and ancient Greek.",
    "Jean-Francois Champollion announced the decipherment of the hieroglyphs in 1822, "
    "working from the Greek text of the Rosetta Stone and from Coptic.",
    "The Great Pyramid of Giza was the tallest man-made structure for nearly four "
    "thousand years, until Lincoln Cathedral was finished in 1311.",
]
QUESTION = "Who deciphered the hieroglyphs?"
TEMPLATE = """Answer the question based only on the following context:
{context}

Question: {question}
"""


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


@pytest.fixture()
def fresh(engine: KVRAGEngine) -> KVRAGEngine:
    """The session's weights with an empty store and the default (deferred) misses."""
    return KVRAGEngine(engine.loaded, store=MemoryKVStore())


def rag_chain(vector_store: InMemoryVectorStore, llm: ChatKVRAG):
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_template(TEMPLATE)
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | llm
        | StrOutputParser()
    )


def chunk_tokens(engine: KVRAGEngine, docs: list[Document]) -> int:
    return sum(engine.tokenize([Chunk(d.page_content)]).num_tokens for d in docs)


def assert_same_as_engine(llm: ChatKVRAG, vector_store: InMemoryVectorStore) -> None:
    """The last answer's first-token logits equal the engine's for the same prompt."""
    docs = vector_store.as_retriever(search_kwargs={"k": 2}).invoke(QUESTION)
    messages = ChatPromptTemplate.from_template(TEMPLATE).invoke(
        {"context": format_docs(docs), "question": QUESTION}
    )
    engine, request = llm.engine_request(messages.to_messages())
    pre = engine.prefill(
        messages=request["messages"],
        known_chunks=request["known_chunks"],
        strategy=request["strategy"],
    )
    torch.testing.assert_close(llm.last_result.first_token_logits, pre.logits, rtol=0, atol=0)


def test_lcel_over_an_ordinary_vector_store_reuses_from_the_second_request(
    fresh: KVRAGEngine,
) -> None:
    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    vector_store.add_documents([Document(page_content=t) for t in DOCS])  # not through us
    llm = ChatKVRAG(engine=fresh, max_tokens=4)
    chain = rag_chain(vector_store, llm)

    assert chain.invoke(QUESTION)
    first = llm.last_result
    assert first.fallback == "uncached" and first.deferred_chunks == 2
    fresh.wait_for_encoding()

    assert chain.invoke(QUESTION)
    second = llm.last_result
    docs = vector_store.as_retriever(search_kwargs={"k": 2}).invoke(QUESTION)
    assert second.fallback is None
    assert second.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, docs)
    assert_same_as_engine(llm, vector_store)


def test_ingested_through_us_reuses_from_the_first_request(fresh: KVRAGEngine) -> None:
    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    add_documents(vector_store, DOCS, fresh, show_progress=False)
    llm = ChatKVRAG(engine=fresh, max_tokens=4)
    # similarity_search outside any retriever run (as an agent's middleware does)
    docs = vector_store.similarity_search(QUESTION, k=2)
    prompt = ChatPromptTemplate.from_template(TEMPLATE)
    messages = prompt.invoke({"context": format_docs(docs), "question": QUESTION})
    llm.invoke(messages)
    result = llm.last_result
    assert result.fallback is None
    assert result.reused_chunk_tokens == chunk_tokens(fresh, docs) > 0
    assert all(d.metadata.get("kvrag_cache_key") for d in docs)


def test_tool_calling_and_structured_output_are_refused_where_asked() -> None:
    llm = ChatKVRAG(max_tokens=4)
    with pytest.raises(UnsupportedInputError, match="tool calling"):
        llm.bind_tools([])
    with pytest.raises(UnsupportedInputError, match="structured output"):
        llm.with_structured_output({"type": "object"})
