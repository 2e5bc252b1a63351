"""Blend on vLLM beside blend in process: time to first token, distance to exact, answers.

``bench vllm --parts blend``: each prompt (a question over its passages, in a new
order) is answered by exact prefill, turbo and blend (the model's calibrated
settings, ``engine.blend_settings``) on both engines: vLLM with the connector
(its own prefill is the exact one) and the in-process engine (its own full
prefill). Per engine and strategy: median time to first token and its speedup
over that engine's exact prefill; the first token's KL to that engine's exact
answer over the exact answer's top 20 log-probabilities (one measure for both
engines: vLLM returns the top 20); greedy answers' token F1 against the exact
answer's; and, for vLLM, the prompt tokens loaded and recomputed, as its reply
says.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from kvrag_integrations.bench.common import markdown_table, other_orders
from kvrag_integrations.bench.metrics import kl_top, token_f1

STRATEGIES = ("full", "turbo", "blend")
TOP = 20


def measure(served: Any, engine: Any, prompts: list, repeats: int, new_tokens: int) -> dict:
    """The figures above for ``prompts`` (``(question, chunks)``, chunks encoded)."""
    rows: dict[str, dict[str, list[float]]] = {
        f"{side}_{s}": {"ttft": [], "kl": [], "f1": [], "loaded": [], "recomputed": []}
        for side in ("vllm", "inproc")
        for s in STRATEGIES
    }
    for eng in (served, engine):
        # blend may read entries of its own encoding context (the calibrated one):
        # a first blend request computes what is missing and encodes it in the
        # background; timed requests must not race that encoding
        for question, chunks in prompts:
            eng.generate(question=question, chunks=chunks, strategy="blend", max_new_tokens=1)
        eng.wait_for_encoding(timeout=900)
    for question, chunks in prompts:
        for side, eng in (("vllm", served), ("inproc", engine)):
            results = {}
            for strategy in STRATEGIES:
                times = []
                # a new order each time: vLLM's exact prefill meets no prefix of an
                # earlier request (its prefix cache would answer a repeat); every
                # strategy's last answer is to the same order, which KL compares
                for order in other_orders(chunks, max(1, repeats)):
                    result = eng.generate(
                        question=question,
                        chunks=order,
                        strategy=strategy,
                        max_new_tokens=new_tokens,
                        stop=["\n"],
                        logprobs=TOP,
                    )
                    times.append(result.ttft_s)
                results[strategy] = result
                row = rows[f"{side}_{strategy}"]
                row["ttft"].append(statistics.median(times))
                row["loaded"].append(result.reused_tokens + result.recomputed_tokens)
                row["recomputed"].append(result.recomputed_tokens)
            exact = _top(results["full"])
            for strategy, result in results.items():
                row = rows[f"{side}_{strategy}"]
                row["kl"].append(kl_top(exact, _top(result)))
                row["f1"].append(token_f1(result.text, results["full"].text))
    tokens = [engine.tokenize(engine.build_segments(question=q, chunks=c)).num_tokens
              for q, c in prompts]  # fmt: skip
    summary = {name: {k: statistics.mean(v) for k, v in row.items()} for name, row in rows.items()}
    for name, row in rows.items():
        summary[name]["ttft"] = statistics.median(row["ttft"])
    return {
        "blend": summary,
        "blend_prompts": len(prompts),
        "blend_median_prompt_tokens": statistics.median(tokens),
        "blend_settings": _settings(engine, prompts),
        "blend_per_prompt": {
            name: {"kl": row["kl"], "f1": row["f1"]} for name, row in rows.items()
        },
    }


def _top(result: Any) -> dict[int, float]:
    """The first token's top log-probabilities (in process: from its logits)."""
    if result.first_token_logprobs:
        return dict(result.first_token_logprobs)
    logprobs = torch.log_softmax(result.first_token_logits.float().reshape(-1), dim=-1)
    values, ids = logprobs.topk(TOP)
    return {int(i): float(v) for i, v in zip(ids, values)}


def _settings(engine: Any, prompts: list) -> str:
    """The calibrated settings blend used on the first prompt (in process)."""
    prompt = engine.tokenize(engine.build_segments(question=prompts[0][0], chunks=prompts[0][1]))
    options = engine.blend_options(prompt)
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "CacheBlend's defaults"


def table(payload: dict[str, Any]) -> str:
    summary = payload["blend"]
    rows = []
    for side, label in (("vllm", "vLLM + KVRAGConnector"), ("inproc", "KVRAGEngine")):
        full = summary[f"{side}_full"]["ttft"]
        turbo_kl = summary[f"{side}_turbo"]["kl"]
        for strategy in STRATEGIES:
            s = summary[f"{side}_{strategy}"]
            rows.append(
                [
                    f"{label}, {strategy}",
                    round(1000 * s["ttft"], 1),
                    f"{full / s['ttft']:.1f}x",
                    round(s["kl"], 4),
                    "-" if strategy == "full" or turbo_kl <= 0 else f"{s['kl'] / turbo_kl:.2f}x",
                    round(s["f1"], 2),
                    round(s["loaded"]) if side == "vllm" else "-",
                    round(s["recomputed"]) if side == "vllm" else "-",
                ]
            )
    head = markdown_table(
        [
            "engine, strategy",
            "TTFT ms",
            "vs its exact prefill",
            "first-token KL to its exact (top 20)",
            "KL / turbo's",
            "answer F1 vs its exact",
            "prompt tokens loaded",
            "of them recomputed",
        ],
        rows,
    )
    return (
        f"{head}\n\n{payload['blend_prompts']} prompts, median "
        f"{payload['blend_median_prompt_tokens']:.0f} tokens; blend's settings (calibrated): "
        f"{payload['blend_settings']}."
    )
