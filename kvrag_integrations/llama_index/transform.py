"""KVCacheTransform: precompute each node's KV cache at ingestion."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.schema import BaseNode, TransformComponent
from pydantic import Field, PrivateAttr

from kvrag_integrations.engine.protocol import check_engine
from kvrag_integrations.llama_index._nodes import attach_cache_keys


class KVCacheTransform(TransformComponent):
    """An ingestion step that stores each node's KV cache and records its key.

    Put it after the splitter. Each node is encoded exactly as synthesizers show it
    to the LLM (``node.get_content(MetadataMode.LLM)``), in batches; chunks already
    in the engine's store are skipped, so running it again writes nothing. The key
    lands in ``node.metadata[CACHE_KEY_FIELD]`` and is excluded from the LLM and
    embedding text. The key is informational: at query time the engine re-derives
    keys from its own model fingerprint, so a key from another model is never used.

    Args:
        engine: the engine (``KVRAGEngine`` or ``VLLMEngine``) whose store receives the caches.
        **kwargs: the fields below.

    Attributes:
        batch_size: chunks per forward.
        show_progress: a progress bar (``IngestionPipeline.run(show_progress=...)``
            overrides it).

    Examples:
        >>> from llama_index.core.ingestion import IngestionPipeline  # doctest: +SKIP
        >>> from llama_index.core.node_parser import SentenceSplitter  # doctest: +SKIP
        >>> pipeline = IngestionPipeline(transformations=[
        ...     SentenceSplitter(chunk_size=256), KVCacheTransform(engine)])  # doctest: +SKIP
        >>> nodes = pipeline.run(documents=docs)  # doctest: +SKIP
        >>> nodes[0].metadata["kvrag_cache_key"][:8]  # doctest: +SKIP
        '3f1c9a0b'
    """

    batch_size: int = Field(default=8, gt=0)
    show_progress: bool = Field(default=False)
    # Serialized with the transform, so IngestionPipeline's cache is per model.
    engine_fingerprint: str = Field(default="")
    _engine: Any = PrivateAttr()

    def __init__(self, engine: Any, **kwargs: Any) -> None:
        check_engine(engine)
        kwargs.setdefault("engine_fingerprint", engine.fingerprint)
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheTransform"

    @property
    def engine(self) -> Any:
        """The engine this transform encodes with."""
        return self._engine

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Encode and store the nodes' caches; returns the same nodes, keys recorded."""
        attach_cache_keys(
            self._engine,
            nodes,
            batch_size=self.batch_size,
            show_progress=bool(kwargs.get("show_progress", self.show_progress)),
        )
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """``__call__`` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
