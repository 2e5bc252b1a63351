"""The second request reuses: queued encodings are taken over, ones in flight are
awaited, nothing is encoded twice, and background forwards yield to requests.

Each test builds its own engine on the tiny model's weights, with
``on_miss="defer"`` where the first request must defer whatever the measured
costs say (``on_miss="auto"`` is tested against a fed cost model in
test_miss_policy.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import pytest
import torch
from corpus import CAPITALS, REEF, TOWER
from corpus import TOWER_QUESTION as QUESTION

from kvrag_integrations import Chunk, KVRAGEngine, MemoryKVStore
from kvrag_integrations.bench.common import count_encodings
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.scheduling.forward_lock import ForwardLock


@pytest.fixture()
def loaded(engine: KVRAGEngine) -> LoadedModel:
    """The tiny weights and their forward lock, with no costs measured yet (other
    tests' measurements would decide otherwise on this tiny model)."""
    return dataclasses.replace(engine.loaded, costs=None)


KW = dict(question=QUESTION, chunks=[TOWER, REEF], max_new_tokens=2, strategy="turbo")


def chunk_tokens(e: KVRAGEngine) -> int:
    """TOWER and REEF's tokens, and the "\n\n" after TOWER (read with it)."""
    n = sum(e.tokenize([Chunk(c)]).num_tokens for c in (TOWER, REEF))
    return n + e.prompts.suffix_ids.numel()


def test_a_request_takes_queued_encodings_over(loaded: LoadedModel) -> None:
    e = KVRAGEngine(loaded, store=MemoryKVStore(), on_miss="defer")
    counts = count_encodings(e)
    with e.loaded.lock.request():  # another request in flight: the worker starts nothing
        cold = e.generate(**KW)
        assert (cold.fallback, cold.strategy, cold.deferred_chunks) == ("uncached", "full", 2)
        assert e.encoder.pending == 3  # both chunks and the leading text, all still queued
        second = e.generate(**KW)
    assert second.fallback is None and second.strategy == "turbo"
    assert (second.taken_over_chunks, second.awaited_chunks, second.encoded_chunks) == (2, 0, 0)
    assert second.deferred_chunks == second.reused_chunks == 0
    assert second.lazily_encoded_chunks == 2
    # Owed work, so counted as reused (as the worker's encodings would have been).
    assert second.reused_chunk_tokens == chunk_tokens(e) and second.reused_prefix_tokens > 0
    assert second.reused_tokens == second.reused_chunk_tokens + second.reused_prefix_tokens
    assert "queued" in second.miss_reason and second.miss_policy == "defer"
    assert e.encoder.pending == 0 and e.encoder.taken_over == 3 and e.encoder.encoded == 0
    assert e.wait_for_encoding(timeout=30)
    assert sorted(counts.values()) == [1, 1, 1]  # each key encoded once, by the request
    warm = e.prefill(strategy="turbo", question=QUESTION, chunks=[TOWER, REEF])
    assert warm.sources.reused == 2 and warm.fallback is None
    torch.testing.assert_close(second.first_token_logits, warm.logits, rtol=0, atol=0)


def test_a_request_waits_for_encodings_in_flight(loaded: LoadedModel) -> None:
    e = KVRAGEngine(loaded, store=MemoryKVStore(), on_miss="defer")
    counts = count_encodings(e)
    entered, go = threading.Event(), threading.Event()
    encode = e.encoder._encode

    def slow(jobs: Any) -> Any:  # the worker's first unit stays in flight until `go`
        entered.set()
        go.wait(60)
        return encode(jobs)

    e.encoder._encode = slow
    cold = e.generate(**KW)
    assert cold.fallback == "uncached" and entered.wait(30)
    assert e.encoder.state(e.caches.lookup(cold_prompt(e))[1])[0] == {
        e.chunk_key(TOWER): "in flight",
        e.chunk_key(REEF): "queued",
        prefix_key(e): "queued",
    }
    results: list[Any] = []
    second = threading.Thread(target=lambda: results.append(e.generate(**KW)))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for TOWER, REEF and the leading text taken over
    go.set()
    second.join(60)
    (r,) = results
    assert (r.awaited_chunks, r.taken_over_chunks, r.encoded_chunks) == (1, 1, 0)
    assert r.fallback is None and r.reused_chunk_tokens == chunk_tokens(e)
    assert e.wait_for_encoding(timeout=30)
    assert sorted(counts.values()) == [1, 1, 1] and e.encoder.encoded == 1


def cold_prompt(e: KVRAGEngine) -> Any:
    from kvrag_integrations.engine.prompting.segments import cache_leading_text

    segments = e.build_segments(question=QUESTION, chunks=[TOWER, REEF])
    return cache_leading_text(e.tokenize(segments))


def prefix_key(e: KVRAGEngine) -> str:
    (head,) = [p for p in cold_prompt(e).cached_pieces if p.is_prefix]
    return e.caches.piece_key(head)


def test_concurrent_requests_on_new_chunks_encode_each_once(engine: KVRAGEngine) -> None:
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="encode")
    counts = count_encodings(e)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(e.generate(**KW))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3 and all(r.fallback is None for r in results)
    assert max(counts.values()) == 1 and len(counts) == 3
    assert sum(r.encoded_chunks for r in results) == 2  # one request encoded, others read
    texts = {r.text for r in results}
    assert len(texts) == 1


