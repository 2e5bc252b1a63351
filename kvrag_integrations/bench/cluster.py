"""Chunk caches on one Redis server and on a Redis Cluster of 1 and 3 primaries.

Per topology, started here on loopback (``bench.redis_cluster``; the 3-primary
cluster with a replica each, as a deployment runs it):

- load throughput: ``readers`` threads (8) ``get`` every entry in turn through
  one shared ``RedisKVStore``, each read verified; MiB/s of stored bytes;
- turbo TTFT: the benchmark prompts (``n_chunks`` chunks of ``chunk_tokens``)
  answered by turbo from the store (first token);
- capacity: every node given a ``maxmemory`` of 75% of the entries' bytes
  (``noeviction``: less than one node can hold, less than the 3 primaries'
  budget, 3 x 80% of it), the entries written as the server writes them (its
  ``StoreBudget``: budget sized from the primaries); how much of the store is
  held, how many entries per primary, the most a node used against its
  ``maxmemory``, and whether Redis ever answered OOM.

Examples:
    python -m kvrag_integrations.bench cluster --items 3 --chunks 10 --chunk-tokens 300
"""

from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvrag_integrations.bench.common import RagItem, markdown_table, trimmed_chunks
from kvrag_integrations.bench.memory import redis_server
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster, find_binary
from kvrag_integrations.bench.stores import _ttft
from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store import RedisKVStore, encode_entry
from kvrag_integrations.store.redis_client import primaries_memory
from kvrag_integrations.store.sizing import store_budget
from kvrag_integrations.store.write_budget import StoreBudget

QUICK = {"items": 1, "n_chunks": 3, "chunk_tokens": 32, "repeats": 1}
TOPOLOGIES = (("one server", 0, 0), ("cluster", 1, 0), ("cluster", 3, 1))
CAPACITY_SHARE = 0.75  # each node's maxmemory, of the entries' bytes


@contextlib.contextmanager
def _topology(kind: str, primaries: int, replicas: int, workdir: Path) -> Iterator[str]:
    """The store URL of a fresh server or cluster, stopped afterwards."""
    if kind == "one server":
        binary = find_binary("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server not found")
        workdir.mkdir(parents=True, exist_ok=True)
        with redis_server(binary, workdir) as url:
            yield url
        return
    with LocalRedisCluster(workdir, primaries=primaries, replicas=replicas) as cluster:
        yield cluster.url


def load_throughput(store: RedisKVStore, kvs: list[ChunkKV], readers: int, repeats: int) -> float:
    """MiB/s of stored bytes that ``readers`` threads read (each every entry, shuffled,
    ``repeats`` times); every read must hit."""
    nbytes = sum(len(encode_entry(kv)) for kv in kvs)
    fingerprint = kvs[0].fingerprint
    lost = threading.Event()

    def read(seed: int) -> None:
        order = list(kvs)
        random.Random(seed).shuffle(order)
        for _ in range(repeats):
            for kv in order:
                if store.get(kv.key, fingerprint) is None:
                    lost.set()

    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, range(readers)))  # warm: connections, page faults
        started = time.perf_counter()
        list(pool.map(read, range(readers)))
        seconds = time.perf_counter() - started
    if lost.is_set():
        raise RuntimeError("an entry was missed during the benchmark")
    return readers * repeats * nbytes / seconds / 2**20


def capacity(store: RedisKVStore, kvs: list[ChunkKV], maxmemory: int) -> dict[str, Any]:
    """Give every node ``maxmemory`` (noeviction), write ``kvs`` through the server's
    budget, and say what is held."""
    client = store.client
    nodes = client.get_nodes() if store.cluster else [None]
    for node in nodes:
        kwargs = {"target_nodes": node} if node is not None else {}
        client.config_set("maxmemory", maxmemory, **kwargs)
        client.config_set("maxmemory-policy", "noeviction", **kwargs)
    budget = StoreBudget(store, store_budget(store)[0])
    most, oom, refused = _most_used(store), 0, 0
    for kv in kvs:
        if not budget.allow_write(len(encode_entry(kv)), kv.fingerprint, kv.key):
            refused += 1
            continue
        try:
            store.put(kv)
        except StoreWriteError:
            oom += 1
        most = max(most, _most_used(store))
    held = [info for info in store.entries()]
    wanted = sum(len(encode_entry(kv)) for kv in kvs)
    return {
        "maxmemory_mib": maxmemory / 2**20,
        "store_mib": wanted / 2**20,
        "budget_mib": budget.max_bytes / 2**20,
        "held_share": sum(i.nbytes for i in held) / wanted,
        "entries_per_primary": dict(Counter(store.shard_of(i.key) for i in held)),
        "evicted": budget.evicted,
        "refused": refused,
        "oom_errors": oom,
        "most_used_share": most / maxmemory,
    }


