"""The engine over a real Redis: damaged values recomputed, a server killed mid-run,
concurrent ingestion, a memory tier in front of a shared Redis.

The store alone is tested in test_store_redis.py; the engine's faults over local
stores are in tests/unit/test_engine_faults.py.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from redis_helpers import DAMAGE, RedisServer, raw_keys

from kvrag_integrations import KVRAGEngine, RedisKVStore, TieredKVStore
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreWriteError

FP = "fp-test"
CHUNK = "The Hubble Space Telescope was launched in April 1990 aboard the shuttle Discovery."
QUESTION = "When was the Hubble Space Telescope launched?"


def make_kv(seed: int = 0, n: int = 16, dtype: torch.dtype = torch.float32) -> ChunkKV:
    gen, shape = torch.Generator().manual_seed(seed), (2, 2, n, 8)
    keys, values = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return ChunkKV(torch.randint(0, 32000, (n,), generator=gen), keys, values, FP)


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_engine_recomputes_a_damaged_entry(
    engine: KVRAGEngine, redis_store: RedisKVStore, damage
) -> None:
    store = redis_store
    eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode")  # recompute on the request
    (ref,) = eng.encode_chunks([CHUNK], show_progress=False)
    rkey = store.prefix + ref.key
    good = eng.store.get(ref.key, eng.fingerprint)
    store.client.set(rkey, damage(store.client.get(rkey), good))

    result = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
    assert result.generated_tokens > 0 and result.lazily_encoded_chunks == 1
    assert store.stats.rejected == 1
    again = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
    assert again.lazily_encoded_chunks == 0 and again.text == result.text  # rewritten, reused


def test_server_killed_mid_run_then_back(
    engine: KVRAGEngine, redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    own = RedisServer(redis_server.binary, tmp_path / "redis").start()  # ours to kill
    try:
        store = RedisKVStore(own.url)
        eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode")
        eng.encode_chunks([CHUNK], show_progress=False)
        baseline = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        assert baseline.lazily_encoded_chunks == 0

        own.stop()
        started = time.monotonic()
        down = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        assert down.text == baseline.text and down.lazily_encoded_chunks == 1  # recomputed
        assert "answering uncached" in caplog.text and time.monotonic() - started < 30
        with pytest.raises(StoreWriteError):
            eng.encode_chunks(["Ingestion must say the store is down."], show_progress=False)

        own.start()  # same port, empty (no persistence); same store object
        kv = make_kv()
        store.put(kv)
        assert store.get(kv.key, FP) is not None
        first = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        second = eng.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=4)
        assert first.lazily_encoded_chunks == 1 and second.lazily_encoded_chunks == 0
        assert second.text == baseline.text
    finally:
        own.stop()


@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
def test_concurrent_ingestion_writes_one_valid_entry(
    engine: KVRAGEngine, redis_server: RedisServer, redis_prefix: str, split: bool
) -> None:
    server, prefix = redis_server, redis_prefix
    store = RedisKVStore(server.url, prefix=prefix, max_value_bytes=64 * 1024 if split else 2**26)
    eng = KVRAGEngine(engine.loaded, store=store)
    barrier = threading.Barrier(8)

    def ingest() -> str:
        barrier.wait()
        return eng.encode_chunks([CHUNK], show_progress=False)[0].key

    with ThreadPoolExecutor(max_workers=8) as pool:
        keys = {f.result() for f in [pool.submit(ingest) for _ in range(8)]}
    (key,) = keys
    assert list(store.keys()) == [key]
    got = store.get(key, eng.fingerprint)
    assert got is not None and got.key == key
    # Besides the entry (and its parts), at most parts of overwritten copies, expiring.
    current = {prefix + key} | set(store._old_parts(store.client, prefix + key))
    assert split == (len(current) > 1)
    assert all(store.client.pttl(k) > 0 for k in raw_keys(store) - current)


def test_tiered_over_redis_promotes_shared_entries(
    engine: KVRAGEngine, redis_store: RedisKVStore
) -> None:
    store = redis_store
    writer = KVRAGEngine(engine.loaded, store=store)  # another worker, same Redis
    writer.encode_chunks([CHUNK], show_progress=False)
    tiered = TieredKVStore(store, max_bytes=64 * 2**20)
    reader = KVRAGEngine(engine.loaded, store=tiered)
    for _ in range(2):
        result = reader.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=2)
        assert result.lazily_encoded_chunks == 0
    assert tiered.tier_stats["backend"]["hits"] == 1 and tiered.tier_stats["memory"]["hits"] == 1
