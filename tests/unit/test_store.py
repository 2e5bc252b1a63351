"""Tests of the chunk KV stores and their byte format (synthetic tensors, no model).

Faults of the stores alone (damaged, foreign, unwritable, pickled) are here;
how the engine recovers from them is in test_engine_faults.py.
"""

from __future__ import annotations

import _pickle
import ast
import os
import pickle
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
import pytest
import safetensors.torch
import torch

import kvrag_integrations
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import CacheEntryError, StoreWriteError
from kvrag_integrations.store import (
    DiskKVStore,
    KVStore,
    MemoryKVStore,
    TieredKVStore,
    decode_entry,
    encode_entry,
)
from kvrag_integrations.store.codec import FORMAT_VERSION, _checksum

FP = "fp-test"
PACKAGE = Path(kvrag_integrations.__file__).parent


def make_kv(
    seed: int = 0, n: int = 5, dtype: torch.dtype = torch.float32, fingerprint: str = FP
) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, n, 8)  # [layers, kv_heads, tokens, head_dim]
    return ChunkKV(
        token_ids=torch.randint(0, 32000, (n,), generator=gen),
        keys=torch.randn(shape, generator=gen).to(dtype),
        values=torch.randn(shape, generator=gen).to(dtype),
        fingerprint=fingerprint,
    )


def entry_path(store: DiskKVStore, key: str) -> Path:
    return store.root / key[:2] / f"{key}.safetensors"


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def assert_same(a: ChunkKV, b: ChunkKV) -> None:
    for name in ("token_ids", "keys", "values"):  # same dtype too: no silent cast
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.fingerprint, a.key) == (b.fingerprint, b.key)


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> KVStore:
    if request.param == "memory":
        return MemoryKVStore()
    return DiskKVStore(tmp_path / "cache")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_bit_exact(store: KVStore, dtype: torch.dtype) -> None:
    kv = make_kv(dtype=dtype)
    key = store.put(kv)
    assert key == kv.key
    got = store.get(key, FP)
    assert got is not None
    assert_same(got, kv)
    assert list(store.keys()) == [key] and len(store) == 1 and store.contains(key)


def test_hits_and_misses_counted(store: KVStore) -> None:
    kv = make_kv()
    assert store.get(kv.key, FP) is None
    store.put(kv)
    assert store.get(kv.key, FP) is not None
    assert (store.stats.hits, store.stats.misses, store.stats.writes) == (1, 1, 1)
    assert store.stats.rejected == 0


def test_foreign_fingerprint_is_a_miss(store: KVStore) -> None:
    kv = make_kv(fingerprint="model-a")
    store.put(kv)
    assert store.get(kv.key, "model-b") is None
    assert store.stats.rejected == 1
    assert not store.contains(kv.key)  # dropped so it gets recomputed
    store.put(kv)
    assert store.get(kv.key, "model-a") is not None


def _flip_payload_byte(data: bytes) -> bytes:
    return data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:]  # the tail is tensor payload


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated
        _flip_payload_byte,
        lambda data: b"this is not a safetensors file" * 4,  # garbage
    ],
    ids=["truncated", "bit-flip", "garbage"],
)
def test_damaged_file_is_rejected_and_removed(tmp_path: Path, damage) -> None:
    store = DiskKVStore(tmp_path)
    kv = make_kv(dtype=torch.bfloat16)
    store.put(kv)
    path = entry_path(store, kv.key)
    path.write_bytes(damage(path.read_bytes()))

    with pytest.raises(CacheEntryError):
        decode_entry(path.read_bytes())
    assert store.get(kv.key, FP) is None
    assert store.stats.rejected == 1 and store.stats.misses == 0
    assert not path.exists()

    store.put(kv)
    got = store.get(kv.key, FP)
    assert got is not None
    assert_same(got, kv)


