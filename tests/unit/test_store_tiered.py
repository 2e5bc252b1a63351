"""TieredKVStore: a memory LRU in front of a disk store (synthetic tensors, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrag_integrations import DiskKVStore, KVRAGEngine, StoreWriteError, TieredKVStore
from kvrag_integrations.chunk_kv import ChunkKV

FP = "fp-test"


def make_kv(seed: int = 0, n: int = 8) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, n, 8)
    return ChunkKV(
        torch.randint(0, 32000, (n,), generator=gen),
        torch.randn(shape, generator=gen),
        torch.randn(shape, generator=gen),
        FP,
    )


def entry_path(store: DiskKVStore, key: str) -> Path:
    return store.root / key[:2] / f"{key}.safetensors"


@pytest.fixture()
def disk(tmp_path: Path) -> DiskKVStore:
    return DiskKVStore(tmp_path / "kv")


def test_backend_hit_is_promoted(disk: DiskKVStore) -> None:
    kv = make_kv()
    disk.put(kv)  # written by another worker
    store = TieredKVStore(disk, max_bytes=2**20)
    first, second = store.get(kv.key, FP), store.get(kv.key, FP)
    assert first is not None and second is first  # the second comes from memory
    assert torch.equal(first.keys, kv.keys)
    tiers = store.tier_stats
    assert (tiers["memory"]["misses"], tiers["memory"]["hits"]) == (1, 1)
    assert tiers["memory"]["promotions"] == 1 and tiers["backend"]["hits"] == 1
    assert (store.stats.hits, store.stats.misses) == (2, 0)


def test_write_through(disk: DiskKVStore) -> None:
    kv = make_kv()
    store = TieredKVStore(disk, max_bytes=2**20)
    assert store.put(kv) == kv.key
    assert store.memory.contains(kv.key) and entry_path(disk, kv.key).is_file()
    assert store.get(kv.key, FP) is not None and store.tier_stats["backend"]["hits"] == 0

    other = TieredKVStore(DiskKVStore(disk.root), max_bytes=2**20)  # e.g. another process
    assert other.get(kv.key, FP) is not None and other.tier_stats["backend"]["hits"] == 1
    store.delete(kv.key)
    assert not store.contains(kv.key) and not entry_path(disk, kv.key).exists()


def test_lru_eviction_counters(disk: DiskKVStore) -> None:
    kvs = [make_kv(seed=i) for i in range(4)]
    store = TieredKVStore(disk, max_bytes=2 * kvs[0].nbytes)
    for kv in kvs[:3]:
        store.put(kv)
    assert list(store.memory.keys()) == [kvs[1].key, kvs[2].key]
    assert store.tier_stats["memory"]["evictions"] == 1 and len(disk) == 3
    assert sorted(store.keys()) == sorted(kv.key for kv in kvs[:3])

    assert store.get(kvs[0].key, FP) is not None  # evicted from memory, still on disk
    tiers = store.tier_stats
    assert tiers["backend"]["hits"] == 1 and tiers["memory"]["promotions"] == 1
    assert tiers["memory"]["evictions"] == 2  # the promotion pushed out kvs[1]
    assert list(store.memory.keys()) == [kvs[2].key, kvs[0].key]
    assert store.memory.nbytes <= store.memory.max_bytes

    assert store.get(kvs[3].key, FP) is None  # in neither tier
    tiers = store.tier_stats
    assert tiers["memory"]["misses"] == 2 and tiers["backend"]["misses"] == 1
    assert store.stats.misses == 1


def test_corrupt_backend_entry_is_a_miss_in_both_tiers(disk: DiskKVStore) -> None:
    kv = make_kv()
    disk.put(kv)
    path = entry_path(disk, kv.key)
    path.write_bytes(path.read_bytes()[:-7])  # truncated by a crash of another writer
    store = TieredKVStore(disk, max_bytes=2**20)
    assert store.get(kv.key, FP) is None
    tiers = store.tier_stats
    assert tiers["memory"]["misses"] == 1 and tiers["backend"]["rejected"] == 1
    assert tiers["memory"]["promotions"] == 0 and not store.memory.contains(kv.key)
    assert store.stats.misses == 1 and not path.exists()  # dropped for a recompute

    store.put(kv)
    assert store.get(kv.key, FP) is not None


def test_foreign_entry_is_a_miss(disk: DiskKVStore) -> None:
    kv = make_kv()
    store = TieredKVStore(disk, max_bytes=2**20)
    store.put(kv)
    assert store.get(kv.key, "another-model") is None
    assert store.tier_stats["memory"]["rejected"] == 1
    assert store.tier_stats["backend"]["rejected"] == 1


def test_failed_backend_write_leaves_memory_alone(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    store = TieredKVStore(DiskKVStore(blocker / "kv"), max_bytes=2**20)
    kv = make_kv()
    with pytest.raises(StoreWriteError):
        store.put(kv)
    assert not store.contains(kv.key)  # so ingestion retries the write


def test_memory_tier_keeps_entries_on_its_device(disk: DiskKVStore) -> None:
    # "meta" stands in for "cuda" on machines without a GPU: same code path.
    device = "cuda" if torch.cuda.is_available() else "meta"
    kv = make_kv()
    disk.put(kv)
    store = TieredKVStore(disk, max_bytes=2**20, device=device)
    got = store.get(kv.key, FP)
    assert got is not None and got.keys.device.type == device
    assert store.memory.get(kv.key, FP).values.device.type == device
    assert disk.get(kv.key, FP).keys.device.type == "cpu"


def test_engine_over_tiered_store(engine: KVRAGEngine, disk: DiskKVStore) -> None:
    chunk = "Mount Kilimanjaro in Tanzania is the highest mountain in Africa."
    store = TieredKVStore(disk, max_bytes=64 * 2**20)
    eng = KVRAGEngine(engine.loaded, store=store)
    eng.encode_chunks([chunk], show_progress=False)
    store.clear_memory()
    question = "What is the highest mountain in Africa?"
    answers = [eng.generate(question=question, chunks=[chunk], max_new_tokens=4) for _ in "ab"]
    assert [a.lazily_encoded_chunks for a in answers] == [0, 0]
    assert answers[0].text == answers[1].text
    assert store.tier_stats["backend"]["hits"] == 1 and store.tier_stats["memory"]["hits"] == 1
