"""Storage precision of chunk caches: float16 (default), bfloat16, int8 (KIVI-style), model."""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
import warnings
from pathlib import Path

import pytest
import safetensors.torch
import torch
import xxhash

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.chunk_kv import (
    FLOAT16_MAX,
    ChunkKV,
    cache_key,
    storage_fingerprint,
)
from kvrag_integrations.errors import CacheEntryError
from kvrag_integrations.store import DiskKVStore, KVStore, MemoryKVStore, decode_entry, encode_entry

FP = "fp-precision"
PRECISIONS = ["float16", "bfloat16", "int8", "model"]
TOWER = "The Eiffel Tower, completed in 1889, is 330 metres tall and stands in Paris."
REEF = "The Great Barrier Reef off Queensland is the largest coral reef system on Earth."
QUESTION = "How tall is the Eiffel Tower?"


def make_kv(seed: int = 0, n: int = 12, shape: tuple[int, int, int] = (3, 2, 16)) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    layers, heads, dim = shape
    # keys with per-channel offsets and spreads (what RoPE'd keys look like), values plain
    keys = (
        torch.randn(layers, heads, n, dim, generator=gen) * 3
        + torch.randn(layers, heads, 1, dim, generator=gen) * 10
    )
    values = torch.randn(layers, heads, n, dim, generator=gen)
    return ChunkKV(torch.randint(0, 32000, (n,), generator=gen), keys, values, FP)