def test_entry_under_another_key_is_rejected(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    a, b = make_kv(seed=1), make_kv(seed=2)
    store.put(a)
    store.put(b)
    path_b = entry_path(store, b.key)
    path_b.write_bytes(entry_path(store, a.key).read_bytes())

    assert store.get(b.key, FP) is None
    assert store.stats.rejected == 1
    assert not path_b.exists()
    assert store.get(a.key, FP) is not None


def test_verify_counts_and_deletes_bad_entries(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    kvs = [make_kv(seed=i) for i in range(3)]
    for kv in kvs:
        store.put(kv)
    entry_path(store, kvs[0].key).write_bytes(b"garbage")
    entry_path(store, kvs[1].key).write_bytes(entry_path(store, kvs[2].key).read_bytes())
    assert store.verify() == {"ok": 1, "bad": 2}
    assert list(store.keys()) == [kvs[2].key]
    assert store.nbytes == entry_path(store, kvs[2].key).stat().st_size


def _resave(kv: ChunkKV, drop: str | None, **metadata: str) -> bytes:
    """Re-save an entry with a tensor dropped and/or metadata fields replaced."""
    tensors = safetensors.torch.load(encode_entry(kv))
    meta = {"format": FORMAT_VERSION, "fingerprint": kv.fingerprint, "key": kv.key}
    meta.update({k: v for k, v in metadata.items() if k != "checksum"})
    # a valid code over the edited metadata: the checks after it must catch the edit
    meta["integrity"], meta["checksum"] = _checksum(meta, tensors, None)
    meta.update(metadata)
    tensors.pop(drop, None)
    return safetensors.torch.save(tensors, metadata=meta)


@pytest.mark.parametrize(
    "drop, metadata, message",
    [
        (None, {"format": "kvrag-chunk-v0"}, "format"),
        (None, {"key": "0" * 64}, "key does not match"),
        (None, {"fingerprint": "other"}, "key does not match"),
        (None, {"checksum": "0" * 32}, "integrity check"),
        (None, {"integrity": "hmac-sha256"}, "expects 'xxh3-128'"),
        ("values", {}, "expected"),
    ],
)
def test_decode_rejects_inconsistent_entries(
    drop: str | None, metadata: dict[str, str], message: str
) -> None:
    with pytest.raises(CacheEntryError, match=message):
        decode_entry(_resave(make_kv(), drop, **metadata))


@pytest.mark.parametrize("key", ["../etc/passwd", "A" * 64, "0" * 63, "0" * 64 + "/x", ""])
def test_invalid_keys_raise(tmp_path: Path, key: str) -> None:
    store = DiskKVStore(tmp_path)
    for call in (
        lambda: store.get(key, FP),
        lambda: store.delete(key),
        lambda: store.contains(key),
    ):
        with pytest.raises(ValueError):
            call()


def test_root_created_lazily(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path / "not" / "yet")
    assert list(store.keys()) == [] and store.nbytes == 0
    assert store.get(make_kv().key, FP) is None
    assert not (tmp_path / "not").exists()


def test_read_only_dir_raises_store_write_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH)
    try:
        try:
            (ro / "probe").write_bytes(b"")
        except OSError:
            pass
        else:
            pytest.skip("chmod does not restrict this user (root?)")
        store = DiskKVStore(ro / "cache")  # constructing on a read-only path is fine
        with pytest.raises(StoreWriteError, match="cannot write"):
            store.put(make_kv())
    finally:
        ro.chmod(0o755)


def test_unwritable_root_raises_store_write_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    store = DiskKVStore(blocker / "cache")  # a parent that is a file: fails even as root
    with pytest.raises(StoreWriteError) as info:
        store.put(make_kv())
    assert isinstance(info.value, OSError) and str(blocker) in str(info.value)


def test_failed_replace_cleans_up_temp_file(tmp_path: Path, monkeypatch) -> None:
    store = DiskKVStore(tmp_path)

    def disk_full(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(StoreWriteError, match="No space left"):
        store.put(make_kv())
    assert all_files(tmp_path) == []


def test_concurrent_puts_leave_one_valid_entry(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    kv = make_kv(n=64)
    barrier = threading.Barrier(8)  # start all writers at once to force the race

    def writer() -> str:
        barrier.wait()
        return store.put(kv)

    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(writer) for _ in range(8)]
        assert {f.result() for f in futures} == {kv.key}  # result() re-raises errors

    assert all_files(tmp_path) == [entry_path(store, kv.key)]
    got = store.get(kv.key, FP)
    assert got is not None
    assert_same(got, kv)
    assert store.stats.writes == 8


def test_memory_lru_order_and_budget() -> None:
    kvs = [make_kv(seed=i) for i in range(5)]
    size = kvs[0].nbytes
    store = MemoryKVStore(max_bytes=3 * size)
    for kv in kvs[:3]:
        store.put(kv)
    assert store.get(kvs[0].key, FP) is kvs[0]  # refresh: kvs[1] is now the oldest

    store.put(kvs[3])
    assert list(store.keys()) == [kvs[2].key, kvs[0].key, kvs[3].key]
    store.put(kvs[4])
    assert list(store.keys()) == [kvs[0].key, kvs[3].key, kvs[4].key]
    assert store.stats.evictions == 2
    assert store.nbytes == 3 * size <= store.max_bytes


def test_memory_oversized_entry_not_stored(caplog: pytest.LogCaptureFixture) -> None:
    small, big = make_kv(n=2), make_kv(n=64)
    store = MemoryKVStore(max_bytes=small.nbytes)
    store.put(small)
    store.put(big)
    assert list(store.keys()) == [small.key]
    assert store.get(big.key, FP) is None and store.stats.evictions == 0
    assert "exceeds max_bytes" in caplog.text


def test_memory_overwrite_and_delete_keep_nbytes_right() -> None:
    kv = make_kv()
    store = MemoryKVStore(max_bytes=None)
    store.put(kv)
    store.put(kv)
    assert store.nbytes == kv.nbytes and len(store) == 1
    store.delete(kv.key)
    assert store.nbytes == 0 and len(store) == 0


# ------------------------------------------------- no pickle in stored data
def _unsafe_loads(path: Path) -> list[str]:
    """Imports of pickle-like modules and calls of torch.load / np.load in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        bad_modules = {"pickle", "cPickle", "_pickle", "dill", "joblib", "marshal", "shelve"}
        found += [f"import {n}" for n in names if n.split(".")[0] in bad_modules]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in {
                ("torch", "load"),
                ("np", "load"),
                ("numpy", "load"),
            }:
                found.append(f"{owner.id}.{node.func.attr}()")
    return [f"{path.relative_to(PACKAGE)}: {what}" for what in found]


def test_source_scan_no_pickle_imports_or_torch_load_in_the_package() -> None:
    """A source-text check (it reads the package's files, runs nothing): no module
    imports pickle-like modules or calls torch.load / np.load, and the codec decodes
    with torch.frombuffer. The behavioural counterpart is
    test_entries_are_read_back_with_every_unpickler_disabled."""
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20
    assert [hit for path in sources for hit in _unsafe_loads(path)] == []
    codec = (PACKAGE / "store" / "codec.py").read_text()
    assert "torch.frombuffer(data" in codec  # what decoding uses instead (no copy)


def test_a_pickled_entry_is_rejected_not_executed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KVRAG_PWNED", raising=False)

    class Payload:
        def __reduce__(self):
            return exec, ("import os; os.environ['KVRAG_PWNED'] = '1'",)

    blob = pickle.dumps(Payload())
    with pytest.raises(CacheEntryError):
        decode_entry(blob)
    store = DiskKVStore(tmp_path)
    key = "ab" * 32
    (tmp_path / key[:2]).mkdir()
    (tmp_path / key[:2] / f"{key}.safetensors").write_bytes(blob)
    assert store.get(key, "any-model") is None and store.stats.rejected == 1
    assert "KVRAG_PWNED" not in os.environ


UNPICKLERS = [
    (pickle, "load"),
    (pickle, "loads"),
    (pickle, "Unpickler"),
    (_pickle, "load"),
    (_pickle, "loads"),
    (_pickle, "Unpickler"),
    (torch, "load"),
    (numpy, "load"),
]


@pytest.mark.parametrize("precision", ["float16", "bfloat16", "int8", "model"])
def test_entries_are_read_back_with_every_unpickler_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """Writing and reading entries through every local store never unpickles: with
    pickle, torch.load and numpy.load all raising, entries still round-trip, and
    decoding reads the tensors with torch.frombuffer (no copy, no unpickler)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache entry was unpickled")

    for module, name in UNPICKLERS:
        monkeypatch.setattr(module, name, refuse)
    frombuffer, decoded = torch.frombuffer, []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        decoded.append(kwargs.get("dtype"))
        return frombuffer(*args, **kwargs)

    monkeypatch.setattr(torch, "frombuffer", spy)
    kv = make_kv(n=8).stored_as(precision)
    assert_same(decode_entry(encode_entry(kv)), kv)
    assert decoded, "decoding did not go through torch.frombuffer"
    disk = DiskKVStore(tmp_path / "disk")
    for store in (MemoryKVStore(), disk, TieredKVStore(DiskKVStore(tmp_path / "tiered"))):
        store.put(kv)
        assert_same(store.get(kv.key, FP), kv)
    assert_same(DiskKVStore(disk.root).get(kv.key, FP), kv)  # read back by a new process
