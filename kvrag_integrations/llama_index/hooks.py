"""Noting which nodes the current request retrieved, from LlamaIndex instrumentation.

A query engine pastes its nodes' LLM text into a flat prompt; to reuse their caches
the LLM must know which spans of that prompt are chunks. Chunks this process
encoded are in ``engine.chunk_index``, but after a restart (persistent vector store
and ``DiskKVStore``), or for an index built without ``KVCacheTransform``, they are
not. So two instrumentation hooks on the root dispatcher note the LLM text of every
node a request handles:

- an event handler for ``RetrievalEndEvent`` (any ``BaseRetriever``, chat engines
  included);
- a span handler that sees ``BaseSynthesizer.synthesize`` / ``asynthesize`` and
  ``BaseNodePostprocessor.postprocess_nodes`` calls with their ``nodes`` (nodes
  after postprocessing, or handed to a synthesizer directly).

Each text is noted twice: in a context variable that follows the request through
threads (copied) and asyncio tasks (``request_chunks``), and in a bounded
process-wide registry (``recent_chunks``, the latest ``MAX_RECENT_CHUNKS`` texts).
The registry is what makes reuse survive task and thread boundaries the context
variable does not cross: a Workflow's retrieve step and synthesize step run in
different tasks, and a streamed response calls the LLM from the consumer's task.

``KVRAGLLM`` passes the request's texts, plus the registry's texts found verbatim in
its prompt, to the engine as ``known_chunks``. Only verbatim matches are reused, so
a stale entry costs a string search, never a wrong answer.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span import BaseSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, NodeWithScore

from kvrag_integrations.engine import registry
from kvrag_integrations.engine.prompting.spans import MAX_RECENT_CHUNKS, ChunkIndex
from kvrag_integrations.llama_index._nodes import llm_texts

MAX_REQUEST_CHUNKS = 256  # the most recent node texts kept per request context

_REQUEST_CHUNKS: ContextVar[tuple[str, ...]] = ContextVar("kvrag_request_chunks", default=())
_RECENT = ChunkIndex(max_chunks=MAX_RECENT_CHUNKS)
_INSTALLED = False
_INSTALL_LOCK = threading.Lock()


def note_nodes(nodes: Iterable[BaseNode | NodeWithScore]) -> None:
    """Remember the nodes' LLM texts as chunks of the current request.

    Examples:
        >>> from llama_index.core.schema import TextNode
        >>> note_nodes([TextNode(text="Paris is the capital of France.")])
        >>> request_chunks()[-1]
        'Paris is the capital of France.'
    """
    new = list(dict.fromkeys(llm_texts(nodes)))
    if not new:
        return
    for text in new:
        _RECENT.add(text)
        # simple_summarize pastes str(list) of its chunks: each one escaped as repr.
        escaped = repr(text)[1:-1]
        if escaped != text:
            _RECENT.add(escaped)
    fresh = set(new)
    kept = [t for t in _REQUEST_CHUNKS.get() if t not in fresh]
    _REQUEST_CHUNKS.set(tuple([*kept, *new][-MAX_REQUEST_CHUNKS:]))


def request_chunks() -> tuple[str, ...]:
    """Node texts noted in this context (thread or task), oldest first."""
    return _REQUEST_CHUNKS.get()


def recent_chunks() -> ChunkIndex:
    """The process-wide registry of noted node texts (bounded, least recent dropped)."""
    return _RECENT


def known_chunks(prompts: Iterable[str]) -> tuple[str, ...]:
    """The chunks to look for in ``prompts``: this request's notes, then any noted
    text (in any task or thread) that occurs verbatim in them.

    Examples:
        >>> from llama_index.core.schema import TextNode
        >>> note_nodes([TextNode(text="Ottawa is the capital of Canada.")])
        >>> known_chunks(["Context: Ottawa is the capital of Canada. Q?"])[-1]
        'Ottawa is the capital of Canada.'
    """
    out = dict.fromkeys(request_chunks())
    for prompt in prompts:
        for text in _RECENT.find(prompt):
            # a noted text inside a longer known chunk adds nothing (the longer wins)
            if not any(text in chunk for chunk in out):
                out[text] = None
    return tuple(out)


class RetrievalNodesHandler(BaseEventHandler):
    """Notes the nodes of every ``RetrievalEndEvent``."""

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGRetrievalNodesHandler"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            note_nodes(event.nodes)
            # Their caches start loading now, while the framework builds the prompt.
            registry.prefetch(list(dict.fromkeys(llm_texts(event.nodes))))


class SynthesisNodesHandler(BaseSpanHandler[BaseSpan]):
    """Notes the ``nodes`` argument of synthesizer spans; opens no spans itself."""

    @classmethod
    def class_name(cls) -> str:
        return "KVRAGSynthesisNodesHandler"

    def new_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        parent_span_id: str | None = None,
        tags: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        if isinstance(instance, (BaseSynthesizer, BaseNodePostprocessor)):
            nodes = bound_args.arguments.get("nodes")
            if isinstance(nodes, (list, tuple)):
                note_nodes(n for n in nodes if isinstance(n, (BaseNode, NodeWithScore)))
        return None

    def prepare_to_exit_span(self, *args: Any, **kwargs: Any) -> BaseSpan | None:
        return None

    def prepare_to_drop_span(self, *args: Any, **kwargs: Any) -> BaseSpan | None:
        return None


def install_hooks() -> None:
    """Attach both handlers to LlamaIndex's root dispatcher (once per process)."""
    global _INSTALLED
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        root = get_dispatcher()
        root.add_event_handler(RetrievalNodesHandler())
        root.add_span_handler(SynthesisNodesHandler())
        _INSTALLED = True
