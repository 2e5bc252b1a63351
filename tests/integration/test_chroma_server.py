"""Both framework adapters against a real Chroma server (``chroma run``) over HTTP."""

from __future__ import annotations

import contextvars
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import chromadb
import pytest
from llama_index.core import Document as LIDocument
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.vector_stores.chroma import ChromaVectorStore

from kvrag_integrations import CACHE_KEY_FIELD, KVRAGEngine, MemoryKVStore
from kvrag_integrations.bench.ports import free_port
from kvrag_integrations.langchain import KVRAGRetriever, add_documents
from kvrag_integrations.llama_index import KVRAGLLM, KVCacheTransform, MiniLMEmbedding

DOCS = [
    "Canberra is the capital city of Australia. It was chosen in 1908.",
    "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario.",
    "Wellington is the capital of New Zealand, on the North Island.",
]
QUESTION = "What is the capital of Australia?"


def find_chroma() -> str | None:
    beside = Path(sys.executable).parent / "chroma"  # the CLI of this interpreter's chromadb
    return str(beside) if beside.is_file() else shutil.which("chroma")


@pytest.fixture(scope="module")
def chroma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    cli = find_chroma()
    if cli is None:
        pytest.skip("the chroma CLI (installed with chromadb) is not on this machine")
    workdir = tmp_path_factory.mktemp("chroma")
    host, port = "127.0.0.1", free_port()
    env = {**os.environ, "ANONYMIZED_TELEMETRY": "False"}
    args = [cli, "run", "--path", str(workdir / "db"), "--host", host, "--port", str(port)]
    log = open(workdir / "chroma.log", "wb")  # noqa: SIM115  (closed after the server stops)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                url = f"http://{host}:{port}/api/v2/heartbeat"
                with urllib.request.urlopen(url, timeout=1) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "chroma.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"chroma server did not come up on port {port}:\n{tail}")
            time.sleep(0.2)
        yield host, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture()
def client(chroma_server: tuple[str, int]) -> chromadb.api.ClientAPI:
    host, port = chroma_server
    return chromadb.HttpClient(host=host, port=port)


@pytest.fixture()
def fresh_engine(engine: KVRAGEngine) -> KVRAGEngine:
    """Same weights, an empty store: every cache it has comes from this test's ingestion."""
    return KVRAGEngine(engine.loaded, store=MemoryKVStore())


def test_langchain_over_chroma_server(client, fresh_engine: KVRAGEngine) -> None:
    collection = client.create_collection(f"lc-{uuid.uuid4().hex}", embedding_function=None)
    ids = add_documents(collection, DOCS, fresh_engine, show_progress=False)
    assert collection.count() == len(DOCS) == len(ids)
    writes = fresh_engine.store.stats.writes

    retriever = KVRAGRetriever(collection=collection, engine=fresh_engine, k=2)
    docs = retriever.invoke(QUESTION)
    assert len(docs) == 2 and "Canberra" in docs[0].page_content
    for doc in docs:
        key = doc.metadata[CACHE_KEY_FIELD]
        assert key == fresh_engine.chunk_key(doc.page_content)
        assert fresh_engine.store.get(key, fresh_engine.fingerprint) is not None
    assert fresh_engine.store.stats.writes == writes  # retrieval found them all cached

    result = fresh_engine.generate(
        question=QUESTION, chunks=[d.page_content for d in docs], max_new_tokens=8
    )
    assert result.lazily_encoded_chunks == 0 and result.reused_tokens > 0


def test_llama_index_over_chroma_server(client, fresh_engine: KVRAGEngine) -> None:
    collection = client.create_collection(f"li-{uuid.uuid4().hex}")
    index = VectorStoreIndex.from_documents(
        [LIDocument(text=text) for text in DOCS],
        storage_context=StorageContext.from_defaults(
            vector_store=ChromaVectorStore(chroma_collection=collection)
        ),
        embed_model=MiniLMEmbedding(),
        transformations=[
            SentenceSplitter(chunk_size=128, chunk_overlap=0),
            KVCacheTransform(fresh_engine),
        ],
    )
    assert collection.count() == len(DOCS)
    llm = KVRAGLLM(fresh_engine, strategy="turbo", max_new_tokens=8)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    # An empty context: no node texts noted by earlier tests in this thread.
    response = contextvars.Context().run(query_engine.query, QUESTION)
    stats = llm.last_stats
    assert "Canberra" in str(response)
    assert stats["reused_tokens"] - stats["reused_prefix_tokens"] > 0  # the chunks' caches
    assert stats["lazily_encoded_chunks"] == 0


def test_command_line_over_chroma_server(chroma_server, engine, tmp_path, capsys) -> None:
    from kvrag_integrations.cli import main

    host, port = chroma_server
    for i, text in enumerate(DOCS):
        (tmp_path / f"doc{i}.txt").write_text(text)
    where = ["--collection", f"cli-{uuid.uuid4().hex[:8]}", "--chroma-host", host]
    where += ["--chroma-port", str(port), "--store", f"disk:{tmp_path / 'kv'}"]
    assert main(["ingest", str(tmp_path), *where, "--no-progress"]) == 0
    assert "3 new" in capsys.readouterr().out
    assert main(["ingest", str(tmp_path), *where, "--no-progress"]) == 0
    assert "3 unchanged" in capsys.readouterr().out
    argv = ["ask", QUESTION, *where, "--strategy", "turbo", "--top-k", "1"]
    assert main([*argv, "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "doc0.txt" in err and " reused 0 " not in err
