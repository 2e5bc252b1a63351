"""Attention without a materialized mask where the visible keys are exactly lower-right causal.

When the computed rows of a forward over a prompt cache are a contiguous tail
of the prompt (turbo's question after the chunks, the self-check's tail), each
row ``i`` of ``q`` sees exactly the keys ``0..kv-q+i``: torch's
``causal_lower_right(q, kv)``, which SDPA's fused kernels (flash, cuDNN,
efficient) take as a flag instead of a ``[q, kv]`` additive mask (on an H100 at
16.5k keys, 0.07 ms per layer against 0.36 ms with the mask). Elsewhere (CPU)
torch would materialize that mask in every layer; there one boolean mask is
built per forward and shared by its layers (CPU SDPA takes a boolean mask at
least as fast as an additive one). One row sees every key: no mask at all.

How it reaches the model's own forward: :func:`lower_right_forward` points the
model's config at an ``AttentionInterface`` function of ours for the forward
and passes, for each layer type whose window does not cut in, a zero-stride
placeholder as its 4D mask (nothing materialized). Our function runs SDPA
lower-right on a placeholder seen by the thread that set it, and transformers'
own SDPA on anything else (every other forward: its masks are built as SDPA's,
``register_attention_like``). Layer types whose sliding window cuts in keep
their additive mask. Only models whose attention is ``"sdpa"`` take it:
eager ones (Gemma 2's softcapping, which SDPA cannot do), and any forward
under another wrapper (``attention_mass``), keep today's path, and the first
is named in the log once per architecture.

Within the same block, one query token over a ``[1, 1, 1, kv]`` mask (the
static decode's step, ``engine.modeling.static_decode``) runs as one SDPA
with each K/V head's query heads packed as its rows: no K/V copy per group.

``KVRAG_FAST_PATH=0`` (or ``false``) turns it off (the engine's fast paths'
one switch).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from kvrag_integrations.engine.modeling.hf_compat import (
    attention_function,
    attn_implementation,
    register_attention_like,
    set_attn_implementation,
)

logger = logging.getLogger(__name__)

_NAME = "kvrag_sdpa_lower_right"
_INNER = "sdpa"
_active = threading.local()  # .on: this thread's forward passed placeholders; .masks
_swap_lock = threading.Lock()
_swapped: dict[int, int] = {}  # id(config) -> forwards inside (re-entrant, any thread)
_named: set[str] = set()
# Where SDPA takes causal_lower_right as a flag (fused kernels); elsewhere torch
# would materialize it per layer, and our per-forward boolean mask is cheaper.
_FLAG_DEVICES = ("cuda",)


def fast_path_enabled() -> bool:
    """False where ``KVRAG_FAST_PATH`` is ``0``/``false``/``off``/``no``."""
    return os.environ.get("KVRAG_FAST_PATH", "1").strip().lower() not in ("0", "false", "off", "no")


def placeholder(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``[1, 1, q, kv]`` zero-stride view standing for lower-right causal (one element)."""
    return torch.zeros((), dtype=dtype, device=device).expand(1, 1, q_len, kv_len)


def _is_placeholder(mask: Any) -> bool:
    return (
        getattr(_active, "on", False)
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 4
        and all(s == 0 for s in mask.stride())
    )


def _lower_right_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA lower-right on our placeholder, one query over a mask (a static
    decode step) with its heads packed; transformers' SDPA on anything else."""
    if _is_one_query(query, attention_mask) and kwargs.get("softcap") is None:
        return _packed_one_query(module, query, key, value, attention_mask, scaling)
    if not _is_placeholder(attention_mask) or kwargs.get("softcap") is not None:
        inner = attention_function(_INNER, module)
        return inner(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    # one row sees every key: no mask; on CUDA the flag (a fused kernel takes it)
    if q_len == 1:
        bias = None
    elif query.device.type in _FLAG_DEVICES:
        bias = causal_lower_right(q_len, kv_len)
    else:
        bias = _bool_mask(q_len, kv_len, query.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=bias,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _is_one_query(query: torch.Tensor, mask: Any) -> bool:
    return (
        getattr(_active, "on", False)
        and query.shape[2] == 1
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 4
        and mask.shape[2] == 1
        and mask.shape[1] == 1
        and not all(s == 0 for s in mask.stride())
    )


def _packed_one_query(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
) -> tuple[torch.Tensor, None]:
    """One query token over ``[1, 1, 1, kv]`` mask: the query heads of each K/V head
    as that head's rows (``[b, kv_heads, groups, d]``), so SDPA reads each K/V head
    once and no kernel needs grouped-query support with a mask (transformers
    copies K/V per group there before 5.24)."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def _bool_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, q, kv]`` lower-right causal as booleans, built once per forward."""
    masks = _active.masks
    key = (q_len, kv_len, device)
    if key not in masks:
        rows = torch.arange(kv_len - q_len, kv_len, device=device)
        masks[key] = (torch.arange(kv_len, device=device)[None, :] <= rows[:, None])[None, None]
    return masks[key]


register_attention_like(_NAME, _lower_right_attention, like=_INNER)


def can_take(lm: Any) -> bool:
    """Whether ``lm``'s forwards may run lower-right now (its attention is SDPA,
    unwrapped, and the switch is on); names an architecture that cannot, once."""
    if not fast_path_enabled():
        return False
    impl = attn_implementation(lm.config)
    if impl in (_INNER, _NAME):
        return True
    arch = type(lm).__name__
    if impl == "eager" and arch not in _named:
        _named.add(arch)
        logger.info(
            "%s runs eager attention (softcapping or its config): reuse forwards keep "
            "their additive masks (no mask-free attention)",
            arch,
        )
    return False


@contextmanager
def lower_right_forward(lm: Any) -> Iterator[None]:
    """Within the block, this thread's forward of ``lm`` runs our attention
    function (placeholders as lower-right). Re-entrant and safe with other
    threads' forwards (they get transformers' SDPA and its masks)."""
    config, key = lm.config, id(lm.config)
    with _swap_lock:
        if _swapped.get(key, 0) == 0:
            set_attn_implementation(config, _NAME)
        _swapped[key] = _swapped.get(key, 0) + 1
    previous = getattr(_active, "on", False), getattr(_active, "masks", None)
    _active.on, _active.masks = True, {}
    try:
        yield
    finally:
        _active.on, _active.masks = previous
        with _swap_lock:
            _swapped[key] -= 1
            if _swapped[key] == 0:
                del _swapped[key]
                set_attn_implementation(config, _INNER)
