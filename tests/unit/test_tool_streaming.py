"""Streaming equals invoke with tools bound, for every family, on both frameworks.

A scripted engine answers with a given output: the family's tiny engine
(test_tool_families: its real template and marker tokens) with its job replaced
by one that emits the output's tokens one at a time, filling
``result.token_ids`` as both engines do. Everything else (prompt, tool plan,
``with_tool_calls``, the adapters) is the real path. For text, a call, text
then a call, an invalid call, and answers that start with ``[``, ``{`` or a
code fence: the concatenated stream (text, and ``tool_call_chunks`` merged)
equals what invoke returns, ids included; text that cannot be a call streams
before the answer ends. The random tiny model itself, sampled with a seed,
streams what it generates.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import operator
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from corpus import SEARCH_TOOL
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool
from test_tool_families import _cached

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.engine.modeling.generate import TextDecoder
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.langchain import ChatKVRAG
from kvrag_integrations.llama_index import KVRAGLLM

CALLS = {
    "qwen2.5": '<tool_call>\n{"name": "search", "arguments": {"query": "tower"}}\n</tool_call>',
    "llama3.1": '<|python_tag|>{"name": "search", "parameters": {"query": "tower"}}',
    "mistral": '[TOOL_CALLS][{"name": "search", "arguments": {"query": "tower"}}]',
    "gemma3": '[search(query="tower")]',
}
BARE = {"llama3.1": '{"name": "search", "parameters": {"query": "tower"}}'}
TEXT = "The tower was completed in 1889, as the documents say."
LEADING = ["[1] The tower was completed in 1889.", '{"name": "Alice", "age": 30}', "```\n1889\n```"]


def _outputs(family: str) -> list[tuple[str, str]]:
    out = [("text", TEXT), ("call", CALLS[family])]
    out += [(f"starts with {a[0]}", a) for a in LEADING]
    if family != "gemma3":  # marked calls may follow text; a Python list is the whole answer
        out.append(("text then call", "Let me look that up.\n" + CALLS[family]))
        bad = CALLS[family].replace('"tower"', "tower")
        out.append(("invalid call", bad))
    if family in BARE:
        out.append(("bare call", BARE[family]))
    return out


CASES = [(f, label, text) for f in CALLS for label, text in _outputs(f)]


def scripted(engine: KVRAGEngine, output: str) -> KVRAGEngine:
    """``engine`` answering every request with ``output``'s tokens, one at a time."""
    tok = engine.tokenizer
    ids = tok(output, add_special_tokens=False)["input_ids"]

    def request_job(request: Any, result: Any) -> Any:
        def job(cancel: threading.Event) -> Iterator[str]:
            decoder = TextDecoder(tok)
            for token in ids:
                result.token_ids.append(token)
                piece = decoder.push(token)
                if piece:
                    yield piece
            result.finish_reason = "stop"
            result.generated_tokens = len(ids)

        return job

    other = copy.copy(engine)
    other.request_job = request_job
    return other


def _engine(family: str, tiny_loaded: LoadedModel, output: str) -> KVRAGEngine:
    return scripted(_cached(family, tiny_loaded), output)


MESSAGES = [{"role": "user", "content": "When was the tower built?"}]


@pytest.mark.parametrize(("family", "label", "output"), CASES)
def test_the_engines_stream_equals_generate(
    tiny_loaded: LoadedModel, family: str, label: str, output: str
) -> None:
    engine = _engine(family, tiny_loaded, output)
    kw = dict(messages=MESSAGES, tools=[SEARCH_TOOL])
    result = engine.generate(**kw)
    job, streamed = engine.open_request(None, None, kw)
    pieces, at = [], []
    for piece in job(threading.Event()):  # the stream's work, on this thread
        pieces.append(piece)
        at.append(len(streamed.token_ids))
    assert "".join(pieces) == streamed.text == result.text
    assert streamed.tool_calls == result.tool_calls  # ids included
    assert streamed.invalid_tool_calls == result.invalid_tool_calls
    n = len(streamed.token_ids)
    if label in ("call", "bare call"):
        assert [c.name for c in result.tool_calls] == ["search"] and result.text == ""
    elif label == "invalid call":
        assert not result.tool_calls and len(result.invalid_tool_calls) == 1
    elif label == "text then call":
        assert result.text == "Let me look that up." and len(result.tool_calls) == 1
        assert at[0] < n  # the text streamed before the call ended
    else:  # text, whatever it starts with: all of it, streamed before the end
        assert result.text == output and not result.tool_calls and not result.invalid_tool_calls
        assert len(pieces) > 1 and at[0] < n - 2


def _lc_equal(invoked: Any, merged: Any) -> None:
    assert merged.content == invoked.content
    assert merged.tool_calls == invoked.tool_calls
    strip = [{k: c[k] for k in ("name", "args", "id")} for c in invoked.invalid_tool_calls]
    assert [{k: c[k] for k in ("name", "args", "id")} for c in merged.invalid_tool_calls] == strip


@pytest.mark.parametrize(("family", "label", "output"), CASES)
def test_langchain_stream_and_astream_equal_invoke(
    tiny_loaded: LoadedModel, family: str, label: str, output: str
) -> None:
    llm = ChatKVRAG(engine=_engine(family, tiny_loaded, output)).bind_tools([SEARCH_TOOL])
    question = [HumanMessage("When was the tower built?")]
    invoked = llm.invoke(question)
    _lc_equal(invoked, functools.reduce(operator.add, llm.stream(question)))

    async def collect() -> list[Any]:
        return [chunk async for chunk in llm.astream(question)]

    _lc_equal(invoked, functools.reduce(operator.add, asyncio.run(collect())))
    if label == "invalid call":
        assert invoked.invalid_tool_calls[0]["error"] and not invoked.tool_calls


