"""The LlamaIndex adapters with the real default model and real chromadb."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import uuid
from pathlib import Path
from typing import Any

import chromadb
import pytest
import torch
from llama_index.core import Document, StorageContext, VectorStoreIndex, get_response_synthesizer
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode
from llama_index.vector_stores.chroma import ChromaVectorStore

from kvrag_integrations import CACHE_KEY_FIELD, ChunkKV, DiskKVStore, KVRAGEngine
from kvrag_integrations.llama_index import (
    KVRAGLLM,
    KVCacheTransform,
    KVRAGRetriever,
    KVRerankPostprocessor,
    MiniLMEmbedding,
    request_chunks,
)
from kvrag_integrations.rerank import KVReranker

DOCS = [
    ("Australia", "Canberra is the capital city of Australia. It was chosen in 1908."),
    ("Canada", "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario."),
    ("New Zealand", "Wellington is the capital of New Zealand, on the North Island."),
]
QUESTION = "What is the capital of Australia?"


def documents() -> list[Document]:
    return [Document(text=text, metadata={"title": title}) for title, text in DOCS]


def splitter() -> SentenceSplitter:
    return SentenceSplitter(chunk_size=128, chunk_overlap=0)


def fresh(fn: Any, *args: Any) -> Any:
    """Run ``fn`` in an empty context: no node texts noted by earlier tests."""
    return contextvars.Context().run(fn, *args)


def llm_texts(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]


def chunk_tokens(engine: KVRAGEngine, nodes: list[NodeWithScore]) -> int:
    """The nodes' tokens, and the "\n\n" between them that LlamaIndex's templates
    put in context_str: each is read with the chunk before it (the chunk suffix)."""
    refs = engine.encode_chunks(llm_texts(nodes), show_progress=False)
    between = max(len(nodes) - 1, 0) * engine.prompts.suffix_ids.numel()
    return sum(ref.num_tokens for ref in refs) + between


def chunk_reuse(llm: KVRAGLLM) -> int:
    """Reused tokens of the last call less the cached leading text (system prompt, header)."""
    return llm.last_stats["reused_tokens"] - llm.last_stats["reused_prefix_tokens"]


def entry_path(store: DiskKVStore, key: str) -> Path:
    return Path(store.root) / key[:2] / f"{key}.safetensors"


def chroma_index(engine: KVRAGEngine, client: Any, name: str | None = None) -> VectorStoreIndex:
    collection = client.get_or_create_collection(name or f"t{uuid.uuid4().hex}")
    storage = StorageContext.from_defaults(
        vector_store=ChromaVectorStore(chroma_collection=collection)
    )
    return VectorStoreIndex.from_documents(
        documents(),
        storage_context=storage,
        embed_model=embed_model(),
        transformations=[splitter(), KVCacheTransform(engine)],
    )


@functools.cache
def embed_model() -> MiniLMEmbedding:
    return MiniLMEmbedding()


@pytest.fixture(scope="module")
def index(engine: KVRAGEngine) -> VectorStoreIndex:
    return chroma_index(engine, chromadb.EphemeralClient())


@pytest.fixture()
def disk_engine(engine: KVRAGEngine, tmp_path: Path) -> KVRAGEngine:
    """Same weights, its own on-disk store, an empty chunk index; lazy fills on the request
    path; caches at model precision (its answers are compared with the session engine's)."""
    store = DiskKVStore(tmp_path / "kv")
    return KVRAGEngine(engine.loaded, store=store, on_miss="encode", cache_precision="model")


def ask(index: VectorStoreIndex, llm: KVRAGLLM, question: str = QUESTION, **kw: Any) -> Any:
    kw.setdefault("similarity_top_k", 2)
    return fresh(index.as_query_engine(llm=llm, **kw).query, question)


# ------------------------------------------------------------------ the query engine
def test_swapping_only_the_llm_reuses_the_retrieved_chunks(engine, index) -> None:
    llm = KVRAGLLM(engine, strategy="turbo", max_new_tokens=8)
    response = ask(index, llm)
    stats = llm.last_stats
    assert "Canberra" in str(response)
    reused = stats["reused_tokens"] - stats["reused_prefix_tokens"]  # less the leading text
    assert reused == chunk_tokens(engine, response.source_nodes) > 0
    assert stats["lazily_encoded_chunks"] == 0 and stats["strategy"] == "turbo"
    assert stats["prefilled_tokens"] + stats["reused_tokens"] == stats["prompt_tokens"]
    # The cache key is recorded but reaches neither the prompt nor the embedded text.
    prompt = "\n".join(m["content"] for m in llm.last_messages)
    assert "title: Australia" in prompt and CACHE_KEY_FIELD not in prompt
    for node in response.source_nodes:
        key = node.node.metadata[CACHE_KEY_FIELD]
        assert key == engine.chunk_key(node.node.get_content(metadata_mode=MetadataMode.LLM))
        embedded = node.node.get_content(metadata_mode=MetadataMode.EMBED)
        assert "title:" in embedded and CACHE_KEY_FIELD not in embedded
        assert key not in prompt and key not in embedded


def test_first_token_logits_equal_the_engines_own(engine, index) -> None:
    options = {"recompute_ratio": 0.3}
    llm = KVRAGLLM(engine, strategy="blend", strategy_options=options, max_new_tokens=4)
    ask(index, llm)
    assert llm.last_stats["recomputed_tokens"] > 0
    same = engine.prefill(
        messages=llm.last_messages, known_chunks=llm.last_known_chunks, strategy="blend", **options
    )
    torch.testing.assert_close(llm.last_result.first_token_logits, same.logits, rtol=0, atol=0)

    full = KVRAGLLM(engine, strategy="full", max_new_tokens=4)
    ask(index, full)
    plain = engine.prefill(
        messages=full.last_messages, known_chunks=full.last_known_chunks, strategy="full"
    )
    torch.testing.assert_close(full.last_result.first_token_logits, plain.logits, rtol=0, atol=0)
    assert full.last_stats["reused_tokens"] == 0


def test_streaming_async_and_refine(engine, index) -> None:
    llm = KVRAGLLM(engine, strategy="turbo", max_new_tokens=8)
    answer = str(ask(index, llm))
    expected = chunk_reuse(llm)

    streamed = ask(index, llm, streaming=True)
    assert "".join(streamed.response_gen) == answer
    assert chunk_reuse(llm) == expected

    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    assert str(fresh(asyncio.run, query_engine.aquery(QUESTION))) == answer
    assert chunk_reuse(llm) == expected

    async def astream() -> str:
        qe = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True)
        response = await qe.aquery(QUESTION)
        return "".join([token async for token in response.async_response_gen()])

    assert fresh(asyncio.run, astream()) == answer
    assert chunk_reuse(llm) == expected

    refined = ask(index, llm, response_mode="refine")
    assert str(refined).strip()
    last_chunk = refined.source_nodes[-1:]  # the refine step's prompt holds the last chunk
    assert chunk_reuse(llm) == chunk_tokens(engine, last_chunk)


