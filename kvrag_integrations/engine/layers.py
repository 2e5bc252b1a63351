"""A layer-by-layer forward over a prompt cache, computing only chosen tokens.

Every strategy that reuses caches ends here: the prompt's K/V buffer holds each
token's keys and values (cached or not yet computed); ``run_layers`` runs the
chosen tokens through the model's own modules (embedding, norms, q/k/v/o
projections, rotary embedding, MLP, final norm, lm head: the Llama / Qwen2 /
Mistral layout), writes their fresh K/V into the buffer, and returns the logits
of the last prompt token.

Masks are by sequence index: a computed token sees exactly the keys at indices
<= its own, wherever it sits (the reference CacheBlend code aligns the causal
mask bottom-right, which lets a mid-sequence token see later keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvrag_integrations.engine.rope import rotate_half

# selector(layer_index, fresh_q, fresh_k, fresh_v, computed_idx) -> bool keep-mask over
# computed_idx; q is [heads, n, head_dim], k and v [kv_heads, n, head_dim], post-RoPE.
Selector = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PromptKV:
    """The prompt's KV cache in sequence order.

    Attributes:
        keys: ``[layers, kv_heads, tokens, head_dim]`` post-RoPE keys.
        values: same shape.
        positions: ``[tokens]`` RoPE position of each token.
        input_ids: ``[tokens]`` token ids.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def next_position(self) -> int:
        """Position of the first generated token."""
        return int(self.positions.max().item()) + 1 if self.num_tokens else 0


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


def _window(config: Any, layer_idx: int) -> int | None:
    """The sliding-window size of a layer, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types and types[layer_idx] != "sliding_attention":
        return None
    return int(window)


def _mask(query_idx: torch.Tensor, total: int, window: int | None) -> torch.Tensor:
    keys = torch.arange(total, device=query_idx.device)
    mask = keys.unsqueeze(0) <= query_idx.unsqueeze(1)
    if window is not None:
        mask &= keys.unsqueeze(0) > (query_idx.unsqueeze(1) - window)
    return mask


_BLOCKS = 4  # query blocks for a large scattered subset (see _attend)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    idx: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of the queries at sequence indices ``idx`` over ``keys[:, :, :j + 1]``.

    When every token is a query this is plain causal attention (the fused
    kernel, no mask). A large scattered subset is split into blocks by position:
    a block never needs keys past its last query, which skips about a third of
    the masked-out work that one rectangular call would do.
    """
    total = keys.shape[-2]
    if idx.numel() == total and window is None:
        return F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    blocks = _BLOCKS if idx.numel() >= 128 else 1
    outs = []
    for part, q_part in zip(idx.tensor_split(blocks), q.tensor_split(blocks, dim=2)):
        if part.numel() == 0:
            continue
        end = int(part[-1]) + 1
        outs.append(
            F.scaled_dot_product_attention(
                q_part,
                keys[:, :, :end],
                values[:, :, :end],
                attn_mask=_mask(part, end, window),
                scale=scale,
                enable_gqa=True,
            )
        )
    return torch.cat(outs, dim=2)


@torch.no_grad()
def run_layers(
    lm: Any,
    kv: PromptKV,
    compute_idx: torch.Tensor,
    *,
    full_layers: int = 0,
    selector: Selector | None = None,
    write_all_selected_layer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute the tokens ``compute_idx`` through every layer, over the cache ``kv``.

    Args:
        lm: the causal LM (``lm.model`` holds the decoder parts).
        kv: the prompt buffer; computed tokens' K/V are written into it in place.
        compute_idx: sorted indices of the tokens to compute; must include the last.
        full_layers: the first ``full_layers`` layers compute *every* token and write
            its K/V (CacheBlend's full layer 0).
        selector: called at layer ``full_layers`` with the fresh Q/K/V of every token;
            returns which of them to keep computing (tokens in ``compute_idx`` must
            be kept). Only kept tokens' K/V are written from that layer on.
        write_all_selected_layer: also write the fresh K/V of the tokens the selector
            drops at its own layer (they are computed anyway, and exact there).

    Returns:
        ``(logits, computed)``: float32 logits ``[vocab]`` of the last prompt token and
        the indices computed after the selection (for the stats).
    """
    inner = lm.model
    device = kv.keys.device
    total = kv.num_tokens
    widen = full_layers > 0 or selector is not None
    idx = torch.arange(total, device=device) if widen else compute_idx.to(device)
    hidden = inner.embed_tokens(kv.input_ids.to(device)[idx]).unsqueeze(0)
    for layer_no, layer in enumerate(inner.layers):
        attn = layer.self_attn
        head_dim = attn.head_dim
        x = layer.input_layernorm(hidden)
        k = attn.k_proj(x).view(1, idx.numel(), -1, head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, idx.numel(), -1, head_dim).transpose(1, 2)
        if hasattr(attn, "k_norm"):  # Qwen3-style per-head norms
            k = attn.k_norm(k)
        cos, sin = inner.rotary_emb(hidden, kv.positions.to(device)[idx].unsqueeze(0))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        k = _apply_rope(k, cos, sin)
        q = attn.q_proj(x).view(1, idx.numel(), -1, head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        q = _apply_rope(q, cos, sin)
        if selector is not None and layer_no == full_layers:
            if write_all_selected_layer:
                kv.keys[layer_no][:, idx] = k[0]
                kv.values[layer_no][:, idx] = v[0]
            keep = selector(layer_no, q[0], k[0], v[0], idx)
            keep |= torch.isin(idx, compute_idx.to(device))
            idx, hidden = idx[keep], hidden[:, keep]
            q, k, v = q[:, :, keep], k[:, :, keep], v[:, :, keep]
        kv.keys[layer_no][:, idx] = k[0]
        kv.values[layer_no][:, idx] = v[0]
        out = _attend(
            q,
            kv.keys[layer_no].unsqueeze(0),
            kv.values[layer_no].unsqueeze(0),
            idx,
            _window(lm.config, layer_no),
            attn.scaling,
        )
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, idx.numel(), -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if layer_no + 1 == full_layers and selector is None:
            keep = torch.isin(idx, compute_idx.to(device))
            idx, hidden = idx[keep], hidden[:, keep]
    last = inner.norm(hidden[:, -1:])
    logits = lm.lm_head(last)[0, -1].float()
    return logits, idx
