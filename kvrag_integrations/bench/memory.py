"""What stored chunk caches cost: bytes per token and per chunk, and read throughput.

The stores keep a ``ChunkKV`` in whatever dtype it was put in, and the engine
casts it to the model's dtype when it reads it; there is no storage-dtype
option, so each storage dtype here (float32, float16, bfloat16) is made by
casting the engine's own caches before storing them. Per dtype the suite
reports the stored entry size (``store.codec`` safetensors bytes, which disk
and Redis write) per token and per chunk, against the raw K/V size, and the
fidelity cost of storing in it: the first-token KL of turbo answers built from
the cast caches against turbo from caches in the model's dtype. Then the read
throughput of each store (``get`` of every entry, verified), in MB/s of
stored bytes and chunks/s: the in-process LRU (no copy), the disk store (warm
OS page cache) and Redis when a ``redis-server`` binary is found (started here
on a free loopback port, stopped afterwards).

Examples:
    python -m kvrag_integrations.bench memory --chunks 16 --chunk-tokens 256
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvrag_integrations.bench.common import RagItem, chunk_pool, markdown_table, timed
from kvrag_integrations.bench.metrics import kl_divergence
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import DiskKVStore, KVStore, MemoryKVStore
from kvrag_integrations.store.codec import encode_entry

DTYPES = ("float32", "float16", "bfloat16")
QUICK = {"n_chunks": 3, "chunk_tokens": 16, "repeats": 1, "questions": 1}


def find_redis_server() -> str | None:
    """The ``redis-server`` binary on PATH (or in /usr/bin, /usr/sbin), if any."""
    candidates = [shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/sbin/redis-server"]
    return next((p for p in candidates if p and Path(p).is_file()), None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(binary: str, workdir: Path) -> Iterator[str]:
    """A throwaway loopback redis-server (no persistence); yields its URL."""
    import redis

    port = _free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
    args += ["--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not come up on port {port}")
            time.sleep(0.05)
        client.close()
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


def sizes(kvs: list[ChunkKV], dtype: torch.dtype) -> dict[str, float]:
    """Stored bytes per token and per chunk of ``kvs`` cast to ``dtype``."""
    cast = [kv.to("cpu", dtype) for kv in kvs]
    stored = [len(encode_entry(kv)) for kv in cast]
    raw = [kv.keys.numel() * kv.keys.element_size() * 2 for kv in cast]
    tokens = sum(kv.num_tokens for kv in cast)
    return {
        "bytes_per_token": sum(stored) / tokens,
        "kv_bytes_per_token": sum(raw) / tokens,
        "bytes_per_chunk": statistics.mean(stored),
        "overhead": sum(stored) / sum(raw) - 1,
    }


def fidelity(
    engine: Any, kvs: list[ChunkKV], dtype: torch.dtype, questions: list[str], chunks: list[str]
) -> float:
    """Mean first-token KL of turbo from ``dtype``-stored caches vs model-dtype caches."""
    from kvrag_integrations.engine.engine import KVRAGEngine

    store = MemoryKVStore(max_bytes=None)
    for kv in kvs:
        store.put(kv.to("cpu", dtype))
    cast_engine = KVRAGEngine(engine.loaded, store=store, on_miss="encode")  # never a fallback
    kls = []
    for q in questions:
        ref = engine.prefill(question=q, chunks=chunks, strategy="turbo").logits
        got = cast_engine.prefill(question=q, chunks=chunks, strategy="turbo")
        if got.lazily_encoded_chunks:
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
    engine.encode_chunks(chunks, show_progress=False)
    kvs = [engine.store.get(engine.chunk_key(c), engine.fingerprint) for c in chunks]
    if any(kv is None for kv in kvs):
        raise RuntimeError("the engine's store evicted a chunk the benchmark just encoded")
    kvs = [kv.to("cpu") for kv in kvs]
    qs = [it.question for it in items[: max(1, questions)]]
    prompt_chunks = chunks[: min(len(chunks), 8)]
    per_dtype = []
    for name in dtypes:
        dtype = getattr(torch, name)
        row = {"dtype": name, **sizes(kvs, dtype)}
        row["turbo_kl_vs_model_dtype"] = fidelity(engine, kvs, dtype, qs, prompt_chunks)
        per_dtype.append(row)
    binary = find_redis_server() if redis else None
    reads = []
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-") as tmp, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(binary, Path(tmp))) if binary else None
        for store_name, store in _stores(Path(tmp), url):
            for name in dtypes:
                cast = [kv.to("cpu", getattr(torch, name)) for kv in kvs]
                speed = read_throughput(store, cast, engine.fingerprint, repeats)
                reads.append({"store": store_name, "dtype": name, **speed})
                for kv in cast:
                    store.delete(kv.key)
            if hasattr(store, "close"):
                store.close()
    return {
        "chunks": len(kvs),
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "model_dtype": str(engine.loaded.dtype).replace("torch.", ""),
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
            f"{r['turbo_kl_vs_model_dtype']:.2e}",
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