# ------------------------------------------------------- damaged, foreign, restarted
def test_missing_or_corrupt_caches_are_encoded_on_the_fly(engine, disk_engine, tmp_path) -> None:
    index = chroma_index(disk_engine, chromadb.PersistentClient(str(tmp_path / "chroma")))
    llm = KVRAGLLM(disk_engine, strategy="turbo", max_new_tokens=8)
    clean = ask(index, llm, similarity_top_k=3)
    clean_logits = llm.last_result.first_token_logits
    keys = [n.node.metadata[CACHE_KEY_FIELD] for n in clean.source_nodes]
    store = disk_engine.store
    entry_path(store, keys[0]).unlink()
    corrupt = entry_path(store, keys[1])
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x01
    corrupt.write_bytes(bytes(data))

    again = ask(index, llm, similarity_top_k=3)
    assert llm.last_stats["lazily_encoded_chunks"] == 2
    assert store.stats.rejected == 1
    assert str(again) == str(clean)
    # The two re-encoded chunks were batched differently from ingestion's: equal up
    # to matmul rounding (measured 1.5e-5 on logits of magnitude ~20), as documented.
    torch.testing.assert_close(llm.last_result.first_token_logits, clean_logits, atol=1e-4, rtol=0)
    assert all(store.get(k, disk_engine.fingerprint) is not None for k in keys)  # rewritten


