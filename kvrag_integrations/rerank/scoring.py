"""The reranker's batched forward: a static padded layout over cached prefixes, and scores.

Candidates are scored in batches with a static padded layout: each row's prefix
cache is padded on the right to the batch's longest prefix ``Pmax`` (zero K/V),
the suffixes follow at columns ``Pmax..`` left-padded so that every row's last real
token sits in the last column (one logit row per candidate is all the LM head
computes), and an explicit 4D mask hides the padding while each row keeps its own
RoPE positions.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.modeling.hf_compat import layered_cache


def batch_inputs(
    ids: list[torch.Tensor], prefix_lens: list[int], pad_id: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Input ids, position ids and the 4D additive mask (None: no padding) of one batch.

    Row ``r`` has ``prefix_lens[r]`` cached tokens at positions ``0..P_r-1`` and
    computes ``ids[r]`` at positions ``P_r..``, left-padded to the widest row.
    """
    batch, width = len(ids), max(t.numel() for t in ids)
    p_max = max(prefix_lens)
    lens = torch.tensor([t.numel() for t in ids])
    plen = torch.tensor(prefix_lens)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    col = torch.arange(width)
    start = width - lens  # first real column of each row (suffixes are left-padded)
    # Padding columns get position P_r: harmless, nothing real attends to them.
    positions = plen[:, None] + (col[None, :] - start[:, None]).clamp(min=0)
    for r, t in enumerate(ids):
        input_ids[r, width - t.numel() :] = t
    if not bool((lens != width).any() or (plen != p_max).any()):
        return input_ids, positions, None
    # Key column k < Pmax is cached slot k; k >= Pmax is computed column k - Pmax.
    key = torch.arange(p_max + width)
    comp = key - p_max
    seen = key[None, None, :] < plen[:, None, None]  # real cached tokens
    seen = seen | (
        (comp[None, None, :] >= start[:, None, None]) & (comp[None, None, :] <= col[None, :, None])
    )
    # A padding column also sees itself so that no row is fully masked.
    seen = seen | (comp[None, None, :] == col[None, :, None])
    mask = torch.zeros(seen.shape, dtype=dtype)
    mask.masked_fill_(~seen, torch.finfo(dtype).min)
    return input_ids, positions, mask[:, None]


def batch_cache(kvs: list[ChunkKV], p_max: int) -> Any:
    """A DynamicCache with each row's prefix K/V, right-padded with zeros to ``p_max``."""
    n_layers, n_heads, _, head_dim = kvs[0].keys.shape
    shape = (n_layers, len(kvs), n_heads, p_max, head_dim)  # [L, B, H, Pmax, D]
    keys, values = kvs[0].keys.new_zeros(shape), kvs[0].values.new_zeros(shape)
    for r, kv in enumerate(kvs):
        keys[:, r, :, : kv.num_tokens] = kv.keys
        values[:, r, :, : kv.num_tokens] = kv.values
    return layered_cache(keys, values)


def query_likelihood(logits: torch.Tensor, input_ids: torch.Tensor, n_query: int) -> list[float]:
    """Each row's mean log-probability of its last ``n_query`` ids (the query), from
    the ``n_query + 1`` last logit columns (columns ``-n_query-1 .. -2`` predict them)."""
    logp = torch.log_softmax(logits[:, :n_query].float(), dim=-1)
    target = input_ids[:, -n_query:].to(logp.device)
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return picked.mean(dim=-1).cpu().tolist()


def judge(logits: torch.Tensor, yes_ids: list[int], no_ids: list[int]) -> list[float]:
    """Each row's ``log P(yes) - log P(no)`` at its last logit column (variants summed)."""
    logp = torch.log_softmax(logits[:, -1].float(), dim=-1)
    yes = torch.logsumexp(logp[:, yes_ids], dim=-1)
    no = torch.logsumexp(logp[:, no_ids], dim=-1)
    return (yes - no).cpu().tolist()
