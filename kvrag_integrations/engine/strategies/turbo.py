"""TurboRAG (arXiv 2410.07590): reuse every chunk cache as stored.

``key_temperature`` is APE's attention temperature (arXiv 2502.05431): chunk
keys divided by T sharpen (T < 1) the attention later tokens pay the chunks,
which were encoded without each other; no token is recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.forward import run_tokens
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput
from kvrag_integrations.engine.strategies.reuse import (
    ChunkReuse,
    divide_chunk_keys,
    output,
    with_last,
)


class TurboRAG(ChunkReuse):
    """Concatenate chunk caches, then prefill only the text around them.

    Args:
        positions: ``"reordered"`` (default) or ``"composite"``.
        key_temperature: divide the retrieved chunks' keys by this (APE's T;
            1.0, the default, reuses them as stored). The leading text and the
            text around the chunks are untouched. The scaled keys stay in the
            cache, so decoding attends with the same temperature.
        chunk_context: the entries it reads (``ChunkReuse``; None: the engine's).
    """

    name = "turbo"

    def __init__(
        self,
        positions: str = "reordered",
        key_temperature: float = 1.0,
        chunk_context: str | None = None,
    ) -> None:
        super().__init__(positions, chunk_context)
        if isinstance(key_temperature, bool) or not isinstance(key_temperature, (int, float)):
            raise TypeError("key_temperature must be a positive number")
        if not (key_temperature > 0 and math.isfinite(key_temperature)):
            raise ValueError(f"key_temperature must be > 0, got {key_temperature}")
        self.key_temperature = float(key_temperature)

    def prefill(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        kv, placement = self.assemble_placed(model, prompt, chunk_kvs)
        uncached = placement.uncached.to(kv.device)
        if self.key_temperature != 1.0:
            divide_chunk_keys(kv, placement, self.key_temperature)
        todo = with_last(uncached, kv.num_tokens)
        logits = run_tokens(model.model, model.layout, kv, todo)
        return output(kv, logits, uncached, todo)
