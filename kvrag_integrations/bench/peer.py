"""The comparison a user makes before switching: LlamaIndex's usual local-model LLM vs KVRAGLLM.

The peer is ``HuggingFaceLLM`` (``llama-index-llms-huggingface``): transformers'
``generate`` with a ``TextIteratorStreamer``, prefilling the whole prompt on
every call. It gets the engine's already loaded model and tokenizer objects
(the same weights, no second load). Against it, ``KVRAGLLM`` with each
strategy on the same engine, chunk caches precomputed as ingestion would.

Both receive the same RAG prompt (instruction, retrieved passages, question)
as one user message through ``stream_chat``, and both apply the model's chat
template. TTFT here is what a LlamaIndex user sees: from the call to the first
streamed response, median of repeats after one warm-up. KVRAGLLM finds the
passages in the message text (they are chunks its engine encoded); the table
shows how many prompt tokens it reused, and the F1 of each greedy answer
against HuggingFaceLLM's (the same model and prompt should give the same
answer under full prefill).

Examples:
    python -m kvrag_integrations.bench peer --items 5
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from kvrag_integrations.bench import plots
from kvrag_integrations.bench.common import RagItem, append_values, markdown_table, trimmed_chunks
from kvrag_integrations.bench.metrics import token_f1
from kvrag_integrations.bench.rows import label, request_options
from kvrag_integrations.engine.prompting.segments import rag_user_segments

PEER = "HuggingFaceLLM"
STRATEGIES: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("turbo", {}),
    ("blend", {"recompute_ratio": 0.15}),
]
QUICK = {"items": 1, "n_chunks": 2, "chunk_tokens": 16, "repeats": 1, "max_new_tokens": 2}


def prompt_text(question: str, chunks: list[str]) -> str:
    """The engine's default RAG user message as one string."""
    return "".join(s.text for s in rag_user_segments(question, chunks))


def huggingface_llm(engine: Any, max_new_tokens: int) -> Any:
    """``HuggingFaceLLM`` on the engine's loaded model and tokenizer, greedy."""
    try:
        from llama_index.llms.huggingface import HuggingFaceLLM
    except ImportError as exc:
        raise ImportError(
            "the peer suite needs llama-index-llms-huggingface: "
            "pip install 'kvrag-integrations[bench]'"
        ) from exc
    return HuggingFaceLLM(
        model=engine.model,
        tokenizer=engine.tokenizer,
        model_name=engine.model_name,
        tokenizer_name=engine.model_name,
        context_window=engine.context_window,
        max_new_tokens=max_new_tokens,
        generate_kwargs={"do_sample": False, "pad_token_id": engine.tokenizer.pad_token_id},
        is_chat_model=True,
        device_map=str(engine.device),  # unused: the model is passed in
    )


def first_response_s(llm: Any, text: str) -> tuple[float, str]:
    """Seconds from ``stream_chat`` to its first streamed response; and the full answer."""
    from llama_index.core.base.llms.types import ChatMessage

    messages = [ChatMessage(role="user", content=text)]
    started = time.perf_counter()
    stream = llm.stream_chat(messages)
    first = next(stream)
    elapsed = time.perf_counter() - started
    answer = first.message.content or ""
    for response in stream:  # drain: the peer decodes in a thread that must finish
        answer = response.message.content or ""
    return elapsed, answer


def _median_ttft(llm: Any, text: str, repeats: int) -> tuple[float, str]:
    first_response_s(llm, text)  # warm-up
    times, answer = [], ""
    for _ in range(max(1, repeats)):
        seconds, answer = first_response_s(llm, text)
        times.append(seconds)
    return statistics.median(times), answer


