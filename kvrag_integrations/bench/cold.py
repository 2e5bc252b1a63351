"""Cold requests: the chunks are not cached yet. Never slower than no reuse?

A user's first question over fresh documents (ingested without ``KVCacheTransform``,
or evicted since) finds no chunk cache. Each measurement here gets an engine with an
empty store on the same weights, the chunks noted as a retriever would note them
(``note_nodes``), and the RAG prompt through ``stream_chat``, side by side with:

- ``KVRAGLLM full``: plain prefill, no reuse (the reference);
- ``KVRAGLLM <strategy> cold``: the default (``on_miss="auto"``): encodes the chunks
  on the request path when the measured costs say that is no dearer than a full
  prefill, else answers by plain prefill and encodes them in the background;
- ``... cold, on_miss=defer`` and ``... cold, on_miss=encode``: each path forced;
- ``... second request, right after``: the same prompt again at once, not waiting
  for the background worker (it takes the queued encodings over);
- ``... next request, once encoded``: the same prompt once the background encoding
  is done (``engine.wait_for_encoding()``);
- ``full prefill of another prompt, quiet`` / ``... right after a deferred
  request``: a different prompt of the same length by plain prefill, on a quiet
  engine and right after a request deferred its chunks (the background worker
  still encoding them): what leftover background work costs the next request;
- ``HuggingFaceLLM``: LlamaIndex's local-model LLM on the same loaded model (the
  ``peer`` suite's).

TTFT is from the call to the first streamed response, median of repeats after one
warm-up; ``vs full`` is the ratio to ``KVRAGLLM full``. ``max_encodings_per_key``
is how often one engine encoded any one chunk (1: never twice), ``cold_vs_full``
the default's cold ratio and ``leftover_slowdown`` the next request's, after /
quiet.

Examples:
    python -m kvrag_integrations.bench cold --items 2 --chunks 4 --chunk-tokens 128
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from kvrag_integrations.bench import peer
from kvrag_integrations.bench.common import (
    RagItem,
    append_values,
    count_encodings,
    markdown_table,
    trimmed_chunks,
)
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY
from kvrag_integrations.store import MemoryKVStore

QUICK = {"items": 1, "n_chunks": 2, "chunk_tokens": 16, "repeats": 1, "max_new_tokens": 2}


def run(
    engine: Any,
    items: list[RagItem],
    *,
    n_chunks: int = 5,
    chunk_tokens: int = 200,
    repeats: int = 3,
    max_new_tokens: int = 4,
    strategy: str = DEFAULT_STRATEGY,
) -> dict[str, Any]:
    """TTFT of a request on uncached chunks, per LLM and mode (see the module doc)."""
    from llama_index.core.schema import TextNode

    from kvrag_integrations.engine.engine import KVRAGEngine
    from kvrag_integrations.llama_index import KVRAGLLM, note_nodes

    encodings: list[Counter[str]] = []  # per engine: each has a store of its own

    def fresh(on_miss: str = "auto") -> Any:
        e = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss=on_miss)
        encodings.append(count_encodings(e))
        return e

    def llm(e: Any, name: str = strategy) -> Any:
        return KVRAGLLM(e, strategy=name, max_new_tokens=max_new_tokens)

    labels = {
        "full": "KVRAGLLM full",
        "auto": f"KVRAGLLM {strategy} cold (default: auto)",
        "defer": f"KVRAGLLM {strategy} cold, on_miss=defer",
        "encode": f"KVRAGLLM {strategy} cold, on_miss=encode",
        "second": f"KVRAGLLM {strategy} second request, right after (no wait)",
        "warm": f"KVRAGLLM {strategy} next request, once encoded",
        "quiet": "KVRAGLLM full, another prompt, quiet engine",
        "after": "KVRAGLLM full, another prompt, right after a deferred request",
        "peer": peer.PEER,
    }
    per: dict[str, dict[str, list[float]]] = {key: {} for key in labels}
    hf = peer.huggingface_llm(engine, max_new_tokens)
    for it in items:
        chunks = trimmed_chunks(engine.tokenizer, it, n_chunks, chunk_tokens)
        text = peer.prompt_text(it.question, chunks)
        other = peer.prompt_text(it.question, chunks[::-1])  # same length, another prompt
        note_nodes([TextNode(text=c) for c in chunks])  # what the retriever's event does
        peer.first_response_s(hf, text)  # warm-up
        peer.first_response_s(llm(fresh(), "full"), text)
        for _ in range(max(1, repeats)):
            seconds, _ = peer.first_response_s(hf, text)
            append_values(per["peer"], ttft=seconds, reused_chunk_tokens=0, reused=0.0)
            _measure(per["full"], llm(fresh(), "full"), text)
            for mode in ("defer", "encode"):
                forced = llm(fresh(mode))
                _measure(per[mode], forced, text)
                forced.engine.wait_for_encoding()  # nothing runs beside the next one
            # The default, then the same prompt at once, then once encoded.
            auto = llm(fresh())
            _measure(per["auto"], auto, text)
            _measure(per["second"], auto, text)
            auto.engine.wait_for_encoding()
            _measure(per["warm"], auto, text)
            # Leftover background work against the next request (another prompt).
            _measure(per["quiet"], llm(fresh(), "full"), other)
            deferred = llm(fresh("defer"))
            _measure({}, deferred, text)  # its chunks go to the background worker
            _measure(per["after"], llm(fresh(), "full"), other)
            deferred.engine.wait_for_encoding()
    full = statistics.median(per["full"]["ttft"])
    rows = []
    for key, label in labels.items():
        ttft = statistics.median(per[key]["ttft"])
        rows.append(
            {
                "llm": label,
                "ttft_ms": ttft * 1000,
                "vs_full": ttft / full,
                "reused_chunk_tokens": statistics.mean(per[key]["reused_chunk_tokens"]),
                "reused": statistics.mean(per[key]["reused"]),
                "fell_back": statistics.mean(per[key].get("fell_back", [0.0])),
            }
        )
    quiet, after = (statistics.median(per[k]["ttft"]) for k in ("quiet", "after"))
    return {
        "items": len(items),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "max_new_tokens": max_new_tokens,
        "strategy": strategy,
        "cold_vs_full": rows[1]["vs_full"],
        "leftover_slowdown": after / quiet,
        "max_encodings_per_key": max((max(c.values(), default=0) for c in encodings), default=0),
        "results": rows,
    }


def _measure(row: dict[str, list[float]], llm: Any, text: str) -> None:
    seconds, _ = peer.first_response_s(llm, text)
    append_values(row, ttft=seconds, **_stats(llm))


def _stats(llm: Any) -> dict[str, float]:
    stats = llm.last_stats
    return {
        "reused_chunk_tokens": stats["reused_chunk_tokens"],
        "reused": stats["reused_tokens"] / max(1, stats["prompt_tokens"]),
        "fell_back": float(stats["fallback"] is not None),
    }


def table(payload: dict[str, Any]) -> str:
    """TTFT side by side with the ratio to plain prefill."""
    rows = [
        [
            r["llm"],
            round(r["ttft_ms"], 1),
            f"{r['vs_full']:.2f}x",
            round(r["reused_chunk_tokens"]),
            f"{r.get('reused', 0.0):.0%}",
            f"{r['fell_back']:.0%}",
        ]
        for r in payload["results"]
    ]
    headers = ["LLM", "TTFT ms (first streamed response)", "vs full", "reused chunk tokens",
               "reused (of the prompt)", "answered by plain prefill"]  # fmt: skip
    return markdown_table(headers, rows)
