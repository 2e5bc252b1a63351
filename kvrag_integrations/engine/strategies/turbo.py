"""TurboRAG (arXiv 2410.07590): reuse every chunk cache as stored."""

from __future__ import annotations

from collections.abc import Sequence

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.forward import run_tokens
from kvrag_integrations.engine.model import LoadedModel
from kvrag_integrations.engine.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput
from kvrag_integrations.engine.strategies.reuse import ChunkReuse, output, with_last


class TurboRAG(ChunkReuse):
    """Concatenate chunk caches, then prefill only the text around them.

    Args:
        positions: ``"reordered"`` (default) or ``"composite"``.
    """

    name = "turbo"

    def prefill(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        kv, uncached = self.assemble(model, prompt, chunk_kvs)
        todo = with_last(uncached, kv.num_tokens)
        logits = run_tokens(model.model, model.layout, kv, todo)
        return output(kv, logits, uncached, todo)
