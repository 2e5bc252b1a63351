"""Plain OpenAI clients against the server: what an application that only points its
base URL at ``python -m kvrag_integrations.vllm.serve`` gets.

The suite starts the server (a fresh disk store), then vLLM's own OpenAI server
without the connector (prefix caching on), one at a time, and runs the
frameworks' own documented RAG patterns against each, nothing of this package
in them:

- **LangChain**: the RAG agent of LangChain's docs (``create_agent`` with a
  ``@dynamic_prompt`` middleware calling ``similarity_search`` on an
  ``InMemoryVectorStore``; the passages in the system message), the model
  ``ChatOpenAI(base_url=...)``;
- **LlamaIndex**: ``VectorStoreIndex.as_query_engine()`` with ``OpenAILike``
  (its default text-QA template, on the completions endpoint).

Each question's ``n_chunks`` MuSiQue passages are its vector store. It is asked
(the server learns the prompt: stored after the answer, ``learned_after_s`` later),
then, once it is stored, a new question over the same passages (retrieved in
another order). Measured on the second request: the share of
the prompt vLLM reports as cached (``usage.prompt_tokens_details``) and its
latency with one output token (TTFT), on both servers. Then, with new
questions' passages ingested through the server first
(``VLLMEngine.connect(url).encode_chunks``), the share cached on their first
request.

- **fidelity**: on the second requests' prompts, the first token's KL
  divergence (over the exact answer's top 20) from vLLM's exact answer (the
  plain server), next to client-side turbo's (``VLLMEngine.connect``, its own
  prompt) from its own exact answer;
- **exactness**: a request with no stored passage and an opted-out one
  (``{"kvrag": {"detect": false}}``), each under a fresh salt on both servers:
  the largest gap between their top-20 log-probabilities.

Examples:
    python -m kvrag_integrations.bench openai --items 10 --chunks 4 --out docs/bench
"""

from __future__ import annotations

import math
import statistics
import uuid
from typing import Any

from kvrag_integrations.bench.common import RagItem, markdown_table
from kvrag_integrations.bench.metrics import kl_top
from kvrag_integrations.bench.openai_apps import (
    Meter,
    Server,
    embeddings_for_langchain,
    embeddings_for_llama_index,
    langchain_agent,
    llama_index_engine,
    system_prompt,
)

QUICK = {"items": 3, "n_chunks": 4}
NEW_QUESTION = "Which people, places or works do these passages name?"


