"""Entries someone edited, signed differently or replaced by hostile files: never used."""

from __future__ import annotations

import json
import os
import random
import struct
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.errors import CacheEntryError
from kvrag_integrations.store import DiskKVStore, decode_entry, encode_entry
from kvrag_integrations.store.maintenance import prune, summarize

FP = "fp-tamper"


def make_kv(seed: int = 0, n: int = 6, dtype: torch.dtype = torch.float32) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, 2, n, 64)
    return ChunkKV(
        token_ids=torch.randint(0, 32000, (n,), generator=gen),
        keys=torch.randn(shape, generator=gen).to(dtype),
        values=torch.randn(shape, generator=gen).to(dtype),
        fingerprint=FP,
    )


def split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict, payload: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + payload


def assert_rejected_or_identical(blob: bytes, kv: ChunkKV) -> str:
    try:
        got = decode_entry(blob)
    except CacheEntryError:
        return "rejected"
    for name in ("token_ids", "keys", "values"):  # provably harmless: the same tensors
        a, b = getattr(got, name), getattr(kv, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    return "identical"


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda h: h["keys"].update(dtype="I32"), id="keys-F32-to-I32"),
        pytest.param(lambda h: h["values"].update(dtype="I32"), id="values-F32-to-I32"),
        pytest.param(lambda h: h["keys"].update(shape=h["keys"]["shape"][::-1]), id="shape-order"),
        pytest.param(
            lambda h: h["keys"].update(dtype="F16", shape=[*h["keys"]["shape"][:3], 128]),
            id="F32-64-to-F16-128",
        ),
    ],
)
def test_header_edits_that_keep_the_bytes_are_rejected(tmp_path: Path, edit) -> None:
    kv = make_kv()
    header, payload = split(encode_entry(kv))
    edit(header)
    forged = join(header, payload)
    with pytest.raises(CacheEntryError, match="integrity"):
        decode_entry(forged)
    store = DiskKVStore(tmp_path)
    store.put(kv)
    path = next(tmp_path.glob("??/*.safetensors"))
    path.write_bytes(forged)
    assert store.get(kv.key, FP) is None and store.stats.rejected == 1
    assert not path.exists()  # dropped, recomputed by the engine


def _mutate(header: dict, rng: random.Random) -> str:
    names = ["token_ids", "keys", "values"]
    what = rng.choice(["dtype", "shape", "offsets", "metadata"])
    if what == "dtype":
        header[rng.choice(names)]["dtype"] = rng.choice(
            ["F32", "F16", "BF16", "I32", "I64", "F64", "U8", "I16", "BOOL"]
        )
    elif what == "shape":
        tensor = header[rng.choice(names)]
        shape = list(tensor["shape"])
        op = rng.choice(["permute", "scale", "drop", "add"])
        if op == "permute":
            rng.shuffle(shape)
        elif op == "scale" and len(shape) > 1:
            i, j = rng.sample(range(len(shape)), 2)
            if shape[j] % 2 == 0:
                shape[i], shape[j] = shape[i] * 2, shape[j] // 2
        elif op == "drop" and len(shape) > 1:
            shape.pop(rng.randrange(len(shape)))
        else:
            shape.insert(rng.randrange(len(shape) + 1), 1)
        tensor["shape"] = shape
    elif what == "offsets":
        tensor = header[rng.choice(names)]
        start, end = tensor["data_offsets"]
        delta = rng.choice([-8, -4, -2, 2, 4, 8])
        tensor["data_offsets"] = rng.choice(
            [[start + delta, end + delta], [start, end + delta], [start + delta, end]]
        )
    else:
        meta = header["__metadata__"]
        field = rng.choice(sorted(meta))
        value = meta[field]
        i = rng.randrange(len(value)) if value else 0
        meta[field] = value[:i] + rng.choice("0af-xZ") + value[i + 1 :]
    return what


def test_randomized_header_mutations_are_rejected_or_harmless() -> None:
    rng = random.Random(1234)
    outcomes: dict[str, int] = {}
    for i in range(600):
        kv = make_kv(seed=i % 7, n=4 + i % 5, dtype=[torch.float32, torch.bfloat16][i % 2])
        header, payload = split(encode_entry(kv))
        kind = _mutate(header, rng)
        result = assert_rejected_or_identical(join(header, payload), kv)
        outcomes[f"{kind}:{result}"] = outcomes.get(f"{kind}:{result}", 0) + 1
    assert sum(outcomes.values()) == 600
    rejected = sum(v for k, v in outcomes.items() if k.endswith("rejected"))
    assert rejected >= 550, outcomes  # the rest changed nothing the decoder uses


