"""The one interface every prompt-cache strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.engine.kv import ChunkKV
from kvrag_integrations.engine.layers import PromptKV
from kvrag_integrations.engine.segments import TokenizedPrompt


@dataclass
class PrefillOutput:
    """What a strategy hands to the decoder.

    Attributes:
        kv: the prompt cache in sequence order, with each token's RoPE position.
        logits: float32 ``[vocab]`` logits of the last prompt token.
        reused_tokens: cached chunk tokens whose K/V were used as stored.
        recomputed_tokens: cached chunk tokens computed again (CacheBlend).
        prefilled_tokens: prompt tokens computed from scratch (not chunk tokens).
    """

    kv: PromptKV
    logits: torch.Tensor
    reused_tokens: int
    recomputed_tokens: int
    prefilled_tokens: int


class Strategy(ABC):
    """Builds the prompt's KV cache from the prompt and its chunks' stored caches.

    ``chunk_kvs[i]`` is the stored cache of the i-th chunk piece of ``prompt``
    (already on the model's device and dtype). Strategies that prefill
    everything do not need caches and say so with ``uses_chunk_caches = False``.
    """

    name: str = ""
    uses_chunk_caches: bool = True

    @abstractmethod
    def prefill(
        self, lm: Any, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        """Return the prompt cache and the last token's logits."""
