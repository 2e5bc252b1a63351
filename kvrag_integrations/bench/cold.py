"""Cold requests: the chunks are not cached yet. Never slower than no reuse?

A user's first question over fresh documents (ingested without ``KVCacheTransform``,
or evicted since) finds no chunk cache. Each measurement here gets an engine with an
empty store on the same weights, the chunks noted as a retriever would note them
(``note_nodes``), and the RAG prompt through ``stream_chat``, side by side with:

- ``KVRAGLLM full``: plain prefill, no reuse (the reference);
- ``KVRAGLLM <strategy> cold``: the default (``on_miss="defer"``): plain prefill
  while the chunks are encoded in the background;
- ``KVRAGLLM <strategy> cold, on_miss=encode``: the old behaviour, encoding the
  chunks on the request path and then reusing them;
- ``KVRAGLLM <strategy> next request``: the same prompt again once the background
  encoding is done (``engine.wait_for_encoding()``);
- ``HuggingFaceLLM``: LlamaIndex's local-model LLM on the same loaded model (the
  ``peer`` suite's).

TTFT is from the call to the first streamed response, median of repeats after one
warm-up; ``vs full`` is the ratio to ``KVRAGLLM full``.

Examples:
    python -m kvrag_integrations.bench cold --items 2 --chunks 4 --chunk-tokens 128
"""

from __future__ import annotations

import statistics
from typing import Any

from kvrag_integrations.bench import peer
from kvrag_integrations.bench.common import RagItem, append_values, markdown_table, trimmed_chunks
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
    strategy: str = "blend",
) -> dict[str, Any]:
    """TTFT of a request on uncached chunks, per LLM and mode (see the module doc)."""
    from llama_index.core.schema import TextNode

    from kvrag_integrations.engine.engine import KVRAGEngine
    from kvrag_integrations.llama_index import KVRAGLLM, note_nodes

    def fresh(on_miss: str = "defer") -> Any:
        return KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss=on_miss)

    labels = {
        "full": "KVRAGLLM full",
        "cold": f"KVRAGLLM {strategy} cold (default: defer)",
        "encode": f"KVRAGLLM {strategy} cold, on_miss=encode",
        "warm": f"KVRAGLLM {strategy} next request",
        "peer": peer.PEER,
    }
    per: dict[str, dict[str, list[float]]] = {key: {} for key in labels}
    hf = peer.huggingface_llm(engine, max_new_tokens)
    for it in items:
        chunks = trimmed_chunks(engine.tokenizer, it, n_chunks, chunk_tokens)
        text = peer.prompt_text(it.question, chunks)
        note_nodes([TextNode(text=c) for c in chunks])  # what the retriever's event does
        peer.first_response_s(hf, text)  # warm-up
        peer.first_response_s(KVRAGLLM(fresh(), strategy="full", max_new_tokens=1), text)
        for _ in range(max(1, repeats)):
            for key in ("full", "cold", "encode", "peer"):
                if key == "peer":
                    seconds, _ = peer.first_response_s(hf, text)
                    append_values(per[key], ttft=seconds, reused_chunk_tokens=0)
                    continue
                name = "full" if key == "full" else strategy
                llm = KVRAGLLM(
                    fresh("encode" if key == "encode" else "defer"),
                    strategy=name,
                    max_new_tokens=max_new_tokens,
                )
                seconds, _ = peer.first_response_s(llm, text)
                append_values(per[key], ttft=seconds, **_stats(llm))
                llm.engine.wait_for_encoding()  # nothing runs beside the next measurement
                if key == "cold":
                    seconds, _ = peer.first_response_s(llm, text)
                    append_values(per["warm"], ttft=seconds, **_stats(llm))
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
                "fell_back": statistics.mean(per[key].get("fell_back", [0.0])),
            }
        )
    return {
        "items": len(items),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
        "max_new_tokens": max_new_tokens,
        "strategy": strategy,
        "results": rows,
    }


def _stats(llm: Any) -> dict[str, float]:
    stats = llm.last_stats
    return {
        "reused_chunk_tokens": stats["reused_chunk_tokens"],
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
            f"{r['fell_back']:.0%}",
        ]
        for r in payload["results"]
    ]
    headers = ["LLM", "TTFT ms (first streamed response)", "vs full", "reused chunk tokens",
               "answered by plain prefill"]  # fmt: skip
    return markdown_table(headers, rows)
