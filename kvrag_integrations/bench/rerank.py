"""Reranker benchmark: throughput with and without prefix reuse, and recall@1/@3.

On MuSiQue (``../shared/data/musique_dev.json``), each query's candidates are its
own 10 passages plus 10 of the next item's (distractors), trimmed to about 250
tokens. Prefix caches are precomputed first (timed apart, as ingestion would);
then every query is scored with reuse and without, side by side in one run.
Recall (a passage containing a gold answer among the first k) is given for the
candidates' listed order, for the order a retriever would give (MiniLM cosine
similarity, the packaged embedding model) and after reranking.

With ``--vllm``, a vLLM column (``rerank_vllm``): the same reranker on a
``VLLMEngine`` in this process, cold, warm, and warm with 8 queries at once.
With ``--vllm-url URL``, the same column on a running server, scored over HTTP
(``VLLMEngine.connect``: query likelihood takes one request per query token
there); start it on an empty store for the cold figure.

Examples:
    python -m kvrag_integrations.bench rerank --items 5
    python -m kvrag_integrations.bench rerank --items 5 --vllm
    python -m kvrag_integrations.bench rerank --items 5 --scoring query_likelihood
    python -m kvrag_integrations.bench rerank --items 2 --scoring query_likelihood \
        --vllm-url http://127.0.0.1:8000
"""

from __future__ import annotations

import time
from typing import Any

from kvrag_integrations.bench.common import RagItem, markdown_table, trim_to_tokens
from kvrag_integrations.bench.rerank_vllm import rows as rerank_vllm_rows
from kvrag_integrations.embeddings import embed_texts
from kvrag_integrations.rerank.reranker import KVReranker
from kvrag_integrations.store import MemoryKVStore

QUICK = {"n_chunks": 4, "chunk_tokens": 24, "repeats": 1, "batch_size": 4}


def load_queries(
    tokenizer: Any, items: list[RagItem], n_candidates: int, n_tokens: int
) -> list[dict[str, Any]]:
    """Queries with candidates (own passages first, then the next item's) and gold flags."""
    if len(items) < 2:
        raise ValueError("the rerank benchmark needs at least two items")
    out = []
    for i, item in enumerate(items):
        pool = item.chunks + items[(i + 1) % len(items)].chunks
        docs = [trim_to_tokens(tokenizer, text, n_tokens) for text in pool[:n_candidates]]
        answers = [a.lower() for a in item.answers if a.strip()]
        gold = [any(a in d.lower() for a in answers) for d in docs]
        out.append({"question": item.question, "docs": docs, "gold": gold})
    return out


def _hit_at(order: list[int], gold: list[bool], k: int) -> bool:
    return any(gold[i] for i in order[:k])


def _retriever_order(question: str, docs: list[str]) -> list[int]:
    """Candidates by MiniLM cosine similarity to the question (a vector store's order)."""
    query, *vectors = embed_texts([question, *docs])
    sims = [sum(a * b for a, b in zip(query, v)) for v in vectors]
    return sorted(range(len(docs)), key=lambda i: (-sims[i], i))


