"""KVRerankPostprocessor: rerank nodes with the decoder reranker (HyperRAG)."""

from __future__ import annotations

from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from pydantic import Field, PrivateAttr

dispatcher = get_dispatcher(__name__)


class KVRerankPostprocessor(BaseNodePostprocessor):
    """Reorders nodes by ``KVReranker`` relevance and keeps the best ``top_n``.

    Each node's score becomes the reranker's: the query's mean token
    log-probability with the default ``scoring="query_likelihood"``,
    ``log P(yes) - log P(no)`` with ``scoring="judge"``. Document caches are reused across queries
    (the reranker stores them).

    Args:
        reranker: a ``kvrag_integrations.rerank.KVReranker``.
        **kwargs: the fields below.

    Attributes:
        top_n: nodes kept (None: the reranker's own ``top_n``).
        metadata_mode: which node text is judged (default ``EMBED``, as LlamaIndex's
            rerankers do; the cache key is excluded from it).

    Examples:
        >>> from kvrag_integrations.rerank import KVReranker  # doctest: +SKIP
        >>> rerank = KVRerankPostprocessor(KVReranker(engine), top_n=3)  # doctest: +SKIP
        >>> query_engine = index.as_query_engine(
        ...     llm=KVRAGLLM(engine), similarity_top_k=10,
        ...     node_postprocessors=[rerank])  # doctest: +SKIP
    """

    top_n: int | None = Field(default=None, ge=1)
    metadata_mode: MetadataMode = Field(default=MetadataMode.EMBED)
    _reranker: Any = PrivateAttr()

    def __init__(self, reranker: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._reranker = reranker

    @classmethod
    def class_name(cls) -> str:
        return "KVRerankPostprocessor"

    @property
    def reranker(self) -> Any:
        """The ``KVReranker`` doing the scoring."""
        return self._reranker

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if query_bundle is None:
            raise ValueError("KVRerankPostprocessor needs the query")
        if not nodes:
            return []
        model_name = str(getattr(self._reranker.engine, "model_name", "kvrag"))
        dispatcher.event(
            ReRankStartEvent(
                query=query_bundle,
                nodes=nodes,
                top_n=self.top_n or len(nodes),
                model_name=model_name,
            )
        )
        docs = [n.node.get_content(metadata_mode=self.metadata_mode) for n in nodes]
        limit = {} if self.top_n is None else {"top_n": self.top_n}
        ranked = self._reranker.rerank(query_bundle.query_str, docs, **limit)
        out = [NodeWithScore(node=nodes[i].node, score=float(score)) for i, score in ranked]
        dispatcher.event(ReRankEndEvent(nodes=out))
        return out
