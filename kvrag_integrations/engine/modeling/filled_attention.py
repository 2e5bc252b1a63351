"""Attention over the filled part of a static cache: the one hook the static
decode's steps (one token, or a prompt's tail) attend through.

The query rows are ``T`` tokens written at ascending cache slots ``slots`` of
a bucket's K/V (``[1, kv_heads, L, d]``); row ``t`` sees the slots ``0 ..
slots[t]``. ``slots`` is a device tensor, so the shapes are the bucket's
whatever the filled length (a CUDA graph replays the same launch for every
token).

Two ways to compute it, the same numbers up to rounding:

- the Triton kernel (``triton_attention``): split over the filled length
  (flash-decoding), reading nothing past the last row's slot, so a step's time
  grows with the filled length and not with the bucket. It runs on CUDA where
  Triton is importable (``BACKEND="auto"``), and on CPU tensors with
  ``BACKEND="triton"`` under ``TRITON_INTERPRET=1`` (set before Triton is
  imported: how the unit tier tests it).
- torch's SDPA over the whole bucket with a boolean mask built from ``slots``
  (the fallback: no Triton, or shapes the kernel does not take): each K/V
  head's query heads packed as its rows, so SDPA reads each K/V head once and
  no grouped-query copy of the cache is made. Unwritten slots must then hold
  finite values (0 x NaN would leak in): buckets are allocated zeroed.

``BACKEND`` (``"auto"``, ``"torch"`` or ``"triton"``) picks; the GPU check
times both.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "filled_attention", "kernel_available", "masked_sdpa"]

BACKEND = "auto"  # "torch": always the masked SDPA; "triton": the kernel on CPU too
_kernel: Any = None  # the Triton entry points once imported; False: none here
_named: set[str] = set()


def _load_kernel() -> Any:
    global _kernel
    if _kernel is None:
        try:
            from kvrag_integrations.engine.modeling import triton_attention
        except ImportError as exc:  # no Triton (CPU wheels, the lowest lane)
            _kernel = False
            logger.info("no Triton (%s): static decode attention runs masked SDPA", exc)
        else:
            _kernel = triton_attention
    return _kernel


def kernel_available(device: torch.device) -> bool:
    """Whether the Triton kernel runs on ``device`` here (CUDA with Triton; CPU
    tensors with ``BACKEND="triton"`` under ``TRITON_INTERPRET=1``)."""
    if BACKEND == "torch":
        return False
    interpreted = BACKEND == "triton" and os.environ.get("TRITON_INTERPRET", "0") != "0"
    return (device.type == "cuda" or interpreted) and bool(_load_kernel())


def filled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[1, heads, T, d]`` (row ``t`` at slot ``slots[t]``,
    ascending) over a bucket's ``key``/``value`` ``[1, kv_heads, L, d]``;
    returns ``[1, T, heads, d]``, the layout transformers' attention functions
    return."""
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if kernel_available(query.device):
        kernel = _load_kernel()
        if kernel.supports(query, key, value):
            return kernel.filled_attention_triton(query, key, value, slots, scale)
        shape = f"{tuple(query.shape)} over {tuple(key.shape)} {query.dtype}"
        if shape not in _named:
            _named.add(shape)
            logger.info(
                "static decode attention: masked SDPA for %s (kernel does not take it)", shape
            )
    return masked_sdpa(query, key, value, slots, scale)


def masked_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The fallback: SDPA over the whole bucket, a boolean mask from ``slots``,
    query heads packed onto their K/V heads (rows ``t * groups + g``)."""
    _, heads, rows_t, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    seen = torch.arange(length, device=key.device)[None, :] <= slots.reshape(-1, 1)  # [T, L]
    packed = query.reshape(1, kv_heads, groups, rows_t, dim).transpose(2, 3)
    packed = packed.reshape(1, kv_heads, rows_t * groups, dim)
    # one row: its mask broadcasts over the packed heads; else one row per (t, g)
    mask = seen if rows_t == 1 else seen.repeat_interleave(groups, dim=0)
    mask = mask[None, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scale
    )
    out = out.reshape(1, kv_heads, rows_t, groups, value.shape[-1]).permute(0, 2, 1, 3, 4)
    return out.reshape(1, rows_t, heads, value.shape[-1])