def _most_used(store: RedisKVStore) -> int:
    return max(info["used_memory"] for info in primaries_memory(store.client).values())


def run(
    engine: KVRAGEngine,
    items: list[RagItem],
    *,
    n_chunks: int = 10,
    chunk_tokens: int = 300,
    repeats: int = 3,
    readers: int = 8,
) -> dict[str, Any]:
    """Load throughput, turbo TTFT and capacity per topology."""
    if find_binary("redis-cli") is None or find_binary("redis-server") is None:
        raise FileNotFoundError("redis-server and redis-cli are needed (apt redis-server)")
    prompts = [
        (it.question, trimmed_chunks(engine.tokenizer, it, n_chunks, chunk_tokens)) for it in items
    ]
    chunks = list(dict.fromkeys(c for _, cs in prompts for c in cs))
    writer = KVRAGEngine(engine.loaded)  # the default storage precision, in memory
    writer.encode_chunks(chunks, show_progress=False)
    kvs = [writer.store.get(writer.chunk_key(c), writer.fingerprint) for c in chunks]
    if any(kv is None for kv in kvs):
        raise RuntimeError("the memory store evicted a chunk the benchmark just encoded")
    store_bytes = sum(len(encode_entry(kv)) for kv in kvs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-cluster-") as tmp:
        for i, (kind, primaries, replicas) in enumerate(TOPOLOGIES):
            with _topology(kind, primaries, replicas, Path(tmp) / str(i)) as url:
                store = RedisKVStore(url, prefix="bench:", socket_timeout=10.0)
                for kv in kvs:
                    store.put(kv)
                speed = load_throughput(store, kvs, readers, repeats)
                reader = KVRAGEngine(engine.loaded, store=store, on_miss="encode")
                for question, cs in prompts:  # warm-up: the leading text's cache, kernels
                    _ttft(reader, question, cs)
                ttfts = [_ttft(reader, q, cs) for _ in range(repeats) for q, cs in prompts]
                for kv in kvs:
                    store.delete(kv.key)
                # (at least 8 MiB: a bare Redis uses about 1 MiB of it)
                held = capacity(store, kvs, max(8 * 2**20, int(CAPACITY_SHARE * store_bytes)))
                store.close()
            rows.append(
                {
                    "topology": kind if not primaries else f"{primaries}P+{primaries * replicas}R",
                    "primaries": max(1, primaries),
                    "load_mib_s": speed,
                    "turbo_ttft_ms": statistics.median(ttfts) * 1000,
                    **held,
                }
            )
    return {
        "entries": len(kvs),
        "entry_mib": store_bytes / len(kvs) / 2**20,
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "readers": readers,
        "repeats": repeats,
        "results": rows,
    }


def table(payload: dict[str, Any]) -> str:
    rows = [
        [
            r["topology"],
            round(r["load_mib_s"]),
            round(r["turbo_ttft_ms"], 1),
            f"{r['maxmemory_mib']:.0f}",
            f"{r['store_mib']:.0f}",
            f"{r['held_share']:.0%}",
            r["evicted"] + r["refused"],
            "/".join(str(n) for n in sorted(r["entries_per_primary"].values())),
            f"{r['most_used_share']:.0%}",
            r["oom_errors"],
        ]
        for r in payload["results"]
    ]
    headers = [
        "Redis",
        f"load MiB/s ({payload['readers']} readers)",
        "turbo TTFT ms",
        "maxmemory/node MiB",
        "store MiB",
        "held",
        "evicted+refused",
        "entries held per primary",
        "most used/maxmemory",
        "OOM errors",
    ]
    note = (
        f"\n\n{payload['entries']} entries of {payload['entry_mib']:.2f} MiB "
        f"({payload['chunks_per_prompt']} chunks of {payload['chunk_tokens']} tokens per "
        "prompt); the cluster's nodes on this host's loopback."
    )
    return markdown_table(headers, rows) + note
