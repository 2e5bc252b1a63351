"""KVRAGLLM refuses what it cannot honour, before any forward: bad options, non-text blocks."""

from __future__ import annotations

import threading

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock

from kvrag_integrations import KVRAGEngine, MemoryKVStore, UnsupportedInputError
from kvrag_integrations.llama_index import KVRAGLLM


@pytest.fixture()
def llm(engine: KVRAGEngine) -> KVRAGLLM:
    return KVRAGLLM(KVRAGEngine(engine.loaded, store=MemoryKVStore()), max_new_tokens=4)


class Forwards:
    """Counts forwards of the real model."""

    def __init__(self, engine: KVRAGEngine) -> None:
        self.calls = 0
        self.hook = engine.model.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1


BAD = [
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"top_k": 2.5}, TypeError, "top_k"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
    ({"seed": "abc"}, TypeError, "seed"),
    ({"stop": [None]}, TypeError, "stop"),
    ({"top_p": 0.0}, ValueError, "top_p"),
]


@pytest.mark.parametrize("bad,error,name", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_call_options_fail_before_any_forward(llm: KVRAGLLM, bad, error, name) -> None:
    counter = Forwards(llm.engine)
    try:
        with pytest.raises(error, match=name):
            llm.complete("Hello", **bad)
        with pytest.raises(error, match=name):
            llm.stream_chat([ChatMessage(role=MessageRole.USER, content="Hello")], **bad)
    finally:
        counter.hook.remove()
    assert counter.calls == 0


def test_bad_instance_settings_are_refused(engine: KVRAGEngine) -> None:
    with pytest.raises(ValueError, match="temperature"):
        KVRAGLLM(engine, temperature=float("nan"))


def test_stop_none_means_no_stop_strings(llm: KVRAGLLM) -> None:
    """LlamaIndex passes stop=None; it is the same as no stop strings."""
    assert llm.complete("Hello", stop=None).text == llm.complete("Hello").text


def test_an_image_block_is_refused_not_dropped(llm: KVRAGLLM) -> None:
    message = ChatMessage(
        role=MessageRole.USER,
        blocks=[TextBlock(text="What is in the picture?"), ImageBlock(url="http://x/cat.png")],
    )
    with pytest.raises(UnsupportedInputError, match="ImageBlock"):
        llm.chat([message])
    with pytest.raises(UnsupportedInputError):
        llm.stream_chat([message])


def test_text_blocks_join_like_message_content(llm: KVRAGLLM) -> None:
    message = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="Hi"), TextBlock(text="!")])
    llm.chat([message])
    assert llm.last_messages == [{"role": "user", "content": message.content}]


def test_an_abandoned_stream_does_not_block_other_calls(llm: KVRAGLLM) -> None:
    stream = llm.stream_complete("Write a long story about a cat.", max_new_tokens=200)
    next(stream)  # one piece, then the consumer goes idle
    done = threading.Event()
    worker = threading.Thread(target=lambda: (llm.complete("Hello"), done.set()))
    worker.start()
    worker.join(timeout=60)
    stream.close()
    assert done.is_set(), "a half-read stream_complete held the engine"
