"""``kvrag ingest``: text and markdown files into a Chroma collection, with KV caches."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from kvrag_integrations.cli.common import (
    CLIError,
    add_chroma_options,
    add_model_options,
    add_store_option,
    chroma_client,
    engine_from,
    get_collection,
    human_bytes,
    store_from,
)

SUFFIXES = (".txt", ".md", ".markdown")
SHA_FIELD = "kvrag_doc_sha"  # what a node's document was made from (text + chunking)
PATH_FIELD = "file_path"
_HIDDEN = (PATH_FIELD, "file_name", SHA_FIELD)  # kept out of the LLM and embedding text


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvrag ingest``."""
    parser = subparsers.add_parser(
        "ingest",
        help="split, embed and KV-cache .txt/.md files into a Chroma collection",
        description=(
            "Split files (or folders, recursively) of .txt/.md with LlamaIndex's "
            "SentenceSplitter, embed them with the packaged MiniLM and store each "
            "chunk's KV cache (KVCacheTransform) next to a Chroma collection. "
            "Running it again skips unchanged files and reuses stored caches."
        ),
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders")
    add_chroma_options(parser)
    add_store_option(parser)
    add_model_options(parser)
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    parser.add_argument("--chunk-overlap", type=int, default=20, help="tokens shared by chunks")
    parser.add_argument("--batch-size", type=int, default=8, help="chunks per forward")
    parser.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="encode through a vLLM server with the connector (python -m "
        "kvrag_integrations.vllm.serve): its store keeps the caches, and its plain "
        "OpenAI clients find them from their first request (--store, --model unused)",
    )
    parser.add_argument("--api-key", default=None, help="the server's API key, if it has keys")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def find_files(paths: list[str]) -> list[Path]:
    """The .txt/.md files named or found (recursively, hidden folders skipped).

    Raises:
        CLIError: a path is missing, a named file has another type, or nothing is found.
    """
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise CLIError(f"no such file or folder: {raw}")
        if path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise CLIError(f"{raw} is not a text or markdown file ({', '.join(SUFFIXES)})")
            found[path.resolve()] = None
            continue
        for child in sorted(path.rglob("*")):
            rel = child.relative_to(path).parts
            hidden = any(part.startswith(".") for part in rel)
            if not hidden and child.is_file() and child.suffix.lower() in SUFFIXES:
                found[child.resolve()] = None
    if not found:
        raise CLIError(f"no {'/'.join(SUFFIXES)} files in {' '.join(paths)}")
    return list(found)


@dataclass
class Tally:
    """What one ingest run did."""

    new: int = 0
    changed: int = 0
    unchanged: int = 0
    skipped: int = 0  # empty files
    chunks: int = 0
    tokens: int = 0


def run(args: argparse.Namespace) -> int:
    """Ingest ``args.paths``; prints a summary line, returns the exit code."""
    if args.chunk_size <= 0 or not 0 <= args.chunk_overlap < args.chunk_size:
        raise CLIError("need --chunk-size > 0 and 0 <= --chunk-overlap < --chunk-size")
    started = time.perf_counter()
    files = find_files(args.paths)
    collection = get_collection(chroma_client(args, create=True), args.collection, create=True)
    if args.server:
        from kvrag_integrations.vllm import VLLMEngine

        store, engine = None, VLLMEngine.connect(args.server, api_key=args.api_key)
    else:
        store = store_from(args)
        engine = engine_from(args, store)
    pipeline = _pipeline(engine, collection, args)
    tally, keys = Tally(), set()
    bar = tqdm(files, desc="Ingesting", unit="file", disable=args.no_progress, file=sys.stderr)
    try:
        with bar:
            for path in bar:
                keys |= _ingest_file(path, engine, collection, pipeline, args, tally)
    finally:
        if store is None:
            engine.close()
    if store is None:
        where = f"(stored by {args.server})"
    else:
        cached = sum(info.nbytes for info in store.entries() if info.key in keys)
        where = f"({store.stats.writes} written), {human_bytes(cached)} cached"
    print(
        f"ingested {len(files)} files ({tally.new} new, {tally.changed} changed, "
        f"{tally.unchanged} unchanged, {tally.skipped} empty) into {args.collection!r}: "
        f"{tally.chunks} chunks, {tally.tokens} tokens, {len(keys)} caches "
        f"{where}, {time.perf_counter() - started:.1f} s"
    )
    return 0


def _pipeline(engine: Any, collection: Any, args: argparse.Namespace) -> Any:
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from kvrag_integrations.llama_index import KVCacheTransform, MiniLMEmbedding

    tokenizer = engine.tokenizer
    splitter = SentenceSplitter(
        chunk_size=args.chunk_size,
        chunk_overlap=args.chunk_overlap,
        # chunk sizes in the model's own tokens; node ids stable per document
        tokenizer=lambda text: tokenizer.encode(text, add_special_tokens=False),
        id_func=lambda i, doc: f"{doc.id_}#{i}",
    )
    return IngestionPipeline(
        transformations=[
            splitter,
            MiniLMEmbedding(),
            KVCacheTransform(engine, batch_size=args.batch_size),
        ],
        vector_store=ChromaVectorStore(chroma_collection=collection),
    )


def _doc_sha(text: str, args: argparse.Namespace) -> str:
    recipe = {"text": text, "chunk_size": args.chunk_size, "chunk_overlap": args.chunk_overlap}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _ingest_file(
    path: Path,
    engine: Any,
    collection: Any,
    pipeline: Any,
    args: argparse.Namespace,
    tally: Tally,
) -> set[str]:
    """Ingest one file unless it is unchanged; returns the cache keys of its chunks."""
    from llama_index.core import Document

    from kvrag_integrations.llama_index._nodes import llm_texts

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    if not text.strip():
        tally.skipped += 1
        return set()
    doc_id, sha = str(path), _doc_sha(text, args)
    stored = collection.get(where={"document_id": doc_id}, include=["metadatas", "documents"])
    if stored["ids"] and all(m.get(SHA_FIELD) == sha for m in stored["metadatas"]):
        # Unchanged: keep its nodes; make sure their caches exist for this model.
        tally.unchanged += 1
        refs = engine.encode_chunks(
            stored["documents"], batch_size=args.batch_size, show_progress=False
        )
    else:
        if stored["ids"]:
            tally.changed += 1
            collection.delete(where={"document_id": doc_id})
        else:
            tally.new += 1
        doc = Document(
            id_=doc_id,
            text=text,
            metadata={PATH_FIELD: doc_id, "file_name": path.name, SHA_FIELD: sha},
            excluded_llm_metadata_keys=list(_HIDDEN),
            excluded_embed_metadata_keys=list(_HIDDEN),
        )
        nodes = pipeline.run(documents=[doc], show_progress=False)
        refs = engine.encode_chunks(
            llm_texts(nodes), batch_size=args.batch_size, show_progress=False
        )
    tally.chunks += len(refs)
    tally.tokens += sum(ref.num_tokens for ref in refs)
    return {ref.key for ref in refs}
