"""Speed and fidelity of every strategy on the same RAG questions, in one run.

Per strategy: median TTFT and speedup over full; fidelity to full prefill (mean
first-token KL, top-1 agreement, token F1 of the greedy answer against full's);
quality against gold (answer F1, and the gold answer's mean per-token
log-likelihood teacher-forced after the prompt cache the strategy built).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from kvrag_integrations.bench import plots
from kvrag_integrations.bench.common import RagItem, markdown_table, trim_to_tokens
from kvrag_integrations.bench.metrics import (
    answer_loglik,
    best_f1,
    kl_divergence,
    paired_bootstrap,
    token_f1,
)
from kvrag_integrations.bench.rows import (
    ENGINE_OPTIONS,
    engine_for,
    label,
    recompute_ratio,
    request_options,
)
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.prompting.tokenize import tokenize_text

DEFAULT_STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.05}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.3}),
]


# The CacheBlend refinements side by side at the default ratio (issue #3's
# question: which of K vs V deviation, EPIC-style chunk-start recompute, keeping
# the chunk-start sinks, attention-weighted selection and a later check layer helps).
ABLATION: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.15, "deviation": "key"}),
    ("blend", {"recompute_ratio": 0.15, "deviation": "both"}),
    ("blend", {"recompute_ratio": 0.15, "recompute_first": 4}),
    ("blend", {"recompute_ratio": 0.15, "check_layer": 2}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 1}),
]

# Each chunk's first token (its attention sink when encoded alone) left cached or
# not, and the other selection rules, on short chunks where partial recompute can
# do worse than turbo (docs/benchmarks.md, "CacheBlend on this model").
SINKS: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 1}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 4}),
    ("blend", {"recompute_ratio": 0.15, "refresh_check_layer": True}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 1, "refresh_check_layer": True}),
    ("blend", {"recompute_ratio": 0.05, "keep_chunk_starts": 1}),
    ("blend", {"recompute_ratio": 0.3, "keep_chunk_starts": 1}),
    ("blend", {"recompute_ratio": 0.15, "deviation": "key"}),
]

# Keeping the check layer's fresh K/V for every token (free: computed anyway),
# alone and with the chunk-start sinks kept, on whole passages.
REFRESH: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.15, "refresh_check_layer": True}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 1}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 1, "refresh_check_layer": True}),
    ("blend", {"recompute_ratio": 0.15, "keep_chunk_starts": 1, "refresh_check_layer": True,
               "deviation": "key"}),
]  # fmt: skip

# How far the greedy answer's agreement with full rises as recompute approaches
# everything: ratio 1.0 is full prefill by another code path (the numerical floor).
AGREEMENT: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.5}),
    ("blend", {"recompute_ratio": 0.8}),
    ("blend", {"recompute_ratio": 1.0}),
]

# Turbo from caches stored in each precision (``cache_precision``, an engine
# setting: such a row runs on an engine of its own over the same weights), against
# the default float16 storage.
PRECISION: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("turbo", {"cache_precision": "model"}),
    ("turbo", {"cache_precision": "int8"}),
]

# The chunk suffix (``chunk_suffix``, an engine setting): the "\n\n" after each
# chunk read from its entry (the default) or computed per request ("").
SUFFIX: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("turbo", {"chunk_suffix": ""}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.15, "chunk_suffix": ""}),
]

# Issue 21's candidates against turbo and blend@0.15 as they are: chunks encoded
# behind the model's BOS as a sink whose rows are dropped (``chunk_context``, an
# engine setting), APE's key temperature, query-driven selection (the question's
# attention over the reused caches, from a quarter of the depth on), and EPIC's
# chunk-start recompute once chunks have a proper sink.
CONTEXT: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("turbo", {"chunk_context": "sink"}),
    ("turbo", {"key_temperature": 0.9}),
    ("blend", {"recompute_ratio": 0.15}),
    ("blend", {"recompute_ratio": 0.15, "selection": "deviation", "chunk_context": "sink"}),
    ("blend", {"recompute_ratio": 0.15, "selection": "query", "keep_chunk_starts": 1}),
    ("blend", {"recompute_ratio": 0.15, "selection": "query", "chunk_context": "sink"}),
    (
        "blend",
        {
            "recompute_ratio": 0.15,
            "selection": "deviation",
            "recompute_first": 4,
            "chunk_context": "sink",
        },
    ),
]

# The same on whole passages (~6k-token prompts, the costly shape), without the
# two rows that short chunks ruled out on both models: APE's temperature (KL
# 2.5x and 1.4x turbo's) and EPIC with the sink (equal to blend with the sink).
CONTEXT_PASSAGES = [row for i, row in enumerate(CONTEXT) if i not in (3, 8)]

# Full, turbo and blend as the engine serves it: blend by name takes the model's
# calibrated settings for the prompt's chunk length (``kvrag calibrate``,
# ``engine.blend_settings``); judged on questions the calibration never saw.
CALIBRATED: list[tuple[str, dict[str, Any]]] = [("full", {}), ("turbo", {}), ("blend", {})]

PRESETS = {
    "default": DEFAULT_STRATEGIES,
    "calibrated": CALIBRATED,
    "precision": PRECISION,
    "suffix": SUFFIX,
    "context": CONTEXT,
    "context-passages": CONTEXT_PASSAGES,
    "ablation": ABLATION,
    "sinks": SINKS,
    "refresh": REFRESH,
    "agreement": AGREEMENT,
}
# Smoke run: full, turbo, blend@0.15 (three points of the trade-off curve).
QUICK = {"items": 1, "n_chunks": 3, "chunk_tokens": 32, "repeats": 1, "max_new_tokens": 4,
         "strategies": DEFAULT_STRATEGIES[:2] + DEFAULT_STRATEGIES[3:4]}  # fmt: skip


def gold_loglik(
    engine: KVRAGEngine, question: str, chunks: list[str], answer: str, name: str, options: dict
) -> float:
    """Mean per-token log-prob of ``answer`` after the prompt cache ``name`` builds."""
    pre = engine.prefill(question=question, chunks=chunks, strategy=name, **options)
    ids = tokenize_text(engine.tokenizer, answer.strip())
    return answer_loglik(engine.model, pre.output.kv, pre.logits, ids)


def run(
    engine: KVRAGEngine,
    items: list[RagItem],
    *,
    n_chunks: int = 10,
    chunk_tokens: int = 0,
    repeats: int = 1,
    max_new_tokens: int = 24,
    strategies: list[tuple[str, dict[str, Any]]] | None = None,
    loglik: bool = True,
) -> dict[str, Any]:
    """Run every strategy on every item; ``chunk_tokens=0`` keeps passages whole.

    ``loglik`` adds the gold answer's log-likelihood (one more, untimed, prefill
    per strategy and item).
    """
    strategies = strategies or DEFAULT_STRATEGIES
    engines: dict[tuple, KVRAGEngine] = {}
    per: dict[str, dict[str, list[float]]] = {label(n, o): {} for n, o in strategies}
    for name, _ in strategies:  # (their entries are stored with the chunks')
        engine.use_strategy(name)
    prompt_tokens = []
    for item in items:
        chunks = item.chunks[:n_chunks]
        if chunk_tokens:
            chunks = [trim_to_tokens(engine.tokenizer, c, chunk_tokens) for c in chunks]
        engine.encode_chunks(chunks, show_progress=False)
        reference = None
        for name, options in strategies:
            row = per[label(name, options)]
            options = dict(options)
            settings = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
            runner = engine_for(engine, settings, engines)
            runner.encode_chunks(chunks, show_progress=False)
            options = request_options(name, options)
            ttfts, result = [], None
            for _ in range(max(1, repeats)):
                result = runner.generate(
                    question=item.question,
                    chunks=chunks,
                    strategy=name,
                    max_new_tokens=max_new_tokens,
                    stop=["\n"],
                    **options,
                )
                ttfts.append(result.ttft_s)
            if reference is None:
                reference = result  # the first strategy (full) is the reference
                prompt_tokens.append(result.prompt_tokens)
            logits, ref_logits = result.first_token_logits, reference.first_token_logits
            row.setdefault("ttft_s", []).append(statistics.median(ttfts))
            row.setdefault("kl", []).append(kl_divergence(ref_logits, logits))
            row.setdefault("top1", []).append(float(logits.argmax() == ref_logits.argmax()))
            row.setdefault("f1_vs_full", []).append(token_f1(result.text, reference.text))
            row.setdefault("f1_gold", []).append(best_f1(result.text, item.answers))
            row.setdefault("recomputed", []).append(result.recomputed_tokens)
            gold = next((a for a in item.answers if a.strip()), None)
            if loglik and gold is not None:
                ll = gold_loglik(runner, item.question, chunks, gold, name, options)
                row.setdefault("loglik", []).append(ll)
    base = statistics.median(per[label(*strategies[0])]["ttft_s"])
    rows = []
    for (strategy, options), (name, values) in zip(strategies, per.items()):
        ttft = statistics.median(values["ttft_s"])
        rows.append(
            {
                "strategy": name,
                "recompute_ratio": recompute_ratio(strategy, options),
                "ttft_ms": ttft * 1000,
                "speedup": base / ttft,
                "kl_vs_full": statistics.mean(values["kl"]),
                "top1_vs_full": statistics.mean(values["top1"]),
                "f1_vs_full": statistics.mean(values["f1_vs_full"]),
                "f1_gold": statistics.mean(values["f1_gold"]),
                "recomputed_tokens": statistics.mean(values["recomputed"]),
                "gold_loglik": statistics.mean(values["loglik"]) if values.get("loglik") else None,
                # Per question, in item order: strategies compare pairwise on the same items.
                "kl_per_item": [round(x, 5) for x in values["kl"]],
                "f1_vs_full_per_item": [round(x, 3) for x in values["f1_vs_full"]],
            }
        )
    payload = {
        "items": len(items),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens or "whole",
        "median_prompt_tokens": statistics.median(prompt_tokens) if prompt_tokens else 0,
        "repeats": repeats,
        "results": rows,
    }
    calibration = engine.calibrations.current() if ("blend", {}) in strategies else None
    if calibration is not None:  # what "blend" (no options) ran with
        payload["blend_calibration"] = [c.as_json() for c in calibration.choices]
    return payload


def table(payload: dict[str, Any]) -> str:
    headers = [
        "strategy",
        "TTFT ms",
        "speedup",
        "KL vs full",
        "top-1 vs full",
        "F1 vs full",
        "F1 vs gold",
        "gold log-lik",
    ]
    rows = [
        [
            r["strategy"],
            round(r["ttft_ms"], 1),
            f"{r['speedup']:.1f}x",
            round(r["kl_vs_full"], 3),
            round(r["top1_vs_full"], 2),
            round(r["f1_vs_full"], 2),
            round(r["f1_gold"], 2),
            "-" if r.get("gold_loglik") is None else round(r["gold_loglik"], 3),
        ]
        for r in payload["results"]
    ]
    text = markdown_table(headers, rows)
    if payload.get("blend_calibration"):  # what "blend" ran with: the model's calibration
        chosen = "; ".join(
            f"~{c['chunk_tokens']}-token chunks: "
            + ", ".join(f"{k}={v}" for k, v in c["settings"].items())
            for c in payload["blend_calibration"]
        )
        text += f"\n\nblend: the model's calibrated settings ({chosen})."
    tables = [text, paired_table(payload)]
    # Variants of blend also against blend@0.15 itself (the default's options).
    if sum(r["strategy"].startswith("blend(") for r in payload["results"]) > 0:
        tables.append(paired_table(payload, base_name="blend@0.15"))
    return "\n\n".join(t for t in tables if t)


def paired_table(payload: dict[str, Any], base_name: str = "turbo") -> str:
    """Every partial-reuse row against ``base_name`` on the same questions, with
    90% intervals.

    Empty when the payload has no per-question lists (older runs) or no such row.
    Means over a few dozen questions are noisy; resampling the questions (pairs
    kept together) shows which differences the sample supports.
    """
    base = next((r for r in payload["results"] if r["strategy"] == base_name), None)
    if base is None or len(base.get("kl_per_item", [])) < 2:
        return ""
    rows = []
    for r in payload["results"]:
        if r["strategy"] in ("full", "turbo", base_name) or "kl_per_item" not in r:
            continue
        kl, f1 = r["kl_per_item"], r["f1_vs_full_per_item"]
        ratio, lo, hi = paired_bootstrap(kl, base["kl_per_item"])
        gain, glo, ghi = paired_bootstrap(f1, base["f1_vs_full_per_item"], ratio=False)
        mean, mlo, mhi = paired_bootstrap(f1)
        lower = sum(a < b for a, b in zip(kl, base["kl_per_item"]))
        rows.append(
            [
                r["strategy"],
                f"{ratio:.2f} ({lo:.2f}-{hi:.2f})",
                f"{lower}/{len(kl)}",
                f"{mean:.2f} ({mlo:.2f}-{mhi:.2f})",
                f"{gain:+.2f} ({glo:+.2f} to {ghi:+.2f})",
            ]
        )
    headers = [
        f"against {base_name}, same questions",
        f"KL / {base_name}'s KL (90% CI)",
        "questions with lower KL",
        "F1 vs full (90% CI)",
        f"F1 vs full minus {base_name}'s (90% CI)",
    ]
    return markdown_table(headers, rows) if rows else ""


def plot(payload: dict[str, Any], out_dir: Path, name: str = "quality") -> list[Path]:
    """``<name>-tradeoff.png``: KL and top-1 agreement against the recompute ratio."""
    points = [r for r in payload["results"] if plots.ratio_of(r) is not None]
    if len(points) < 2:
        return []
    return [plots.quality_tradeoff(payload, out_dir / f"{name}-tradeoff.png")]
