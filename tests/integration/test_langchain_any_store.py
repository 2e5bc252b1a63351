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
    from langchain_core.tools import tool

    @tool
    def search(query: str) -> str:
        """Search the web."""
        return query

    llm = ChatKVRAG(max_tokens=4)
    assert llm.bind_tools([]) is llm  # no tools: nothing to refuse (create_agent, tools=[])
    with pytest.raises(UnsupportedInputError, match="tool calling"):
        llm.bind_tools([search])
    with pytest.raises(UnsupportedInputError, match="structured output"):
        llm.with_structured_output({"type": "object"})
    with pytest.raises(UnsupportedInputError, match="n > 1"):
        llm.invoke("Hello", n=2)


def _second_request_reuses(llm: ChatKVRAG, fresh: KVRAGEngine, run, docs: list[Document]) -> None:
    """Run twice (the first may answer by plain prefill and queue the caches): the
    second reads most chunk tokens from cache, with the engine's own logits."""
    run()
    fresh.wait_for_encoding()
    run()
    result = llm.last_result
    assert result.fallback is None
    assert result.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, docs) > 0


def test_create_agent_with_dynamic_prompt(fresh: KVRAGEngine) -> None:
    """The RAG agent of LangChain's docs: a @dynamic_prompt middleware that calls
    similarity_search and puts the documents in the system message."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    add_documents(vector_store, DOCS, fresh, show_progress=False)
    model = ChatKVRAG(engine=fresh, max_tokens=4)

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        """Inject context into state messages."""
        last_query = request.state["messages"][-1].text
        retrieved_docs = vector_store.similarity_search(last_query, k=2)
        docs_content = "\n\n".join(doc.page_content for doc in retrieved_docs)
        system_message = (
            f"You are a helpful assistant. Use the following context in your response:"
            f"\n\n{docs_content}"
        )
        return system_message

    agent = create_agent(model, tools=[], middleware=[prompt_with_context])
    docs = vector_store.similarity_search(QUESTION, k=2)
    for _ in agent.stream(
        {"messages": [{"role": "user", "content": QUESTION}]}, stream_mode="values"
    ):
        pass
    result = model.last_result
    assert result.fallback is None  # ingested through us: reused from the first request
    assert result.reused_chunk_tokens == chunk_tokens(fresh, docs)


def test_create_retrieval_chain(fresh: KVRAGEngine) -> None:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    vector_store.add_documents([Document(page_content=t) for t in DOCS])
    llm = ChatKVRAG(engine=fresh, max_tokens=4)
    system_prompt = (
        "Use the given context to answer the question. "
        "If you don't know the answer, say you don't know. "
        "Use three sentence maximum and keep the answer concise. "
        "Context: {context}"
    )
    prompt = ChatPromptTemplate.from_messages([("system", system_prompt), ("human", "{input}")])
    question_answer_chain = create_stuff_documents_chain(llm, prompt)
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})
    chain = create_retrieval_chain(retriever, question_answer_chain)
    docs = retriever.invoke(QUESTION)
    _second_request_reuses(llm, fresh, lambda: chain.invoke({"input": QUESTION}), docs)


def test_langgraph_rag_graph(fresh: KVRAGEngine) -> None:
    """The retrieve -> generate graph of LangChain's RAG tutorial."""
    from typing import TypedDict

    from langgraph.graph import START, StateGraph

    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    vector_store.add_documents([Document(page_content=t) for t in DOCS])
    llm = ChatKVRAG(engine=fresh, max_tokens=4)
    prompt = ChatPromptTemplate.from_template(TEMPLATE)
    retriever = vector_store.as_retriever(search_kwargs={"k": 2})

    class State(TypedDict):
        question: str
        context: list[Document]
        answer: str

    def retrieve(state: State):
        retrieved_docs = retriever.invoke(state["question"])
        return {"context": retrieved_docs}

    def generate(state: State):
        docs_content = "\n\n".join(doc.page_content for doc in state["context"])
        messages = prompt.invoke({"question": state["question"], "context": docs_content})
        response = llm.invoke(messages)
        return {"answer": response.content}

    graph_builder = StateGraph(State).add_sequence([retrieve, generate])
    graph_builder.add_edge(START, "retrieve")
    graph = graph_builder.compile()
    docs = retriever.invoke(QUESTION)
    _second_request_reuses(llm, fresh, lambda: graph.invoke({"question": QUESTION}), docs)
