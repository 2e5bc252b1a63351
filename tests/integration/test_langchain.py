"""The LangChain parts on the real default model, MiniLM and an in-memory chromadb."""

from __future__ import annotations

import uuid
from typing import Any

import chromadb
import pytest
import torch
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.messages.content import create_plaintext_block, create_text_block
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from kvrag_integrations import CACHE_KEY_FIELD, Chunk, KVRAGEngine, Text
from kvrag_integrations.langchain import (
    ChatKVRAG,
    KVRAGRetriever,
    KVRerankCompressor,
    add_documents,
    document_id,
    to_engine_messages,
)

pytestmark = pytest.mark.anyio

DOCS = [
    "Marie Curie was born in Warsaw in 1867 and won two Nobel Prizes.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia.",
    "Ada Lovelace wrote the first published algorithm for a machine.",
    "Mount Kilimanjaro is the highest mountain in Africa.",
]
SYSTEM = "You answer questions from the context. Answer briefly."
QUESTION = "Where was Marie Curie born?"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> KVRAGEngine:
    """The process-wide shared engine (the one ChatKVRAG() uses), not conftest's copy."""
    return KVRAGEngine.shared()


@pytest.fixture(scope="module")
def collection(engine: KVRAGEngine) -> Any:
    client = chromadb.EphemeralClient()
    coll = client.create_collection(f"kvrag-lc-{uuid.uuid4().hex[:8]}", embedding_function=None)
    add_documents(coll, [Document(page_content=d, metadata={"n": i}) for i, d in enumerate(DOCS)],
                  engine, show_progress=False)  # fmt: skip
    return coll


@pytest.fixture(scope="module")
def llm(engine: KVRAGEngine) -> ChatKVRAG:
    return ChatKVRAG(engine=engine, strategy="turbo", max_tokens=12)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


PROMPT = ChatPromptTemplate.from_messages(
    [("system", SYSTEM), ("human", "Context:\n{context}\n\nQuestion: {question}")]
)


def make_chain(retriever: KVRAGRetriever, llm: ChatKVRAG) -> Any:
    return (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | PROMPT
        | llm
        | StrOutputParser()
    )


def test_add_documents_is_idempotent(engine: KVRAGEngine, collection: Any) -> None:
    before = collection.count()
    ids = add_documents(collection, DOCS[:2] + DOCS[:1], engine, show_progress=False)
    assert collection.count() == before == len(DOCS)
    assert ids == [document_id(DOCS[0]), document_id(DOCS[1]), document_id(DOCS[0])]
    stored = collection.get(ids=[ids[0]], include=["metadatas"])["metadatas"][0]
    assert stored[CACHE_KEY_FIELD] == engine.chunk_key(DOCS[0])
    assert engine.store.contains(engine.chunk_key(DOCS[0]))


def test_retriever_returns_cached_documents(engine: KVRAGEngine, collection: Any) -> None:
    retriever = KVRAGRetriever(collection=collection, engine=engine, k=2)
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 2 and docs[0].page_content == DOCS[0]
    assert len(retriever.invoke(QUESTION, k=3)) == 3
    for doc in docs:
        assert doc.metadata[CACHE_KEY_FIELD] == engine.chunk_key(doc.page_content)
        assert engine.store.contains(doc.metadata[CACHE_KEY_FIELD])
        assert doc.page_content in engine.chunk_index
        assert doc.id == document_id(doc.page_content)
    only = retriever.invoke(QUESTION, where={"n": 2})
    assert [d.page_content for d in only] == [DOCS[2]]


def test_lcel_chain_reuses_caches_and_matches_engine(
    engine: KVRAGEngine, collection: Any, llm: ChatKVRAG
) -> None:
    retriever = KVRAGRetriever(collection=collection, engine=engine, k=2)
    answer = make_chain(retriever, llm).invoke(QUESTION)
    assert isinstance(answer, str) and answer
    result = llm.last_result
    assert result is not None and result.strategy == "turbo"
    docs = retriever.invoke(QUESTION)
    chunk_tokens = sum(r.num_tokens for r in engine.encode_chunks([d.page_content for d in docs]))
    chunk_tokens += (len(docs) - 1) * engine.prompts.suffix_ids.numel()  # format_docs' "\n\n"
    # reused = the retrieved chunks + the cached leading text (system prompt, header)
    assert result.reused_tokens - result.reused_prefix_tokens == chunk_tokens > 0
    # The same prompt, given straight to the engine as role/content dicts.
    human = f"Context:\n{format_docs(docs)}\n\nQuestion: {QUESTION}"
    pre = engine.prefill(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": human}],
        strategy="turbo",
    )
    assert pre.prompt.num_tokens == result.prompt_tokens
    torch.testing.assert_close(result.first_token_logits, pre.logits, rtol=0, atol=0)


