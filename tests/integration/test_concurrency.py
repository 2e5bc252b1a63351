"""One engine shared by threads and asyncio tasks: same answers, nothing lost."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag_integrations import DiskKVStore, GenerationResult, KVRAGEngine, MemoryKVStore

CHUNKS = [
    "The Amazon River flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Everest, on the border of Nepal and China, is 8,849 metres high.",
    "The Great Barrier Reef lies off the coast of Queensland in Australia.",
    "Lake Baikal in Siberia is the deepest lake in the world.",
]
QUESTIONS = [
    ("Which ocean does the Amazon flow into?", [0, 1]),
    ("How high is Mount Everest?", [1, 2]),
    ("Where is the Great Barrier Reef?", [2, 3]),
    ("What is the deepest lake?", [3, 0]),
    ("Which countries does the Amazon cross?", [0]),
    ("Where is Lake Baikal?", [3, 2]),
]
STRATEGIES = ["turbo", "blend", "full"]


def requests(n: int) -> list[dict[str, Any]]:
    """``n`` requests cycling over questions and strategies."""
    out = []
    for i in range(n):
        question, picks = QUESTIONS[i % len(QUESTIONS)]
        strategy = STRATEGIES[(i // len(QUESTIONS)) % len(STRATEGIES)]
        out.append(
            {"question": question, "chunks": [CHUNKS[j] for j in picks], "strategy": strategy}
        )
    return out


@pytest.fixture()
def eng(engine: KVRAGEngine) -> KVRAGEngine:
    """Same weights, its own store, chunks already encoded (the serving situation)."""
    shared = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    shared.encode_chunks(CHUNKS, show_progress=False)
    return shared


def same(a: GenerationResult, b: GenerationResult) -> bool:
    # One forward at a time (the engine lock) makes threading itself bit-neutral; the
    # tolerance only covers kernels whose reduction order may vary run to run.
    return a.text == b.text and torch.allclose(
        a.first_token_logits, b.first_token_logits, atol=1e-4, rtol=0
    )


def test_threads_give_the_serial_answers(eng: KVRAGEngine) -> None:
    reqs = requests(12)  # every question, turbo and blend
    serial = [eng.generate(**r, max_new_tokens=4) for r in reqs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        threaded = list(pool.map(lambda r: eng.generate(**r, max_new_tokens=4), reqs))
    assert all(same(s, t) for s, t in zip(serial, threaded))
    assert all(t.lazily_encoded_chunks == 0 for t in threaded)


def test_asyncio_tasks_give_the_serial_answers(eng: KVRAGEngine) -> None:
    reqs = requests(8)
    serial = [eng.generate(**r, max_new_tokens=4) for r in reqs]

    async def main() -> list[GenerationResult]:
        calls = [asyncio.to_thread(eng.generate, **r, max_new_tokens=4) for r in reqs]
        return await asyncio.gather(*calls)

    assert all(same(s, t) for s, t in zip(serial, asyncio.run(main())))


def test_soak_100_requests_on_8_threads(eng: KVRAGEngine) -> None:
    """Each of the 18 question-strategy pairs five or six times, eight at once."""
    reqs = requests(100)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(eng.generate, **r, max_new_tokens=2) for r in reqs]
        results = [f.result(timeout=300) for f in futures]  # re-raises any error
    elapsed = time.monotonic() - started
    assert len(results) == 100 and elapsed < 300
    assert all(1 <= r.generated_tokens <= 2 and r.text is not None for r in results)
    assert all(r.lazily_encoded_chunks == 0 for r in results)
    # Identical requests got identical answers, whichever thread ran them.
    by_request: dict[tuple, set[str]] = {}
    for r, result in zip(reqs, results):
        by_request.setdefault((r["question"], r["strategy"]), set()).add(result.text)
    assert all(len(texts) == 1 for texts in by_request.values())
    assert eng.store.stats.rejected == 0


def test_concurrent_encode_of_one_chunk_writes_one_entry(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    store = DiskKVStore(tmp_path / "kv")
    eng = KVRAGEngine(engine.loaded, store=store)
    barrier = threading.Barrier(8)

    def ingest() -> str:
        barrier.wait()
        return eng.encode_chunks([CHUNKS[0]], show_progress=False)[0].key

    with ThreadPoolExecutor(max_workers=8) as pool:
        keys = {f.result() for f in [pool.submit(ingest) for _ in range(8)]}
    (key,) = keys
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    assert files == [tmp_path / "kv" / key[:2] / f"{key}.safetensors"]  # no temp files left
    assert store.verify() == {"ok": 1, "bad": 0}
    got = store.get(key, eng.fingerprint)
    assert got is not None and got.key == key


def test_mixed_streams_and_generates_on_8_threads_give_the_serial_answers(
    eng: KVRAGEngine,
) -> None:
    """Streams read slowly, interleaved with generates: decode steps interleave too."""
    reqs = requests(16)
    serial = [eng.generate(**r, max_new_tokens=6) for r in reqs]

    def run(i: int) -> tuple[str, torch.Tensor]:
        if i % 2:
            result = eng.generate(**reqs[i], max_new_tokens=6)
            return result.text, result.first_token_logits
        stream = eng.stream(**reqs[i], max_new_tokens=6)
        pieces = []
        for piece in stream:
            pieces.append(piece)
            time.sleep(0.01)  # a slow reader: other requests run in between
        return "".join(pieces), stream.result.first_token_logits

    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(run, range(len(reqs))))
    for s, (text, logits) in zip(serial, got):
        assert text == s.text
        assert torch.allclose(logits, s.first_token_logits, atol=1e-4, rtol=0)


def test_a_stalled_stream_does_not_block_a_thread_pool(eng: KVRAGEngine) -> None:
    stalled = eng.stream(**requests(1)[0], max_new_tokens=50)
    next(stalled)  # never read again
    pool = ThreadPoolExecutor(max_workers=4)
    try:
        futures = [pool.submit(eng.generate, **r, max_new_tokens=2) for r in requests(8)]
        results = [f.result(timeout=120) for f in futures]
    finally:
        stalled.close()  # (frees the workers if the stream did hold the engine)
        pool.shutdown()
    assert all(r.generated_tokens >= 1 for r in results)
