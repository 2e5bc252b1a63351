"""``python -m kvrag_integrations.bench <suite>``: run a benchmark suite.

Suites: ``ttft`` (TTFT of every strategy), ``quality`` (speed and fidelity to
full prefill, F1 against gold), ``rerank`` (reranker throughput with and
without reuse, recall@3). Each writes ``<suite>.json`` (numbers + machine
facts + the command) and ``<suite>.md`` (a table) under ``--out``.
``report`` turns a results folder into docs/benchmarks.md and the README table.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvrag_integrations.bench import quality, report, rerank, ttft
from kvrag_integrations.bench.common import load_items, machine_info, write_results
from kvrag_integrations.engine.engine import KVRAGEngine

SUITES = {"ttft": ttft, "quality": quality, "rerank": rerank}


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["report"]:
        report.main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m kvrag_integrations.bench")
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--model", default=None, help="HF id, path or .gguf (default: SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--data", default=None, help="MuSiQue-format JSON (default: ../shared/data)"
    )
    parser.add_argument("--items", type=int, default=5, help="questions to run")
    parser.add_argument("--chunks", type=int, default=None, help="chunks (candidates) per prompt")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="trim chunks to N tokens")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")
    parser.add_argument(
        "--preset", default=None, help="strategy set: default, or ablation (quality only)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 items, tiny chunks")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.repeats, args.chunks, args.chunk_tokens = 2, 1, 3, 64
    # Unset options keep each suite's own defaults (see each suite's run()).
    given = {"n_chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "repeats": args.repeats}
    options = {k: v for k, v in given.items() if v is not None}
    if args.preset is not None:
        presets = getattr(SUITES[args.suite], "PRESETS", {})
        if args.preset not in presets:
            parser.error(f"suite {args.suite} has no preset {args.preset!r} ({sorted(presets)})")
        options["strategies"] = presets[args.preset]

    engine = KVRAGEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    items = load_items(args.data, args.items)
    suite = SUITES[args.suite]
    payload = suite.run(engine, items, **options)
    payload["machine"] = machine_info(engine)
    payload["command"] = "python -m kvrag_integrations.bench " + " ".join(argv)
    text = suite.table(payload)
    name = args.suite if args.preset in (None, "default") else f"{args.suite}-{args.preset}"
    path = write_results(args.out, name, payload, text)
    print(text)
    print(f"\n{json.dumps(payload['machine'])}\nresults: {path}")


if __name__ == "__main__":
    main()
