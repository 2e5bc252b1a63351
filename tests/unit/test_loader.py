"""ChunkLoader: concurrent reads and prefetch give exactly what ``store.get`` gives.

The loader alone, then through the engine (``engine``: the unit tier's tiny model).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from corpus import CAPITAL_QUESTION as QUESTION
from corpus import CAPITALS as CHUNKS
from corpus import on_disk

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.caching.loader import ChunkLoader
from kvrag_integrations.store import DiskKVStore, MemoryKVStore


def entry(seed: int, n: int = 5) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 1, n, 4, generator=gen)
    return ChunkKV(torch.arange(seed, seed + n), keys, keys * 2, "fp")


@pytest.fixture()
def disk(tmp_path: Path) -> tuple[DiskKVStore, list[ChunkKV]]:
    store = DiskKVStore(tmp_path)
    kvs = [entry(i) for i in range(6)]
    for kv in kvs:
        store.put(kv)
    return store, kvs


def test_get_many_equals_store_get_in_key_order(disk) -> None:
    store, kvs = disk
    loader = ChunkLoader(max_workers=3)
    keys = [kv.key for kv in kvs] + ["0" * 64]  # one miss
    got = loader.get_many(store, "fp", keys)
    assert list(got) == keys
    for kv in kvs:
        assert torch.equal(got[kv.key].keys, kv.keys)
        assert torch.equal(got[kv.key].values, kv.values)
    assert got["0" * 64] is None
    assert loader.get_many(store, "another-model", [kvs[0].key])[kvs[0].key] is None


def test_prefetched_reads_are_taken_not_read_again(disk) -> None:
    store, kvs = disk
    loader = ChunkLoader()
    keys = [kv.key for kv in kvs[:4]]
    assert loader.prefetch(store, "fp", keys + keys) == 4  # duplicates read once
    assert loader.prefetch(store, "fp", keys) == 0  # already staged
    got = loader.get_many(store, "fp", keys)
    assert loader.taken == 4 and loader.staged == 0
    assert store.stats.hits == 4  # each entry was read once, by its prefetch
    assert all(torch.equal(got[kv.key].keys, kv.keys) for kv in kvs[:4])


def test_a_corrupt_entry_prefetched_is_a_miss_like_get(disk, tmp_path: Path) -> None:
    store, kvs = disk
    path = next(tmp_path.glob(f"??/{kvs[0].key}.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    loader = ChunkLoader()
    loader.prefetch(store, "fp", [kvs[0].key])
    assert loader.get_many(store, "fp", [kvs[0].key]) == {kvs[0].key: None}
    assert store.stats.rejected == 1


def test_staged_reads_are_bounded_and_expire(disk) -> None:
    store, kvs = disk
    loader = ChunkLoader(max_staged=2, ttl_s=0.05)
    loader.prefetch(store, "fp", [kv.key for kv in kvs[:5]])
    assert loader.staged == 2 and loader.expired == 3
    time.sleep(0.1)
    loader.prefetch(store, "fp", [kvs[5].key])  # an expired read is dropped on the next call
    assert loader.staged == 1 and loader.expired == 5
    time.sleep(0.1)
    loader.get_many(store, "fp", [kvs[0].key])  # a request drops expired reads too
    assert loader.staged == 0 and loader.expired == 6 and loader.taken == 0
    loader.prefetch(store, "fp", [kvs[1].key])
    loader.close()
    assert loader.staged == 0


def test_memory_stores_are_read_inline_and_never_prefetched() -> None:
    store = MemoryKVStore()
    kv = entry(0)
    store.put(kv)
    loader = ChunkLoader()
    assert loader.prefetch(store, "fp", [kv.key]) == 0
    assert loader.get_many(store, "fp", [kv.key])[kv.key] is kv
    assert loader._pool is None  # no thread was started for a memory store


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ChunkLoader(max_workers=0)
    with pytest.raises(ValueError):
        ChunkLoader(ttl_s=0)


# ---------------------------------------------- through the engine (tiny model)


def test_prefetched_and_concurrent_reads_give_the_same_logits(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    eng = on_disk(engine, tmp_path)
    eng.encode_chunks(CHUNKS, show_progress=False)
    eng.prefill(question=QUESTION, chunks=CHUNKS, strategy="turbo")  # caches the leading text
    ahead = eng.prefill(question=QUESTION, chunks=CHUNKS, strategy="turbo")  # concurrent reads
    assert eng.prefetch(CHUNKS) == len(CHUNKS)
    fetched = eng.prefill(question=QUESTION, chunks=CHUNKS, strategy="turbo")
    assert eng.caches.loader.taken == len(CHUNKS) and eng.caches.loader.staged == 0
    assert fetched.fallback is None and fetched.token_counts() == ahead.token_counts()
    torch.testing.assert_close(fetched.logits, ahead.logits, rtol=0, atol=0)


def test_prefetch_of_unknown_or_bad_texts_reads_nothing_wrong(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    eng = on_disk(engine, tmp_path)
    assert eng.prefetch(["never encoded"]) == 1  # a read that will be a miss
    assert eng.prefetch([""]) == 0  # not a chunk: skipped, no error
    pre = eng.prefill(question=QUESTION, chunks=["never encoded"], strategy="turbo")
    assert pre.lazily_encoded_chunks == 1  # the prefetched miss was a miss, encoded here
    assert eng.caches.loader.taken == 1 and eng.caches.loader.staged == 0
