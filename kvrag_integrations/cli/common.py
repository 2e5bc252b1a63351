"""What the subcommands share: options, the engine, the Chroma collection, errors."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvrag_integrations.chunk_kv import DEFAULT_PRECISION, PRECISIONS
from kvrag_integrations.errors import KVRAGError
from kvrag_integrations.store import KVStore
from kvrag_integrations.store.url import STORE_URL_FORMS, open_store

DEFAULT_CHROMA = os.path.join(".", "kvrag_data", "chroma")
DEFAULT_STORE = "disk:" + os.path.join(".", "kvrag_data", "kv")


class CLIError(KVRAGError, ValueError):
    """Bad command-line input (a missing path, an empty collection, ...): exit code 2."""


def add_store_option(parser: argparse.ArgumentParser) -> None:
    """``--store URL``: where chunk KV caches live."""
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        metavar="URL",
        help=f"KV cache store: {STORE_URL_FORMS} (default: {DEFAULT_STORE})",
    )


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device`` and ``--cache-precision``: the model whose caches are
    made or used, and how they are stored."""
    parser.add_argument(
        "--model", default=None, help="HF id, local path or .gguf (default: bundled SmolLM2)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, auto (default: cpu)")
    parser.add_argument(
        "--cache-precision",
        default=DEFAULT_PRECISION,
        choices=PRECISIONS,
        help="how chunk caches are stored (default: float16; model = full precision)",
    )


def add_chroma_options(parser: argparse.ArgumentParser) -> None:
    """``--collection``, ``--chroma`` and ``--chroma-host``/``--chroma-port``."""
    parser.add_argument("--collection", required=True, help="Chroma collection name")
    parser.add_argument(
        "--chroma",
        default=DEFAULT_CHROMA,
        metavar="DIR",
        help=f"persistent Chroma directory (default: {DEFAULT_CHROMA})",
    )
    parser.add_argument("--chroma-host", default=None, help="a Chroma server instead of --chroma")
    parser.add_argument("--chroma-port", type=int, default=8000, help="its port (default: 8000)")


def store_from(args: argparse.Namespace) -> KVStore:
    """The store ``--store`` names (``StoreURLError`` for an unknown form)."""
    return open_store(args.store)


def engine_from(args: argparse.Namespace, store: KVStore) -> Any:
    """A ``KVRAGEngine`` over ``store`` with the process-wide shared weights.

    The weights come from ``KVRAGEngine.shared`` (loaded once per process), so
    calling the command line many times in one process loads the model once.
    """
    from kvrag_integrations.engine.engine import KVRAGEngine

    base = KVRAGEngine.shared(args.model, device=args.device)
    precision = getattr(args, "cache_precision", DEFAULT_PRECISION)
    return KVRAGEngine(base.loaded, store=store, cache_precision=precision)


def chroma_client(args: argparse.Namespace, *, create: bool) -> Any:
    """The Chroma client ``--chroma`` / ``--chroma-host`` name.

    Args:
        args: parsed options.
        create: make the persistent directory if it is missing (ingest); otherwise
            a missing directory is a ``CLIError`` (ask).
    """
    import chromadb

    if args.chroma_host:
        return chromadb.HttpClient(host=args.chroma_host, port=args.chroma_port)
    path = Path(args.chroma)
    if not create and not path.is_dir():
        raise CLIError(f"no Chroma directory at {path}; run `kvrag ingest` first")
    return chromadb.PersistentClient(path=str(path))


def get_collection(client: Any, name: str, *, create: bool) -> Any:
    """The collection ``name``; a ``CLIError`` if it is missing (unless ``create``) or invalid."""
    try:
        if create:
            return client.get_or_create_collection(name)
        return client.get_collection(name)
    except Exception as exc:  # chromadb's error types differ between versions
        kind = type(exc).__name__
        if "does not exist" in str(exc) or kind == "NotFoundError":
            raise CLIError(f"collection {name!r} does not exist; run `kvrag ingest` first") from exc
        if kind == "InvalidArgumentError":
            raise CLIError(f"bad collection name {name!r}: {exc}") from exc
        raise


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    Examples:
        >>> human_bytes(0), human_bytes(1536), human_bytes(3 * 2**30)
        ('0 B', '1.5 KiB', '3.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
