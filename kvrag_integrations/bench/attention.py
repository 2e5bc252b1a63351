"""Where the question's attention over reused chunk caches goes, per layer.

Why query-driven selection must look past the first layers, and why it needs
chunks with a proper sink: per layer, on turbo's prompt cache (chunks encoded
alone, then behind BOS), the share of the question's attention to chunk tokens
that lands on each chunk's first token, and how far the layer's top-15% chunk
tokens (the tokens query-driven selection would recompute, ranked by that layer
alone) overlap the top-15% by the layers ``CacheBlend(selection="query")``
sums by default.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from kvrag_integrations.bench.common import RagItem, markdown_table, trimmed_chunks
from kvrag_integrations.bench.rows import engine_for
from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.modeling.attention_mass import attention_mass
from kvrag_integrations.engine.modeling.forward import run_tokens
from kvrag_integrations.engine.strategies import TurboRAG
from kvrag_integrations.engine.strategies.reuse import with_last

CONTEXTS = ("alone", "sink")
QUICK = {"items": 1, "n_chunks": 3, "chunk_tokens": 16}


def _per_layer(engine: KVRAGEngine, question: str, chunks: list[str]) -> dict[str, list[float]]:
    engine.encode_chunks(chunks, show_progress=False)
    prompt = engine.tokenize(engine.build_segments(question=question, chunks=chunks))
    caches, _ = engine.caches.for_prompt(prompt)
    layout = engine.loaded.layout
    kv, uncached = TurboRAG().assemble(engine.loaded, prompt, caches)
    todo = with_last(uncached, kv.num_tokens)
    chunk = torch.zeros(kv.num_tokens, dtype=torch.bool, device=kv.device)
    first = chunk.clone()
    at = 0
    for piece in prompt.pieces:
        if piece.is_chunk:
            chunk[at : at + piece.ids.numel()] = True
            first[at] = True
        at += piece.ids.numel()
    tail = int((todo > int(chunk.nonzero().max())).sum())
    masses = []
    with engine.exclusive():
        for layer in range(layout.num_layers):
            with attention_mass(engine.model, {layer}, tail) as mass:
                run_tokens(engine.model, layout, kv, todo, on_update=lambda *_: None)
            masses.append(mass.mass[: kv.num_tokens].masked_fill(~chunk, 0))
    k = max(1, round(0.15 * int(chunk.sum())))
    deep = set(torch.topk(sum(masses[layout.num_layers // 4 :]), k).indices.tolist())
    starts, overlap = [], []
    for w in masses:
        starts.append(float(w[first].sum() / w.sum()))
        overlap.append(len(set(torch.topk(w, k).indices.tolist()) & deep) / k)
    return {"chunk_start_share": starts, "overlap_with_summed": overlap}


def run(
    engine: KVRAGEngine, items: list[RagItem], *, n_chunks: int = 16, chunk_tokens: int = 64
) -> dict[str, Any]:
    """Per layer, means over ``items``, for chunks encoded alone and behind BOS."""
    engines: dict[tuple, KVRAGEngine] = {}
    out: dict[str, Any] = {}
    for context in CONTEXTS:
        runner = engine_for(engine, {"chunk_context": context}, engines)
        prompts = [(it.question, trimmed_chunks(runner.tokenizer, it, n_chunks, chunk_tokens))
                   for it in items]  # fmt: skip
        per = [_per_layer(runner, question, chunks) for question, chunks in prompts]
        out[context] = {
            key: [statistics.mean(p[key][i] for p in per) for i in range(len(per[0][key]))]
            for key in per[0]
        }
    layers = engine.loaded.layout.num_layers
    return {
        "items": len(items),
        "chunks_per_prompt": n_chunks,
        "chunk_tokens": chunk_tokens,
        "summed_layers": f"{layers // 4}-{layers - 1}",
        "chunk_start_token_share": 1 / chunk_tokens,
        "contexts": out,
    }


def table(payload: dict[str, Any]) -> str:
    alone, sink = payload["contexts"]["alone"], payload["contexts"]["sink"]
    rows = [
        [
            layer,
            f"{alone['chunk_start_share'][layer]:.2f}",
            f"{sink['chunk_start_share'][layer]:.2f}",
            f"{alone['overlap_with_summed'][layer]:.2f}",
            f"{sink['overlap_with_summed'][layer]:.2f}",
        ]
        for layer in range(len(alone["chunk_start_share"]))
    ]
    headers = [
        "layer",
        "attention on chunk-first tokens: alone",
        "behind BOS",
        f"top-15% overlap with layers {payload['summed_layers']}: alone",
        "behind BOS",
    ]
    note = (
        f"Chunk-first tokens are {payload['chunk_start_token_share']:.1%} of chunk tokens. "
        "Attention share: of the question's attention to chunk tokens."
    )
    return markdown_table(headers, rows) + "\n\n" + note