def run(engine: Any, items: list[RagItem], *, n_chunks: int = 4) -> dict[str, Any]:
    """The figures above; ``items``: 3 groups of questions (LangChain, LlamaIndex,
    ingestion) are taken from them, ``len(items) // 3`` each (at least one)."""
    from kvrag_integrations.vllm.launch import served_checkpoint

    _, name = served_checkpoint(None)
    per = max(1, len(items) // 3) if len(items) >= 3 else len(items)
    groups = {
        "langchain": items[:per],
        "llama_index": items[per : 2 * per] or items[:per],
        "ingested": items[2 * per : 3 * per] or items[:per],
    }
    lc_embed, li_embed = embeddings_for_langchain(), embeddings_for_llama_index()
    runs: dict[str, dict[str, Any]] = {}
    unseen = f"Spell the code {uuid.uuid4().hex} backwards."  # one text, both servers
    for kind in ("kvrag", "plain"):
        with Server(kind) as server:
            _warm_up(server, name)
            runs[kind] = _sequence(server, name, groups, n_chunks, lc_embed, li_embed)
            if kind == "kvrag":
                runs[kind]["turbo_kl"] = _client_turbo_kl(server, groups["langchain"], n_chunks)
            runs[kind]["probes"] = _probes(server, name, groups["langchain"][0], n_chunks, unseen)
    return _summary(runs, n_chunks, per)


def _warm_up(server: Server, name: str) -> None:
    """A few short requests first: vLLM's first requests are slow on any server."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    for _ in range(3):
        messages = [{"role": "user", "content": "Say hello."}]
        client.chat.completions.create(model=name, messages=messages, max_tokens=2)


def _sequence(
    server: Server,
    name: str,
    groups: dict[str, list[RagItem]],
    n_chunks: int,
    lc_embed: Any,
    li_embed: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    meter = Meter()
    for kind, build in (("langchain", langchain_agent), ("llama_index", llama_index_engine)):
        embed = lc_embed if kind == "langchain" else li_embed
        records = []
        for item in groups[kind]:
            # each application is a tenant of its own (a cache_salt): at the server's
            # defaults, learned prompts are found only by the tenant that taught them
            salt = f"bench-{kind}-{uuid.uuid4().hex}"
            chunks = item.chunks[:n_chunks]
            app = build(server.url, name, chunks, embed, meter.client(), cache_salt=salt)
            app(item.question)
            first = meter.take()
            first["learned_after_s"] = server.wait_learned(first["prompt_tokens"])
            app(NEW_QUESTION)
            records.append({"first": first, "second": meter.take()})
        out[kind] = records
    if server.kind == "kvrag":
        from kvrag_integrations.vllm import VLLMEngine

        with VLLMEngine.connect(server.url) as client:  # ingestion, apart from the application
            for item in groups["ingested"]:
                client.encode_chunks(item.chunks[:n_chunks], show_progress=False)
    records = []
    for item in groups["ingested"]:
        app = langchain_agent(server.url, name, item.chunks[:n_chunks], lc_embed, meter.client())
        app(item.question)
        records.append({"first": meter.take()})
    out["ingested"] = records
    return out


def _client_turbo_kl(server: Server, items: list[RagItem], n_chunks: int) -> list[float]:
    """Client-side turbo's first-token KL from its own exact answer (full prefill)."""
    from kvrag_integrations.vllm import VLLMEngine

    kls = []
    with VLLMEngine.connect(server.url) as client:
        for item in items:
            chunks = item.chunks[:n_chunks]
            client.encode_chunks(chunks, show_progress=False)
            args = {"question": NEW_QUESTION, "chunks": chunks[::-1], "max_new_tokens": 1}
            turbo = client.generate(**args, logprobs=20)
            full = client.generate(**args, logprobs=20, strategy="full")
            kls.append(kl_top(full.first_token_logprobs or {}, turbo.first_token_logprobs or {}))
    return kls


def _probes(
    server: Server, name: str, item: RagItem, n_chunks: int, unseen_text: str
) -> dict[str, Any]:
    """First-token top-20 log-probabilities of the second request's prompt (as the
    LangChain agent sent it), as sent and opted out, and of a prompt with no stored
    passage, each under a fresh salt where exactness is compared."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    context = "\n\n".join(item.chunks[:n_chunks][::-1])
    messages = [
        {"role": "system", "content": system_prompt(context)},
        {"role": "user", "content": NEW_QUESTION},
    ]
    unseen = [{"role": "user", "content": unseen_text}]
    salt = f"probe-{uuid.uuid4().hex}"
    out = {}
    for label, msgs, extra in (
        ("detected", messages, {}),
        ("opted_out", messages, {"kv_transfer_params": {"kvrag": {"detect": False}}}),
        ("no_passage", unseen, {}),
    ):
        if label != "detected":
            extra = {**extra, "cache_salt": salt + label}
        reply = client.chat.completions.create(
            model=name,
            messages=msgs,
            max_tokens=1,
            temperature=0,
            logprobs=True,
            top_logprobs=20,
            extra_body=extra,
        )
        top = reply.choices[0].logprobs.content[0].top_logprobs
        out[label] = {t.token: t.logprob for t in top}
    return out


def _share(record: dict[str, Any]) -> float:
    return record["cached"] / max(1, record["prompt_tokens"])


def _summary(runs: dict[str, dict[str, Any]], n_chunks: int, per: int) -> dict[str, Any]:
    ours, plain = runs["kvrag"], runs["plain"]
    frameworks = {}
    for kind in ("langchain", "llama_index"):
        mine, base = ours[kind], plain[kind]
        latency = statistics.median(r["second"]["latency_s"] for r in mine)
        base_latency = statistics.median(r["second"]["latency_s"] for r in base)
        frameworks[kind] = {
            "prompt_tokens": statistics.median(r["second"]["prompt_tokens"] for r in mine),
            "cached_share_second": statistics.median(_share(r["second"]) for r in mine),
            "cached_share_second_plain": statistics.median(_share(r["second"]) for r in base),
            "ttft_ms": 1000 * latency,
            "ttft_plain_ms": 1000 * base_latency,
            "speedup": base_latency / latency,
            "first_ttft_ms": 1000 * statistics.median(r["first"]["latency_s"] for r in mine),
            "first_ttft_plain_ms": 1000 * statistics.median(r["first"]["latency_s"] for r in base),
            "learned_after_ms": 1000
            * statistics.median(r["first"]["learned_after_s"] for r in mine),
        }
    detected_kl = [
        kl_top(b["second"]["top"], m["second"]["top"])
        for m, b in zip(ours["langchain"], plain["langchain"])
    ]
    probes, base_probes = ours["probes"], plain["probes"]
    from kvrag_integrations.bench.vllm_serving import vllm_version

    return {
        "vllm": vllm_version(),
        "questions_per_framework": per,
        "passages": n_chunks,
        "frameworks": frameworks,
        "ingested_first_request_share": statistics.median(
            _share(r["first"]) for r in ours["ingested"]
        ),
        "fidelity": {
            "detected_kl_median": statistics.median(detected_kl),
            "client_turbo_kl_median": statistics.median(ours["turbo_kl"]),
            "detected_kl": detected_kl,
            "client_turbo_kl": ours["turbo_kl"],
        },
        "exactness": {
            label: _gap(probes[label], base_probes[label]) for label in ("opted_out", "no_passage")
        },
        "raw": runs,
    }


def _gap(got: dict[str, float], want: dict[str, float]) -> float:
    common = got.keys() & want.keys()
    return max(abs(got[t] - want[t]) for t in common) if common else math.inf


def table(payload: dict[str, Any]) -> str:
    rows = []
    for kind, f in payload["frameworks"].items():
        rows.append(
            [
                kind,
                f"{f['prompt_tokens']:.0f}",
                f"{100 * f['cached_share_second']:.1f}%",
                f"{100 * f['cached_share_second_plain']:.1f}%",
                f"{f['ttft_ms']:.0f}",
                f"{f['ttft_plain_ms']:.0f}",
                f"{f['speedup']:.1f}x",
                f"{f['first_ttft_ms']:.0f} / {f['first_ttft_plain_ms']:.0f}",
            ]
        )
    head = [
        "client",
        "prompt tokens",
        "second request cached (ours)",
        "cached (vLLM alone)",
        "TTFT ms (ours)",
        "TTFT ms (vLLM alone)",
        "speedup",
        "first request ms (ours / alone)",
    ]
    fid, exact = payload["fidelity"], payload["exactness"]
    notes = (
        f"\nFirst request after ingestion through the server: "
        f"{100 * payload['ingested_first_request_share']:.1f}% cached (median).  \n"
        f"First-token KL from vLLM's exact answer: detected {fid['detected_kl_median']:.4f}, "
        f"client-side turbo {fid['client_turbo_kl_median']:.4f} (medians).  \n"
        f"Largest top-20 log-probability gap to vLLM without the connector: opted out "
        f"{exact['opted_out']:.2e}, no stored passage {exact['no_passage']:.2e}."
    )
    return markdown_table(head, rows) + "\n" + notes