def test_usage_and_response_metadata(engine: KVRAGEngine, llm: ChatKVRAG) -> None:
    engine.encode_chunks([DOCS[0]], show_progress=False)
    msg = llm.invoke([HumanMessage(f"Context: {DOCS[0]}\n\nQuestion: {QUESTION}")])
    usage, meta = msg.usage_metadata, msg.response_metadata
    assert usage is not None and meta is not None
    n_chunk = engine.encode_chunks([DOCS[0]], show_progress=False)[0].num_tokens
    prefix = meta["reused_prefix_tokens"]
    assert usage["input_token_details"]["cache_read"] == n_chunk + prefix
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert meta["model_name"] == engine.model_name == "SmolLM2-135M-Instruct"
    assert meta["strategy"] == "turbo" and meta["finish_reason"] in {"stop", "length"}
    assert meta["ttft_s"] > 0 and meta["reused_tokens"] == n_chunk + prefix
    blend = llm.invoke(f"{DOCS[0]}\n{QUESTION}", strategy="blend", recompute_ratio=0.5)
    assert blend.response_metadata["strategy"] == "blend"
    assert blend.response_metadata["recomputed_tokens"] > 0


def test_documents_kwarg_and_bind_mark_chunks(llm: ChatKVRAG) -> None:
    text = f"Note {uuid.uuid4().hex}: the museum opens at nine on weekdays."
    prompt = f"{text}\n\nWhen does the museum open?"
    assert llm.engine is not None and text not in llm.engine.chunk_index
    first = llm.invoke(prompt, documents=[Document(page_content=text)], on_miss="encode")
    assert first.response_metadata["lazily_encoded_chunks"] == 1  # found, stored on the fly
    again = llm.bind(documents=[text]).invoke(prompt)
    n = llm.engine.encode_chunks([text], show_progress=False)[0].num_tokens
    prefix = again.response_metadata["reused_prefix_tokens"]
    assert again.usage_metadata["input_token_details"]["cache_read"] == n + prefix


def test_content_blocks_with_cache_key(engine: KVRAGEngine, llm: ChatKVRAG) -> None:
    key = engine.chunk_key(DOCS[2])
    engine.encode_chunks([DOCS[1], DOCS[2]], show_progress=False)
    message = HumanMessage(
        content=[
            {"type": "text", "text": "Context:\n"},
            create_text_block(DOCS[2], kvrag_cache_key=key),
            {"type": "text", "text": "\n"},
            create_plaintext_block(DOCS[1]),
            {"type": "text", "text": "\n\nWho wrote the first algorithm?"},
        ]
    )
    msgs, known = to_engine_messages([SystemMessage(SYSTEM), message], engine)
    assert known == [] and msgs[0] == {"role": "system", "content": SYSTEM}
    assert msgs[1]["content"] == [
        Text("Context:\n"), Chunk(DOCS[2]), Text("\n"), Chunk(DOCS[1]),
        Text("\n\nWho wrote the first algorithm?"),
    ]  # fmt: skip
    out = llm.invoke([message])
    n = sum(r.num_tokens for r in engine.encode_chunks([DOCS[1], DOCS[2]], show_progress=False))
    prefix = out.response_metadata["reused_prefix_tokens"]
    assert out.usage_metadata["input_token_details"]["cache_read"] == n + prefix


