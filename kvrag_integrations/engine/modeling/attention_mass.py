"""How much attention the last rows of a forward pay each key, inside the model's own forward.

Query-driven selection (ProphetKV, A3) needs the question's attention over the
prompt's keys, which fused attention kernels do not return. Rather than redo a
family's query projection, norms and rotary ourselves, we register an attention
function with transformers' ``AttentionInterface`` that calls the model's own
implementation (sdpa, eager, ...) unchanged and, on the layers asked for, also
computes ``softmax(q k^T * scaling + mask)`` for the last ``rows`` queries (the
queries the model itself built: normed, rotated, scaled as it does). The
model's config points at it only inside :func:`attention_mass`, under the
model's forward lock, so no other forward sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvrag_integrations.engine.modeling.hf_compat import (
    attention_function,
    attn_implementation,
    register_attention,
    set_attn_implementation,
)

_NAME = "kvrag_attention_mass"
_active = threading.local()


class AttentionMass:
    """Per-key attention mass of the last ``rows`` queries, summed over heads,
    queries and ``layers`` (each layer contributes ``rows * heads`` in all)."""

    def __init__(self, layers: set[int], rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.layers = layers
        self.rows = rows
        self.mass: torch.Tensor | None = None

    def add(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
        softcap: float | None,
    ) -> None:
        """Accumulate one layer's weights (``query [1, H, q, d]``, ``key [1, KVH, T, d]``)."""
        heads, kv_heads = query.shape[1], key.shape[1]
        m = min(self.rows, query.shape[2])
        q = query[0, :, -m:].float().reshape(kv_heads, heads // kv_heads * m, -1)
        k = key[0].float()
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [KVH, g*m, T]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(kv_heads, heads // kv_heads, m, -1)
        if mask is not None:
            tail = mask[0, 0, -m:, : k.shape[1]]
            if tail.dtype == torch.bool:
                scores = scores.masked_fill(~tail, float("-inf"))
            else:
                scores = scores + tail.float()
        mass = scores.softmax(dim=-1).sum(dim=(0, 1, 2))
        self.mass = mass if self.mass is None else self.mass + mass


def _mass_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The model's own attention; records weights on the layers asked for."""
    recorder: AttentionMass = _active.recorder
    inner = attention_function(_active.inner, module)
    if getattr(module, "layer_idx", None) in recorder.layers:
        recorder.add(query, key, attention_mask, kwargs.get("scaling"), kwargs.get("softcap"))
    return inner(module, query, key, value, attention_mask, **kwargs)


register_attention(_NAME, _mass_attention)


@contextmanager
def attention_mass(lm: Any, layers: set[int], rows: int) -> Iterator[AttentionMass]:
    """Within the block, the forwards of ``lm`` record the attention mass of
    their last ``rows`` queries on ``layers``. Hold the model's forward lock.

    Every forward inside must pass its own 4D mask (``run_tokens`` over a prompt
    cache does): the model's mask builders do not know this implementation.
    """
    config = lm.config
    inner = attn_implementation(config)
    recorder = AttentionMass(set(layers), rows)
    _active.recorder, _active.inner = recorder, inner
    set_attn_implementation(config, _NAME)
    try:
        yield recorder
    finally:
        set_attn_implementation(config, inner)
        _active.recorder = _active.inner = None
