"""Failures and hostile input: unwritable stores, bad arguments, no pickle, hash-only names."""

from __future__ import annotations

import ast
import errno
import logging
import os
import pickle
import re
import socket
import time
from pathlib import Path

import pytest
import torch

import kvrag_integrations
from kvrag_integrations import (
    CacheEntryError,
    ContextWindowExceededError,
    DiskKVStore,
    InvalidChunkError,
    KVRAGEngine,
    RedisKVStore,
    StoreWriteError,
    Text,
    UnknownStrategyError,
)
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.segments import Chunk
from kvrag_integrations.store import decode_entry

CHUNK = "The Rosetta Stone was found in 1799 near the town of Rashid in Egypt."
QUESTION = "When was the Rosetta Stone found?"
PACKAGE = Path(kvrag_integrations.__file__).parent
FP = "fp-test"


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dead_or_silent_redis_does_not_hang() -> None:
    pytest.importorskip("redis", reason="the redis client is missing: pip install -e '.[test]'")
    kv = ChunkKV(torch.arange(4), torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), FP)
    dead = RedisKVStore(f"redis://127.0.0.1:{_free_port()}/0")  # nothing listens
    started = time.monotonic()
    assert dead.get(kv.key, FP) is None and not dead.contains(kv.key)
    with pytest.raises(StoreWriteError, match="cannot write"):
        dead.put(kv)
    assert time.monotonic() - started < 5
    assert dead.stats.misses == 1 and dead.stats.rejected == 0  # down is a miss, not damage

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        mute = RedisKVStore(f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        started = time.monotonic()
        assert mute.get(kv.key, FP) is None
        with pytest.raises(StoreWriteError):
            mute.put(kv)
        assert time.monotonic() - started < 15  # ~1 s timeout, one retry, per call


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


def test_no_pickle_in_the_package() -> None:
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


@pytest.mark.parametrize("text", ["../../etc/passwd", "/etc/shadow", "a\x00b", "C:\\Windows\\x"])
def test_keys_and_paths_come_from_hashes(engine: KVRAGEngine, tmp_path: Path, text: str) -> None:
    root = tmp_path / "kv"
    eng = KVRAGEngine(engine.loaded, store=DiskKVStore(root))
    (ref,) = eng.encode_chunks([text], show_progress=False)
    assert re.fullmatch(r"[0-9a-f]{64}", ref.key) and ref.key == eng.chunk_key(text)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [root / ref.key[:2] / f"{ref.key}.safetensors"]
    assert files[0].resolve().is_relative_to(root.resolve())


# ------------------------------------------------- tampered entries in the store
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
    ids = e.tokenize([Chunk(text)]).input_ids
    n = ids.numel()
    e.store.put(ChunkKV(ids, torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4), e.fingerprint))
    result = e.generate(question="Who deciphered them?", chunks=[text], max_new_tokens=2)
    assert result.lazily_encoded_chunks == 1  # the bad entry was a miss, encoded again
    config = e.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = (config.num_hidden_layers, config.num_key_value_heads, n, head_dim)
    assert e.store.get(e.chunk_key(text), e.fingerprint).keys.shape == layout  # not (2, 1, n, 4)
