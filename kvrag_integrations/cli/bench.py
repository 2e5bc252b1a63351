"""``kvrag bench ...``: the benchmark suites (``python -m kvrag_integrations.bench``)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvrag bench``; everything after ``bench`` goes to the benchmark's own parser."""
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark suite: ttft, quality, rerank or report",
        description="Arguments as for `python -m kvrag_integrations.bench` (`kvrag bench -h`).",
        add_help=False,  # -h/--help belongs to the benchmark's parser
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Forward ``args.args`` to the benchmark entry point; returns its exit code."""
    return forward(args.args)


def forward(argv: list[str]) -> int:
    """Run ``kvrag_integrations.bench.__main__.main(argv)`` and return an exit code."""
    from kvrag_integrations.bench.__main__ import main as bench_main

    try:
        bench_main(list(argv))
    except SystemExit as exc:  # argparse errors (2) and --help (0) of the benchmark
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