def search(query: str) -> str:
    """Search the documents."""
    return query


@pytest.mark.parametrize(("family", "label", "output"), CASES)
def test_llama_index_stream_chat_equals_chat(
    tiny_loaded: LoadedModel, family: str, label: str, output: str
) -> None:
    llm = KVRAGLLM(_engine(family, tiny_loaded, output))
    tool = FunctionTool.from_defaults(fn=search)
    messages = [ChatMessage(role="user", content="When was the tower built?")]
    chat = llm.chat_with_tools([tool], chat_history=messages, allow_parallel_tool_calls=True)
    *_, last = llm.stream_chat_with_tools([tool], chat_history=messages)

    async def collect() -> list[Any]:
        stream = await llm.astream_chat_with_tools([tool], chat_history=messages)
        return [r async for r in stream]

    alast = asyncio.run(collect())[-1]
    for streamed in (last, alast):
        assert streamed.message.content == chat.message.content
        assert streamed.message.additional_kwargs == chat.message.additional_kwargs
    selections = llm.get_tool_calls_from_response(chat, error_on_no_tool_call=False)
    assert [s.tool_name for s in selections] == (
        ["search"] if "call" in label and label != "invalid call" else []
    )


def test_parallel_tool_calls_false_keeps_the_first_call(tiny_loaded: LoadedModel) -> None:
    two = CALLS["qwen2.5"] + "\n" + CALLS["qwen2.5"].replace("tower", "bridge")
    engine = _engine("qwen2.5", tiny_loaded, two)
    both = engine.generate(messages=MESSAGES, tools=[SEARCH_TOOL])
    one = engine.generate(messages=MESSAGES, tools=[SEARCH_TOOL], parallel_tool_calls=False)
    assert [c.arguments["query"] for c in both.tool_calls] == ["tower", "bridge"]
    assert one.tool_calls == both.tool_calls[:1]
    llm = ChatKVRAG(engine=engine)
    assert (
        len(llm.bind_tools([SEARCH_TOOL], parallel_tool_calls=False).invoke("Q?").tool_calls) == 1
    )
    with pytest.raises(TypeError, match="parallel_tool_calls"):
        engine.generate(messages=MESSAGES, tools=[SEARCH_TOOL], parallel_tool_calls="no")


@pytest.mark.parametrize("family", ["qwen2.5", "mistral"])
def test_the_random_model_streams_what_it_generates(tiny_loaded: LoadedModel, family: str) -> None:
    engine = _cached(family, tiny_loaded)
    kw = dict(messages=MESSAGES, tools=[SEARCH_TOOL], max_new_tokens=24, temperature=1.0, seed=7)
    result = engine.generate(**kw)
    stream = engine.stream(**kw)
    assert "".join(stream) == stream.result.text == result.text
    assert stream.result.tool_calls == result.tool_calls
    assert stream.result.token_ids == result.token_ids


def test_concurrent_llama_index_chats_each_get_their_own_calls(tiny_loaded: LoadedModel) -> None:
    """No shared state: each thread's ``chat`` answers from its own call's result
    (it read the instance's last result, which another thread may have set)."""
    base = _cached("qwen2.5", tiny_loaded)
    n = 6
    llm = KVRAGLLM(scripted(base, ""))
    barrier = threading.Barrier(n)

    def request_job(request: Any, result: Any) -> Any:
        asked = re.search(r"Question n(\d+)n", request.prompt.pieces[-1].text).group(1)
        answer = CALLS["qwen2.5"].replace("tower", f"q{asked}")
        ids = base.tokenizer(answer, add_special_tokens=False)["input_ids"]

        def job(cancel: threading.Event) -> Iterator[str]:
            barrier.wait(timeout=30)  # every request in flight at once
            result.token_ids.extend(ids)
            yield answer
            time.sleep(0.01 * int(asked))  # finish in a different order

        return job

    llm.engine.request_job = request_job
    got: dict[int, Any] = {}

    def ask(i: int) -> None:
        message = ChatMessage(role="user", content=f"Question n{i}n")
        got[i] = llm.chat([message], tools=[SEARCH_TOOL]).message.additional_kwargs

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    queries = {i: json.loads(got[i]["tool_calls"][0]["function"]["arguments"]) for i in got}
    assert queries == {i: {"query": f"q{i}"} for i in range(n)}


LONG = ("The tower was completed in 1889. " * 3200)[:100_000]  # a 100 KB argument


@pytest.mark.parametrize(
    ("family", "call"), [*CALLS.items(), *BARE.items()], ids=[*CALLS, *(f"{f} bare" for f in BARE)]
)
def test_a_100kb_argument_streams_as_generate_reads_it(
    tiny_loaded: LoadedModel, family: str, call: str
) -> None:
    """The detectors read a stream once (the suite ``bench tools`` times them): a
    call with a 100 KB argument, emitted token by token, is the same call streamed
    or not, and no piece of it streams as text."""
    output = call.replace('"tower"', json.dumps(LONG))
    engine = _engine(family, tiny_loaded, output)
    kw = dict(messages=MESSAGES, tools=[SEARCH_TOOL])
    result = engine.generate(**kw)
    job, streamed = engine.open_request(None, None, kw)
    assert "".join(job(threading.Event())) == streamed.text == result.text == ""
    assert streamed.tool_calls == result.tool_calls
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("search", {"query": LONG})]
