"""LangChain's own RAG patterns over an ordinary vector store, only the chat model swapped.

The LCEL chain (retriever | format_docs | prompt | model | parser), the RAG agent
(``create_agent`` with a ``@dynamic_prompt`` middleware calling
``similarity_search``), ``create_retrieval_chain`` and the RAG tutorial's
LangGraph graph (a ``retrieve`` node calling ``similarity_search``), over
``InMemoryVectorStore`` filled with its own ``add_documents``: nothing of ours
but ``ChatKVRAG`` (and the packaged MiniLM as the embedding model). Retrieved
documents are recognised through the callback hook (retrievers) or the wrapped
search methods (a direct ``similarity_search``); the first request answers by
plain prefill and queues their caches, the second reuses them, with the
engine's own first-token logits for the prompt the model received.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from corpus import LCEL_DOCS as DOCS
from corpus import LCEL_QUESTION as QUESTION
from corpus import LCEL_TEMPLATE as TEMPLATE
from corpus import format_docs
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from kvrag_integrations import Chunk, GenerationResult, KVRAGEngine, MemoryKVStore
from kvrag_integrations.engine.prompting.spans import MAX_RECENT_CHUNKS, ChunkIndex
from kvrag_integrations.errors import UnsupportedInputError
from kvrag_integrations.langchain import ChatKVRAG, MiniLMEmbeddings, add_documents, hooks


@pytest.fixture()
def fresh(engine: KVRAGEngine, monkeypatch: pytest.MonkeyPatch) -> KVRAGEngine:
    """The session's weights with an empty store and deferred misses (the default
    "auto" defers on CPU until its measured costs say encoding is cheaper; the
    second request without waiting: test_second_request_frameworks.py), and an empty
    registry of recently retrieved texts (earlier tests retrieved the same
    documents: each test must recognise them on its own)."""
    hooks.install_hooks()
    monkeypatch.setattr(hooks, "_RECENT", ChunkIndex(max_chunks=MAX_RECENT_CHUNKS))
    return KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="defer")


class Received(BaseCallbackHandler):
    """The messages of the chat model's latest call, exactly as it received them."""

    messages: list[BaseMessage] | None = None

    def on_chat_model_start(
        self, serialized: Any, messages: list[list[BaseMessage]], **kwargs: Any
    ) -> None:
        self.messages = list(messages[0])


def model_for(fresh: KVRAGEngine) -> tuple[ChatKVRAG, Received]:
    received = Received()
    return ChatKVRAG(engine=fresh, max_tokens=4, callbacks=[received]), received


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
    """The documents' tokens, and the "\n\n" between them (the docs' join): each is
    read with the chunk before it (the chunk suffix)."""
    between = max(len(docs) - 1, 0) * engine.prompts.suffix_ids.numel()
    return sum(engine.tokenize([Chunk(d.page_content)]).num_tokens for d in docs) + between


def assert_same_as_engine(llm: ChatKVRAG, messages: list[BaseMessage] | None) -> None:
    """The last answer's first-token logits equal the engine's own prefill of the
    prompt the model received (same chunks, same strategy)."""
    assert messages, "the chat model was not called"
    engine, request = llm.engine_request(messages)
    pre = engine.prefill(
        messages=request["messages"],
        known_chunks=request["known_chunks"],
        strategy=request["strategy"],
    )
    torch.testing.assert_close(llm.last_result.first_token_logits, pre.logits, rtol=0, atol=0)


def reuses_from_the_second_request(
    llm: ChatKVRAG, received: Received, fresh: KVRAGEngine, run: Callable[[], Any]
) -> tuple[GenerationResult, GenerationResult]:
    """Run twice: the first request answers by plain prefill and queues the chunk
    caches, the second reuses them with the engine's own first-token logits."""
    run()
    first = llm.last_result
    assert first.fallback == "uncached" and first.deferred_chunks > 0
    fresh.wait_for_encoding()
    run()
    second = llm.last_result
    assert second.fallback is None
    assert_same_as_engine(llm, received.messages)
    return first, second