def run(
    engine: Any,
    items: list[RagItem],
    *,
    n_chunks: int = 20,
    chunk_tokens: int = 250,
    repeats: int = 1,
    batch_size: int = 16,
    template: str | None = None,
    scoring: str = "judge",
    vllm: bool = False,
    vllm_engine: Any = None,
) -> dict[str, Any]:
    """Measure the reranker on MuSiQue-style items; returns the numbers.

    Args:
        engine: a loaded ``KVRAGEngine``.
        items: questions (at least two: the next item's passages are distractors).
        n_chunks: candidates per question (its own passages first, then the next item's).
        chunk_tokens: passages are trimmed to about this many tokens.
        repeats: times each query is scored per mode (all timed).
        batch_size: candidates per forward.
        template: a rerank template preset (None: the scoring's default).
        scoring: ``"judge"`` or ``"query_likelihood"`` (see ``KVReranker``).
        vllm: add the vLLM column (``rerank_vllm``: cold, warm, concurrent, the
            score gap to in process), on ``vllm_engine`` or a vLLM of its own.

    Returns:
        A dict with throughputs (candidates/s), speedup, precompute time, recall@3
        before and after reranking, and the largest reuse vs full score gap.
    """
    n_candidates, doc_tokens = n_chunks, chunk_tokens
    queries = load_queries(engine.tokenizer, items, n_candidates, doc_tokens)
    # An unbounded store of its own: the benchmark must not evict or be evicted.
    reranker = KVReranker(
        engine,
        store=MemoryKVStore(max_bytes=None),
        batch_size=batch_size,
        template=template,
        scoring=scoring,
    )
    # Warm-up (first-call allocations, kernels) on a throwaway query, untimed.
    reranker.score("warm-up", queries[0]["docs"][:2], reuse=False)
    started = time.perf_counter()
    encoded = reranker.encode_documents([d for q in queries for d in q["docs"]])
    precompute_s = time.perf_counter() - started
    encoded_base = reranker.stats.prefixes_encoded
    times = {"reuse": 0.0, "full": 0.0}
    scored, max_gap = 0, 0.0
    hits_before = hits_after = answerable = 0
    hits = {f"{name}@{k}": 0 for name in ("listed", "retriever", "reranked") for k in (1, 3)}
    for q in queries:
        for _ in range(max(1, repeats)):
            results = {}
            for mode in ("reuse", "full"):
                t0 = time.perf_counter()
                results[mode] = reranker.score(q["question"], q["docs"], reuse=mode == "reuse")
                times[mode] += time.perf_counter() - t0
            scored += len(q["docs"])
            gaps = [abs(a - b) for a, b in zip(results["reuse"], results["full"], strict=True)]
            max_gap = max(max_gap, *gaps)
        scores = results["reuse"]
        if any(q["gold"]):
            answerable += 1
            order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
            hits_before += _hit_at(list(range(len(scores))), q["gold"], 3)
            hits_after += _hit_at(order, q["gold"], 3)
            orders = {
                "listed": list(range(len(scores))),
                "retriever": _retriever_order(q["question"], q["docs"]),
                "reranked": order,
            }
            for key in hits:
                name, k = key.split("@")
                hits[key] += _hit_at(orders[name], q["gold"], int(k))
    if reranker.stats.prefixes_encoded != encoded_base:
        raise RuntimeError("a timed run encoded prefixes: the reuse timing is not clean")
    n_docs = sum(len(q["docs"]) for q in queries)
    extra: dict[str, Any] = {}
    if vllm or vllm_engine is not None:
        from kvrag_integrations.bench import rerank_vllm

        own = vllm_engine is None
        on_vllm = rerank_vllm.start_engine() if own else vllm_engine
        try:
            extra = rerank_vllm.column(on_vllm, reranker, queries)
        finally:
            if own:
                on_vllm.close()
    return {
        **extra,
        "queries": len(queries),
        "candidates_per_query": n_candidates,
        "doc_tokens": doc_tokens,
        "batch_size": batch_size,
        "repeats": repeats,
        "template": reranker.template.name,
        "scoring": reranker.scoring,
        "mean_prefix_tokens": sum(
            reranker.prefix_ids(d).numel() for q in queries for d in q["docs"]
        )
        / max(1, n_docs),
        "mean_suffix_tokens": sum(reranker.suffix_ids(q["question"]).numel() for q in queries)
        / len(queries),
        "precompute_s": precompute_s,
        "prefixes_precomputed": encoded,
        "reuse_cands_per_s": scored / times["reuse"],
        "full_cands_per_s": scored / times["full"],
        "speedup": times["full"] / times["reuse"],
        "max_abs_score_gap": max_gap,
        "answerable_queries": answerable,
        "recall@3_before": hits_before / answerable if answerable else float("nan"),
        "recall@3_after": hits_after / answerable if answerable else float("nan"),
        "recall": {k: v / answerable if answerable else float("nan") for k, v in hits.items()},
    }


def table(result: dict[str, Any]) -> str:
    """The result as a small Markdown table."""
    rows = [
        ["without reuse (full forward)", result["full_cands_per_s"], "", ""],
        ["with reuse (prefix caches)", result["reuse_cands_per_s"], result["speedup"], ""],
    ]
    recall = result.get("recall")
    if recall:
        for name, label in (("listed", "listed order"), ("retriever", "retriever (MiniLM)")):
            rows.append([label, "", "", recall[f"{name}@1"], recall[f"{name}@3"]])
        scoring = result.get("scoring", "judge")
        rows.append([f"reranked ({scoring})", "", "", recall["reranked@1"], recall["reranked@3"]])
        rows[:2] = [[*r, ""] for r in rows[:2]]
        rows[2:2] = [[*r, ""] for r in rerank_vllm_rows(result)]
        headers = ["", "candidates/s", "speedup", "recall@1", "recall@3"]
    else:  # results written before recall@1 was measured
        rows.append(["retrieval order", "", "", result["recall@3_before"]])
        rows.append(["reranked", "", "", result["recall@3_after"]])
        headers = ["", "candidates/s", "speedup", "recall@3"]
    notes = (
        f"\n\n{result['queries']} queries x {result['candidates_per_query']} candidates "
        f"(~{result['mean_prefix_tokens']:.0f} prefix + ~{result['mean_suffix_tokens']:.0f} "
        f"suffix tokens), batch {result['batch_size']}; precompute of "
        f"{result['prefixes_precomputed']} prefixes: {result['precompute_s']:.2f} s; "
        f"max |score(reuse) - score(full)| = {result['max_abs_score_gap']:.2e}; "
        f"recall over {result['answerable_queries']} answerable queries."
    )
    return markdown_table(headers, rows) + notes