def run(
    engine: Any,
    items: list[RagItem],
    *,
    n_chunks: int = 10,
    chunk_tokens: int = 300,
    repeats: int = 3,
    max_new_tokens: int = 8,
    strategies: list[tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """TTFT of HuggingFaceLLM and of KVRAGLLM per strategy on the same prompts."""
    from kvrag_integrations.llama_index import KVRAGLLM

    strategies = strategies or STRATEGIES
    prompts = []
    for it in items:
        chunks = trimmed_chunks(engine.tokenizer, it, n_chunks, chunk_tokens)
        prompts.append((prompt_text(it.question, chunks), chunks))
    engine.encode_chunks([c for _, cs in prompts for c in cs], show_progress=False)
    peer = huggingface_llm(engine, max_new_tokens)
    ours = {
        label(n, o): KVRAGLLM(
            engine,
            strategy=n,
            strategy_options=request_options(n, o),
            max_new_tokens=max_new_tokens,
        )
        for n, o in strategies
    }
    per: dict[str, dict[str, list[float]]] = {PEER: {}, **{name: {} for name in ours}}
    for text, chunks in prompts:
        peer_ttft, peer_answer = _median_ttft(peer, text, repeats)
        rendered = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        peer_tokens = len(engine.tokenizer(rendered)["input_ids"])
        append_values(
            per[PEER],
            ttft=peer_ttft,
            prompt_tokens=peer_tokens,
            reused=0,
            chunk_share=0.0,
            f1_vs_peer=1.0,
        )
        # The chunks' tokens and the "\n\n" between them (the default user message's
        # separator), which the engine reads with the chunk before it (chunk_suffix).
        in_chunks = (
            sum(len(engine.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in chunks)
            + (len(chunks) - 1) * engine.prompts.suffix_ids.numel()
        )
        for name, llm in ours.items():
            ttft, answer = _median_ttft(llm, text, repeats)
            stats = llm.last_stats
            append_values(
                per[name],
                ttft=ttft,
                prompt_tokens=stats["prompt_tokens"],
                reused=stats["reused_tokens"] - stats["reused_prefix_tokens"],
                chunk_share=(stats["reused_tokens"] - stats["reused_prefix_tokens"]) / in_chunks,
                f1_vs_peer=token_f1(answer, peer_answer),
            )
    base = statistics.median(per[PEER]["ttft"])
    rows = []
    for name, v in per.items():
        ttft = statistics.median(v["ttft"])
        rows.append(
            {
                "llm": name if name == PEER else f"KVRAGLLM {name}",
                "strategy": name,
                "ttft_ms": ttft * 1000,
                "speedup": base / ttft,
                "prompt_tokens": statistics.median(v["prompt_tokens"]),
                "reused_chunk_tokens": statistics.mean(v["reused"]),
                "reused_share_of_chunks": statistics.mean(v["chunk_share"]),
                "f1_vs_peer": statistics.mean(v["f1_vs_peer"]),
            }
        )
    return {
        "items": len(prompts),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "max_new_tokens": max_new_tokens,
        "peer": f"llama_index.llms.huggingface.{PEER}",
        "results": rows,
    }


def table(payload: dict[str, Any]) -> str:
    """TTFT side by side, speedup over HuggingFaceLLM, reuse and answer agreement."""
    rows = [
        [
            r["llm"],
            round(r["ttft_ms"], 1),
            f"{r['speedup']:.1f}x",
            int(r["prompt_tokens"]),
            round(r["reused_chunk_tokens"]),
            round(r["f1_vs_peer"], 2),
        ]
        for r in payload["results"]
    ]
    headers = ["LLM", "TTFT ms (first streamed response)", "speedup", "prompt tokens",
               "reused chunk tokens", f"answer F1 vs {PEER}"]  # fmt: skip
    return markdown_table(headers, rows)


def plot(payload: dict[str, Any], out_dir: Path, name: str = "peer") -> list[Path]:
    """``<name>.png``: TTFT bars, HuggingFaceLLM first."""
    bars = {**payload, "results": [{**r, "strategy": r["llm"]} for r in payload["results"]]}
    title = f"LlamaIndex: {PEER} vs KVRAGLLM (TTFT, stream_chat)"
    return [plots.ttft_bars(bars, out_dir / f"{name}.png", title)]