def test_a_foreign_models_cache_is_never_used(engine, disk_engine, tmp_path) -> None:
    title, text = DOCS[0]
    node = TextNode(text=text, metadata={"title": title})
    KVCacheTransform(disk_engine)([node])
    ours = node.metadata[CACHE_KEY_FIELD]
    real = disk_engine.store.get(ours, disk_engine.fingerprint)
    foreign = ChunkKV(real.token_ids, real.keys + 1.0, real.values, "another-model")
    other = DiskKVStore(tmp_path / "other")
    other.put(foreign)
    store = disk_engine.store
    store.put(foreign)  # a valid entry of the other model, under the other model's key
    entry_path(store, ours).write_bytes(entry_path(other, foreign.key).read_bytes())
    node.metadata[CACHE_KEY_FIELD] = foreign.key  # as if ingested by the other model

    llm = KVRAGLLM(disk_engine, strategy="turbo", max_new_tokens=4)
    synthesizer = get_response_synthesizer(llm=llm)
    before = (store.stats.hits, store.stats.rejected)
    fresh(synthesizer.synthesize, QUESTION, [NodeWithScore(node=node, score=1.0)])
    assert store.stats.rejected == before[1] + 1  # our key's slot held a foreign entry
    assert store.stats.hits == before[0]  # nothing foreign was accepted
    assert llm.last_stats["lazily_encoded_chunks"] == 1
    assert entry_path(store, foreign.key).is_file()  # the metadata key was never read
    reference = engine.prefill(
        messages=llm.last_messages, known_chunks=llm.last_known_chunks, strategy="turbo"
    )
    # The session engine may hold this chunk from another batch (earlier tests): equal
    # up to matmul rounding, as documented; a foreign cache would be off by whole units.
    torch.testing.assert_close(
        llm.last_result.first_token_logits, reference.logits, atol=1e-4, rtol=0
    )


def test_caches_survive_a_restart_next_to_a_persistent_chroma(engine, tmp_path) -> None:
    kv_dir, chroma_dir, name = tmp_path / "kv", str(tmp_path / "chroma"), "docs"
    first = KVRAGEngine(engine.loaded, store=DiskKVStore(kv_dir))
    chroma_index(first, chromadb.PersistentClient(chroma_dir), name)
    assert len(first.store) == len(DOCS)

    # "Restart": a new engine (empty chunk index) and a new client on the same paths.
    restarted = KVRAGEngine(engine.loaded, store=DiskKVStore(kv_dir))
    collection = chromadb.PersistentClient(chroma_dir).get_collection(name)
    index = VectorStoreIndex.from_vector_store(
        ChromaVectorStore(chroma_collection=collection), embed_model=embed_model()
    )
    assert len(restarted.chunk_index) == 0
    llm = KVRAGLLM(restarted, strategy="turbo", max_new_tokens=8)
    response = ask(index, llm)
    assert llm.last_stats["lazily_encoded_chunks"] == 0
    assert chunk_reuse(llm) == chunk_tokens(restarted, response.source_nodes) > 0
    assert restarted.store.stats.writes == 0
    # Without the request's node texts nothing in the prompt is known as a chunk:
    blind = KVRAGEngine(engine.loaded, store=DiskKVStore(kv_dir))
    assert blind.prefill(messages=llm.last_messages, strategy="turbo").token_counts()[0] == 0

    # KVRAGRetriever alone registers the texts (and would encode what is missing).
    other = KVRAGEngine(engine.loaded, store=DiskKVStore(kv_dir))
    retriever = KVRAGRetriever(other, index, similarity_top_k=2)
    nodes = retriever.retrieve(QUESTION)
    assert all(t in other.chunk_index for t in llm_texts(nodes))
    assert other.store.stats.writes == 0
    llm = KVRAGLLM(other, strategy="turbo", max_new_tokens=8)
    fresh(RetrieverQueryEngine.from_args(retriever, llm=llm).query, QUESTION)
    assert llm.last_stats["lazily_encoded_chunks"] == 0
    assert chunk_reuse(llm) == chunk_tokens(other, nodes)


