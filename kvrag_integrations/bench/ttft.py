"""TTFT of every strategy on the same prompts, side by side in one run."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvrag_integrations.bench import plots
from kvrag_integrations.bench.common import RagItem, markdown_table, timed, trimmed_chunks
from kvrag_integrations.bench.quality import CALIBRATED, DEFAULT_STRATEGIES
from kvrag_integrations.bench.rows import ENGINE_OPTIONS, engine_for, label, request_options
from kvrag_integrations.engine.engine import KVRAGEngine

# Issue 21's candidates for the default blend beside today's (their fidelity:
# the quality suite's "context" presets); rows with ``chunk_context`` run on an
# engine of their own over the same weights, with its own entries.
CONTEXT: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.15, "selection": "query", "chunk_context": "sink"}),
    ("turbo", {"chunk_context": "sink"}),
]
# Blend as the engine serves it (the model's calibrated settings for these chunks'
# length), beside full and turbo.
PRESETS = {"default": DEFAULT_STRATEGIES, "context": CONTEXT, "calibrated": CALIBRATED}

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
    for name, _ in strategies:  # (their entries are stored with the chunks')
        engine.use_strategy(name)
    all_chunks = [c for _, chunks in prompts for c in chunks]
    encode_s, _ = timed(lambda: engine.encode_chunks(all_chunks, show_progress=False), 1, 0)
    engines: dict[tuple, KVRAGEngine] = {}
    rows_of = []
    for name, options in strategies:
        options = dict(options)
        settings = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
        runner = engine_for(engine, settings, engines)
        if runner is not engine:
            runner.encode_chunks(all_chunks, show_progress=False)
        row = label(name, {**options, **settings})
        rows_of.append((row, runner, name, request_options(name, options)))
    per_strategy: dict[str, list[float]] = {}
    prompt_tokens = []
    for question, chunks in prompts:
        for row, runner, name, options in rows_of:
            request = dict(question=question, chunks=chunks, strategy=name, **options)
            ttft, _ = timed(lambda e=runner, r=request: e.generate(max_new_tokens=1, **r), repeats)
            per_strategy.setdefault(row, []).append(ttft)
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
