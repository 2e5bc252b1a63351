"""``python -m kvrag_integrations.bench <suite>``: run a benchmark suite (or ``all``).

Suites: ``ttft`` (TTFT of every strategy), ``scaling`` (TTFT against the number
and length of chunks, with the query-only floor), ``decode`` (ms per decoded
token at batch 1 after turbo at ~4k and ~16k prompt tokens, beside HF's
``generate``), ``quality`` (speed and
fidelity to full prefill, F1 and log-likelihood against gold), ``attention``
(where the question's attention over reused chunks goes, per layer), ``rerank``
(reranker throughput with and without reuse, recall@1/@3; one file per ``--scoring``), ``peer``
(LlamaIndex's HuggingFaceLLM against KVRAGLLM), ``memory`` (stored bytes per
token and store read throughput), ``cold`` (a request on uncached chunks: KVRAGLLM
against plain prefill and HuggingFaceLLM), ``stores`` (turbo TTFT from memory, disk
and Redis per storage precision), ``cluster`` (load throughput of 8 readers, turbo
TTFT and capacity on one Redis server and on a Redis Cluster of 1 and 3 primaries,
started here; run by name), ``vllm`` (vLLM with the KV connector against vLLM
alone and the in-process engine: reuse, TTFT, throughput, the frameworks on it;
needs vLLM installed), ``openai`` (plain OpenAI clients, LangChain's ``ChatOpenAI``
and LlamaIndex's ``OpenAILike``, against the server with and without the connector;
needs vLLM), ``serve`` (load: our server against vLLM's own at several concurrencies,
by vLLM's serving benchmark, and beside a flooding client; needs vLLM), ``match``
(the content index that finds stored entries inside a prompt: cover time, build,
log replay, memory; no model: ``--chunks`` entries, ``--repeats`` prompts),
``tools`` (CPU time of each tool family's streaming detector on a call with a
long argument; no model). ``all`` runs them in that order on one loaded model
(``vllm``, ``openai``, ``serve``, ``match`` and ``tools`` apart: they are run by
name). Each writes ``<suite>.json`` (numbers + machine facts + the command),
``<suite>.md`` (a table) and its PNG plots under ``--out``.
``--quick`` shrinks every suite to a smoke run (a few items, tiny chunks).
``--dummy-weights`` makes ``--model`` a named shape (``llama-3.1-8b``, ...: see
``bench/shapes.py``) with random weights, for timings without a download.
``scaling --preset gpu`` writes ``gpu-scaling-<model>`` files, into docs/bench
on a CUDA device. ``report`` turns a results folder into docs/benchmarks.md
and the README table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import time
from contextlib import ExitStack
from types import ModuleType
from typing import Any

from kvrag_integrations.bench import (
    attention,
    cluster,
    cold,
    decode,
    match,
    memory,
    openai_clients,
    peer,
    plots,
    quality,
    report,
    rerank,
    scaling,
    serve_load,
    shapes,
    stores,
    tool_stream,
    ttft,
    vllm_serving,
)
from kvrag_integrations.bench.common import (
    load_items,
    machine_info,
    resolve_device,
    write_results,
)
from kvrag_integrations.engine.engine import KVRAGEngine

SUITES: dict[str, ModuleType] = {
    "ttft": ttft,
    "scaling": scaling,
    "decode": decode,
    "quality": quality,
    "attention": attention,
    "rerank": rerank,
    "peer": peer,
    "memory": memory,
    "cold": cold,
    "stores": stores,
    "cluster": cluster,
    "vllm": vllm_serving,
    "openai": openai_clients,
    "serve": serve_load,
    "match": match,
    "tools": tool_stream,
}
# Suites that load no model (nor benchmark data): run by name only.
MODEL_FREE = {"match", "tools"}
# What ``all`` runs on one model: every suite but those that need more than the
# package (vLLM) and those that need no model.
ALL = [
    name
    for name in SUITES
    if name not in ("vllm", "openai", "serve", "cluster") and name not in MODEL_FREE
]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvrag_integrations.bench")
    p.add_argument("suite", choices=[*SUITES, "all"])
    p.add_argument("--model", default=None, help="HF id, path or .gguf (default: SmolLM2)")
    p.add_argument(
        "--dummy-weights",
        action="store_true",
        help=f"--model is a shape ({', '.join(shapes.SHAPES)}) with random weights: timings only",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, ...")
    p.add_argument("--dtype", default=None)
    p.add_argument("--data", default=None, help="MuSiQue-format JSON (default: ../shared/data)")
    p.add_argument("--items", type=int, default=None, help="questions to run (default 5)")
    p.add_argument(
        "--first-item",
        type=int,
        default=0,
        help="skip the data's questions before this one (questions a calibration never saw)",
    )
    p.add_argument("--chunks", type=int, default=None, help="chunks (candidates) per prompt")
    p.add_argument("--chunk-tokens", type=int, default=None, help="trim chunks to N tokens")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    p.add_argument(
        "--ratios", type=_floats, default=None, help="blend recompute ratios, e.g. 0.05,0.15"
    )
    p.add_argument("--counts", type=_ints, default=None, help="scaling: chunk counts, e.g. 1,2,4")
    p.add_argument(
        "--lengths",
        type=_ints,
        default=None,
        help="scaling: chunk lengths (tokens); vllm prefix-hit, decode: prompt lengths; "
        "tools: argument sizes (KB)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="quality/peer/vllm: answer length; decode: tokens decoded",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="quality: default, ablation, sinks, refresh, agreement, precision or suffix; "
        "ttft: context; scaling: gpu (16, 64, 128 chunks x 256 tokens, turbo per store); "
        "decode: gpu (~4k and ~16k tokens)",
    )
    p.add_argument(
        "--no-loglik", action="store_true", help="quality: skip the gold log-likelihood prefill"
    )
    p.add_argument("--scoring", default=None, help="rerank: judge or query_likelihood")
    p.add_argument("--vllm", action="store_true", help="rerank: add a vLLM column")
    p.add_argument(
        "--vllm-url",
        default=None,
        help="rerank: the vLLM column on a running server (VLLMEngine.connect; its store "
        "empty, for the cold figure), scored over HTTP",
    )
    p.add_argument(
        "--parts",
        type=_names,
        default=None,
        help="vllm: the parts to run (ttft, throughput, agreement, frameworks, prefix-hit)",
    )
    p.add_argument(
        "--concurrencies", type=_ints, default=None, help="serve: requests at once, e.g. 1,4,16"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="serve: requests at each concurrency (default: max(24, 4 x concurrency))",
    )
    p.add_argument(
        "--flood-concurrency",
        type=int,
        default=None,
        help="serve: the flooding client's requests in flight (0: no abuse run)",
    )
    p.add_argument(
        "--flood-kinds",
        type=_names,
        default=None,
        help="serve: what the flooder sends, e.g. prefix (default: glue,prefix,save,beam,salts)",
    )
    p.add_argument(
        "--servers", type=_names, default=None, help="serve: kvrag, plain or both (default)"
    )
    p.add_argument(
        "--api-server-count", type=int, default=None, help="serve: our server's API processes"
    )
    p.add_argument(
        "--filled",
        type=_ints,
        default=None,
        help="decode: also time one step at these filled lengths inside one bucket",
    )
    p.add_argument(
        "--static-on-cpu",
        action="store_true",
        help="decode: time the static decode on CPU too (opt-in there; CUDA takes it by default)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 2 items, tiny sizes")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG files")
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default bench_results; gpu preset on CUDA: docs/bench)",
    )
    p.add_argument(
        "--tag", default=None, help="append to the result files' name (runs side by side)"
    )
    return p


def suite_options(
    module: ModuleType, args: argparse.Namespace, vllm_engine: Any = None
) -> dict[str, Any]:
    """The suite's ``run`` keyword arguments: the preset's sizes, its ``QUICK`` sizes,
    then what was given (``vllm_engine``: a running one, for the suites that take it)."""
    options = preset_options(module, args)
    given = {
        "n_chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "counts": args.counts,
        "lengths": args.lengths,
        "max_new_tokens": args.max_new_tokens,
        "loglik": False if args.no_loglik else None,
        "scoring": args.scoring,
        "vllm": True if args.vllm else None,
        "parts": args.parts,
        "static_on_cpu": True if getattr(args, "static_on_cpu", False) else None,
        "filled": getattr(args, "filled", None),
        "concurrencies": getattr(args, "concurrencies", None),
        "requests": getattr(args, "requests", None),
        "flood_concurrency": getattr(args, "flood_concurrency", None),
        "flood_kinds": getattr(args, "flood_kinds", None),
        "servers": getattr(args, "servers", None),
        "api_server_count": getattr(args, "api_server_count", None),
        "vllm_engine": vllm_engine,
    }
    if args.ratios is not None:
        given["strategies"] = [("full", {}), ("turbo", {})]
        given["strategies"] += [("blend", {"recompute_ratio": r}) for r in args.ratios]
    if args.preset not in (None, "default"):
        given["strategies"] = module.PRESETS[args.preset]
    options.update({k: v for k, v in given.items() if v is not None})
    accepted = set(inspect.signature(module.run).parameters) - {"engine", "items"}
    return {k: v for k, v in options.items() if k in accepted}


def preset_options(module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """Sizes the preset sets (``PRESET_OPTIONS``), then ``--quick``'s (``QUICK``, and
    the preset's own smoke sizes, ``QUICK_PRESET``)."""
    preset = args.preset if args.preset not in (None, "default") else None
    options: dict[str, Any] = {}
    if preset:
        options.update(getattr(module, "PRESET_OPTIONS", {}).get(preset, {}))
    if args.quick:
        options.update(getattr(module, "QUICK", {}))
        if preset:
            options.update(getattr(module, "QUICK_PRESET", {}).get(preset, {}))
    return options


