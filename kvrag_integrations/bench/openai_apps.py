"""The applications of ``bench openai``: the frameworks' documented RAG patterns with a
plain OpenAI-compatible model, and the servers they point at.

Nothing of this package is in an application's path to the model: ``ChatOpenAI``
and ``OpenAILike`` talk HTTP to the server. The embedding model is the packaged
MiniLM through sentence-transformers, as an application would load it. A
``Meter`` reads what the server answered (usage, first-token log-probabilities)
and how long it took, from the HTTP client the application is given.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvrag_integrations.bench.ports import free_port

SYSTEM_PROMPT = "You are a helpful assistant. Use the following context in your response:"


def system_prompt(context: str) -> str:
    """The system message of LangChain's RAG agent (its docs' ``prompt_with_context``)."""
    return f"{SYSTEM_PROMPT}\n\n{context}"


class Meter:
    """Latency, usage and first-token log-probabilities of each request an
    application's HTTP client sends (non-streaming: the answer arrives whole)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._started = 0.0

    def client(self) -> httpx.Client:
        hooks = {"request": [self._request], "response": [self._response]}
        return httpx.Client(event_hooks=hooks, timeout=600)

    def _request(self, request: httpx.Request) -> None:
        self._started = time.perf_counter()

    def _response(self, response: httpx.Response) -> None:
        elapsed = time.perf_counter() - self._started
        response.read()
        body = response.json() if response.status_code == 200 else {}
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        self.records.append(
            {
                "latency_s": elapsed,
                "prompt_tokens": usage.get("prompt_tokens") or 0,
                "cached": details.get("cached_tokens") or 0,
                "top": _top(body),
            }
        )

    def take(self) -> dict[str, Any]:
        """The last request's record (the application made one model call)."""
        if not self.records:
            raise RuntimeError("the application sent no request")
        record = self.records[-1]
        self.records.clear()
        return record


def _top(body: dict[str, Any]) -> dict[str, float]:
    choices = body.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") or {}
    if logprobs.get("content"):  # chat
        return {t["token"]: t["logprob"] for t in logprobs["content"][0]["top_logprobs"]}
    tops = logprobs.get("top_logprobs")  # completions
    return dict(tops[0]) if tops else {}


# ------------------------------------------------------------------ embeddings
def _sentence_model() -> Any:
    from kvrag_integrations.embeddings import load_sentence_transformer

    return load_sentence_transformer()


