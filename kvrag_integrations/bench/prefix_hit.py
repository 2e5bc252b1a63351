"""Reuse from the store against vLLM's own prefix hit, through ``VLLMEngine`` in process.

Part ``prefix-hit`` of the ``vllm`` suite (``--parts prefix-hit``; ``--lengths``
sets the prompt lengths, ``--repeats`` the timed pairs per length). For each
length and repeat, a prompt of stored chunks (MuSiQue passages, each trimmed
so that the prompt has about that many tokens; a repeat takes other passages,
so every prompt has a layout vLLM has never seen) is measured twice, in turn:

- **store**: a turbo request whose chunks are all stored: the connector loads
  every piece (the template's head, then the chunks; vLLM computes the
  question and the template's tail). Its layout is new, so its ``cache_salt``
  is too, and vLLM's prefix cache holds none of its blocks. Checked: every
  chunk counted as reused, by vLLM's count of cached tokens net of any piece a
  worker failed to load (the connector's reply: ``recomputed``);
- **prefix hit**: exactly the same prompt token ids as an exact request
  (``strategy="full"``, which carries nothing for the connector), sent twice:
  the first warms vLLM's prefix cache, the second is timed. Checked: vLLM
  counts the prompt's whole blocks as cached.

The ratio store / prefix hit (medians) is what issue 40 bounds at 1.3x.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvrag_integrations.bench.common import RagItem, markdown_table, trim_to_tokens

DEFAULT_LENGTHS = (1000, 3500, 6000)
_PASSAGE_TOKENS = 600  # about a MuSiQue passage: a prompt of n tokens has n / 600 chunks
_OVERHEAD_TOKENS = 80  # the template, instruction and question around the chunks


def prompt_chunks(tokenizer: Any, items: list[RagItem], length: int, repeat: int) -> list[str]:
    """Passages for a prompt of about ``length`` tokens (from item ``repeat`` on,
    the following items' next), each marked with the length and repeat: every
    prompt's chunks, hence its layout, are new."""
    count = max(1, round(length / _PASSAGE_TOKENS))
    each = max(16, (length - _OVERHEAD_TOKENS) // count)
    passages = [c for k in range(len(items)) for c in items[(repeat + k) % len(items)].chunks]
    chunks = [trim_to_tokens(tokenizer, text, each) for text in passages[:count]]
    return [f"({length}.{repeat}) {c}" for c in chunks]  # unique to this prompt


def measure(served: Any, items: list[RagItem], lengths: list[int], repeats: int) -> dict[str, Any]:
    """The store and prefix-hit TTFTs per length (see the module doc), interleaved."""
    question = items[0].question
    block = _block_size(served)
    # One untimed pair first: the template's leading text is encoded on first use.
    _pair(served, question, prompt_chunks(served.tokenizer, items, 256, -1), block)
    rows: dict[int, dict[str, list[Any]]] = {
        n: {"store": [], "prefix_hit": [], "tokens": [], "cached": []} for n in lengths
    }
    for repeat in range(repeats):
        for length in lengths:  # every length in each round: drift hits them alike
            chunks = prompt_chunks(served.tokenizer, items, length, repeat)
            store, hit, tokens, cached = _pair(served, question, chunks, block)
            row = rows[length]
            row["store"].append(store)
            row["prefix_hit"].append(hit)
            row["tokens"].append(tokens)
            row["cached"].append(cached)
    out = []
    for length, row in rows.items():
        store_ms = 1000 * statistics.median(row["store"])
        hit_ms = 1000 * statistics.median(row["prefix_hit"])
        out.append(
            {
                "length": length,
                "prompt_tokens": statistics.median(row["tokens"]),
                "store_ms": round(store_ms, 1),
                "prefix_hit_ms": round(hit_ms, 1),
                "ratio": round(store_ms / hit_ms, 3),
                "store_ms_all": [round(1000 * s, 1) for s in row["store"]],
                "prefix_hit_ms_all": [round(1000 * s, 1) for s in row["prefix_hit"]],
                "cached_tokens": row["cached"][-1],
            }
        )
    return {"prefix_hit": {"repeats": repeats, "block_size": block, "rows": out}}


def _pair(
    served: Any, question: str, chunks: list[str], block: int
) -> tuple[float, float, int, tuple[int, int]]:
    """(store TTFT, prefix-hit TTFT, prompt tokens, (cached by each)) for one prompt."""
    served.encode_chunks(chunks, show_progress=False)
    asked = dict(question=question, chunks=chunks, max_new_tokens=1)
    store = served.generate(**asked)
    n = store.prompt_tokens
    if store.fallback is not None or store.reused_chunks != len(chunks):
        raise RuntimeError(
            f"the turbo request loaded {store.reused_chunks} of {len(chunks)} chunks from "
            f"the store ({store.miss_reason}): not a measurement of a full load"
        )
    served.generate(**asked, strategy="full")  # warms vLLM's prefix cache
    hit = served.generate(**asked, strategy="full")
    if hit.prompt_tokens != n or hit.reused_tokens < (n - 1) // block * block:
        raise RuntimeError(
            f"the exact request's second send found {hit.reused_tokens} of {n} prompt "
            "tokens in vLLM's prefix cache: not a prefix hit"
        )
    return store.ttft_s, hit.ttft_s, n, (store.reused_tokens, hit.reused_tokens)


def _block_size(served: Any) -> int:
    """vLLM's scheduler block size (its prefix cache hits whole blocks)."""
    engine = getattr(served.backend, "_engine", None)
    config = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    return int(getattr(config, "block_size", None) or 16)


def table(payload: dict[str, Any]) -> str:
    part = payload["prefix_hit"]
    rows = [
        [r["length"], r["prompt_tokens"], r["store_ms"], r["prefix_hit_ms"], r["ratio"]]
        for r in part["rows"]
    ]
    return markdown_table(
        [
            "prompt (tokens)",
            "tokens (median)",
            "TTFT from our store ms",
            "TTFT, vLLM prefix hit ms",
            "store / prefix hit",
        ],
        rows,
    )
