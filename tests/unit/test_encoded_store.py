"""EncodedKVStore: a backend that only moves bytes gets the codec's verification."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import DiskKVStore, EncodedKVStore, RedisKVStore


class DictBytes(EncodedKVStore):
    """The smallest backend: bytes in a dict."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.blobs: dict[str, bytes] = {}

    def _read_bytes(self, key: str) -> bytes | None:
        return self.blobs.get(key)

    def _write_bytes(self, key: str, data: bytes, ttl_s: float | None = None) -> None:
        self.blobs[key] = bytes(data)

    def _delete(self, key: str) -> None:
        self.blobs.pop(key, None)

    def keys(self) -> Iterator[str]:
        yield from list(self.blobs)


def entry(seed: int) -> ChunkKV:
    keys = torch.randn(2, 1, 4, 8, generator=torch.Generator().manual_seed(seed))
    return ChunkKV(torch.arange(seed, seed + 4), keys.half(), (2 * keys).half(), "fp")


def test_disk_and_redis_are_byte_backends_of_the_one_entry_layer() -> None:
    assert issubclass(DiskKVStore, EncodedKVStore) and issubclass(RedisKVStore, EncodedKVStore)
    for cls in (DiskKVStore, RedisKVStore):  # the format lives in one place
        assert "_get" not in vars(cls) and "_put" not in vars(cls)


def test_a_byte_backend_round_trips_and_rejects_damage() -> None:
    store = DictBytes()
    good, bad, moved = entry(0), entry(1), entry(2)
    for kv in (good, bad, moved):
        store.put(kv)
    got = store.get(good.key, "fp")
    assert torch.equal(got.keys, good.keys) and torch.equal(got.values, good.values)
    blob = bytearray(store.blobs[bad.key])
    blob[-3] ^= 0x01  # one payload bit
    store.blobs[bad.key] = bytes(blob)
    store.blobs["f" * 64] = store.blobs.pop(moved.key)  # stored under another key
    assert store.verify() == {"ok": 1, "bad": 2}
    assert list(store.keys()) == [good.key]
    assert store.get(bad.key, "fp") is None and store.stats.rejected == 0  # scrubbed, absent


def test_a_secret_on_one_side_is_a_miss() -> None:
    signed, plain = DictBytes(secret="s3cret"), DictBytes()
    kv = entry(3)
    signed.put(kv)
    plain.blobs = dict(signed.blobs)
    assert plain.get(kv.key, "fp") is None and plain.stats.rejected == 1
    assert torch.equal(signed.get(kv.key, "fp").keys, kv.keys)