def test_a_v1_entry_is_a_clean_miss(tmp_path: Path) -> None:
    """Entries of the previous format (sha256 over the payload only) are not read."""
    import hashlib

    kv = make_kv()
    tensors = {"token_ids": kv.token_ids, "keys": kv.keys, "values": kv.values}
    digest = hashlib.sha256()
    for t in tensors.values():
        digest.update(t.numpy().tobytes())
    meta = {"format": "kvrag-chunk-v1", "fingerprint": FP, "key": kv.key}
    meta["checksum"] = digest.hexdigest()
    store = DiskKVStore(tmp_path)
    store.put(kv)
    path = next(tmp_path.glob("??/*.safetensors"))
    path.write_bytes(safetensors.torch.save(tensors, metadata=meta))
    assert store.get(kv.key, FP) is None and store.stats.rejected == 1
    store.put(kv)
    assert torch.equal(store.get(kv.key, FP).keys, kv.keys)


def test_a_store_secret_signs_and_checks_entries(tmp_path: Path, monkeypatch) -> None:
    kv = make_kv()
    signed = DiskKVStore(tmp_path / "a", secret="s3cret")
    signed.put(kv)
    assert torch.equal(signed.get(kv.key, FP).values, kv.values)
    blob = next((tmp_path / "a").glob("??/*.safetensors")).read_bytes()
    assert (
        json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])["__metadata__"]["integrity"]
        == "hmac-sha256"
    )
    # another secret, no secret, and an unsigned entry read by a signed store: all misses
    for reader in (DiskKVStore(tmp_path / "a", secret="other"), DiskKVStore(tmp_path / "a")):
        assert reader.get(kv.key, FP) is None
        signed.put(kv)
    plain = DiskKVStore(tmp_path / "b")
    plain.put(kv)
    monkeypatch.setenv("KVRAG_STORE_SECRET", "from-env")
    assert DiskKVStore(tmp_path / "b").get(kv.key, FP) is None  # the env secret applies
    with pytest.raises(ValueError, match="empty"):
        DiskKVStore(tmp_path, secret="")


def test_hostile_files_are_quick_misses(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    fifo_kv, zero_kv, big_kv = make_kv(seed=1), make_kv(seed=2), make_kv(seed=3)
    for kv in (fifo_kv, zero_kv, big_kv):
        store.put(kv)
    paths = {
        kv.key: next(tmp_path.glob(f"??/{kv.key}.safetensors")) for kv in (fifo_kv, zero_kv, big_kv)
    }
    paths[fifo_kv.key].unlink()
    os.mkfifo(paths[fifo_kv.key])
    paths[zero_kv.key].unlink()
    paths[zero_kv.key].symlink_to("/dev/zero")
    with paths[big_kv.key].open("ab") as handle:  # a header that lies about the size
        handle.write(b"\0" * 4096)
    started = time.perf_counter()
    for kv in (fifo_kv, zero_kv, big_kv):
        assert store.get(kv.key, FP) is None
    assert time.perf_counter() - started < 5
    assert store.stats.rejected == 3
    summary = summarize(store)  # listing does not hang on them either
    assert summary.entries <= 3


def test_temp_files_that_name_no_writer_are_removed_after_the_grace(tmp_path: Path) -> None:
    """An older version's temp files name no writer: they may be in flight, so they
    wait out the grace (writers that name themselves: test_store_temp_files.py)."""
    store = DiskKVStore(tmp_path)
    kv = make_kv()
    store.put(kv)
    shard = next(tmp_path.glob("??"))
    stale = shard / ".tmp-killed.part"
    stale.write_bytes(b"x" * 1000)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = shard / ".tmp-inflight.part"
    fresh.write_bytes(b"y" * 10)
    summary = summarize(store)
    assert (summary.temp_files, summary.temp_bytes) == (1, 10)
    assert (summary.temp_files_reclaimed, summary.temp_bytes_reclaimed) == (1, 1000)
    assert summary.entries == 1 and summary.nbytes > 1000
    result = prune(store, max_bytes=10**9)
    assert not stale.exists() and fresh.exists()  # a write in flight is left alone
    assert result == [] and (result.temp_files, result.temp_bytes) == (1, 10)
    assert store.get(kv.key, FP) is not None
