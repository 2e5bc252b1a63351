"""Reuse of a tool's passages, whatever form the tool returns them in (in process).

The agent's second call holds the tool's message. Its passages were ingested
(``encode_chunks``, as a vector store's documents are). A tool returning plain
text (the passages joined) or LangChain's ``content_and_artifact`` (text, and
the ``Document``s as the artifact) gets its passages read from their stored
caches; a tool returning ``json.dumps`` of its documents escapes their quotes
and newlines, so the passages are not in the prompt as they were stored and
are prefilled (docs/langchain.md, "Tools that return JSON", gives the figure).
The share printed is the passage tokens read from storage over all of them.
"""

from __future__ import annotations

import json

import pytest
from corpus import SEARCH_TOOL
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from kvrag_integrations import Chunk, KVRAGEngine
from kvrag_integrations.langchain import ChatKVRAG

# Passages as a retriever returns them: newlines and quotes in them.
DOCS = [
    'The Eiffel Tower, called "the Iron Lady", stands in Paris.\nIt was completed in 1889.',
    'Canberra is the capital of Australia.\nIts name may mean "meeting place".',
    'The Golden Gate Bridge opened in 1937.\nIt spans the "Golden Gate" strait.',
    'Mount Kosciuszko is the highest mountain of Australia.\nIt is 2,228 m "high".',
]


def _tool_message(form: str) -> ToolMessage:
    if form == "plain text":
        return ToolMessage("\n\n".join(DOCS), tool_call_id="c1")
    docs = [Document(d, metadata={"source": f"note{i}.txt"}) for i, d in enumerate(DOCS)]
    if form == "content_and_artifact":  # LangChain's RAG-agent tutorial's tool
        text = "\n\n".join(f"Source: {d.metadata}\nContent: {d.page_content}" for d in docs)
        return ToolMessage(text, tool_call_id="c1", artifact=docs)
    dumped = json.dumps([{"page_content": d.page_content, "metadata": d.metadata} for d in docs])
    return ToolMessage(dumped, tool_call_id="c1")


@pytest.mark.parametrize("form", ["plain text", "content_and_artifact", "json"])
def test_a_tools_passages_are_read_from_storage_in_any_form(engine: KVRAGEngine, form: str) -> None:
    engine.encode_chunks(DOCS)
    llm = ChatKVRAG(engine=engine, max_tokens=1).bind_tools([SEARCH_TOOL])
    call = {"name": "search", "args": {"query": "landmarks"}, "id": "c1"}
    messages = [
        HumanMessage("Which landmarks are named?"),
        AIMessage("", tool_calls=[call]),
        _tool_message(form),
    ]
    reply = llm.invoke(messages)
    passages = sum(engine.tokenize([Chunk(d)]).num_tokens for d in DOCS)
    read = reply.response_metadata["reused_chunk_tokens"]
    # (a passage's stored entry may hold the separator after it: read can pass the total)
    print(f"{form}: passage tokens {passages}, chunk tokens read from storage {read}")
    if form == "json":  # escaped: not the stored passages' text, prefilled exactly
        assert read == 0
    else:
        assert read >= 0.85 * passages