def result_name(name: str, args: argparse.Namespace, engine: KVRAGEngine) -> str:
    """``<suite>[-<preset>][-<scoring>][-<tag>]``; the gpu preset's is
    ``gpu-<suite>-<model>`` (what ``bench report`` renders as a GPU section)."""
    if args.preset == "gpu":
        model = args.model or engine.model_name
        out_name = f"gpu-{name}-" + re.sub(r"[^A-Za-z0-9.]+", "-", str(model)).strip("-").lower()
    else:
        out_name = name if args.preset in (None, "default") else f"{name}-{args.preset}"
    if name == "rerank" and args.scoring:  # one result file per scoring, side by side
        out_name = f"{out_name}-{args.scoring}"
    if args.parts:  # some parts only: never over the whole suite's file
        out_name = f"{out_name}-{'-'.join(args.parts)}"
    if args.tag:  # e.g. one file per model or prompt shape
        out_name = f"{out_name}-{args.tag}"
    return out_name


def out_dir(args: argparse.Namespace, engine: KVRAGEngine) -> str:
    """``--out``; by default docs/bench for the gpu preset on CUDA (published
    figures), bench_results otherwise (never GPU files measured elsewhere)."""
    if args.out is not None:
        return args.out
    if args.preset == "gpu" and engine.device.type == "cuda":
        return "docs/bench"
    return "bench_results"


