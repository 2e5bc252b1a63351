"""TTFT of every strategy on the same prompts, side by side in one run."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvrag_integrations.bench import plots
from kvrag_integrations.bench.common import RagItem, markdown_table, timed, trimmed_chunks
from kvrag_integrations.bench.quality import DEFAULT_STRATEGIES, label
from kvrag_integrations.engine.engine import KVRAGEngine

QUICK = {
    "items": 1,
    "n_chunks": 3,
    "chunk_tokens": 32,
    "repeats": 1,
    "strategies": [DEFAULT_STRATEGIES[i] for i in (0, 1, 3)],
}


def run(
    engine: KVRAGEngine,
    items: list[RagItem],
    *,
    n_chunks: int = 10,
    chunk_tokens: int = 300,
    repeats: int = 3,
    strategies: list[tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Median TTFT per strategy over ``items`` (chunks trimmed to ``chunk_tokens``).

    Caches are precomputed first (timed separately, as ingestion); each request's
    TTFT is the median of ``repeats`` runs after one warm-up.
    """
    strategies = strategies or DEFAULT_STRATEGIES
    prompts = [
        (it.question, trimmed_chunks(engine.tokenizer, it, n_chunks, chunk_tokens)) for it in items
    ]
    all_chunks = [c for _, chunks in prompts for c in chunks]
    encode_s, _ = timed(lambda: engine.encode_chunks(all_chunks, show_progress=False), 1, 0)
    per_strategy: dict[str, list[float]] = {}
    prompt_tokens = []
    for question, chunks in prompts:
        for name, options in strategies:
            request = dict(question=question, chunks=chunks, strategy=name, **options)
            ttft, _ = timed(lambda r=request: engine.generate(max_new_tokens=1, **r), repeats)
            per_strategy.setdefault(label(name, options), []).append(ttft)
        pre = engine.prefill(question=question, chunks=chunks, strategy="full")
        prompt_tokens.append(pre.prompt.num_tokens)
    base = statistics.median(per_strategy["full"])
    rows = []
    for name, values in per_strategy.items():
        med = statistics.median(values)
        rows.append({"strategy": name, "ttft_ms": med * 1000, "speedup": base / med})
    return {
        "items": len(prompts),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "median_prompt_tokens": statistics.median(prompt_tokens),
        "repeats": repeats,
        "encode_s_per_chunk": encode_s / max(1, len(set(all_chunks))),
        "results": rows,
    }


def table(payload: dict[str, Any]) -> str:
    rows = [
        [r["strategy"], round(r["ttft_ms"], 1), f"{r['speedup']:.1f}x"] for r in payload["results"]
    ]
    return markdown_table(["strategy", "TTFT (ms, median)", "speedup vs full"], rows)


def plot(payload: dict[str, Any], out_dir: Path, name: str = "ttft") -> list[Path]:
    """``<name>.png``: TTFT bars per strategy, labelled with the speedup."""
    return [plots.ttft_bars(payload, out_dir / f"{name}.png")]
