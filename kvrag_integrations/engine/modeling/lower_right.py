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

The static decode's steps (``engine.modeling.static_decode``: one token, or
a prompt's tail, over a bucket's whole K/V) pass the same placeholder with
``lower_right_forward(lm, slots=...)``: the rows sit at those cache slots of
a longer buffer, each sees the slots up to its own, and attention reads only
the filled ones
(``filled_attention``: a split-KV Triton kernel, or SDPA under a mask).

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

from kvrag_integrations.engine.modeling.filled_attention import filled_attention
from kvrag_integrations.engine.modeling.hf_compat import (
    attention_function,
    attn_implementation,
    register_attention_like,
    set_attn_implementation,
)
from kvrag_integrations.errors import UnsupportedModelError

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
    """SDPA lower-right on our placeholder, attention over the filled slots on a
    placeholder of the static decode; transformers' SDPA on anything else."""
    slots = getattr(_active, "slots", None)
    if slots is not None and _is_placeholder(attention_mask):
        if kwargs.get("softcap") is not None:  # the static decode refuses these models
            raise UnsupportedModelError("the static decode cannot softcap attention")
        return filled_attention(query, key, value, slots, scaling), None
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
def lower_right_forward(lm: Any, slots: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, this thread's forward of ``lm`` runs our attention
    function (placeholders as lower-right; with ``slots``, a device tensor, as
    rows at those slots of a static cache, reading only the filled slots).
    Re-entrant and safe with other threads' forwards (they get transformers'
    SDPA and its masks)."""
    config, key = lm.config, id(lm.config)
    with _swap_lock:
        if _swapped.get(key, 0) == 0:
            set_attn_implementation(config, _NAME)
        _swapped[key] = _swapped.get(key, 0) + 1
    previous = (getattr(_active, "on", False), getattr(_active, "masks", None),
                getattr(_active, "slots", None))  # fmt: skip
    _active.on, _active.masks, _active.slots = True, {}, slots
    try:
        yield
    finally:
        _active.on, _active.masks, _active.slots = previous
        with _swap_lock:
            _swapped[key] -= 1
            if _swapped[key] == 0:
                del _swapped[key]
                set_attn_implementation(config, _INNER)