def test_retriever_encodes_missing_caches(engine, disk_engine) -> None:
    nodes = [TextNode(text=text, metadata={"title": title}) for title, text in DOCS]
    index = VectorStoreIndex(nodes, embed_model=embed_model())  # ingested without caches
    retriever = KVRAGRetriever(disk_engine, index, similarity_top_k=2)
    found = fresh(asyncio.run, retriever.aretrieve(QUESTION))
    assert disk_engine.store.stats.writes == 2
    for node in found:
        assert node.node.metadata[CACHE_KEY_FIELD] == disk_engine.chunk_key(llm_texts([node])[0])
    retriever.retrieve(QUESTION)
    assert disk_engine.store.stats.writes == 2
    with pytest.raises(TypeError):
        KVRAGRetriever(disk_engine, object())


# ------------------------------------------------------------------ ingestion
def test_transform_in_an_ingestion_pipeline_is_idempotent(disk_engine) -> None:
    def pipeline() -> IngestionPipeline:
        return IngestionPipeline(transformations=[splitter(), KVCacheTransform(disk_engine)])

    nodes = pipeline().run(documents=documents())
    store = disk_engine.store
    assert store.stats.writes == len(store) == len(nodes) == len(DOCS)
    keys = [n.metadata[CACHE_KEY_FIELD] for n in nodes]
    again = pipeline().run(documents=documents())  # a new pipeline: no ingestion cache
    assert [n.metadata[CACHE_KEY_FIELD] for n in again] == keys
    again = asyncio.run(pipeline().arun(documents=documents()))
    assert sorted(n.metadata[CACHE_KEY_FIELD] for n in again) == sorted(keys)
    assert store.stats.writes == len(DOCS)
    for node in nodes:
        assert CACHE_KEY_FIELD in node.excluded_llm_metadata_keys
        assert CACHE_KEY_FIELD in node.excluded_embed_metadata_keys
    assert KVCacheTransform(disk_engine).to_dict()["engine_fingerprint"] == disk_engine.fingerprint


