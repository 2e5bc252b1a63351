"""The engine under faults: unwritable stores, bad arguments, hash-only names, bad entries.

Damaged, foreign, truncated or forged cache entries are misses and are
recomputed. Faults of the stores alone are in test_store*.py (disk, memory,
tiered) and tests/integration/test_store_redis.py; the engine over a Redis that
dies is in tests/integration/test_engine_redis.py.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path

import pytest
import torch

from kvrag_integrations import (
    ContextWindowExceededError,
    DiskKVStore,
    InvalidChunkError,
    KVRAGEngine,
    MemoryKVStore,
    StoreWriteError,
    Text,
    UnknownStrategyError,
)
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.prompting.segments import Chunk
from kvrag_integrations.store import decode_entry

CHUNK = "The Rosetta Stone was found in 1799 near the town of Rashid in Egypt."
QUESTION = "When was the Rosetta Stone found?"


def ask(eng: KVRAGEngine, chunks: list, **kwargs):
    kwargs.setdefault("max_new_tokens", 2)
    return eng.generate(question=QUESTION, chunks=chunks, **kwargs)


# -------------------------------------------------------------- unwritable stores
def _parent_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    return blocker / "kv", str(blocker)  # mkdir fails even for root, unlike chmod 0555


def _disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    def replace(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", replace)
    return tmp_path / "kv", "No space left"


@pytest.mark.parametrize("fault", [_parent_is_a_file, _disk_full], ids=["read-only", "disk-full"])
def test_unwritable_store(engine, tmp_path, monkeypatch, caplog, fault) -> None:
    root, message = fault(tmp_path, monkeypatch)
    store = DiskKVStore(root)
    eng = KVRAGEngine(engine.loaded, store=store, on_miss="encode")  # the lazy fill

    with pytest.raises(StoreWriteError, match="cannot write cache entry") as info:
        eng.encode_chunks([CHUNK], show_progress=False)  # ingestion must say so
    assert message in str(info.value) and isinstance(info.value, OSError)

    with caplog.at_level(logging.WARNING, logger="kvrag_integrations.engine.engine"):
        result = ask(eng, [CHUNK])  # a query still answers, uncached
    assert result.generated_tokens > 0 and result.lazily_encoded_chunks == 1
    assert "not stored" in caplog.text
    assert len(store) == 0 and store.stats.writes == 0
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".part")]  # no temp litter


# --------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "bad, error",
    [
        (None, TypeError),
        ("a single string", TypeError),
        ([None], InvalidChunkError),
        ([42], InvalidChunkError),
        ([b"\xff\xfe invalid UTF-8"], InvalidChunkError),  # bytes are not text
        (["   "], InvalidChunkError),
    ],
    ids=["none", "str", "none-chunk", "int-chunk", "bytes-chunk", "blank-chunk"],
)
def test_bad_chunks_everywhere(engine: KVRAGEngine, bad, error) -> None:
    with pytest.raises(error):
        engine.encode_chunks(bad, show_progress=False)
    if isinstance(bad, list):
        with pytest.raises(error):
            engine.chunk_key(bad[0])
    if bad is None:
        return  # chunks=None is a valid request: the question alone
    for call in (engine.generate, engine.stream, engine.prefill):
        with pytest.raises(error):
            call(question=QUESTION, chunks=bad, max_new_tokens=1)


def test_bad_requests(engine: KVRAGEngine) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate(question=None, chunks=[CHUNK])
    with pytest.raises(TypeError):
        engine.generate(question=42, chunks=[CHUNK])
    with pytest.raises(TypeError):
        engine.generate(messages=[{"role": "user", "content": None}])
    with pytest.raises(TypeError):
        engine.generate(messages=[{"role": "user", "content": b"\xff"}])
    with pytest.raises(ValueError):
        ask(engine, [CHUNK], max_new_tokens=-1)


def test_non_segment_in_segments_is_a_type_error(engine: KVRAGEngine) -> None:
    with pytest.raises(TypeError):
        engine.generate(segments=[Text("Context: "), None], max_new_tokens=1)


def test_chunk_over_the_context_window(engine: KVRAGEngine) -> None:
    huge = "word " * (engine.context_window + 16)
    with pytest.raises(ContextWindowExceededError, match="context window"):
        engine.encode_chunks([huge], show_progress=False)
    with pytest.raises(ContextWindowExceededError):
        ask(engine, [huge])
    with pytest.raises(ContextWindowExceededError):
        ask(engine, [CHUNK], max_new_tokens=engine.context_window)


def test_text_decoded_with_replacement_works(engine: KVRAGEngine, tmp_path: Path) -> None:
    text = b"Caf\xe9 au lait \xff costs 3 euros in Lyon.".decode("utf-8", errors="replace")
    assert "\ufffd" in text
    eng = KVRAGEngine(engine.loaded, store=DiskKVStore(tmp_path / "kv"))
    eng.encode_chunks([text], show_progress=False)
    result = eng.generate(question="How much is it?", chunks=[text], max_new_tokens=2)
    assert result.generated_tokens > 0 and result.lazily_encoded_chunks == 0


@pytest.mark.parametrize("strategy", ["nope", None, "TURBO"])
def test_unknown_strategy(engine: KVRAGEngine, strategy) -> None:
    with pytest.raises(UnknownStrategyError, match="unknown strategy"):
        ask(engine, [CHUNK], strategy=strategy)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan")])
def test_recompute_ratio_outside_unit_interval(engine: KVRAGEngine, ratio: float) -> None:
    with pytest.raises(ValueError, match="recompute_ratio"):
        ask(engine, [CHUNK], strategy="blend", recompute_ratio=ratio)


# ------------------------------------------------------------------ stored data


@pytest.mark.parametrize("text", ["../../etc/passwd", "/etc/shadow", "a\x00b", "C:\\Windows\\x"])
def test_keys_and_paths_come_from_hashes(engine: KVRAGEngine, tmp_path: Path, text: str) -> None:
    root = tmp_path / "kv"
    eng = KVRAGEngine(engine.loaded, store=DiskKVStore(root))
    (ref,) = eng.encode_chunks([text], show_progress=False)
    assert re.fullmatch(r"[0-9a-f]{64}", ref.key) and ref.key == eng.chunk_key(text)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [root / ref.key[:2] / f"{ref.key}.safetensors"]
    assert files[0].resolve().is_relative_to(root.resolve())


# ------------------------------------------- damaged, foreign and forged entries
def test_reingestion_repairs_a_truncated_entry(tmp_path: Path, engine) -> None:
    e = KVRAGEngine(engine.loaded, store=DiskKVStore(tmp_path), on_miss="encode")
    text = "The Rosetta Stone was found in 1799 near Rashid."
    (ref,) = e.encode_chunks([text], show_progress=False)
    path = next(tmp_path.glob(f"??/{ref.key}.safetensors"))
    intact = path.read_bytes()
    path.write_bytes(intact[: len(intact) // 2])
    e.encode_chunks([text], show_progress=False)  # verifies, finds it broken, re-encodes
    repaired, original = decode_entry(path.read_bytes()), decode_entry(intact)
    assert torch.equal(repaired.keys, original.keys)
    assert torch.equal(repaired.values, original.values)


def test_an_entry_of_the_wrong_shape_never_reaches_the_model(tmp_path: Path, engine) -> None:
    """Right fingerprint and key, valid checksum, wrong layout (a forgery without the
    MAC): the engine treats it as a miss instead of crashing deep in torch."""
    e = KVRAGEngine(engine.loaded, store=DiskKVStore(tmp_path), on_miss="encode")
    text = "Champollion deciphered the hieroglyphs in 1822."
    ids = e.caches.entry_ids(e.tokenize([Chunk(text)]).input_ids)  # its key's ids
    n = ids.numel()
    e.store.put(ChunkKV(ids, torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4), e.fingerprint))
    assert e.store.contains(e.chunk_key(text))
    result = e.generate(question="Who deciphered them?", chunks=[text], max_new_tokens=2)
    assert result.lazily_encoded_chunks == 1  # the bad entry was a miss, encoded again
    config = e.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = (config.num_hidden_layers, config.num_key_value_heads, n, head_dim)
    assert e.store.get(e.chunk_key(text), e.fingerprint).keys.shape == layout  # not (2, 1, n, 4)


def test_disk_store_survives_a_new_engine_and_rejects_corruption(engine, tmp_path) -> None:
    e = KVRAGEngine(engine.loaded, store=DiskKVStore(tmp_path))
    (ref,) = e.encode_chunks([CHUNK], show_progress=False)
    good = e.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=1)
    path = next(tmp_path.rglob(f"{ref.key}.safetensors"))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    again = KVRAGEngine(engine.loaded, store=DiskKVStore(tmp_path), on_miss="encode")
    result = again.generate(question=QUESTION, chunks=[CHUNK], max_new_tokens=1)
    assert result.lazily_encoded_chunks == 1  # the corrupt entry was a miss
    assert again.store.stats.rejected == 1
    torch.testing.assert_close(result.first_token_logits, good.first_token_logits)
    assert again.store.get(ref.key, again.fingerprint) is not None  # overwritten


def test_foreign_fingerprint_entry_is_never_used(engine: KVRAGEngine) -> None:
    store = MemoryKVStore()
    e = KVRAGEngine(engine.loaded, store=store)
    (ref,) = e.encode_chunks([CHUNK], show_progress=False)
    assert store.get(ref.key, "another-model") is None
    assert store.stats.rejected == 1