def run_suite(
    name: str,
    engine: KVRAGEngine | None,
    items: list,
    args: argparse.Namespace,
    command: str,
    vllm_engine: Any = None,
) -> None:
    """Run one suite, write its JSON, Markdown table and plots, print the table."""
    module = SUITES[name]
    started = time.perf_counter()
    if args.quick and args.items is None:  # a suite's smoke run may need fewer questions
        items = items[: getattr(module, "QUICK", {}).get("items", len(items))]
    payload = module.run(engine, items, **suite_options(module, args, vllm_engine))
    payload["suite_s"] = round(time.perf_counter() - started, 1)
    payload["machine"] = machine_info(engine)
    payload["command"] = command
    text = module.table(payload)
    out_name = result_name(name, args, engine)
    path = write_results(out_dir(args, engine), out_name, payload, text)
    pngs = []
    plot = not args.no_plots and args.preset in (None, "default") and hasattr(module, "plot")
    if plot and plots.available():
        pngs = module.plot(payload, path.parent, out_name)
    print(f"\n## {out_name}\n\n{text}")
    print(f"results: {path}" + "".join(f"\nplot: {p}" for p in pngs))


def main(argv: list[str] | None = None, *, vllm_engine: Any = None) -> None:
    """Run ``argv``'s suite. ``vllm_engine``: a running ``VLLMEngine`` of the model
    that the ``vllm`` suite (and ``rerank``'s vLLM column) measure instead of
    starting one (the tests pass their session's)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["report"]:
        report.main(argv[1:])
        return
    p = parser()
    args = p.parse_args(argv)
    names = ALL if args.suite == "all" else [args.suite]
    custom = args.preset not in (None, "default")
    if custom and (
        args.suite == "all" or args.preset not in SUITES[args.suite].__dict__.get("PRESETS", {})
    ):
        p.error(f"suite {args.suite} has no preset {args.preset!r}")
    if args.dummy_weights and args.model not in shapes.SHAPES:
        p.error(f"--dummy-weights needs --model one of {', '.join(shapes.SHAPES)}")
    command = "python -m kvrag_integrations.bench " + " ".join(argv)
    if args.suite in MODEL_FREE:
        run_suite(args.suite, None, [], args, command)
        return
    device = resolve_device(args.device)
    if args.dummy_weights:
        engine = KVRAGEngine(shapes.dummy_model(args.model, device, args.dtype))
    else:
        engine = KVRAGEngine.shared(args.model, device=device, dtype=args.dtype)
    count = args.items
    if count is None and args.suite != "all":
        count = preset_options(SUITES[args.suite], args).get("items")
    if count is None:
        count = 2 if args.quick else 5
    items = load_items(args.data, count + args.first_item if count else None)[args.first_item :]
    with ExitStack() as opened:
        if args.vllm_url and vllm_engine is None:
            from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

            vllm_engine = opened.enter_context(VLLMEngine.connect(args.vllm_url))
        for name in names:
            run_suite(name, engine, items, args, command, vllm_engine)
    print(f"\n{json.dumps(machine_info(engine))}")


if __name__ == "__main__":
    main()
