"""Node helpers shared by the adapters: the text a node shows the LLM, its cache key."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from kvrag_integrations.chunk_kv import CACHE_KEY_FIELD
from kvrag_integrations.errors import ContextWindowExceededError, InvalidChunkError

logger = logging.getLogger(__name__)


def as_node(node: BaseNode | NodeWithScore) -> BaseNode:
    """The node itself, unwrapping a ``NodeWithScore``."""
    return node.node if isinstance(node, NodeWithScore) else node


def hide_cache_key(node: BaseNode) -> None:
    """Keep ``CACHE_KEY_FIELD`` out of the node's LLM and embedding text."""
    for keys in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        if CACHE_KEY_FIELD not in keys:
            keys.append(CACHE_KEY_FIELD)


def llm_text(node: BaseNode | NodeWithScore) -> str:
    """The node's content exactly as synthesizers paste it into prompts."""
    return as_node(node).get_content(metadata_mode=MetadataMode.LLM)


def llm_texts(nodes: Iterable[BaseNode | NodeWithScore]) -> list[str]:
    """LLM texts of ``nodes`` that are not empty (empty ones cannot be chunks)."""
    texts = (llm_text(n) for n in nodes)
    return [t for t in texts if t.strip()]


def attach_cache_keys(
    engine: Any,
    nodes: Sequence[BaseNode | NodeWithScore],
    *,
    batch_size: int = 8,
    show_progress: bool = False,
    strict: bool = True,
) -> int:
    """Make sure each node's LLM text has a stored cache and record its key.

    ``engine.encode_chunks`` skips chunks already stored, so this is idempotent.
    The key goes into ``node.metadata[CACHE_KEY_FIELD]``, hidden from the LLM and
    embedding text first, so the text encoded is the text the LLM will see.

    Args:
        engine: a ``KVRAGEngine`` or ``VLLMEngine``.
        nodes: nodes (or ``NodeWithScore``) to encode; empty ones are skipped.
        batch_size: chunks per forward.
        show_progress: a progress bar.
        strict: raise on a chunk longer than the context window; False skips it.

    Returns:
        How many nodes got a key.
    """
    todo: list[tuple[BaseNode, str]] = []
    for item in nodes:
        node = as_node(item)
        hide_cache_key(node)
        text = llm_text(node)
        if text.strip():
            todo.append((node, text))
    if not todo:
        return 0
    texts = [text for _, text in todo]
    try:
        refs: list[Any] = engine.encode_chunks(
            texts, batch_size=batch_size, show_progress=show_progress
        )
    except (ContextWindowExceededError, InvalidChunkError):
        if strict:
            raise
        refs = [_encode_one(engine, text) for text in texts]
    done = 0
    for (node, _), ref in zip(todo, refs):
        if ref is not None:
            node.metadata[CACHE_KEY_FIELD] = ref.key
            done += 1
    return done


def _encode_one(engine: Any, text: str) -> Any:
    try:
        return engine.encode_chunks([text], show_progress=False)[0]
    except (ContextWindowExceededError, InvalidChunkError) as exc:
        logger.warning("node not cached (%s); it will be prefilled when used", exc)
        return None
