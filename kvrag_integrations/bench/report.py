"""Turn a folder of suite results into docs/benchmarks.md and the README table.

``python -m kvrag_integrations.bench report --results docs/bench`` reads the
``<suite>.json`` files the suites wrote, redraws their PNG plots from them
(next to the JSON), renders each suite's table and plots with the command and
machine that produced it, writes ``docs/benchmarks.md`` and
replaces the README block between ``<!-- bench:start -->`` and
``<!-- bench:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from kvrag_integrations.bench import (
    attention,
    cold,
    decode,
    match,
    memory,
    openai_clients,
    peer,
    plots,
    quality,
    rerank,
    scaling,
    serve_load,
    stores,
    tool_stream,
    ttft,
    vllm_serving,
)

SECTIONS = [
    ("ttft", ttft, "Time to first token by strategy"),
    ("ttft-context", ttft, "Time to first token of the blend candidates (encoding context)"),
    ("ttft-calibrated", ttft, "Time to first token with blend's calibrated settings"),
    ("ttft-calibrated-run2", ttft, "Time to first token with blend's calibrated settings (run 2)"),
    ("scaling", scaling, "TTFT vs number and length of chunks, with the query-only floor"),
    ("decode", decode, "Decoding speed at batch 1 after turbo, beside HF's generate"),
    ("quality", quality, "Speed and fidelity on MuSiQue (whole passages)"),
    ("quality-ablation", quality, "CacheBlend refinements at recompute ratio 0.15"),
    ("quality-sinks", quality, "CacheBlend on short chunks: chunk-start sinks kept or recomputed"),
    ("quality-refresh", quality, "CacheBlend on whole passages: check-layer refresh and sinks"),
    ("quality-agreement", quality, "CacheBlend: answer agreement with full as recompute nears 1"),
    ("quality-precision", quality, "Turbo from caches stored in each precision"),
    ("quality-suffix", quality, "The chunk suffix read with its chunk, or computed per request"),
    *[
        (
            f"quality-calibrated-{model}-{shape}{run}",
            quality,
            f"Blend as calibrated, held-out questions{title}: {name}, {what}",
        )
        for model, name in (("smollm2", "SmolLM2-135M"), ("gemma3", "Gemma-3-270M"))
        for shape, what in (("chunks", "10 chunks of 64 tokens"), ("passages", "10 whole passages"))
        for run, title in (("", " 0-19"), ("-run2", " 20-39"))
    ],
    (
        "quality-context-smollm2-chunks",
        quality,
        "Encoding context and selection, SmolLM2-135M, 16 chunks of 64 tokens",
    ),
    (
        "quality-context-gemma3-chunks",
        quality,
        "Encoding context and selection, Gemma-3-270M, 16 chunks of 64 tokens",
    ),
    (
        "quality-context-passages-smollm2",
        quality,
        "Encoding context and selection, SmolLM2-135M, 10 whole passages",
    ),
    (
        "quality-context-passages-gemma3",
        quality,
        "Encoding context and selection, Gemma-3-270M, 10 whole passages",
    ),
    ("attention-smollm2", attention, "Where the question's attention goes per layer, SmolLM2-135M"),
    ("attention-gemma3", attention, "Where the question's attention goes per layer, Gemma-3-270M"),
    ("peer", peer, "LlamaIndex: HuggingFaceLLM vs KVRAGLLM on the same RAG prompts"),
    ("cold", cold, "Cold requests (chunks not cached yet), the second request, leftover work"),
    ("rerank", rerank, "Reranking with document-prefix reuse (HyperRAG)"),
    ("rerank-query_likelihood", rerank, "Reranking by query likelihood (UPR) vs the retriever"),
    ("rerank-judge", rerank, "Reranking by the yes/no judge vs the retriever"),
    ("stores", stores, "Turbo from memory, disk and Redis per storage precision"),
    ("memory", memory, "Stored cache size per dtype and store read throughput"),
    ("vllm", vllm_serving, "vLLM with the KV connector: reuse, TTFT, throughput, frameworks"),
    ("vllm-blend", vllm_serving, "Blend on vLLM beside blend in process, same prompts"),
    ("vllm-blend-run2", vllm_serving, "Blend on vLLM beside blend in process (run 2)"),
    (
        "vllm-prefix-hit",
        vllm_serving,
        "vLLM: a prompt loaded from the store against vLLM's own prefix hit",
    ),
    (
        "openai",
        openai_clients,
        "Plain OpenAI clients (ChatOpenAI, OpenAILike) against the server, and vLLM alone",
    ),
    ("serve", serve_load, "Load: our server against vLLM alone (vllm bench serve), and a flood"),
    ("serve-run2", serve_load, "Load, a second run apart from the first"),
    ("match", match, "Finding stored entries inside a prompt: the content index"),
    ("tools", tool_stream, "Tool calls streamed: each family's detector on a long argument"),
]
# The PNG files each suite writes next to its JSON (``<name><suffix>.png``).
PLOTS = {
    "ttft": [""],
    "scaling": ["-chunks", "-length"],
    "quality": ["-tradeoff"],
    "peer": [""],
    "serve": [""],
    "serve-run2": [""],
}
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


# ``scaling --preset gpu`` results, one per model: ``gpu-scaling-<model>.json``
# (``decode --preset gpu``'s: ``gpu-decode-<model>.json``), after their suite's section.
GPU_PREFIX = "gpu-scaling-"
GPU_DECODE_PREFIX = "gpu-decode-"


def load(results: Path) -> dict[str, dict[str, Any]]:
    """The suite payloads found in ``results`` (missing suites are left out); GPU
    scaling results follow the scaling section."""
    found = {}
    for name, _, _ in SECTIONS:
        path = results / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
        prefix = {"scaling": GPU_PREFIX, "decode": GPU_DECODE_PREFIX}.get(name)
        if prefix is not None:
            for gpu in sorted(results.glob(f"{prefix}*.json")):
                found[gpu.stem] = json.loads(gpu.read_text())
    return found


def section_of(name: str, payload: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The suite module that renders result ``name``, and its section title."""
    if name.startswith(GPU_PREFIX):
        model = (payload or {}).get("machine", {}).get("model") or name[len(GPU_PREFIX) :]
        return scaling, f"On a GPU: TTFT from 16 to 128 chunks, {model}"
    if name.startswith(GPU_DECODE_PREFIX):
        model = (payload or {}).get("machine", {}).get("model") or name[len(GPU_DECODE_PREFIX) :]
        return decode, f"On a GPU: decoding at batch 1 after turbo, {model}"
    return next((m, t) for n, m, t in SECTIONS if n == name)


