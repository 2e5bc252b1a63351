"""The stream machinery without a model: a worker thread, a channel, a cancel event.

Also the sampling processors (transformers') and the stop-string scanner.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvrag_integrations.engine.modeling.generate import StopScanner
from kvrag_integrations.engine.modeling.sampling import (
    SamplingParams,
    choose_token,
    logits_processors,
)
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.streaming import (
    AsyncGenerationStream,
    GenerationStream,
    acquire,
)
from kvrag_integrations.errors import UnsupportedInputError


def pieces(n: int, seen: dict, delay: float = 0.0):
    """A job: ``n`` pieces, recording whether it was cancelled and that it ended."""

    def job(cancel: threading.Event) -> Iterator[str]:
        try:
            for i in range(n):
                if cancel.is_set():
                    seen["cancelled"] = True
                    return
                time.sleep(delay)
                yield f"{i} "
        finally:
            seen["ended"] = threading.current_thread().name

    return job


def test_pieces_arrive_in_order_sync_and_async() -> None:
    seen: dict = {}
    stream = GenerationStream(pieces(5, seen), GenerationResult())
    assert "".join(stream) == "0 1 2 3 4 "
    assert list(stream) == []  # exhausted stays exhausted
    assert seen["ended"] == "kvrag-decode"  # on the worker, not here

    async def main() -> list[str]:
        return [p async for p in AsyncGenerationStream(pieces(3, {}), GenerationResult())]

    assert asyncio.run(main()) == ["0 ", "1 ", "2 "]


def test_errors_keep_their_type_sync_and_async() -> None:
    def failing(cancel: threading.Event) -> Iterator[str]:
        yield "a"
        raise UnsupportedInputError("no images")

    stream = GenerationStream(failing, GenerationResult())
    assert next(stream) == "a"
    with pytest.raises(UnsupportedInputError, match="no images"):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)

    async def main() -> None:
        with pytest.raises(UnsupportedInputError, match="no images"):
            async for _ in AsyncGenerationStream(failing, GenerationResult()):
                pass

    asyncio.run(main())


def test_close_cancels_the_worker_and_waits_for_it() -> None:
    seen: dict = {}
    stream = GenerationStream(pieces(10_000, seen, delay=0.001), GenerationResult())
    next(stream)
    stream.close()
    assert seen.get("cancelled") and "ended" in seen  # stopped, and close waited


def test_dropping_a_stream_cancels_its_worker() -> None:
    seen: dict = {}
    stream = GenerationStream(pieces(10_000, seen, delay=0.001), GenerationResult())
    next(stream)
    del stream
    gc.collect()
    deadline = time.monotonic() + 10
    while "ended" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen.get("cancelled")


def test_aclose_and_a_cancelled_task_stop_the_worker() -> None:
    seen: dict = {}
    other: dict = {}

    async def main() -> None:
        stream = AsyncGenerationStream(pieces(10_000, seen, delay=0.001), GenerationResult())
        async for _ in stream:
            break
        await stream.aclose()

        async def consume() -> None:
            async with AsyncGenerationStream(
                pieces(10_000, other, delay=0.001), GenerationResult()
            ) as s:
                async for _ in s:
                    await asyncio.sleep(10)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while not ("ended" in seen and "ended" in other) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen.get("cancelled") and other.get("cancelled")


def test_acquire_gives_up_when_cancelled_while_waiting() -> None:
    lock, cancel = threading.RLock(), threading.Event()
    held = threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            time.sleep(2.0)

    threading.Thread(target=holder).start()
    held.wait(5)
    threading.Timer(0.1, cancel.set).start()
    started = time.monotonic()
    assert not acquire(lock, cancel)
    assert time.monotonic() - started < 1.5  # left the line, did not wait for the holder
    assert acquire(lock, threading.Event())
    lock.release()


def test_logits_processors_are_transformers_in_generate_order() -> None:
    assert len(logits_processors(SamplingParams())) == 0  # greedy: argmax of the logits
    kinds = [type(p) for p in logits_processors(SamplingParams(repetition_penalty=1.2))]
    assert kinds == [RepetitionPenaltyLogitsProcessor]
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1)
    assert [type(p) for p in logits_processors(params)] == [
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    ]


def test_greedy_choice_with_a_repetition_penalty() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    before = logits.clone()
    params = SamplingParams(repetition_penalty=2.0)
    assert choose_token(logits, SamplingParams(), None) == 1
    assert choose_token(logits, params, None, previous=[1]) == 2  # 3.0 / 2 < 2.9
    assert choose_token(logits, params, None, previous=[]) == 1
    assert torch.equal(logits, before)  # the caller's logits are untouched
    sampled = SamplingParams(temperature=1.0, top_k=1, seed=0)
    assert choose_token(logits, sampled, torch.Generator().manual_seed(0)) == 1


def test_stop_scanner_holds_back_a_possible_stop() -> None:
    scanner = StopScanner(["END", "\n\n"])
    assert scanner.safe_len("abc EN", 0) == 4  # "EN" may start END
    assert scanner.safe_len("abc EX", 0) == 6
    assert scanner.find("abc END x", 0) == 4 and scanner.cut("abc END x") == "abc "
    assert scanner.find("a\n\nEND", 0) == 1
