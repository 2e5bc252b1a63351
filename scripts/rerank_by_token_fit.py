"""Query likelihood over a server: one request per query token (loading the
document) against one plain request per candidate, warm, side by side.

The figures ``vllm.client.scoring.REQUEST_TOKENS`` was fitted to (docs/vllm.md):
start a server on an empty store, then

    python -m kvrag_integrations.vllm.serve --store disk:/tmp/kv --port 8000 &
    python scripts/rerank_by_token_fit.py http://127.0.0.1:8000 250 600

Each length cuts ten MuSiQue passages of two questions to about that many tokens
(a tag of its own per length and run: nothing stored before). By token is forced for its
timing (``REQUEST_TOKENS = 0``) whatever the rule would choose.
"""

from __future__ import annotations

import sys
import time
import uuid

from kvrag_integrations import KVRAGEngine, KVReranker
from kvrag_integrations.bench.common import load_items, trim_to_tokens
from kvrag_integrations.vllm.client import scoring
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

ITEMS = (10, 11)


def main(url: str, lengths: list[int]) -> None:
    items = load_items(None, max(ITEMS) + 1)
    tokenizer = KVRAGEngine.shared().tokenizer
    scoring.REQUEST_TOKENS = 0  # by token, whatever the rule says
    with VLLMEngine.connect(url) as client:
        reranker = KVReranker(client, scoring="query_likelihood")
        for n_tokens in lengths:
            tag = f"fit{n_tokens}-{uuid.uuid4().hex[:8]}"  # stored by no earlier run
            for i in ITEMS:
                item = items[i]
                docs = [
                    f"({tag}) {trim_to_tokens(tokenizer, d, n_tokens)}" for d in item.chunks[:10]
                ]
                reranker.score(item.question, docs)  # cold: stores them
                started = time.perf_counter()
                reranker.score(item.question, docs)
                by_token = time.perf_counter() - started
                started = time.perf_counter()
                reranker.score(item.question, docs, reuse=False)
                plain = time.perf_counter() - started
                heads = [reranker.prefix_ids(d).numel() for d in docs]
                lead, query = reranker.prompt.query_ids(item.question)
                row = {"doc_tokens": round(sum(heads) / len(heads)), "n_query": query.numel()}
                row |= {"tail": lead.numel() + query.numel(), "by_token_s": round(by_token, 2)}
                row |= {
                    "plain_s": round(plain, 2),
                    "plain_over_by_token": round(plain / by_token, 2),
                }
                print(row, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], [int(n) for n in sys.argv[2:]] or [250, 600])
