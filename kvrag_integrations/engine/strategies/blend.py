"""CacheBlend (arXiv 2405.16444): reuse chunk caches, recompute the tokens that deviate.

Layout as for turbo. The first ``check_layer`` layers run every token (layer 0's
K/V depend only on token and position, so this costs no fidelity and gives every
token a context-aware input to the check layer). At the check layer the fresh
K/V of each cached token are compared with its stored ones; the
``recompute_ratio`` share with the largest squared-L2 deviation (plus every
uncached token) keeps going through the remaining layers, writing fresh K/V
over the stored entries. Everything else is reused as stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvrag_integrations.engine.kv import ChunkKV
from kvrag_integrations.engine.layers import PromptKV, run_layers
from kvrag_integrations.engine.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.base import PrefillOutput, Strategy
from kvrag_integrations.engine.strategies.turbo import (
    POSITION_MODES,
    assemble,
    token_masks,
    with_last,
)

DEVIATIONS = ("value", "key", "both")
WEIGHTINGS = ("none", "attention")


class CacheBlend(Strategy):
    """Selective KV recompute on top of reused chunk caches.

    Args:
        recompute_ratio: share of cached chunk tokens to recompute, in [0, 1]
            (0 reproduces turbo, 1 reproduces full prefill).
        check_layer: the layer where deviations are measured (>= 1 keeps
            ``recompute_ratio=0`` equal to turbo; 0 selects on layer-0 K/V).
        deviation: ``"value"`` (the CacheBlend reference), ``"key"`` (LMCache), or
            ``"both"``.
        recompute_first: also recompute the first N tokens of every chunk (EPIC's
            answer to each chunk's spurious attention sink).
        weighting: ``"none"`` ranks tokens by deviation alone (the reference);
            ``"attention"`` weighs each token's per-head deviation by the attention
            the question (the text after the last chunk) pays it at the check
            layer: a deviation nobody attends to does not change the answer.
        keep_chunk_starts: never recompute the first N tokens of every chunk (each
            chunk's attention sink when it was encoded alone; see
            docs/benchmarks.md, "CacheBlend on this model").
        refresh_check_layer: also keep the check layer's fresh K/V of the tokens
            that are not selected (computed anyway and exact at that layer); then
            ``recompute_ratio=0`` is no longer turbo.
        positions: ``"reordered"`` or ``"composite"``, as for turbo.

    Examples:
        >>> CacheBlend(recompute_ratio=0.15).name
        'blend'
    """

    name = "blend"

    def __init__(
        self,
        recompute_ratio: float = 0.15,
        check_layer: int = 1,
        deviation: str = "value",
        recompute_first: int = 0,
        positions: str = "reordered",
        weighting: str = "none",
        keep_chunk_starts: int = 0,
        refresh_check_layer: bool = False,
    ) -> None:
        if isinstance(recompute_ratio, bool) or not isinstance(recompute_ratio, (int, float)):
            raise TypeError("recompute_ratio must be a number in [0, 1]")
        if not 0.0 <= float(recompute_ratio) <= 1.0 or math.isnan(recompute_ratio):
            raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if not isinstance(check_layer, int) or check_layer < 0:
            raise ValueError(f"check_layer must be an int >= 0, got {check_layer!r}")
        if deviation not in DEVIATIONS:
            raise ValueError(f"deviation must be one of {DEVIATIONS}, got {deviation!r}")
        if not isinstance(recompute_first, int) or recompute_first < 0:
            raise ValueError("recompute_first must be an int >= 0")
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
        if not isinstance(keep_chunk_starts, int) or keep_chunk_starts < 0:
            raise ValueError("keep_chunk_starts must be an int >= 0")
        self.keep_chunk_starts = keep_chunk_starts
        if not isinstance(refresh_check_layer, bool):
            raise TypeError("refresh_check_layer must be a bool")
        self.refresh_check_layer = refresh_check_layer
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.weighting = weighting
        self.recompute_ratio = float(recompute_ratio)
        self.check_layer = check_layer
        self.deviation = deviation
        self.recompute_first = recompute_first
        self.positions = positions

    def prefill(
        self, lm: Any, prompt: TokenizedPrompt, chunk_kvs: Sequence[ChunkKV]
    ) -> PrefillOutput:
        n_layers = len(lm.model.layers)
        if self.check_layer >= n_layers:
            raise ValueError(f"check_layer {self.check_layer} >= the model's {n_layers} layers")
        kv, uncached = assemble(lm, prompt, chunk_kvs, self.positions)
        chunk_mask, _ = token_masks(kv.num_tokens, uncached, uncached)
        # A cached leading prefix is exact (nothing precedes it): never a candidate.
        candidates = chunk_mask.clone()
        if prompt.pieces and prompt.pieces[0].is_prefix:
            candidates[: prompt.pieces[0].ids.numel()] = False
        if self.keep_chunk_starts:
            candidates &= ~self._chunk_starts(prompt, kv, self.keep_chunk_starts)
        forced = (
            self._chunk_starts(prompt, kv, self.recompute_first) if self.recompute_first else None
        )

        def select(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx):
            scale = lm.model.layers[layer].self_attn.scaling
            return self.pick(kv, layer, q, k, v, idx, candidates, forced, scale)

        todo = with_last(uncached, kv.num_tokens)
        logits, computed = run_layers(
            lm,
            kv,
            todo,
            full_layers=self.check_layer,
            selector=select,
            write_all_selected_layer=self.refresh_check_layer,
        )
        return PrefillOutput(kv, logits, *token_masks(kv.num_tokens, uncached, computed))

    def pick(
        self,
        kv: PromptKV,
        layer: int,
        fresh_q: torch.Tensor,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        idx: torch.Tensor,
        candidates: torch.Tensor,
        forced: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Keep-mask over ``idx``: the top ``recompute_ratio`` of ``candidates`` by deviation."""
        cached = candidates[idx]
        n_keep = round(self.recompute_ratio * int(cached.sum()))
        keep = torch.zeros_like(cached)
        if forced is not None:
            keep |= forced[idx]
        if n_keep == 0:
            return keep
        dev = torch.zeros(fresh_k.shape[:2], device=idx.device)  # [kv_heads, n]
        if self.deviation in ("value", "both"):
            dev += _sq_dist(fresh_v, kv.values[layer][:, idx])
        if self.deviation in ("key", "both"):
            dev += _sq_dist(fresh_k, kv.keys[layer][:, idx])
        if self.weighting == "attention":
            dev = dev.sqrt() * _question_attention(fresh_q, fresh_k, idx, cached, scale)
        score = dev.sum(dim=0)
        score[~cached] = float("-inf")
        keep[torch.topk(score, n_keep).indices] = True
        return keep

    def _chunk_starts(self, prompt: TokenizedPrompt, kv: PromptKV, n: int) -> torch.Tensor:
        """Mask of the first ``n`` tokens of every chunk (not the cached leading text)."""
        starts = torch.zeros(kv.num_tokens, dtype=torch.bool, device=kv.keys.device)
        offset = 0
        for piece in prompt.pieces:
            if piece.is_chunk and not piece.is_prefix:
                starts[offset : offset + min(n, piece.ids.numel())] = True
            offset += piece.ids.numel()
        return starts


def _sq_dist(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Per-head, per-token squared L2 distance: ``[heads, n, d] -> [heads, n]``."""
    return (fresh.float() - stored.float()).pow(2).sum(dim=-1)


def _question_attention(
    q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, cached: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention the tokens after the last cached one pay each token, per KV head.

    ``q`` is ``[heads, n, d]``, ``k`` ``[kv_heads, n, d]``; returns ``[kv_heads, n]``
    (summed over the query heads of each KV group and over the question tokens).
    """
    last_cached = int(cached.nonzero().max())
    tail = torch.arange(last_cached + 1, idx.numel(), device=idx.device)
    group = q.shape[0] // k.shape[0]
    qt = q[:, tail].float()  # [heads, t, d]
    kk = k.float().repeat_interleave(group, dim=0)  # [heads, n, d]
    scores = (qt @ kk.transpose(-1, -2)) * scale
    visible = idx.unsqueeze(0) <= idx[tail].unsqueeze(1)  # causal, by sequence index
    attn = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [heads, t, n]
    return attn.view(k.shape[0], group, tail.numel(), -1).sum(dim=(1, 2))
