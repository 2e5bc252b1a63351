"""``python -m kvrag_integrations.bench <suite>``: run a benchmark suite.

Writes ``<suite>.json`` (numbers + machine facts) and ``<suite>.md`` (a table)
under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json

from kvrag_integrations.bench import quality, ttft
from kvrag_integrations.bench.common import load_items, machine_info, write_results
from kvrag_integrations.engine.engine import KVRAGEngine

SUITES = {"ttft": ttft, "quality": quality}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvrag_integrations.bench")
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--model", default=None, help="HF id, path or .gguf (default: SmolLM2)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--data", default=None, help="MuSiQue-format JSON (default: ../shared/data)"
    )
    parser.add_argument("--items", type=int, default=5, help="questions to run")
    parser.add_argument("--chunks", type=int, default=10, help="chunks per prompt")
    parser.add_argument(
        "--chunk-tokens", type=int, default=None, help="trim chunks (ttft: 300, quality: whole)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 item, 1 repeat")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.repeats, args.chunks, args.chunk_tokens = 1, 1, 3, 64
    options = {"n_chunks": args.chunks, "repeats": args.repeats}
    if args.chunk_tokens is not None:
        options["chunk_tokens"] = args.chunk_tokens

    engine = KVRAGEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    items = load_items(args.data, args.items)
    suite = SUITES[args.suite]
    payload = suite.run(engine, items, **options)
    payload["machine"] = machine_info(engine)
    payload["command"] = "python -m kvrag_integrations.bench " + " ".join(argv or [])
    text = suite.table(payload)
    path = write_results(args.out, args.suite, payload, text)
    print(text)
    print(f"\n{json.dumps(payload['machine'])}\nresults: {path}")


if __name__ == "__main__":
    main()
