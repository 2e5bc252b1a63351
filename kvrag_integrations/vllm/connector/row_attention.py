"""Attention of a few rows at scattered positions over a run's keys (blend in vLLM).

What ``connector.blend``'s proxies compute for the rows a blend recomputes: each
row sees the keys at positions up to its own (within the layer's sliding window),
with grouped K/V heads and softcapped scores where the layer has them; and the
attention weight each key gets from the question's rows (query-driven selection).
"""

from __future__ import annotations

import torch


def rows_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``query [R, H, d]`` over ``keys``/``values [T, KVH, d]`` where ``visible [R, T]``;
    float32, grouped heads without copies (SDPA's GQA); returns ``[R, H, dv]``.

    Rows come sorted by position and see keys up to their own: many rows are cut in
    two halves, each over the keys its last row sees (the first half's attention
    then costs about half)."""
    rows = query.shape[0]
    if rows >= _SPLIT_ROWS:
        half = rows // 2
        parts = []
        for part in (slice(0, half), slice(half, rows)):
            seen = visible[part].any(dim=0).nonzero()
            end = int(seen.max()) + 1 if seen.numel() else 1
            sliced = (keys[:end], values[:end], visible[part, :end])
            parts.append(_attention_block(query[part], *sliced, scale, softcap))
        return torch.cat(parts)
    return _attention_block(query, keys, values, visible, scale, softcap)


_SPLIT_ROWS = 64  # rows from which cutting them in two halves pays


def _attention_block(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    q = query.float().transpose(0, 1).unsqueeze(0)  # [1, H, R, d]
    k = keys.float().transpose(0, 1).unsqueeze(0)
    v = values.float().transpose(0, 1).unsqueeze(0)
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[None, None], scale=scale, enable_gqa=True
        )
    else:  # softcapped scores (Gemma 2): SDPA has no softcap
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible[None, None], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), v)
    return out[0].transpose(0, 1)


def rows_mass(
    query: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Each key's attention weight from ``query``'s rows, summed over rows and heads
    (``engine.modeling.attention_mass``'s measure)."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    q = query.float().transpose(0, 1).reshape(kv_heads, heads // kv_heads * query.shape[0], -1)
    k = keys.float().transpose(0, 1)  # [KVH, T, d]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(kv_heads, heads // kv_heads, query.shape[0], -1)
    scores = scores.masked_fill(~visible[None, None], float("-inf"))
    return scores.softmax(dim=-1).sum(dim=(0, 1, 2))
