"""The one interface every prompt-cache strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.forward import PromptKV
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt

if TYPE_CHECKING:
    from kvrag_integrations.engine.modeling.model import LoadedModel


@dataclass
class PrefillOutput:
    """What a strategy hands to the decoder.

    Attributes:
        kv: the prompt cache in sequence order, with each token's RoPE position.
        logits: float32 ``[vocab]`` logits of the last prompt token.
        chunk_mask: bool ``[tokens]``, True for tokens of cached chunks.
        reused_mask: bool ``[tokens]``, True where the stored K/V were used as is.
    """

    kv: PromptKV
    logits: torch.Tensor
    chunk_mask: torch.Tensor
    reused_mask: torch.Tensor

    def token_counts(self, lazy_mask: torch.Tensor | None = None) -> tuple[int, int, int]:
        """``(reused, recomputed, prefilled)`` prompt tokens; they sum to the prompt length.

        Args:
            lazy_mask: tokens of chunks encoded during this request (a lazy fill):
                computed here, so they count as prefilled, not reused.
        """
        reused = self.reused_mask
        if lazy_mask is not None:
            reused = reused & ~lazy_mask.to(reused.device)
        recomputed = self.chunk_mask & ~self.reused_mask
        prefilled = ~(reused | recomputed)
        return int(reused.sum()), int(recomputed.sum()), int(prefilled.sum())


class Strategy(ABC):
    """Builds the prompt's KV cache from the prompt and its chunks' stored caches.

    ``chunk_kvs[i]`` is the stored cache of the i-th chunk piece of ``prompt``
    (on the model's device, in its storage form: float or int8, which
    ``reuse.ChunkReuse.assemble`` casts or dequantizes to the model's dtype while
    laying the caches out); ``model`` carries the weights and their
    :class:`~kvrag_integrations.engine.modeling.layout.ModelLayout`. Strategies that prefill
    everything do not need caches and say so with ``uses_chunk_caches = False``.
    """

    name: str = ""
    uses_chunk_caches: bool = True

    @abstractmethod
    def prefill(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        """Return the prompt cache and the last token's logits."""