@pytest.fixture(params=["memory", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> KVStore:
    return MemoryKVStore() if request.param == "memory" else DiskKVStore(tmp_path / "kv")


def assert_same_form(a: ChunkKV, b: ChunkKV) -> None:
    assert a.precision == b.precision
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_round_trip_per_precision(store: KVStore, precision: str) -> None:
    original = make_kv()
    stored = original.stored_as(precision)
    expected = {"model": "float32"}.get(precision, precision)
    assert stored.precision == expected
    store.put(stored)
    got = store.get(stored.key, FP)
    assert got is not None
    assert_same_form(got, stored)
    keys, values = got.to("cpu", torch.float32).keys, got.to("cpu", torch.float32).values
    assert keys.dtype == values.dtype == torch.float32
    tol = {"model": 0.0, "float16": 2e-2, "bfloat16": 0.2, "int8": 0.25}[precision]
    assert (keys - original.keys).abs().max() <= tol
    assert (values - original.values).abs().max() <= tol


def test_int8_error_is_within_half_a_step() -> None:
    """Keys: one scale per [layer, head, channel]; values: one per [layer, head, token]."""
    kv = make_kv(seed=3, n=300, shape=(4, 3, 64))
    q = kv.stored_as("int8")
    assert q.keys.dtype == q.values.dtype == torch.uint8
    assert tuple(q.key_scale.shape) == (4, 3, 1, 64) and q.key_scale.dtype == torch.float16
    assert tuple(q.value_scale.shape) == (4, 3, 300, 1) and q.value_zero.dtype == torch.float16
    keys, values = q.dequantize(torch.float32)
    eps = 1e-5
    assert ((keys - kv.keys).abs() <= q.key_scale.float() / 2 + eps).all()
    assert ((values - kv.values).abs() <= q.value_scale.float() / 2 + eps).all()
    # the scales really are per channel / per token: the range over the reduced dim / 255
    spread = kv.keys.amax(dim=2, keepdim=True) - kv.keys.amin(dim=2, keepdim=True)
    torch.testing.assert_close(q.key_scale.float(), spread / 255, rtol=2e-3, atol=1e-6)


def test_int8_constant_and_empty_slices() -> None:
    ids = torch.arange(4)
    flat = ChunkKV(ids, torch.full((1, 1, 4, 8), 2.5), torch.full((1, 1, 4, 8), -1.0), FP)
    keys, values = flat.stored_as("int8").dequantize()
    assert torch.equal(keys, flat.keys) and torch.equal(values, flat.values)
    empty = ChunkKV(torch.arange(0), torch.zeros(1, 1, 0, 8), torch.zeros(1, 1, 0, 8), FP)
    q = empty.stored_as("int8")
    assert decode_entry(encode_entry(q)).num_tokens == 0


def test_float16_overflow_falls_back_to_bfloat16() -> None:
    kv = make_kv()
    big = kv.values.clone()
    big[0, 0, 0, 0] = 2 * FLOAT16_MAX
    hot = ChunkKV(kv.token_ids, kv.keys, big, FP)
    stored = hot.stored_as("float16")
    assert stored.precision == "bfloat16"  # float16 would make it inf
    assert torch.isfinite(stored.values).all()
    assert kv.stored_as("float16").precision == "float16"
    assert hot.stored_as("int8").precision == "bfloat16"  # its zero point would overflow too
    assert decode_entry(encode_entry(stored)).precision == "bfloat16"


def test_int8_smollm2_entry_is_at_most_12kb_per_token() -> None:
    kv = make_kv(n=300, shape=(30, 3, 64)).stored_as("int8")  # SmolLM2-135M's K/V shape
    assert kv.nbytes / 300 <= 12_000
    assert len(encode_entry(kv)) / 300 <= 12_000
    full = make_kv(n=300, shape=(30, 3, 64))
    assert full.nbytes / 300 > 46_000 and full.stored_as("float16").nbytes / 300 < 23_100


def test_chunk_kv_validates_quantization_tensors() -> None:
    q = make_kv().stored_as("int8")
    with pytest.raises(ValueError, match="needs all"):
        ChunkKV(q.token_ids, q.keys, q.values, FP, key_scale=q.key_scale)
    with pytest.raises(ValueError, match="key_zero must be float16"):
        ChunkKV(
            q.token_ids,
            q.keys,
            q.values,
            FP,
            q.key_scale,
            q.key_zero.float(),
            q.value_scale,
            q.value_zero,
        )
    with pytest.raises(ValueError, match="value_scale must be"):
        ChunkKV(
            q.token_ids, q.keys, q.values, FP, q.key_scale, q.key_zero, q.key_scale, q.value_zero
        )
    with pytest.raises(ValueError, match="float keys/values"):
        ChunkKV(q.token_ids, q.keys, q.values, FP)  # uint8 codes without scales


def test_int8_header_edits_are_rejected() -> None:
    blob = encode_entry(make_kv().stored_as("int8"))
    (n,) = struct.unpack("<Q", blob[:8])
    header, payload = json.loads(blob[8 : 8 + n]), blob[8 + n :]

    def forged(edit) -> bytes:
        h = json.loads(json.dumps(header))
        edit(h)
        head = json.dumps(h).encode()
        return struct.pack("<Q", len(head)) + head + payload

    for edit in (
        lambda h: h["key_scale"].update(dtype="BF16"),
        lambda h: h["__metadata__"].update(precision="float16"),
        lambda h: h.pop("value_zero"),
    ):
        with pytest.raises(CacheEntryError):
            decode_entry(forged(edit))


def test_decode_is_zero_copy(tmp_path: Path) -> None:
    kv = make_kv().stored_as("float16")
    blob = bytearray(encode_entry(kv))
    got = decode_entry(blob)
    start = ctypes.addressof((ctypes.c_char * len(blob)).from_buffer(blob))
    for tensor in got.tensors().values():
        assert start <= tensor.data_ptr() < start + len(blob)
    store = DiskKVStore(tmp_path)
    store.put(kv)
    from_disk = store.get(kv.key, FP)
    assert_same_form(from_disk, kv)
    assert from_disk.keys.is_contiguous()  # a view of the bytearray read from the file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_bytes = decode_entry(bytes(blob))  # read-only bytes (what Redis returns)
    assert not [w for w in caught if "writable" in str(w.message)]
    assert_same_form(from_bytes, kv)


def _v2_entry(kv: ChunkKV) -> bytes:
    """An entry as format v2 wrote it (no precision; the v2 integrity code)."""
    tensors = {"token_ids": kv.token_ids, "keys": kv.keys, "values": kv.values}
    meta = {"format": "kvrag-chunk-v2", "fingerprint": kv.fingerprint, "key": kv.key}
    described = dict(meta, tensors=[[n, str(t.dtype), list(t.shape)] for n, t in tensors.items()])
    head = json.dumps(described, sort_keys=True).encode()
    digest = xxhash.xxh3_128(struct.pack("<Q", len(head)) + head)
    for t in tensors.values():
        digest.update(t.numpy().tobytes())
    meta["integrity"], meta["checksum"] = "xxh3-128", digest.hexdigest()
    return safetensors.torch.save(tensors, metadata=meta)


def test_a_v2_entry_is_a_clean_miss(tmp_path: Path) -> None:
    kv = make_kv()
    store = DiskKVStore(tmp_path)
    store.put(kv)
    path = next(tmp_path.glob("??/*.safetensors"))
    path.write_bytes(_v2_entry(kv))
    with pytest.raises(CacheEntryError, match="kvrag-chunk-v2"):
        decode_entry(path.read_bytes())
    assert store.get(kv.key, FP) is None and store.stats.rejected == 1
    assert not path.exists()  # dropped, recomputed
    store.put(kv)
    assert_same_form(store.get(kv.key, FP), kv)


# ------------------------------------------------------------- with the engine
def test_engines_of_different_precision_never_read_each_others_entries(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    shared = DiskKVStore(tmp_path)
    half = KVRAGEngine(engine.loaded, store=shared, on_miss="encode")  # the default
    full = KVRAGEngine(engine.loaded, store=shared, on_miss="encode", cache_precision="model")
    assert half.cache_precision == "float16"
    assert half.fingerprint == storage_fingerprint(engine.loaded.fingerprint, "float16")
    assert half.fingerprint != full.fingerprint and half.chunk_key(TOWER) != full.chunk_key(TOWER)
    (ref,) = half.encode_chunks([TOWER], show_progress=False)
    assert shared.get(ref.key, half.fingerprint).precision == "float16"

    first = full.prefill(question=QUESTION, chunks=[TOWER])
    assert first.lazily_encoded_chunks == 1  # the float16 entry is not full's
    got = shared.get(full.chunk_key(TOWER), full.fingerprint)
    assert got.precision == "float32" and len(shared) == 2

    # A float16 entry forged under full's key and fingerprint is still not used.
    planted = half.store.get(ref.key, half.fingerprint)
    forged = ChunkKV(planted.token_ids, planted.keys, planted.values, full.fingerprint)
    assert forged.key == full.chunk_key(TOWER)
    shared.put(forged)
    again = full.prefill(question=QUESTION, chunks=[TOWER])
    assert again.lazily_encoded_chunks == 1  # a miss: encoded again at full precision
    assert shared.get(forged.key, full.fingerprint).precision == "float32"


def test_cache_key_ignores_precision_only_through_the_fingerprint() -> None:
    ids = [1, 2, 3]
    keys = {cache_key(storage_fingerprint("m", p), ids) for p in PRECISIONS}
    assert len(keys) == len(PRECISIONS)
    with pytest.raises(ValueError, match="cache_precision"):
        storage_fingerprint("m", "int4")
    digest = hashlib.sha256(b"m+kv-int8\x00" + torch.tensor(ids).numpy().tobytes())
    assert cache_key("m+kv-int8", ids) == digest.hexdigest()