# ------------------------------------------------------------------ the parts alone
def test_llm_calls_report_stats(engine, monkeypatch) -> None:
    text = DOCS[1][1]
    engine.encode_chunks([text], show_progress=False)
    llm = KVRAGLLM(engine, strategy="turbo", max_new_tokens=6, system_prompt="Be brief.")
    meta = llm.metadata
    assert (meta.context_window, meta.num_output) == (engine.context_window, 6)
    assert meta.is_chat_model and meta.model_name == engine.model_name

    done = llm.complete(f"{text}\nWhat is the capital of Canada?")
    assert done.additional_kwargs["reused_tokens"] > 0 and done.raw == done.additional_kwargs
    assert llm.last_messages[0] == {"role": "system", "content": "Be brief."}
    messages = [
        ChatMessage(role=MessageRole.DEVELOPER, content="Answer in one word."),
        ChatMessage(role=MessageRole.USER, content=f"{text}\nCapital of Canada?"),
    ]
    reply = llm.chat(messages)
    assert [m["role"] for m in llm.last_messages] == ["system", "user"]
    assert reply.message.role == MessageRole.ASSISTANT and reply.additional_kwargs["ttft_s"] > 0
    assert reply.additional_kwargs == llm.last_stats
    last = list(llm.stream_chat(messages))[-1]
    assert last.delta == "" and last.message.content == reply.message.content
    assert last.additional_kwargs["generated_tokens"] == llm.last_stats["generated_tokens"]
    assert "".join(p.delta for p in llm.stream_complete("Say hi.", max_new_tokens=3)).strip()
    assert llm.last_stats["generated_tokens"] <= 3

    async def concurrently() -> tuple[Any, str, int]:
        ticks = [0]

        async def tick() -> None:
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        answer = await llm.achat(messages)
        streamed = "".join([r.delta async for r in await llm.astream_chat(messages)])
        ticker.cancel()
        abandoned = await llm.astream_chat(messages)
        async for _ in abandoned:
            break  # leaving early must release the engine for the next call
        await abandoned.aclose()
        return answer, streamed, ticks[0]

    answer, streamed, ticks = asyncio.run(concurrently())
    assert answer.message.content == streamed == reply.message.content
    assert ticks > 10  # the event loop kept running during generation
    later = threading.Thread(target=llm.complete, args=("Say hi.",), kwargs={"max_new_tokens": 2})
    later.start()
    later.join(timeout=120)
    assert not later.is_alive()
    assert asyncio.run(llm.acomplete("Say hi.", max_new_tokens=2)).text.strip()
    with pytest.raises(ValueError):
        KVRAGLLM(engine, model="another")
    with pytest.raises(TypeError):
        KVRAGLLM(engine, strategy="turbo", strategy_options={"recompute_ratio": 0.5})
    monkeypatch.setattr(KVRAGEngine, "shared", classmethod(lambda cls, *a, **k: engine))
    assert KVRAGLLM(model="default").engine is engine


def test_rerank_postprocessor(engine, index) -> None:
    reranker = KVReranker(engine)
    nodes = [NodeWithScore(node=TextNode(text=t, metadata={"title": h})) for h, t in DOCS]
    kept = KVRerankPostprocessor(reranker, top_n=2).postprocess_nodes(nodes, query_str=QUESTION)
    docs = [n.node.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
    expected = reranker.rerank(QUESTION, docs, top_n=2)
    assert [(n.node.node_id, n.score) for n in kept] == [
        (nodes[i].node.node_id, pytest.approx(s)) for i, s in expected
    ]
    llm = KVRAGLLM(engine, strategy="turbo", max_new_tokens=2)
    rerank = KVRerankPostprocessor(reranker, top_n=1)
    response = ask(index, llm, similarity_top_k=3, node_postprocessors=[rerank])
    assert len(response.source_nodes) == 1
    with pytest.raises(ValueError):
        KVRerankPostprocessor(reranker).postprocess_nodes(nodes)


def test_minilm_embedding() -> None:
    model = embed_model()
    vector = model.get_text_embedding("Canberra is in Australia.")
    assert len(vector) == 384 and sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-4)
    assert model.get_query_embedding("Canberra is in Australia.") == pytest.approx(vector, abs=1e-5)
    batch = asyncio.run(model.aget_text_embedding_batch(["a b", "Canberra is in Australia."]))
    assert batch[1] == pytest.approx(vector, abs=1e-5)


def test_hooks_note_nodes_per_request(engine, disk_engine) -> None:
    """A synthesizer handed nodes directly (no retriever) still reuses their caches."""
    node = TextNode(text=DOCS[2][1], metadata={"title": DOCS[2][0]})
    KVCacheTransform(disk_engine)([node])
    restarted = KVRAGEngine(engine.loaded, store=disk_engine.store, cache_precision="model")
    llm = KVRAGLLM(restarted, strategy="turbo", max_new_tokens=4)
    synthesize = get_response_synthesizer(llm=llm).synthesize

    def run() -> tuple[str, ...]:
        synthesize("Capital of New Zealand?", [NodeWithScore(node=node)])
        return request_chunks()

    noted = fresh(run)
    assert noted == (node.get_content(metadata_mode=MetadataMode.LLM),)
    assert llm.last_known_chunks == noted
    assert llm.last_stats["reused_tokens"] > 0 and llm.last_stats["lazily_encoded_chunks"] == 0
    assert fresh(request_chunks) == ()  # contexts do not share notes