def _machine(payload: dict[str, Any]) -> str:
    m = payload.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpu', '?')} CPU, {m.get('cpu_threads', '?')} threads"
    return (
        f"{m.get('model', '?')} ({m.get('dtype', '?')}) on {where}; torch {m.get('torch', '?')}, "
        f"transformers {m.get('transformers', '?')}; {m.get('date', '?')}"
    )


def images(name: str, results: Path, page: Path) -> list[str]:
    """The suite's PNG files present in ``results``, as links relative to ``page``."""
    found = [results / f"{name}{suffix}.png" for suffix in PLOTS.get(name, [])]
    return [Path(os.path.relpath(p, page.parent)).as_posix() for p in found if p.is_file()]


def section(name: str, payload: dict[str, Any], pictures: list[str] = ()) -> str:
    """One suite's table, its plots and its provenance."""
    module, title = section_of(name, payload)
    lines = [f"## {title}", "", module.table(payload), ""]
    lines += [f"![{name}]({link})\n" for link in pictures]
    lines += [
        f"Command: `{payload.get('command', '?')}`  ",
        f"Machine: {_machine(payload)}  ",
    ]
    skip = {"results", "machine", "command"}
    facts = {k: v for k, v in payload.items() if k not in skip and not isinstance(v, (list, dict))}
    if facts:
        lines.append("Setup: " + ", ".join(f"{k}={_fmt(v)}" for k, v in facts.items()))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def readme_block(
    found: dict[str, dict[str, Any]], results: Path | None = None, readme: Path | None = None
) -> str:
    """The README's benchmark summary: TTFT, an 8B model on a GPU, the stores, the
    peer comparison, quality and vLLM, when measured."""
    parts = []
    shown = ("ttft", "gpu-scaling-llama-3.1-8b", "stores", "peer", "quality", "vllm", "openai")
    for name in shown:
        if name in found:
            pics = images(name, results, readme) if results and readme else []
            parts.append(section(name, found[name], pics[:1]).replace("## ", "### ", 1))
    parts.append("More, and how each number is measured: [docs/benchmarks.md](docs/benchmarks.md).")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag_integrations.bench report")
    parser.add_argument("--results", default="docs/bench", help="folder of <suite>.json files")
    parser.add_argument("--docs", default="docs/benchmarks.md")
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--no-plots", action="store_true", help="do not redraw the PNG files")
    args = parser.parse_args(argv)
    results = Path(args.results)
    found = load(results)
    if not found:
        raise SystemExit(f"no suite results in {args.results}")
    if not args.no_plots and plots.available():  # redraw from the JSON: always in step
        for name, payload in found.items():
            module, _ = section_of(name)
            if name in PLOTS and hasattr(module, "plot"):
                module.plot(payload, results, name)
    docs = Path(args.docs)
    head = docs.read_text().split(START)[0] if docs.is_file() else "# Benchmarks\n\n"
    body = "\n\n".join(section(n, p, images(n, results, docs)) for n, p in found.items())
    docs.write_text(f"{head.rstrip()}\n\n{START}\n{body}\n{END}\n")
    readme = Path(args.readme)
    text = readme.read_text()
    if START in text and END in text:
        block = f"{START}\n{readme_block(found, results, readme)}\n{END}"
        pattern = re.escape(START) + ".*?" + re.escape(END)
        readme.write_text(re.sub(pattern, lambda _: block, text, flags=re.S))
    print(f"wrote {docs} and the README table from {len(found)} suites")
