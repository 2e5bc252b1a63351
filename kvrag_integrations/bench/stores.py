"""Turbo TTFT from memory, disk and Redis per storage precision, side by side in one run.

The ``ttft`` setup (10 chunks of 300 tokens per prompt): for each storage
precision (``cache_precision``), the chunks are encoded once, copied into a
``DiskKVStore`` (warm page cache) and a ``RedisKVStore`` (a throwaway loopback
``redis-server``, when one is found), and every prompt is answered by turbo from
each store in turn, repeats interleaved, so the stores are compared under the
same load. Also per precision: stored bytes per token (what disk and Redis
hold) and turbo's first-token KL against model-precision caches; and the
query-only floor (only the question's tokens computed over a ready cache).

Examples:
    python -m kvrag_integrations.bench stores --items 3
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrag_integrations.bench.common import RagItem, markdown_table, sync, trimmed_chunks
from kvrag_integrations.bench.memory import redis_server
from kvrag_integrations.bench.metrics import kl_divergence
from kvrag_integrations.bench.redis_cluster import find_binary
from kvrag_integrations.bench.scaling import floor_time
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.store import DiskKVStore, KVStore, MemoryKVStore, encode_entry

PRECISIONS = ("model", "float16", "int8")
QUICK = {"items": 1, "n_chunks": 3, "chunk_tokens": 32, "repeats": 1}


def _stores(workdir: Path, redis_url: str | None, tag: str) -> dict[str, KVStore]:
    stores: dict[str, KVStore] = {"memory": MemoryKVStore(max_bytes=None)}
    stores["disk"] = DiskKVStore(workdir / f"disk-{tag}")
    if redis_url is not None:
        from kvrag_integrations.store import RedisKVStore

        stores["redis"] = RedisKVStore(redis_url, prefix=f"bench-{tag}:", socket_timeout=10.0)
    return stores


def _ttft(engine: KVRAGEngine, question: str, chunks: list[str]) -> float:
    started = time.perf_counter()
    result = engine.generate(question=question, chunks=chunks, strategy="turbo", max_new_tokens=1)
    sync(engine)
    if result.fallback is not None or result.lazily_encoded_chunks:
        raise RuntimeError("a stored chunk was missing: the timing would not be turbo's")
    return time.perf_counter() - started


def run(
    engine: KVRAGEngine,
    items: list[RagItem],
    *,
    n_chunks: int = 10,
    chunk_tokens: int = 300,
    repeats: int = 3,
    precisions: tuple[str, ...] = PRECISIONS,
    redis: bool = True,
) -> dict[str, Any]:
    """Median turbo TTFT per (precision, store), bytes per token and KL per precision."""
    prompts = [
        (it.question, trimmed_chunks(engine.tokenizer, it, n_chunks, chunk_tokens)) for it in items
    ]
    all_chunks = list(dict.fromkeys(c for _, chunks in prompts for c in chunks))
    binary = find_binary("redis-server") if redis else None
    rows, reference = [], {}
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-") as tmp, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(binary, Path(tmp))) if binary else None
        for precision in precisions:
            stores = _stores(Path(tmp), url, precision)
            engines = {
                name: KVRAGEngine(
                    engine.loaded, store=store, cache_precision=precision, on_miss="encode"
                )
                for name, store in stores.items()
            }
            memory = engines["memory"]
            memory.encode_chunks(all_chunks, show_progress=False)
            keys = list(memory.store.keys())
            entries = [memory.store.get(k, memory.caches.fingerprint) for k in keys]
            for name, store in stores.items():
                if name != "memory":
                    for kv in entries:
                        store.put(kv)
            stored_bytes = sum(len(encode_entry(kv)) for kv in entries)
            tokens = sum(kv.num_tokens for kv in entries)
            kls = []
            for question, chunks in prompts:
                logits = memory.prefill(question=question, chunks=chunks, strategy="turbo").logits
                if precision == precisions[0]:
                    reference[question] = logits
                kls.append(kl_divergence(reference[question], logits))
                for eng in engines.values():  # warm-up: the leading text's cache, kernels
                    _ttft(eng, question, chunks)
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(max(1, repeats)):
                for question, chunks in prompts:
                    for name, eng in engines.items():
                        times[name].append(_ttft(eng, question, chunks))
            base = statistics.median(times["memory"])
            for name, values in times.items():
                rows.append(
                    {
                        "precision": precision,
                        "store": name,
                        "ttft_ms": statistics.median(values) * 1000,
                        "vs_memory": statistics.median(values) / base,
                        "bytes_per_token": stored_bytes / tokens,
                        "kl_vs_first": statistics.mean(kls),
                    }
                )
            for store in stores.values():
                if hasattr(store, "close"):
                    store.close()
    floors = [floor_time(engine, q, chunks, max(1, repeats))[0] for q, chunks in prompts]
    return {
        "items": len(prompts),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "reference_precision": precisions[0],
        "model_dtype": str(engine.dtype).replace("torch.", ""),
        "redis": "measured" if binary else "redis-server not found",
        "floor_ms": statistics.median(floors) * 1000,
        "results": rows,
    }


def table(payload: dict[str, Any]) -> str:
    rows = [
        [
            r["precision"],
            r["store"],
            round(r["ttft_ms"], 1),
            f"{r['vs_memory']:.2f}x",
            f"{r['ttft_ms'] / payload['floor_ms']:.2f}x",
            round(r["bytes_per_token"]),
            f"{r['kl_vs_first']:.2e}",
        ]
        for r in payload["results"]
    ]
    headers = ["precision", "store", "turbo TTFT ms", "vs memory", "vs floor", "bytes/token"]
    headers.append(f"KL vs {payload['reference_precision']}")
    note = (
        f"\n\nQuery-only floor: {payload['floor_ms']:.1f} ms (model dtype "
        f"{payload['model_dtype']}); Redis: {payload['redis']}."
    )
    return markdown_table(headers, rows) + note
