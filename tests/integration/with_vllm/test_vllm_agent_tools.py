"""LangChain's RAG agent over the server, with vLLM's own tool calling.

One ``python -m kvrag_integrations.vllm.serve`` started with vLLM's tool-calling
flags and the packaged ChatML tool template (the bundled SmolLM2's own template
has no tools). The application is LangChain v1's RAG-agent tutorial: a
``retrieve_context`` tool (``response_format="content_and_artifact"``) over an
in-memory vector store, ``create_agent(ChatOpenAI(base_url=...), tools=[...])``.
Its passages were ingested with ``kvrag ingest --server`` (shared: what a writer
stored deliberately). What is checked is what the server reports for the agent's
second model call (the one holding the ``ToolMessage``): LangChain's
``usage_metadata["input_token_details"]["cache_read"]``, against the tokens the
passages hold.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_helpers import free_port
from vllm_helpers import Corpus, VLLMServer, needs_vllm

needs_vllm()
pytest.importorskip("langchain_openai")
pytest.importorskip("langchain.agents")

from kvrag_integrations.bench.openai_apps import embeddings_for_langchain  # noqa: E402

TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOL_FLAGS += ["--chat-template", "chatml-tools", "--tool-strict-level", "parameter"]
PASSAGES = 4


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    workdir = tmp_path_factory.mktemp("vllm-tools")
    server = VLLMServer(f"disk:{workdir / 'store'}", workdir, free_port(), TOOL_FLAGS)
    try:
        yield server.wait()
    finally:
        server.stop()


def ingest(url: str, texts: list[str], folder: Path) -> list[tuple[str, dict]]:
    """``kvrag ingest --server``: the chunks (text, metadata) it stored, as the app's
    vector store gets them."""
    import chromadb

    notes = folder / "notes"
    notes.mkdir()
    for i, text in enumerate(texts):
        (notes / f"note{i}.txt").write_text(text)
    command = [sys.executable, "-m", "kvrag_integrations.cli", "ingest", str(notes)]
    command += ["--collection", "notes", "--chroma", str(folder / "chroma")]
    command += ["--server", url, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = chromadb.PersistentClient(str(folder / "chroma")).get_collection("notes").get()
    return [(t, {"source": m["file_name"]}) for t, m in zip(got["documents"], got["metadatas"])]


def rag_agent(url: str, model: str, chunks: list[tuple[str, dict]], **client: object):
    """LangChain's RAG-agent tutorial, verbatim but for the model and a middleware that
    makes the small model call the tool first (vLLM's named tool choice: structured
    output) and answer after it."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain.tools import tool
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    vector_store = InMemoryVectorStore(embeddings_for_langchain())
    vector_store.add_texts([t for t, _ in chunks], metadatas=[m for _, m in chunks])

    @tool(response_format="content_and_artifact")
    def retrieve_context(query: str):  # type: ignore[no-untyped-def]
        """Retrieve information to help answer a query."""
        retrieved_docs = vector_store.similarity_search(query, k=PASSAGES)
        serialized = "\n\n".join(
            (f"Source: {doc.metadata}\nContent: {doc.page_content}") for doc in retrieved_docs
        )
        return serialized, retrieved_docs

    @wrap_model_call
    def retrieve_first(request, handler):  # type: ignore[no-untyped-def]
        first = request.messages[-1].type == "human"
        return handler(request.override(tool_choice="retrieve_context" if first else "none"))

    model_ = ChatOpenAI(
        model=model, base_url=f"{url}/v1", api_key="none", temperature=0, max_tokens=96, **client
    )
    prompt = (
        "You have access to a tool that retrieves context from a blog post. "
        "Use the tool to help answer user queries."
    )
    tools = [retrieve_context]
    agent = create_agent(model_, tools, system_prompt=prompt, middleware=[retrieve_first])
    return lambda q: agent.invoke({"messages": [{"role": "user", "content": q}]})["messages"]


def cache_read(message) -> int:  # type: ignore[no-untyped-def]
    return (message.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0)


def test_rag_agent_reads_the_tool_messages_passages_from_storage(
    tool_server: VLLMServer, musique: Corpus, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from kvrag_integrations.engine.modeling.model import checkpoint_folder

    folder, name = checkpoint_folder(None)
    tok = AutoTokenizer.from_pretrained(folder)
    chunks = ingest(tool_server.url, musique.chunks(70, PASSAGES, tag="agent-tools"), tmp_path)
    ask = rag_agent(tool_server.url, name, chunks)
    for question in [musique.item(70).question, "Which people or places do these name?"]:
        messages = ask(question)
        kinds = [m.type for m in messages]
        assert kinds == ["human", "ai", "tool", "ai"], kinds
        assert messages[1].tool_calls[0]["name"] == "retrieve_context"
        docs = messages[2].artifact  # the Documents the tool returned
        held = sum(len(tok(d.page_content, add_special_tokens=False).input_ids) for d in docs)
        usage = messages[3].usage_metadata
        computed = usage["input_tokens"] - cache_read(messages[3])
        print(question, usage, held)
        # the passages' tokens came from storage: at least 85% of them cached, and
        # what was computed is at most the tail after them and 15% of them
        assert cache_read(messages[3]) >= 0.85 * held
        assert computed <= 0.15 * held
