"""VLLMEngine keeps KVRAGEngine's methods and results: generate, stream, astream,
encode_chunks, the accounting, the errors."""

from __future__ import annotations

import asyncio
import time

import pytest
from corpus import SEARCH_TOOL
from vllm_helpers import Corpus, needs_vllm

from kvrag_integrations import ContextWindowExceededError, UnsupportedInputError
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()


def test_encode_then_generate_reuses_every_stored_piece(
    vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    item, chunks = musique.item(30), musique.chunks(30, 3, tag="encode")
    refs = vllm_engine.encode_chunks(chunks, show_progress=False)
    assert [len(r.key) for r in refs] == [64, 64, 64]
    assert refs == vllm_engine.encode_chunks(chunks, show_progress=False)  # same keys, again
    result = vllm_engine.generate(question=item.question, chunks=chunks[::-1], max_new_tokens=8)
    assert result.strategy == "turbo" and result.fallback is None
    assert result.reused_chunks == 3
    assert result.reused_tokens == result.reused_prefix_tokens + result.reused_chunk_tokens
    assert result.reused_tokens + result.prefilled_tokens == result.prompt_tokens
    assert result.reused_chunk_tokens >= sum(r.num_tokens for r in refs)
    assert 0 < result.ttft_s <= result.total_s
    assert result.generated_tokens == len(result.token_ids) > 0
    assert set(result.stats) >= {"reused_tokens", "prefilled_tokens", "ttft_s", "strategy"}
    assert all(c in vllm_engine.chunk_index for c in chunks)


def test_stream_and_astream_give_generates_answer(vllm_engine: VLLMEngine, musique: Corpus) -> None:
    item, chunks = musique.item(31), musique.chunks(31, 2, tag="stream")
    vllm_engine.encode_chunks(chunks, show_progress=False)
    asked = dict(question=item.question, chunks=chunks, max_new_tokens=16)
    whole = vllm_engine.generate(**asked)
    stream = vllm_engine.stream(**asked)
    assert "".join(stream) == whole.text
    assert stream.result.token_ids == whole.token_ids

    async def collect() -> tuple[str, int]:
        astream = vllm_engine.astream(**asked)
        text = "".join([piece async for piece in astream])
        return text, astream.result.reused_tokens

    text, reused = asyncio.run(collect())
    assert text == whole.text and reused > 0


def test_a_closed_stream_stops_and_says_so(vllm_engine: VLLMEngine, musique: Corpus) -> None:
    item = musique.item(32)
    chunks = musique.chunks(32, 1)
    stream = vllm_engine.stream(question=item.question, chunks=chunks, max_new_tokens=400)
    next(stream)
    began = time.perf_counter()
    stream.close()
    assert time.perf_counter() - began < 30
    assert stream.result.finish_reason == "cancelled"
    assert stream.result.generated_tokens < 400


def test_what_vllm_cannot_run_is_refused_at_the_call(vllm_engine: VLLMEngine) -> None:
    # (blend runs here: its workers recompute; options only the in-process one has do not)
    with pytest.raises(UnsupportedInputError, match=r"\['check_layer'\] need KVRAGEngine"):
        vllm_engine.generate(
            question="Who?", chunks=["Ada wrote it."], strategy="blend", check_layer=2
        )
    with pytest.raises(UnsupportedInputError, match=r"\['positions'\] need KVRAGEngine"):
        vllm_engine.generate(question="Who?", chunks=["Ada wrote it."], positions="composite")
    with pytest.raises(ContextWindowExceededError):
        vllm_engine.generate(question="Who?", chunks=["word " * 5000])
    with pytest.raises(ValueError, match="top_p"):
        vllm_engine.generate(question="Who?", top_p=0.0)
    with pytest.raises(TypeError, match="list of strings"):
        vllm_engine.encode_chunks("one string")


def test_a_miss_is_computed_in_the_request_and_encoded_for_the_next(
    vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    item, chunks = musique.item(33), musique.chunks(33, 2, tag="miss")  # never encoded
    first = vllm_engine.generate(question=item.question, chunks=chunks, max_new_tokens=4)
    assert first.fallback == "uncached" and first.deferred_chunks >= 2
    assert first.reused_chunks == 0
    assert vllm_engine.wait_for_encoding(timeout=300)
    second = vllm_engine.generate(question=item.question, chunks=chunks, max_new_tokens=4)
    assert second.fallback is None and second.reused_chunks == 2


def test_on_miss_encode_encodes_first(vllm_engine: VLLMEngine, musique: Corpus) -> None:
    item, chunks = musique.item(34), musique.chunks(34, 2, tag="on-miss-encode")
    result = vllm_engine.generate(
        question=item.question, chunks=chunks, max_new_tokens=4, on_miss="encode"
    )
    assert result.fallback is None and result.reused_chunks == 2


def test_messages_and_known_chunks_are_laid_out_as_in_process(
    vllm_engine: VLLMEngine,
    engine,
    musique: Corpus,  # type: ignore[no-untyped-def]
) -> None:
    item = musique.item(35)
    (chunk,) = musique.chunks(35, 1)
    messages = [{"role": "user", "content": f"Context:\n{chunk}\n\nQuestion: {item.question}"}]
    ours = vllm_engine.tokenize(vllm_engine.build_segments(messages=messages, known_chunks=[chunk]))
    theirs = engine.tokenize(engine.build_segments(messages=messages, known_chunks=[chunk]))
    assert ours.input_ids.tolist() == theirs.input_ids.tolist()
    assert [p.kind for p in ours.pieces] == [p.kind for p in theirs.pieces]


@pytest.mark.parametrize("choice", ["required", "search"])
def test_a_forced_tool_call_is_valid_by_vllms_structured_outputs(
    vllm_engine: VLLMEngine, musique: Corpus, choice: str
) -> None:
    """The bundled model, forced to call: vLLM's structured outputs keep the call's
    JSON schema; the call parses; the tool's documents in the next call are reused."""
    item, chunks = musique.item(33), musique.chunks(33, 2, tag="tools")
    vllm_engine.encode_chunks(chunks, show_progress=False)
    messages = [{"role": "user", "content": item.question}]
    result = vllm_engine.generate(
        messages=messages, tools=[SEARCH_TOOL], tool_choice=choice, max_new_tokens=48
    )
    assert [c.name for c in result.tool_calls] == ["search"]
    assert isinstance(result.tool_calls[0].arguments.get("query"), str)
    call = result.tool_calls[0].as_openai()
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "\n\n".join(chunks)},
    ]
    answer = vllm_engine.generate(messages=messages, tools=[SEARCH_TOOL], max_new_tokens=8)
    chunk_tokens = sum(
        len(vllm_engine.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks
    )
    assert answer.reused_chunk_tokens >= 0.8 * chunk_tokens