def plain_store() -> InMemoryVectorStore:
    """An ordinary vector store filled with its own add_documents (not through us)."""
    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    vector_store.add_documents([Document(page_content=t) for t in DOCS])
    return vector_store


def test_lcel_over_an_ordinary_vector_store_reuses_from_the_second_request(
    fresh: KVRAGEngine,
) -> None:
    vector_store = plain_store()
    llm, received = model_for(fresh)
    chain = rag_chain(vector_store, llm)

    first, second = reuses_from_the_second_request(
        llm, received, fresh, lambda: chain.invoke(QUESTION)
    )
    assert first.deferred_chunks == 2
    docs = vector_store.as_retriever(search_kwargs={"k": 2}).invoke(QUESTION)
    assert second.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, docs) > 0


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


def test_structured_output_and_n_are_refused_where_asked() -> None:
    llm = ChatKVRAG(max_tokens=4)
    assert llm.bind_tools([]) is llm  # no tools: nothing bound (create_agent, tools=[])
    with pytest.raises(UnsupportedInputError, match="structured output"):
        llm.with_structured_output({"type": "object"})
    with pytest.raises(UnsupportedInputError, match="n > 1"):
        llm.invoke("Hello", n=2)


def _rag_agent(model: ChatKVRAG, vector_store: Any) -> Any:
    """LangChain's RAG tutorial agent, verbatim but for the model and a middleware
    that makes the small model's first call the retrieval (``tool_choice``)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain.tools import tool

    @tool(response_format="content_and_artifact")
    def retrieve_context(query: str):
        """Retrieve information to help answer a query."""
        retrieved_docs = vector_store.similarity_search(query, k=2)
        serialized = "\n\n".join(
            (f"Source: {doc.metadata}\nContent: {doc.page_content}") for doc in retrieved_docs
        )
        return serialized, retrieved_docs

    @wrap_model_call
    def retrieve_first(request: Any, handler: Any) -> Any:
        if not any(m.type == "tool" for m in request.messages):
            request = request.override(tool_choice="required")
        return handler(request)

    tools = [retrieve_context]
    prompt = (
        "You have access to a tool that retrieves context from a blog post. "
        "Use the tool to help answer user queries."
    )
    return create_agent(model, tools, system_prompt=prompt, middleware=[retrieve_first])


def _run_agent(agent: Any) -> list[Any]:
    """The agent's messages after one question: human, the AI message with the
    call, the tool message with the documents, the answer."""
    state = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    return state["messages"]


def test_the_rag_agents_tool_documents_are_reused_from_the_first_call(fresh: KVRAGEngine) -> None:
    """Documents ingested through us: the agent's second model call (after the
    retrieval tool) reads >= 80% of their tokens from their stored caches."""
    from langchain_core.messages import AIMessage, ToolMessage

    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    add_documents(vector_store, DOCS, fresh, show_progress=False)
    model = ChatKVRAG(engine=fresh, max_tokens=16)
    messages = _run_agent(_rag_agent(model, vector_store))
    call, tool_message = messages[1], messages[2]
    assert isinstance(call, AIMessage) and call.tool_calls[0]["name"] == "retrieve_context"
    assert isinstance(tool_message, ToolMessage) and tool_message.artifact
    result = model.last_result
    assert result.fallback is None
    assert result.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, tool_message.artifact) > 0


def test_the_rag_agents_tool_documents_are_reused_from_the_second_run(fresh: KVRAGEngine) -> None:
    """Over a plain store: the first run encodes the documents, the second reuses them."""
    vector_store = plain_store()
    model = ChatKVRAG(engine=fresh, max_tokens=16)
    agent = _rag_agent(model, vector_store)
    _run_agent(agent)
    fresh.wait_for_encoding(120)
    messages = _run_agent(agent)
    result = model.last_result
    assert result.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, messages[2].artifact) > 0


def test_create_agent_with_dynamic_prompt_over_a_plain_store(fresh: KVRAGEngine) -> None:
    """The RAG agent of LangChain's docs, verbatim but for the model: a
    @dynamic_prompt middleware calls similarity_search (no retriever, no callback)
    and puts the documents in the system message."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    vector_store = plain_store()
    model, received = model_for(fresh)

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        """Inject context into state messages."""
        last_query = request.state["messages"][-1].text
        retrieved_docs = vector_store.similarity_search(last_query)

        docs_content = "\n\n".join(doc.page_content for doc in retrieved_docs)

        system_message = (
            "You are a helpful assistant. Use the following context in your response:"
            f"\n\n{docs_content}"
        )

        return system_message

    agent = create_agent(model, tools=[], middleware=[prompt_with_context])

    def run() -> None:
        for _step in agent.stream(
            {"messages": [{"role": "user", "content": QUESTION}]},
            stream_mode="values",
        ):
            pass

    first, second = reuses_from_the_second_request(model, received, fresh, run)
    docs = vector_store.similarity_search(QUESTION)  # k=4: all three documents
    assert first.deferred_chunks == len(docs) == len(DOCS)
    assert second.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, docs) > 0


