"""Listing, checking and pruning store entries (synthetic tensors, no model)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import StoreURLError
from kvrag_integrations.store import (
    DiskKVStore,
    KVStore,
    MemoryKVStore,
    RedisKVStore,
    TieredKVStore,
    open_store,
)
from kvrag_integrations.store.maintenance import find_corrupt, prune, summarize

FP = "fp-test"


def make_kv(seed: int = 0, n: int = 5, fingerprint: str = FP) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, n, 8)
    keys, values = (torch.randn(shape, generator=gen) for _ in range(2))
    return ChunkKV(torch.randint(0, 32000, (n,), generator=gen), keys, values, fingerprint)


def entry_path(store: DiskKVStore, key: str) -> Path:
    return store.root / key[:2] / f"{key}.safetensors"


@pytest.fixture(params=["memory", "disk", "tiered"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> KVStore:
    if request.param == "memory":
        return MemoryKVStore()
    if request.param == "disk":
        return DiskKVStore(tmp_path / "kv")
    return TieredKVStore(DiskKVStore(tmp_path / "kv"), max_bytes=1 << 20)


def test_entries_describe_size_time_and_fingerprint(store: KVStore) -> None:
    before = time.time()
    kvs = [make_kv(0), make_kv(1, n=7), make_kv(2, fingerprint="other")]
    for kv in kvs:
        store.put(kv)
    infos = {info.key: info for info in store.entries()}
    assert set(infos) == {kv.key for kv in kvs}
    for kv in kvs:
        info = infos[kv.key]
        assert info.fingerprint == kv.fingerprint
        assert info.updated_at is not None and info.updated_at >= before - 2  # mtime granularity
        # disk and tiered report file sizes: the tensors plus a small header
        assert kv.nbytes <= info.nbytes <= kv.nbytes + 1024
    summary = summarize(store)
    assert summary.entries == 3 and summary.by_fingerprint == {FP: 2, "other": 1}
    assert summary.nbytes == sum(info.nbytes for info in infos.values())


def test_check_and_find_corrupt_on_disk(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    kvs = [make_kv(i) for i in range(3)]
    for kv in kvs:
        store.put(kv)
    data = bytearray(entry_path(store, kvs[0].key).read_bytes())
    data[-3] ^= 0xFF  # a flipped payload byte: only the checksum notices
    entry_path(store, kvs[0].key).write_bytes(bytes(data))
    entry_path(store, kvs[1].key).write_bytes(b"short")
    assert "checksum" in store.check(kvs[0].key)
    assert store.check(kvs[2].key) is None
    # An unreadable header still lists the entry, with no fingerprint.
    assert {i.key: i.fingerprint for i in store.entries()}[kvs[1].key] is None

    found = dict(find_corrupt(store))
    assert set(found) == {kvs[0].key, kvs[1].key} and len(store) == 3  # reported, kept
    assert set(dict(find_corrupt(store, delete=True))) == set(found)
    assert list(store.keys()) == [kvs[2].key]
    assert find_corrupt(store) == []


def test_prune_by_age_foreign_and_size(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    kvs = [make_kv(i) for i in range(4)] + [make_kv(9, fingerprint="other")]
    now = time.time()
    for age_days, kv in zip([10, 3, 2, 1, 0], kvs):
        store.put(kv)
        stamp = now - age_days * 86400
        os.utime(entry_path(store, kv.key), (stamp, stamp))

    assert [i.key for i in prune(store, foreign_to=FP, dry_run=True)] == [kvs[4].key]
    assert len(store) == 5  # a dry run chooses, evicts nothing
    assert [i.key for i in prune(store, foreign_to=FP)] == [kvs[4].key]
    assert [i.key for i in prune(store, older_than_s=5 * 86400)] == [kvs[0].key]
    sizes = {i.key: i.nbytes for i in store.entries()}
    budget = sizes[kvs[2].key] + sizes[kvs[3].key]
    assert [i.key for i in prune(store, max_bytes=budget)] == [kvs[1].key]  # oldest first
    assert sorted(store.keys()) == sorted([kvs[2].key, kvs[3].key])
    assert prune(store, max_bytes=budget) == []


def test_open_store_forms(tmp_path: Path) -> None:
    disk = open_store(f"disk:{tmp_path}")
    assert isinstance(disk, DiskKVStore) and disk.root == tmp_path
    assert isinstance(open_store("memory"), MemoryKVStore)
    pytest.importorskip("redis")
    redis_store = open_store("redis://127.0.0.1:1/3")  # no connection until used
    assert isinstance(redis_store, RedisKVStore)
    assert redis_store.client.connection_pool.connection_kwargs["db"] == 3
    for bad in ("disk:", "s3://bucket", "./kv", ""):
        with pytest.raises(StoreURLError):
            open_store(bad)


def test_prune_honours_namespaces_quotas_and_expiry(tmp_path: Path) -> None:
    """Issue 59 hole 14 (and 11 at rest): ``prune --max-bytes`` evicted the least
    recently used entries across namespaces, ignoring quotas; ``--foreign`` took
    every entry of a server's tenants for another model's; a private entry of a
    server killed mid-request stayed. Now a namespace over its quota gives way
    first, a tenant's entries of the model are its own, and private entries unused
    for ``PRIVATE_TTL_S`` go."""
    from kvrag_integrations.store.namespaces import PRIVATE_TTL_S
    from kvrag_integrations.vllm.trust import Tenant

    store = DiskKVStore(tmp_path / "kv")
    team = Tenant.of_key_namespace("team-a", b"x").fingerprint(FP)
    shared = [make_kv(i, n=64) for i in range(4)]  # older: the shared namespace's
    keyed = [make_kv(10 + i, n=64, fingerprint=team) for i in range(8)]  # newer, a team's
    own = make_kv(30, n=8, fingerprint=Tenant.of_request("anonymous", "1").fingerprint(FP))
    for age, kv in enumerate([*shared, *keyed, own]):
        store.put(kv)
        stamp = time.time() - 1000 + age
        if kv is own:
            stamp = time.time() - PRIVATE_TTL_S - 60  # a killed server's, long unused
        os.utime(entry_path(store, kv.key), (stamp, stamp))
    one = next(i.nbytes for i in store.entries() if i.key == shared[0].key)
    evicted = {info.key for info in prune(store, max_bytes=10 * one + 2048)}
    # the team held 8 of 10 (over half): its oldest went, and the shared ones stayed
    assert evicted == {own.key, keyed[0].key, keyed[1].key}
    assert all(store.contains(kv.key) for kv in shared)
    evicted = {info.key for info in prune(store, foreign_to=FP)}
    assert evicted == set()  # the team's entries are the model's (FP), in a namespace
    assert {info.key for info in prune(store, foreign_to="another")} == {
        kv.key for kv in [*shared, *keyed[2:]]
    }