def test_ingestion_takes_queued_chunks_over(loaded: LoadedModel) -> None:
    e = KVRAGEngine(loaded, store=MemoryKVStore(), on_miss="defer")
    counts = count_encodings(e)
    with e.loaded.lock.request():
        e.generate(**KW)
        e.encode_chunks([TOWER, REEF, CAPITALS[0]], show_progress=False)
        assert e.encoder.pending == 1  # only the leading text is left to the worker
    assert e.wait_for_encoding(timeout=30)
    assert max(counts.values()) == 1 and len(counts) == 4


def test_background_forwards_pause_between_layers_for_a_request(engine: KVRAGEngine) -> None:
    """A background forward gives the lock up at the next decoder layer once a
    request asks for it, resumes after, and encodes exactly as without pausing."""
    lock: ForwardLock = engine.loaded.lock
    ids = [engine.tokenize([Chunk(TOWER)]).input_ids]
    pad = int(engine.tokenizer.pad_token_id)
    reference = encode_chunk_batch(engine.model, ids, "fp", pad)[0]
    at_layer, go, got, checked = (threading.Event() for _ in range(4))
    out: list[Any] = []

    def hold(module: Any, args: Any) -> None:  # the first layer: wait for the test
        if threading.current_thread().name == "bg":
            at_layer.set()
            go.wait(60)

    def background() -> None:
        with lock.background(engine.model), lock:
            out.append(encode_chunk_batch(engine.model, ids, "fp", pad)[0])

    def request() -> None:
        with lock:
            got.set()
            checked.wait(60)

    handle = engine.model.model.layers[0].register_forward_pre_hook(hold)
    pauses = lock.pauses
    bg, fg = threading.Thread(target=background, name="bg"), threading.Thread(target=request)
    try:
        bg.start()
        assert at_layer.wait(30)  # the background forward is inside the model
        fg.start()
        while lock.foreground == 0:  # the request is counted before it blocks
            threading.Event().wait(0.001)
        go.set()
        assert got.wait(30)  # the background forward paused: the request has the lock
        assert lock.pauses == pauses + 1 and not out
    finally:
        checked.set()
        go.set()
        fg.join(30)
        bg.join(30)
        handle.remove()
    torch.testing.assert_close(out[0].keys, reference.keys, rtol=0, atol=0)
    torch.testing.assert_close(out[0].values, reference.values, rtol=0, atol=0)


def test_stats_say_where_each_chunk_came_from(engine: KVRAGEngine) -> None:
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="defer")
    e.encode_chunks([TOWER], show_progress=False)
    cold = e.generate(**KW)
    stats = cold.stats
    for name in ("reused_chunks", "awaited_chunks", "taken_over_chunks", "encoded_chunks",
                 "deferred_chunks", "evicted_chunks", "miss_policy", "miss_reason",
                 "fallback"):  # fmt: skip
        assert name in stats
    assert stats["deferred_chunks"] == 1 and stats["fallback"] == "uncached"
    assert stats["miss_policy"] == "defer" and "on_miss=defer" in stats["miss_reason"]
    assert e.wait_for_encoding(timeout=30)
    lazy = e.generate(**{**KW, "chunks": [TOWER, REEF, CAPITALS[1]]}, on_miss="encode")
    assert (lazy.reused_chunks, lazy.encoded_chunks, lazy.deferred_chunks) == (2, 1, 0)
    assert lazy.fallback is None and lazy.lazily_encoded_chunks == 1


def test_evicted_chunks_are_a_visible_fallback_and_warn_once(
    engine: KVRAGEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A store too small for the prompt's chunk caches: the miss says "evicted", and
    the engine warns once that they cannot all stay cached."""
    probe = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="encode")
    probe.encode_chunks([TOWER, REEF], show_progress=False)
    one = max(info.nbytes for info in probe.store.entries())
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore(max_bytes=one + 1), on_miss="encode")
    with caplog.at_level(logging.WARNING, logger="kvrag_integrations"):
        first = e.generate(**KW)
        assert first.fallback is None and first.encoded_chunks == 2
        assert "cannot all stay cached" in first.miss_reason
        again = e.generate(**KW, on_miss="defer")
        assert again.fallback == "evicted" and again.evicted_chunks >= 1
        assert again.stats["fallback"] == "evicted"
        e.generate(**KW)
    warnings = [r for r in caplog.records if "cannot all stay cached" in r.getMessage()]
    assert len(warnings) == 1
