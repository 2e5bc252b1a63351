"""The one interface every prompt-cache strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.results import PrefillOutput  # what every strategy returns

if TYPE_CHECKING:
    from kvrag_integrations.engine.modeling.model import LoadedModel


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
    # The encoding context of the entries it reads (``entries.CHUNK_CONTEXTS``);
    # None: the engine's own.
    chunk_context: str | None = None

    @abstractmethod
    def prefill(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        """Return the prompt cache and the last token's logits."""
