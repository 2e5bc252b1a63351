"""What stored chunk caches cost: bytes per token and per chunk, and read throughput.

The engine stores chunk caches in its ``cache_precision`` (float16 by default,
bfloat16, int8, or the model's dtype) and casts them to the model's dtype when
it reads them. Per storage form (float32, float16, bfloat16, int8) the suite
reports the stored entry size (``store.codec`` safetensors bytes, which disk
and Redis write) per token and per chunk, against the K/V bytes held (int8:
codes plus scales), and the fidelity cost of storing in it: the first-token KL
of turbo answers from an engine storing in that precision against one storing
at the model's precision. Then the read
throughput of each store (``get`` of every entry, verified), in MB/s of
stored bytes and chunks/s: the in-process LRU (no copy), the disk store (warm
OS page cache) and Redis when a ``redis-server`` binary is found (started here
on a free loopback port, stopped afterwards).

Examples:
    python -m kvrag_integrations.bench memory --chunks 16 --chunk-tokens 256
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvrag_integrations.bench.common import RagItem, chunk_pool, markdown_table, timed
from kvrag_integrations.bench.metrics import kl_divergence
from kvrag_integrations.bench.ports import free_port
from kvrag_integrations.bench.redis_cluster import answers_ping, find_binary
from kvrag_integrations.chunk_kv import PRECISIONS, ChunkKV, dtype_name
from kvrag_integrations.store import DiskKVStore, KVStore, MemoryKVStore
from kvrag_integrations.store.codec import encode_entry

DTYPES = ("float32", "float16", "bfloat16", "int8")
QUICK = {"n_chunks": 3, "chunk_tokens": 16, "repeats": 1, "questions": 1}


@contextlib.contextmanager
def redis_server(binary: str, workdir: Path) -> Iterator[str]:
    """A throwaway loopback redis-server (no persistence); yields its URL."""
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
    args += ["--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not answers_ping(port, proc):
            raise RuntimeError(f"redis-server did not come up on port {port}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _stores(workdir: Path, redis_url: str | None) -> Iterator[tuple[str, KVStore]]:
    yield "memory", MemoryKVStore(max_bytes=None)
    yield "disk", DiskKVStore(workdir / "disk")
    if redis_url is not None:
        from kvrag_integrations.store import RedisKVStore

        yield "redis", RedisKVStore(redis_url, prefix="bench:", socket_timeout=10.0)


def _stored(kv: ChunkKV, name: str) -> ChunkKV:
    """``kv`` (model precision) in storage form ``name`` (a float dtype or ``int8``)."""
    return kv.stored_as("int8") if name == "int8" else kv.to("cpu", getattr(torch, name))


def _precision(engine: Any, name: str) -> str | None:
    """The ``cache_precision`` that stores in form ``name`` (None: none does)."""
    if name == dtype_name(engine.dtype):
        return "model"
    return name if name in PRECISIONS else None


def sizes(kvs: list[ChunkKV], name: str) -> dict[str, float]:
    """Stored bytes per token and per chunk of ``kvs`` in storage form ``name``."""
    cast = [_stored(kv, name) for kv in kvs]
    stored = [len(encode_entry(kv)) for kv in cast]
    raw = [kv.nbytes - kv.token_ids.numel() * 8 for kv in cast]  # K/V (+ scales) held
    tokens = sum(kv.num_tokens for kv in cast)
    return {
        "bytes_per_token": sum(stored) / tokens,
        "kv_bytes_per_token": sum(raw) / tokens,
        "bytes_per_chunk": statistics.mean(stored),
        "overhead": sum(stored) / sum(raw) - 1,
    }


def fidelity(engine: Any, name: str, questions: list[str], chunks: list[str]) -> float | None:
    """Mean first-token KL of turbo from caches stored as ``name`` vs model-precision
    caches (None when no ``cache_precision`` stores as ``name``)."""
    from kvrag_integrations.engine.engine import KVRAGEngine

    precision = _precision(engine, name)
    if precision is None:
        return None

    def make(p: str) -> Any:
        e = KVRAGEngine(engine.loaded, store=MemoryKVStore(max_bytes=None), cache_precision=p)
        e.encode_chunks(chunks, show_progress=False)
        return e

    reference, cast_engine = make("model"), make(precision)
    kls = []
    for q in questions:
        ref = reference.prefill(question=q, chunks=chunks, strategy="turbo").logits
        got = cast_engine.prefill(question=q, chunks=chunks, strategy="turbo")
        if got.fallback or got.lazily_encoded_chunks:
            raise RuntimeError("a cast cache was missing: the comparison would be void")
        kls.append(kl_divergence(ref, got.logits))
    return statistics.mean(kls)


def read_throughput(
    store: KVStore, kvs: list[ChunkKV], fingerprint: str, repeats: int
) -> dict[str, float]:
    """Median time to ``get`` every entry; MB/s of stored bytes and chunks/s."""
    keys = [store.put(kv) for kv in kvs]

    def read_all() -> None:
        for key in keys:
            if store.get(key, fingerprint) is None:
                raise RuntimeError(f"{type(store).__name__} lost an entry during the benchmark")

    seconds, _ = timed(read_all, repeats)
    nbytes = sum(len(encode_entry(kv)) for kv in kvs)
    return {"mb_per_s": nbytes / seconds / 1e6, "chunks_per_s": len(kvs) / seconds}


def run(
    engine: Any,
    items: list[RagItem],
    *,
    n_chunks: int = 32,
    chunk_tokens: int = 256,
    repeats: int = 5,
    questions: int = 2,
    dtypes: tuple[str, ...] = DTYPES,
    redis: bool = True,
) -> dict[str, Any]:
    """Sizes and fidelity per storage dtype, then read throughput per store and dtype."""
    chunks = chunk_pool(engine.tokenizer, items, chunk_tokens)[:n_chunks]
    if not chunks:
        raise ValueError(f"no passage has {chunk_tokens} tokens")
    from kvrag_integrations.engine.engine import KVRAGEngine

    full = KVRAGEngine(engine.loaded, store=MemoryKVStore(max_bytes=None), cache_precision="model")
    full.encode_chunks(chunks, show_progress=False)
    kvs = [full.store.get(full.chunk_key(c), full.fingerprint) for c in chunks]
    if any(kv is None for kv in kvs):
        raise RuntimeError("the engine's store evicted a chunk the benchmark just encoded")
    kvs = [kv.to("cpu") for kv in kvs]
    qs = [it.question for it in items[: max(1, questions)]]
    prompt_chunks = chunks[: min(len(chunks), 8)]
    per_dtype = []
    for name in dtypes:
        row = {"dtype": name, **sizes(kvs, name)}
        row["turbo_kl_vs_model_dtype"] = fidelity(engine, name, qs, prompt_chunks)
        per_dtype.append(row)
    binary = find_binary("redis-server") if redis else None
    reads = []
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-") as tmp, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(binary, Path(tmp))) if binary else None
        for store_name, store in _stores(Path(tmp), url):
            for name in dtypes:
                cast = [_stored(kv, name) for kv in kvs]
                speed = read_throughput(store, cast, full.fingerprint, repeats)
                reads.append({"store": store_name, "dtype": name, **speed})
                for kv in cast:
                    store.delete(kv.key)
            if hasattr(store, "close"):
                store.close()
    return {
        "chunks": len(kvs),
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "model_dtype": str(engine.dtype).replace("torch.", ""),
        "redis": "measured" if binary else "redis-server not found",
        "results": per_dtype,
        "reads": reads,
    }


def table(payload: dict[str, Any]) -> str:
    """Sizes per dtype, then read throughput per store."""
    size_rows = [
        [
            r["dtype"],
            round(r["bytes_per_token"]),
            round(r["kv_bytes_per_token"]),
            f"{r['bytes_per_chunk'] / 1e6:.2f}",
            f"{r['overhead'] * 100:.2f}%",
            "n/a"
            if r["turbo_kl_vs_model_dtype"] is None
            else f"{r['turbo_kl_vs_model_dtype']:.2e}",
        ]
        for r in payload["results"]
    ]
    read_rows = [
        [r["store"], r["dtype"], round(r["mb_per_s"], 1), round(r["chunks_per_s"], 1)]
        for r in payload["reads"]
    ]
    headers = ["storage dtype", "bytes/token", "K/V bytes/token", "MB/chunk", "format overhead"]
    headers.append(f"turbo KL vs {payload['model_dtype']} caches")
    return "\n".join(
        [
            f"Stored size ({payload['chunks']} chunks of {payload['chunk_tokens']} tokens):",
            "",
            markdown_table(headers, size_rows),
            "",
            f"Store read throughput (median of {payload['repeats']} passes; disk from a warm "
            "page cache; memory returns the stored object, no copy):",
            "",
            markdown_table(["store", "dtype", "MB/s", "chunks/s"], read_rows),
        ]
    )