def embeddings_for_langchain() -> Any:
    from langchain_core.embeddings import Embeddings

    model = _sentence_model()

    class MiniLM(Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return model.encode(texts, normalize_embeddings=True).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    return MiniLM()


def embeddings_for_llama_index() -> Any:
    from llama_index.core.embeddings import BaseEmbedding

    model = _sentence_model()

    class MiniLM(BaseEmbedding):
        def _get_query_embedding(self, query: str) -> list[float]:
            return model.encode([query], normalize_embeddings=True)[0].tolist()

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._get_query_embedding(text)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

    return MiniLM(model_name="all-MiniLM-L6-v2")


# ------------------------------------------------------------------ applications
def langchain_agent(
    url: str,
    model: str,
    passages: list[str],
    embeddings: Any,
    http_client: httpx.Client,
    api_key: str = "none",
    cache_salt: str | None = None,
) -> Callable[[str], Any]:
    """LangChain's RAG agent (its docs), over an ``InMemoryVectorStore`` of ``passages``,
    with ``ChatOpenAI`` pointed at ``url`` (``cache_salt``: the client's own tenant,
    sent in ``extra_body``: its learned prompts are found again)."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelRequest, dynamic_prompt
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    vector_store = InMemoryVectorStore(embeddings)
    vector_store.add_texts(passages)
    llm = ChatOpenAI(
        model=model,
        base_url=f"{url}/v1",
        api_key=api_key,
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        http_client=http_client,
        extra_body={"cache_salt": cache_salt} if cache_salt else None,
    )

    @dynamic_prompt
    def prompt_with_context(request: ModelRequest) -> str:
        """Inject context into state messages."""
        last_query = request.state["messages"][-1].text
        retrieved_docs = vector_store.similarity_search(last_query, k=len(passages))
        docs_content = "\n\n".join(doc.page_content for doc in retrieved_docs)
        return system_prompt(docs_content)

    agent = create_agent(llm, tools=[], middleware=[prompt_with_context])
    return lambda question: agent.invoke({"messages": [{"role": "user", "content": question}]})


def llama_index_engine(
    url: str,
    model: str,
    passages: list[str],
    embed_model: Any,
    http_client: httpx.Client,
    cache_salt: str | None = None,
) -> Callable[[str], Any]:
    """LlamaIndex's query engine over a ``VectorStoreIndex`` of ``passages``, with
    ``OpenAILike`` pointed at ``url`` (completions: its default; ``cache_salt``:
    the client's own tenant, in ``extra_body``)."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.llms.openai_like import OpenAILike

    index = VectorStoreIndex.from_documents(
        [Document(text=p) for p in passages], embed_model=embed_model
    )
    llm = OpenAILike(
        model=model,
        api_base=f"{url}/v1",
        api_key="none",
        max_tokens=1,
        temperature=0,
        context_window=4096,
        http_client=http_client,
        additional_kwargs={"extra_body": {"cache_salt": cache_salt}} if cache_salt else {},
    )
    engine = index.as_query_engine(llm=llm, similarity_top_k=len(passages))
    return engine.query


# ------------------------------------------------------------------ servers
class Server:
    """One OpenAI server on a free port until the block ends: ``"kvrag"`` (``serve``
    on a fresh disk store) or ``"plain"`` (vLLM's own, without the connector)."""

    def __init__(self, kind: str, extra: list[str] | None = None) -> None:
        self.kind = kind
        self.extra = extra or []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrag-bench-server-")

    def command(self) -> list[str]:
        from kvrag_integrations.vllm.launch import cpu_kv_cache_bytes, plain_server_command

        rest = ["--port", str(self.port), "--max-model-len", "4096", *self.extra]
        rest += ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes())]
        if self.kind == "plain":
            return plain_server_command(None, rest)
        store = self.store_url
        return [sys.executable, "-m", "kvrag_integrations.vllm.serve", "--store", store, *rest]

    @property
    def store_url(self) -> str:
        return f"disk:{Path(self._tmp.name) / 'store'}"

    def wait_learned(self, length: int, timeout: float = 60.0) -> float:
        """Seconds until the store's index holds an entry of ``length`` ids (a learned
        prompt is written after its answer); 0 for vLLM alone."""
        return wait_indexed(self.store_url, length, timeout) if self.kind == "kvrag" else 0.0

    def __enter__(self) -> Server:
        from kvrag_integrations.vllm.launch import platform_env, wait_until_serving

        log = open(Path(self._tmp.name) / "server.log", "wb")
        env = {**platform_env(), **os.environ}
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        if wait_until_serving(self.url, self.proc):
            return self
        self.__exit__()
        raise RuntimeError((Path(self._tmp.name) / "server.log").read_text()[-3000:])

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._tmp.cleanup()


def wait_indexed(store_url: str, length: int, timeout: float = 60.0) -> float:
    """Seconds until the index log of the store ``store_url`` holds an entry of
    ``length`` ids (a prompt the server learns is written after its answer).

    Raises:
        TimeoutError: none within ``timeout`` seconds.
    """
    from kvrag_integrations.matching import open_index_log

    log = open_index_log(store_url)
    started = time.monotonic()
    try:
        while time.monotonic() - started < timeout:
            if any(len(ids) == length for _, ids in log.read_new()):
                return time.monotonic() - started
            time.sleep(0.02)
    finally:
        log.close()
    raise TimeoutError(f"no entry of {length} ids was indexed in {timeout} s")
