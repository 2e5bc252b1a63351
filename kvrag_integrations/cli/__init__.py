"""The ``kvrag`` command line: ingest, ask, bench, store, calibrate.

Each subcommand is a module with ``register(subparsers)``, which adds its parser
and sets ``func`` (``Namespace -> int`` exit code) with ``set_defaults``. To add
one, write such a module and list it in ``SUBCOMMANDS``.

Errors the user can fix (a missing path, an unknown store URL, an empty
collection, a bad option value) end with a one-line message on stderr and exit
code 2, never a traceback.

Examples:
    >>> main(["store", "stats", "--store", "s3://nowhere"])
    2
"""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType

from kvrag_integrations.cli import ask, bench, calibrate, ingest, store
from kvrag_integrations.errors import KVRAGError
from kvrag_integrations.store.url import redact_url
from kvrag_integrations.train import cli as train

SUBCOMMANDS: list[ModuleType] = [
    ingest,
    ask,
    bench,
    store,
    calibrate,
    train,
]

PROG = "kvrag"


def build_parser() -> argparse.ArgumentParser:
    """The ``kvrag`` parser with every module of ``SUBCOMMANDS`` registered."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fast RAG with precomputed KV caches (TurboRAG, CacheBlend) on local models.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log warnings and info")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``kvrag`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after it, -h included, is the benchmark's
        return bench.forward(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad usage, 0 for --help
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (KVRAGError, ValueError, ImportError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. a store or Chroma server that cannot be reached
        if args.verbose:
            raise
        print(f"{PROG}: error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = redact_url(" ".join(str(exc).split()))  # a store URL may carry a password
    return text or type(exc).__name__


__all__ = ["PROG", "SUBCOMMANDS", "build_parser", "main"]
