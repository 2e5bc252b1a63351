"""The main job: a small RAG question over the bundled sample corpus, full vs turbo
(the default strategy).

Run it with ``python -m kvrag_integrations`` (add ``--help`` for options).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import Counter
from importlib import resources
from typing import Any

from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY


def load_sample_corpus() -> dict[str, Any]:
    """The sample corpus that ships with the package (passages and questions)."""
    text = resources.files("kvrag_integrations").joinpath("data/sample_corpus.json")
    return json.loads(text.read_text(encoding="utf-8"))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def keyword_retrieve(question: str, passages: list[str], k: int) -> list[int]:
    """Indices of the ``k`` passages sharing the most (idf-weighted) words with the question.

    A dependency-free stand-in for a vector store, so the demo runs anywhere;
    the LlamaIndex and LangChain integrations use real retrievers.
    """
    docs = [Counter(_words(p)) for p in passages]
    df = Counter(w for d in docs for w in d)
    query = set(_words(question))

    def score(doc: Counter) -> float:
        return sum(math.log(1 + len(docs) / df[w]) for w in query if w in doc)

    return sorted(range(len(docs)), key=lambda i: -score(docs[i]))[:k]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF id, path or .gguf (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--question", default=None, help="default: the corpus's first question")
    parser.add_argument("-k", "--top-k", type=int, default=6, help="passages retrieved")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per strategy")
    args = parser.parse_args(argv)

    corpus = load_sample_corpus()
    passages = [p["text"] for p in corpus["passages"]]
    question = args.question or corpus["questions"][0]["question"]
    print(f"Loading {args.model or 'the bundled SmolLM2-135M-Instruct'} on {args.device} ...")
    engine = KVRAGEngine.from_pretrained(args.model, device=args.device)

    print(f"Precomputing KV caches of {len(passages)} passages (once, at ingestion):")
    engine.encode_chunks(passages)
    chunks = [passages[i] for i in keyword_retrieve(question, passages, args.top_k)]

    print(f"\nQuestion: {question}  ({len(chunks)} retrieved passages)\n")
    rows = []
    for strategy in ("full", DEFAULT_STRATEGY):
        runs = [
            engine.generate(question=question, chunks=chunks, strategy=strategy, max_new_tokens=32)
            for _ in range(max(1, args.repeats))
        ]
        ttft = statistics.median(r.ttft_s for r in runs)
        rows.append((strategy, ttft, runs[-1]))
    base = rows[0][1]
    print(
        f"{'strategy':<8} {'TTFT (ms)':>10} {'speedup':>8} {'reused':>7} {'prefilled':>9}  answer"
    )
    for strategy, ttft, r in rows:
        print(
            f"{strategy:<8} {ttft * 1000:>10.1f} {base / ttft:>7.1f}x {r.reused_tokens:>7} "
            f"{r.prefilled_tokens:>9}  {r.text.strip()!r}"
        )


if __name__ == "__main__":
    main()
