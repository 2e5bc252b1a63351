"""Streams on the real model: a worker decodes, the consumer reads a queue.

A consumer that stops reading (break, close, aclose, dropping the stream, an
adapter's generator closed) frees the engine at once; ``astream`` gives what
``stream`` gives; a worker's error reaches the consumer with its own type; the
event loop keeps running while ``astream`` decodes.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from kvrag_integrations import KVRAGEngine, MemoryKVStore, Text
from kvrag_integrations.engine.modeling.generate import TextDecoder
from kvrag_integrations.errors import ContextWindowExceededError

QUESTION = "When was the Eiffel Tower completed?"
CHUNK = "The Eiffel Tower in Paris was completed in 1889 for the World's Fair."
# A prompt the model continues for hundreds of tokens (it counts on): a stream
# of it that were not cancelled would hold the forward lock for a minute.
COUNTING = dict(
    segments=[Text("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,")], chat_template=False, max_new_tokens=1000
)


def next_generate_finishes(engine: KVRAGEngine, timeout: float = 20.0) -> bool:
    """Whether a short generate() on another thread finishes within ``timeout`` s
    (a thread, so that a stream still holding the lock fails the test, not hangs it)."""
    done = threading.Event()

    def run() -> None:
        engine.generate(question=QUESTION, max_new_tokens=1)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


@pytest.fixture()
def eng(engine: KVRAGEngine) -> KVRAGEngine:
    return KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="encode")


def test_breaking_out_of_a_stream_frees_the_engine(eng: KVRAGEngine) -> None:
    stream = eng.stream(**COUNTING)
    result = stream.result
    for _ in stream:
        break
    del stream  # the consumer dropped it: the worker stops at its next token
    gc.collect()
    started = time.monotonic()
    assert next_generate_finishes(eng)
    assert time.monotonic() - started < 20
    assert result.finish_reason == "cancelled"
    assert result.generated_tokens < COUNTING["max_new_tokens"]


def test_a_for_loop_over_a_temporary_stream_that_breaks_frees_the_engine(
    eng: KVRAGEngine,
) -> None:
    for piece in eng.stream(**COUNTING):
        assert piece
        break
    assert next_generate_finishes(eng)


def test_closing_a_stream_stops_the_worker_and_releases_the_lock(eng: KVRAGEngine) -> None:
    stream = eng.stream(**COUNTING)
    next(stream)
    stream.close()  # returns once the worker has let go
    assert stream.result.finish_reason == "cancelled"
    assert eng.loaded.lock.acquire(timeout=5)
    eng.loaded.lock.release()
    with pytest.raises(StopIteration):  # a closed stream ends (what was queued may come first)
        for _ in range(2000):
            next(stream)
    assert next_generate_finishes(eng)


def test_closing_an_adapter_stream_frees_the_engine(eng: KVRAGEngine) -> None:
    from kvrag_integrations.llama_index import KVRAGLLM

    llm = KVRAGLLM(eng, max_new_tokens=1000, strategy="turbo")
    gen = llm.stream_complete("Count from 1 to 1000, separated by commas: 1, 2, 3,")
    next(gen)
    gen.close()  # the generator's close closes the engine stream
    assert next_generate_finishes(eng)


def test_aclose_frees_the_engine(eng: KVRAGEngine) -> None:
    async def main() -> str:
        stream = eng.astream(**COUNTING)
        async for piece in stream:
            assert piece
            break
        await stream.aclose()
        ok = await asyncio.to_thread(next_generate_finishes, eng)
        assert ok
        return stream.result.finish_reason

    assert asyncio.run(main()) == "cancelled"


def test_a_dropped_async_stream_frees_the_engine(eng: KVRAGEngine) -> None:
    async def main() -> None:
        stream = eng.astream(**COUNTING)
        await stream.__anext__()
        del stream
        gc.collect()
        assert await asyncio.to_thread(next_generate_finishes, eng)

    asyncio.run(main())


def test_astream_gives_what_stream_gives(eng: KVRAGEngine) -> None:
    kw = dict(question=QUESTION, chunks=[CHUNK], max_new_tokens=24)
    plain = eng.generate(**kw)  # encodes the chunk and the leading text: both reuse them
    stream = eng.stream(**kw)
    pieces = list(stream)

    async def main() -> tuple[list[str], object]:
        astream = eng.astream(**kw)
        return [p async for p in astream], astream.result

    apieces, aresult = asyncio.run(main())
    assert len(pieces) > 1
    assert apieces == pieces
    assert aresult.text == stream.result.text == "".join(pieces)
    assert aresult.token_ids == stream.result.token_ids
    assert aresult.reused_tokens == stream.result.reused_tokens > 0
    assert plain.text == stream.result.text


def test_the_event_loop_runs_while_astream_decodes(eng: KVRAGEngine) -> None:
    async def main() -> tuple[int, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        n = 0
        async for _ in eng.astream(question=QUESTION, chunks=[CHUNK], max_new_tokens=16):
            n += 1
        stop.set()
        await task
        return ticks, n

    ticks, pieces = asyncio.run(main())
    assert pieces > 1 and ticks > pieces  # the loop ticked between and during tokens


def test_worker_errors_reach_the_consumer_with_their_type(eng: KVRAGEngine, monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ContextWindowExceededError("the store said no")

    # Store reads run on the worker, after the request was checked on the caller's thread.
    monkeypatch.setattr(eng.caches, "lookup", broken)
    kw = dict(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
    stream = eng.stream(**kw)
    with pytest.raises(ContextWindowExceededError, match="store said no"):
        list(stream)

    async def main() -> None:
        with pytest.raises(ContextWindowExceededError, match="store said no"):
            async for _ in eng.astream(**kw):
                pass

    asyncio.run(main())
    monkeypatch.undo()
    assert next_generate_finishes(eng)  # nothing left holding the lock


def test_incremental_decoding_gives_the_full_decode(engine: KVRAGEngine) -> None:
    """Random ids (partial UTF-8 sequences included): the pieces add up to decode(ids)."""
    import torch

    tokenizer = engine.tokenizer
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, len(tokenizer), (40,), generator=g).tolist()
        decoder = TextDecoder(tokenizer)
        text = "".join(decoder.push(i) for i in ids) + decoder.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_exiting_with_a_stream_in_flight_is_clean() -> None:
    """Exit stops stream workers between tokens: a daemon thread killed mid-forward
    aborts the process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from kvrag_integrations import KVRAGEngine, Text\n"
        "e = KVRAGEngine.from_pretrained()\n"
        "s = e.stream(segments=[Text('1, 2, 3, 4, 5,')], chat_template=False,\n"
        "             max_new_tokens=500)\n"
        "assert next(s)\n"  # s still referenced: its worker is decoding at exit
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_stop_string_across_tokens_is_cut_where_it_starts(eng: KVRAGEngine) -> None:
    """transformers' StopStringCriteria ends decoding; the text stops before the string."""
    from kvrag_integrations.engine.modeling.generate import stop_string_criteria

    kw = dict(question=QUESTION, chunks=[CHUNK], max_new_tokens=24)
    plain = eng.generate(**kw)
    # A boundary between two generated tokens, well inside the answer.
    ids = plain.token_ids
    cut = len(eng.tokenizer.decode(ids[: len(ids) // 2], skip_special_tokens=True))
    stop = plain.text[cut - 2 : cut + 2]
    assert len(stop) == 4 and plain.text.find(stop) >= 0
    criteria = stop_string_criteria(eng.tokenizer, [stop])
    assert criteria is not None and stop_string_criteria(eng.tokenizer, [stop]) is criteria
    stopped = eng.generate(stop=[stop], **kw)
    assert stopped.finish_reason == "stop"
    assert stopped.text == plain.text[: plain.text.find(stop)]
    assert stopped.generated_tokens < plain.generated_tokens
    stream = eng.stream(stop=[stop], **kw)
    assert "".join(stream) == stopped.text == stream.result.text
