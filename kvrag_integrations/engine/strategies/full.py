"""The reference: a plain prefill of the whole prompt through transformers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.forward import PromptKV, prefill
from kvrag_integrations.engine.modeling.hf_compat import (
    DynamicCache,
    cache_argument,
    cache_layers,
    output_cache,
)
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput, Strategy


class FullPrefill(Strategy):
    """Prefill every prompt token with the model's own forward: no reuse.

    This is the baseline every speedup is measured against and the reference
    every exactness test compares to. Where the request reserved a static
    decode bucket, the same forward writes each layer's K/V straight into it
    (``forward.prefill``) instead of keeping transformers' ``DynamicCache``.
    """

    name = "full"
    uses_chunk_caches = False

    @torch.no_grad()
    def prefill(
        self, model: LoadedModel, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        lm = model.model
        ids = prompt.input_ids.to(lm.device)
        none = torch.zeros(ids.numel(), dtype=torch.bool, device=lm.device)
        positions = torch.arange(ids.numel(), device=lm.device)
        claimed = model.decoder.claim(model.layout, positions, ids)
        if claimed is not None:  # the request's static bucket: K/V written there, one copy
            return PrefillOutput(claimed, prefill(lm, model.layout, claimed), none, none)
        # A config-less DynamicCache keeps every token's K/V on sliding-window
        # layers too (the mask applies the window), so all layers stack.
        out = lm(
            input_ids=ids.unsqueeze(0),
            **cache_argument(lm, DynamicCache()),
            use_cache=True,
            logits_to_keep=1,
        )
        layers = cache_layers(output_cache(out))
        kv = PromptKV(
            keys=[k[0] for k, _ in layers],
            values=[v[0] for _, v in layers],
            positions=positions,
            input_ids=ids,
        )
        return PrefillOutput(kv, out.logits[0, -1].float(), none, none)