def test_message_roles_and_refused_blocks(engine: KVRAGEngine) -> None:
    msgs, known = to_engine_messages(
        [SystemMessage("s"), HumanMessage("h"), AIMessage("a")], engine, documents=["doc text"]
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert [m["content"] for m in msgs] == ["s", "h", "a"] and known == ["doc text"]
    image = {"type": "image", "base64": "AAAA", "mime_type": "image/png"}
    with pytest.raises(ValueError, match="text only"):
        to_engine_messages([HumanMessage(content=[image])], engine)


def test_sampling_stop_and_max_tokens(llm: ChatKVRAG) -> None:
    plain = llm.invoke("Hello")
    assert "!" in plain.text
    stopped = llm.invoke("Hello", stop=["!"])
    assert "!" not in stopped.text and stopped.response_metadata["finish_reason"] == "stop"
    short = llm.invoke("Write a long story about a cat.", max_tokens=3)
    assert short.usage_metadata["output_tokens"] == 3
    assert short.response_metadata["finish_reason"] == "length"
    a, b = (llm.invoke("Tell me a fact.", temperature=0.9, top_p=0.9, seed=7) for _ in range(2))
    assert a.text == b.text
    assert ChatKVRAG(engine=llm.engine, stop=["!"]).invoke("Hello").text == stopped.text


def test_streaming_is_incremental(engine: KVRAGEngine, collection: Any, llm: ChatKVRAG) -> None:
    chunks = list(llm.stream("Hello"))
    assert len([c for c in chunks if c.content]) > 1
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata
    assert "".join(c.text for c in chunks) == llm.invoke("Hello").text
    chain = make_chain(KVRAGRetriever(collection=collection, engine=engine, k=2), llm)
    pieces = list(chain.stream(QUESTION))
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == chain.invoke(QUESTION)


async def test_async_invoke_stream_batch(
    engine: KVRAGEngine, collection: Any, llm: ChatKVRAG
) -> None:
    chain = make_chain(KVRAGRetriever(collection=collection, engine=engine, k=2), llm)
    expected = chain.invoke(QUESTION)
    assert await chain.ainvoke(QUESTION) == expected
    assert llm.last_result is not None and llm.last_result.reused_tokens > 0
    pieces = [p async for p in chain.astream(QUESTION)]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == expected
    assert await chain.abatch([QUESTION, QUESTION]) == [expected, expected]
    assert chain.batch([QUESTION, QUESTION]) == [expected, expected]


async def test_async_stream_stopped_early_releases_engine(llm: ChatKVRAG) -> None:
    previous = llm.last_result
    stream = llm.astream("Write a long story about a cat.", max_tokens=200)
    async for _ in stream:
        break  # leave after the first piece: the worker must stop and let go of the engine
    await stream.aclose()
    # The next request waits for the engine's lock: a worker still decoding 200
    # tokens would hold it for several seconds.
    msg = await llm.ainvoke("Hello", max_tokens=2)
    assert msg.response_metadata["ttft_s"] < 3.0
    assert llm.last_result is not previous and llm.last_result.generated_tokens == 2


def test_engine_is_not_serialized(llm: ChatKVRAG) -> None:
    dumped = llm.model_dump()
    assert "engine" not in dumped and dumped["strategy"] == "turbo"
    assert llm._identifying_params["model_name"] == "SmolLM2-135M-Instruct"
    assert llm._llm_type == "kvrag-chat"


def test_rerank_compressor(engine: KVRAGEngine) -> None:
    docs = [Document(page_content=d, metadata={"i": i}) for i, d in enumerate(DOCS)]
    kept = KVRerankCompressor(engine=engine, top_n=2).compress_documents(docs, QUESTION)
    assert len(kept) == 2
    scores = [d.metadata["relevance_score"] for d in kept]
    assert scores == sorted(scores, reverse=True)
    assert all(d.page_content == DOCS[d.metadata["i"]] for d in kept)
    everything = KVRerankCompressor(engine=engine, top_n=None).compress_documents(docs, QUESTION)
    assert len(everything) == len(DOCS)
    assert KVRerankCompressor(engine=engine).compress_documents([], QUESTION) == []


async def test_errors_reach_the_caller(llm: ChatKVRAG) -> None:
    with pytest.raises(TypeError):
        llm.invoke("Hello", strategy="turbo", recompute_ratio=0.5)  # not a turbo option
    with pytest.raises(TypeError):
        await llm.ainvoke("Hello", strategy="turbo", recompute_ratio=0.5)
    with pytest.raises(ValueError, match="unknown strategy"):
        [c async for c in llm.astream("Hello", strategy="nope")]
    assert llm.invoke("Hello", max_tokens=None).text  # None: the model's own setting


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"temperature": float("nan")}, ValueError),
        ({"top_k": 2.5}, TypeError),
        ({"max_tokens": 2.5}, TypeError),
        ({"seed": "abc"}, TypeError),
        ({"repetition_penalty": float("nan")}, ValueError),
        ({"stop": [None]}, TypeError),
        ({"top_p": 2.0}, ValueError),
    ],
)
def test_bad_call_arguments_fail_before_any_forward(llm: ChatKVRAG, bad, error) -> None:
    name = {"max_tokens": "max_new_tokens"}.get(next(iter(bad)), next(iter(bad)))
    calls = []
    hook = llm.engine.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(error, match=name):
            llm.invoke("Hello", **bad)
        with pytest.raises(error, match=name):
            list(llm.stream("Hello", **bad))
    finally:
        hook.remove()
    assert calls == []


def test_bad_instance_settings_are_refused(engine: KVRAGEngine) -> None:
    with pytest.raises(ValueError, match="temperature"):
        ChatKVRAG(engine=engine, temperature=float("nan"))
    with pytest.raises(ValueError):
        ChatKVRAG(engine=engine, stop=[None])


def test_media_blocks_raise_the_typed_error(engine: KVRAGEngine) -> None:
    from kvrag_integrations import UnsupportedInputError

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(UnsupportedInputError, match="'image'"):
        to_engine_messages([HumanMessage(content=[{"type": "text", "text": "hi"}, image])], engine)


def test_an_abandoned_sync_stream_does_not_block_the_engine(llm: ChatKVRAG) -> None:
    import threading

    stream = llm.stream("Write a long story about a cat.", max_tokens=200)
    next(stream)  # the caller reads one piece and walks away without closing
    done = threading.Event()
    worker = threading.Thread(target=lambda: (llm.invoke("Hello", max_tokens=2), done.set()))
    worker.start()
    worker.join(timeout=60)
    stream.close()
    assert done.is_set(), "a half-read LangChain stream held the engine"
