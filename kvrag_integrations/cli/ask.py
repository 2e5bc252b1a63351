"""``kvrag ask``: retrieve from a collection and stream an answer that reuses KV caches."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvrag_integrations.cli.common import (
    CLIError,
    add_chroma_options,
    add_model_options,
    add_store_option,
    chroma_client,
    engine_from,
    get_collection,
    store_from,
)
from kvrag_integrations.engine.modeling.generate import SamplingParams
from kvrag_integrations.engine.prompting.segments import check_text
from kvrag_integrations.engine.strategies import DEFAULT_STRATEGY, STRATEGIES

_SOURCE_FIELD = "file_path"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvrag ask``."""
    parser = subparsers.add_parser(
        "ask",
        help="answer a question over a collection, streaming, with TTFT and reuse stats",
        description=(
            "Retrieve the top-k chunks of a collection made by `kvrag ingest`, build "
            "the prompt cache from their stored KV caches with the chosen strategy and "
            "stream the answer to stdout; TTFT, token reuse and sources go to stderr."
        ),
    )
    parser.add_argument("question", help="the question")
    add_chroma_options(parser)
    add_store_option(parser)
    add_model_options(parser)
    parser.add_argument(
        "--strategy",
        choices=list(STRATEGIES),
        default=DEFAULT_STRATEGY,
        help=f"how the prompt cache is built (default: {DEFAULT_STRATEGY})",
    )
    parser.add_argument(
        "--recompute-ratio",
        type=float,
        default=None,
        help="share of chunk tokens blend recomputes (default: 0.15)",
    )
    parser.add_argument("--top-k", type=int, default=3, help="chunks to retrieve (default: 3)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length limit")
    parser.set_defaults(func=run)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Check every argument before anything is loaded, retrieved or computed."""
    try:
        check_text(args.question, "the question")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if not args.question.strip():
        raise CLIError("the question is empty")
    if args.top_k < 1 or args.max_new_tokens < 1:
        raise CLIError("--top-k and --max-new-tokens must be >= 1")
    SamplingParams(max_new_tokens=args.max_new_tokens)
    if args.recompute_ratio is None:
        return {}
    if args.strategy != "blend":
        raise CLIError("--recompute-ratio applies to --strategy blend only")
    if not 0.0 <= args.recompute_ratio <= 1.0:
        raise CLIError(f"--recompute-ratio must be in [0, 1], got {args.recompute_ratio}")
    return {"recompute_ratio": args.recompute_ratio}


def run(args: argparse.Namespace) -> int:
    """Answer ``args.question``; the answer on stdout, the stats on stderr."""
    from llama_index.core import VectorStoreIndex
    from llama_index.vector_stores.chroma import ChromaVectorStore

    from kvrag_integrations.llama_index import KVRAGRetriever, MiniLMEmbedding
    from kvrag_integrations.llama_index._nodes import llm_text

    options = _options(args)
    store = store_from(args)
    collection = get_collection(chroma_client(args, create=False), args.collection, create=False)
    if collection.count() == 0:
        raise CLIError(f"collection {args.collection!r} is empty; run `kvrag ingest` first")
    engine = engine_from(args, store)
    index = VectorStoreIndex.from_vector_store(
        ChromaVectorStore(chroma_collection=collection), embed_model=MiniLMEmbedding()
    )
    # The retriever makes sure every node's cache is stored (encoding only missing ones).
    started, writes = time.perf_counter(), store.stats.writes
    nodes = KVRAGRetriever(engine, index, similarity_top_k=args.top_k).retrieve(args.question)
    retrieval_s, encoded = time.perf_counter() - started, store.stats.writes - writes
    nodes = [n for n in nodes if llm_text(n).strip()]
    stream = engine.stream(
        question=args.question,
        chunks=[llm_text(n) for n in nodes],
        strategy=args.strategy,
        max_new_tokens=args.max_new_tokens,
        **options,
    )
    with stream:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    _report(stream.result, nodes, retrieval_s, encoded)
    return 0


def _report(result: Any, nodes: list[Any], retrieval_s: float, encoded: int) -> None:
    """TTFT, token accounting and sources, on stderr."""
    err = sys.stderr
    print(f"retrieval {retrieval_s * 1000:.0f} ms", file=err, end="")
    print(f" ({encoded} missing chunk caches encoded)" if encoded else "", file=err)
    print(
        f"TTFT {result.ttft_s * 1000:.0f} ms | strategy {result.strategy} | "
        f"reused {result.reused_tokens} tokens ({result.reused_prefix_tokens} of them the "
        f"cached prompt head) | recomputed {result.recomputed_tokens} | "
        f"prefilled {result.prefilled_tokens} | generated {result.generated_tokens}",
        file=err,
    )
    print("sources:", file=err)
    for i, item in enumerate(nodes, 1):
        node = item.node
        source = node.metadata.get(_SOURCE_FIELD) or node.ref_doc_id or node.node_id
        snippet = " ".join(node.get_content().split())[:60]
        score = f"{item.score:.3f}" if item.score is not None else "-"
        print(f"  [{i}] {source} (score {score}): {snippet}", file=err)