def test_create_agent_with_dynamic_prompt_ingested_through_us(fresh: KVRAGEngine) -> None:
    """The same agent over documents added through our add_documents: reused
    from the first request."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt

    vector_store = InMemoryVectorStore(MiniLMEmbeddings())
    add_documents(vector_store, DOCS, fresh, show_progress=False)
    model, received = model_for(fresh)

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
    for _ in agent.stream(
        {"messages": [{"role": "user", "content": QUESTION}]}, stream_mode="values"
    ):
        pass
    result = model.last_result
    docs = vector_store.similarity_search(QUESTION, k=2)
    assert result.fallback is None  # ingested through us: reused from the first request
    assert result.reused_chunk_tokens == chunk_tokens(fresh, docs) > 0
    assert_same_as_engine(model, received.messages)


def test_create_retrieval_chain(fresh: KVRAGEngine) -> None:
    from langchain_classic.chains import create_retrieval_chain
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain

    vector_store = plain_store()
    llm, received = model_for(fresh)
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

    _, second = reuses_from_the_second_request(
        llm, received, fresh, lambda: chain.invoke({"input": QUESTION})
    )
    docs = retriever.invoke(QUESTION)
    assert second.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, docs) > 0


# LangChain's RAG tutorial pulls hub.pull("rlm/rag-prompt") (network); this is its text.
RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of "
    "retrieved context to answer the question. If you don't know the answer, just say "
    "that you don't know. Use three sentences maximum and keep the answer concise.\n"
    "Question: {question} \nContext: {context} \nAnswer:"
)


def test_langgraph_rag_graph(fresh: KVRAGEngine) -> None:
    """The retrieve -> generate graph of LangChain's RAG tutorial, verbatim but for
    the model and the prompt's source: ``retrieve`` calls similarity_search."""
    from typing import TypedDict

    from langgraph.graph import START, StateGraph

    vector_store = plain_store()
    llm, received = model_for(fresh)
    prompt = ChatPromptTemplate.from_messages([("human", RAG_PROMPT)])

    class State(TypedDict):
        question: str
        context: list[Document]
        answer: str

    def retrieve(state: State):
        retrieved_docs = vector_store.similarity_search(state["question"])
        return {"context": retrieved_docs}

    def generate(state: State):
        docs_content = "\n\n".join(doc.page_content for doc in state["context"])
        messages = prompt.invoke({"question": state["question"], "context": docs_content})
        response = llm.invoke(messages)
        return {"answer": response.content}

    graph_builder = StateGraph(State).add_sequence([retrieve, generate])
    graph_builder.add_edge(START, "retrieve")
    graph = graph_builder.compile()

    first, second = reuses_from_the_second_request(
        llm, received, fresh, lambda: graph.invoke({"question": QUESTION})
    )
    docs = vector_store.similarity_search(QUESTION)  # k=4: all three documents
    assert first.deferred_chunks == len(docs) == len(DOCS)
    assert second.reused_chunk_tokens >= 0.8 * chunk_tokens(fresh, docs) > 0
