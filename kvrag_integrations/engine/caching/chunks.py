"""Encoding chunks alone, from position 0 (TurboRAG's independent attention), or
behind a fixed encoding context whose rows are dropped (CacheBlend's reference
code encodes each chunk behind BOS, so the chunk's first token is not its own
attention sink)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.hf_compat import (
    DynamicCache,
    cache_argument,
    cache_layers,
    output_cache,
)


@torch.no_grad()
def encode_chunk_batch(
    lm: Any,
    token_ids: Sequence[torch.Tensor],
    fingerprint: str,
    pad_id: int,
    context_ids: torch.Tensor | None = None,
) -> list[ChunkKV]:
    """Prefill several chunks in one right-padded batch; each sees only itself
    (and ``context_ids`` before it, when given: its K/V are computed, not kept,
    and the chunk's keys are then rotated from position ``len(context_ids)``).

    Right padding keeps every real token at positions 0..n-1 and the causal mask
    keeps it from seeing the padding after it, so each chunk's K/V equal those of
    the chunk prefilled alone (up to float rounding of the batched matmuls). The
    model's inner decoder runs (no lm head: only the K/V are kept).
    """
    device = lm.device
    c = 0 if context_ids is None else int(context_ids.numel())
    lengths = [int(ids.numel()) for ids in token_ids]
    width = c + max(lengths)
    batch = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        if c:
            batch[row, :c] = context_ids
        batch[row, c : c + ids.numel()] = ids
        mask[row, : c + ids.numel()] = 1
    # A config-less DynamicCache keeps every token's K/V on sliding-window layers
    # (the config's would keep only the last window); the mask applies the window.
    out = lm.model(
        input_ids=batch.to(device),
        attention_mask=mask.to(device),
        **cache_argument(lm.model, DynamicCache()),
        use_cache=True,
    )
    layers = cache_layers(output_cache(out))
    keys = torch.stack([k for k, _ in layers])  # [L, B, H, T, D]
    values = torch.stack([v for _, v in layers])
    return [
        ChunkKV(
            token_ids=ids.clone(),
            keys=keys[:, row, :, c : c + n].contiguous(),
            values=values[:, row, :, c : c + n].contiguous(),
            fingerprint=fingerprint,
        )
        for row, (ids, n) in enumerate(zip(token_ids, lengths))
    ]
