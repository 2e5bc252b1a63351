"""Held-out evaluation of a TurboRAG adapter against the base model's full prefill.

``python -m kvrag_integrations.train.eval --adapter ./turbo-adapter --items 16``

For each held-out item (never trained on: ``train.data.is_heldout``) the prompt
is built as in training (same chunk count and length, read from the adapter's
``train_config.json``). Reported per variant, against the *base* model's full
prefill: mean first-token KL, top-1 agreement, and the gold answer's mean
per-token negative log-likelihood (teacher-forced); with ``--generate`` also the
token F1 of greedy answers.

Variants: base full (the reference), base turbo, base blend@ratio, tuned turbo,
tuned full (the "not worse" check of the tuned model itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvrag_integrations.bench.common import machine_info, markdown_table
from kvrag_integrations.bench.metrics import best_f1, kl_divergence
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.train.data import RagExample, load_corpus, prompt_chunks, split
from kvrag_integrations.train.distill import build_sample, student_logits
from kvrag_integrations.train.mask import causal_layout

VARIANTS = ("base-full", "base-turbo", "base-blend", "tuned-turbo", "tuned-full")


def gold_nll(
    engine: KVRAGEngine, question: str, chunks: list[str], answer: str, turbo: bool
) -> float:
    """Mean per-token NLL of ``answer`` (then EOS) after the prompt, full or turbo-masked."""
    prompt = engine.tokenize(engine.build_segments(question=question, chunks=chunks))
    ids = engine.tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids = list(ids) + engine.eos_token_ids[:1]
    sample = build_sample(prompt, ids)
    if not turbo:
        sample.layout = causal_layout(sample.num_tokens)
    rows = torch.arange(sample.answer_start - 1, sample.num_tokens - 1)
    with torch.no_grad():
        logits = student_logits(engine.model, sample, rows)
    labels = sample.input_ids[sample.answer_start :].to(logits.device)
    return float(F.cross_entropy(logits, labels))


def evaluate_item(
    base: KVRAGEngine,
    tuned: KVRAGEngine,
    example: RagExample,
    chunks: list[str],
    ratio: float,
    generate: bool,
    max_new_tokens: int,
) -> dict[str, dict[str, float]]:
    """Every variant's metrics on one item."""
    plan: dict[str, tuple[KVRAGEngine, str, dict[str, Any]]] = {
        "base-full": (base, "full", {}),
        "base-turbo": (base, "turbo", {}),
        "base-blend": (base, "blend", {"recompute_ratio": ratio}),
        "tuned-turbo": (tuned, "turbo", {}),
        "tuned-full": (tuned, "full", {}),
    }
    q = example.question
    reference = base.prefill(question=q, chunks=chunks, strategy="full").logits
    out: dict[str, dict[str, float]] = {}
    for name, (engine, strategy, options) in plan.items():
        logits = engine.prefill(question=q, chunks=chunks, strategy=strategy, **options).logits
        row = {
            "kl": kl_divergence(reference, logits),
            "top1": float(int(logits.argmax()) == int(reference.argmax())),
        }
        if example.answers and strategy != "blend":
            row["gold_nll"] = gold_nll(engine, q, chunks, example.answers[0], strategy == "turbo")
        if generate and example.answers:
            text = engine.generate(
                question=q,
                chunks=chunks,
                strategy=strategy,
                max_new_tokens=max_new_tokens,
                **options,
            ).text
            row["f1"] = best_f1(text, example.answers)
        out[name] = row
    return out


def summarize(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Mean of each metric per variant."""
    summary: dict[str, dict[str, float]] = {}
    for name in VARIANTS:
        metrics = sorted({m for r in rows for m in r[name]})
        summary[name] = {
            m: statistics.fmean(r[name][m] for r in rows if m in r[name]) for m in metrics
        }
    return summary


def table(summary: dict[str, dict[str, float]]) -> str:
    """The summary as a Markdown table."""
    metrics = ["kl", "top1", "gold_nll", "f1"]
    metrics = [m for m in metrics if any(m in s for s in summary.values())]
    rows = [[name] + [summary[name].get(m, float("nan")) for m in metrics] for name in summary]
    return markdown_table(["variant", *metrics], rows)


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; print the table and write ``--out`` JSON. Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m kvrag_integrations.train.eval")
    parser.add_argument("--adapter", required=True, help="adapter folder from `kvrag train`")
    parser.add_argument("--model", default=None)
    parser.add_argument("--data", default=str(Path("..") / "shared" / "data" / "musique_dev.json"))
    parser.add_argument("--items", type=int, default=16, help="held-out items to evaluate")
    parser.add_argument("--ratio", type=float, default=0.15, help="blend's recompute ratio")
    parser.add_argument("--generate", action="store_true", help="also greedy answers' F1")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    cfg = json.loads((Path(args.adapter) / "train_config.json").read_text())
    base = KVRAGEngine.from_pretrained(args.model)
    tuned = KVRAGEngine.from_pretrained(args.model, adapter=args.adapter)
    _, heldout = split(load_corpus(args.data), cfg["heldout_fraction"])
    heldout = heldout[: args.items]
    rows = []
    for example in heldout:
        chunks = prompt_chunks(base.tokenizer, example, cfg["n_chunks"], cfg["chunk_tokens"])
        rows.append(
            evaluate_item(
                base, tuned, example, chunks, args.ratio, args.generate, args.max_new_tokens
            )
        )
    summary = summarize(rows)
    text = table(summary)
    payload = {
        "summary": summary,
        "items": len(rows),
        "item_ids": [e.item_id for e in heldout],
        "train_config": cfg,
        "fingerprints": {"base": base.fingerprint, "tuned": tuned.fingerprint},
        "machine": machine_info(base),
        "wall_s": round(time.perf_counter() - started, 1),
        "per_item": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=1))
    print(text)
    print(json.dumps({"items": len(rows), "wall_s": payload["wall_s"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
