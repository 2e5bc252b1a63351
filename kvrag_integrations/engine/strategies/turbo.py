"""TurboRAG (arXiv 2410.07590): reuse every chunk cache as stored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.engine.kv import ChunkKV
from kvrag_integrations.engine.layers import PromptKV, run_layers
from kvrag_integrations.engine.rope import shift_keys
from kvrag_integrations.engine.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput, Strategy

POSITION_MODES = ("reordered", "composite")


def assemble(
    lm: Any, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV], positions: str = "reordered"
) -> tuple[PromptKV, torch.Tensor]:
    """Lay the chunk caches out in prompt order, keys moved to their positions.

    Args:
        positions: ``"reordered"`` (contiguous, TurboRAG's choice) moves each chunk to
            where it sits in the prompt; ``"composite"`` (the paper's ablation)
            leaves every chunk at 0 and continues text after the longest chunk.

    Returns:
        ``(kv, uncached)``: the buffer (text tokens' slots not yet written) and
        the indices of the text tokens still to compute.
    """
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    inner = lm.model
    first = inner.layers[0].self_attn
    n_layers = len(inner.layers)
    kv_heads = first.k_proj.out_features // first.head_dim
    shape = (n_layers, kv_heads, prompt.num_tokens, first.head_dim)
    # Text tokens' slots are written by run_layers before any layer reads them.
    keys = torch.empty(shape, dtype=lm.dtype, device=lm.device)
    values = torch.empty_like(keys)
    pos = torch.empty(prompt.num_tokens, dtype=torch.long)
    uncached = []
    start = next_pos = 0
    chunk_iter = iter(chunk_kvs)
    inv_freq = inner.rotary_emb.inv_freq
    for piece in prompt.pieces:
        n = piece.ids.numel()
        span = slice(start, start + n)
        if piece.is_chunk:
            chunk = next(chunk_iter)
            at = next_pos if positions == "reordered" else 0
            shift_keys(chunk.keys, at, inv_freq, out=keys[:, :, span])
            values[:, :, span] = chunk.values
            pos[span] = torch.arange(at, at + n)
            next_pos = max(next_pos, at + n)
        else:
            pos[span] = torch.arange(next_pos, next_pos + n)
            next_pos += n
            uncached.append(torch.arange(start, start + n))
        start += n
    kv = PromptKV(keys, values, pos.to(lm.device), prompt.input_ids.to(lm.device))
    todo = torch.cat(uncached) if uncached else torch.zeros(0, dtype=torch.long)
    return kv, todo.to(lm.device)


def with_last(idx: torch.Tensor, total: int) -> torch.Tensor:
    """``idx`` plus the last prompt token, whose logits start decoding."""
    last = torch.tensor([total - 1], device=idx.device)
    return torch.unique(torch.cat([idx, last]))


def token_masks(
    total: int, uncached: torch.Tensor, computed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_mask, reused_mask)`` from the text tokens and the tokens computed."""
    chunk = torch.ones(total, dtype=torch.bool, device=computed.device)
    chunk[uncached] = False
    reused = chunk.clone()
    reused[computed] = False
    return chunk, reused


class TurboRAG(Strategy):
    """Concatenate chunk caches, then prefill only the text around them.

    Args:
        positions: ``"reordered"`` (default) or ``"composite"``.
    """

    name = "turbo"

    def __init__(self, positions: str = "reordered") -> None:
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
        self.positions = positions

    def prefill(
        self, lm: Any, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        kv, uncached = assemble(lm, prompt, chunk_kvs, self.positions)
        todo = with_last(uncached, kv.num_tokens)
        logits, computed = run_layers(lm, kv, todo)
        return PrefillOutput(kv, logits, *token_masks(kv.num_tokens, uncached, computed))
