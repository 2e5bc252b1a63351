"""The rerank benchmark's vLLM column: the same queries scored by ``KVReranker`` on a
``VLLMEngine`` (vLLM in this process with the connector, entries at model precision).

Measured: cold (no document stored: each request computes its whole prompt,
then the entries are encoded), warm (every document stored and loaded at
position 0) for one query at a time and for ``concurrency`` queries at once
(vLLM batches their candidates together), the in-process reranker's warm
throughput at the same concurrency, and the largest score gap to in process.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvrag_integrations.rerank.reranker import KVReranker

VLLM_ARGS = {"max_model_len": 4096, "kv_cache_memory_bytes": 768 * 2**20}


def start_engine(model: str | None = None) -> Any:
    """vLLM in this process on a store of its own (lossless entries)."""
    from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

    store = tempfile.mkdtemp(prefix="kvrag-rerank-vllm-")
    return VLLMEngine.from_pretrained(
        model, store=f"disk:{store}", cache_precision="model", **VLLM_ARGS
    )


def _throughput(reranker: KVReranker, queries: list[dict[str, Any]], concurrency: int) -> float:
    """Candidates per second scoring ``queries`` with ``concurrency`` calls at once."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda q: reranker.score(q["question"], q["docs"]), queries))
    return sum(len(q["docs"]) for q in queries) / (time.perf_counter() - started)


def column(
    vllm_engine: Any,
    in_process: KVReranker,
    queries: list[dict[str, Any]],
    *,
    concurrency: int = 8,
) -> dict[str, Any]:
    """The vLLM column for ``queries`` (``in_process``'s documents already stored)."""
    reranker = KVReranker(vllm_engine, template=in_process.template, scoring=in_process.scoring)
    reranker.score("warm-up", ["(warm-up) a passage."])
    cold_s, gap = 0.0, 0.0
    for q in queries:  # cold: nothing stored (the store is the engine's own)
        t0 = time.perf_counter()
        got = reranker.score(q["question"], q["docs"])
        cold_s += time.perf_counter() - t0
        want = in_process.score(q["question"], q["docs"])
        gap = max(gap, *(abs(a - b) for a, b in zip(got, want, strict=True)))
    n = sum(len(q["docs"]) for q in queries)
    reused = reranker.stats.prefixes_reused
    warm = _throughput(reranker, queries, 1)
    many = queries * max(1, -(-concurrency // len(queries)))  # at least `concurrency` calls
    return {
        "vllm_cold_cands_per_s": n / cold_s,
        "vllm_warm_cands_per_s": warm,
        "vllm_warm_over_cold": warm / (n / cold_s),
        "vllm_concurrency": concurrency,
        "vllm_concurrent_cands_per_s": _throughput(reranker, many, concurrency),
        "in_process_concurrent_cands_per_s": _throughput(in_process, many, concurrency),
        "vllm_prefixes_reused_warm": reranker.stats.prefixes_reused - reused,
        "vllm_max_abs_score_gap": gap,
    }


def rows(result: dict[str, Any]) -> list[list[Any]]:
    """The vLLM rows of the rerank table (none where the run had no vLLM column)."""
    if "vllm_warm_cands_per_s" not in result:
        return []
    k = result["vllm_concurrency"]
    return [
        ["vLLM, cold (documents not stored)", result["vllm_cold_cands_per_s"], "", ""],
        [f"vLLM, warm ({_warm_path(result)})", result["vllm_warm_cands_per_s"], "", ""],
        [f"vLLM, warm, {k} queries at once", result["vllm_concurrent_cands_per_s"], "", ""],
        [f"in process, warm, {k} at once", result["in_process_concurrent_cands_per_s"], "", ""],
    ]


def _warm_path(result: dict[str, Any]) -> str:
    """How the warm calls scored: loading the entries, or (a server's query likelihood
    on documents too short for it to pay, ``scoring.by_token_pays``) plain prefill."""
    if result.get("vllm_prefixes_reused_warm", 1):
        return "entries loaded at 0"
    return "plain prefill: loading would cost more"
