"""Moving cached keys to new positions.

HF caches hold keys *after* RoPE. A key rotated for position ``p`` becomes the
key for ``p + d`` by one more rotation of angle ``d * inv_freq`` (rotations
compose), in the same rotate-half convention the model used. The angles are
computed in float32 from ``inv_freq`` itself, not from the rotary module's
cos/sin, which carry ``attention_scaling`` (YaRN) that must not be applied twice.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotate-half pairing used by Llama, Qwen, Mistral, Gemma and most others."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_keys(
    keys: torch.Tensor,
    delta: int | torch.Tensor,
    inv_freq: torch.Tensor,
    out: torch.Tensor | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """Return ``keys`` moved ``delta`` positions later (negative moves earlier).

    Args:
        keys: ``[..., tokens, head_dim]`` post-RoPE keys (any leading dims).
        delta: one shift for all tokens, or a ``[tokens]`` tensor of per-token shifts.
        inv_freq: the model's ``rotary_emb.inv_freq`` (``[rot_dim // 2]``); when
            ``rot_dim < head_dim`` (partial rotary) the rest passes unchanged.
        out: optional destination (same shape as ``keys``; ``keys`` itself, or
            not overlapping it).
        interleaved: pairs are adjacent dims ``(2i, 2i + 1)`` (Cohere) instead of
            ``(i, i + rot_dim / 2)`` (rotate-half: Llama, Qwen, Mistral, Gemma, ...).

    Examples:
        >>> import torch
        >>> inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        >>> k = torch.randn(2, 5, 8)
        >>> torch.allclose(shift_keys(shift_keys(k, 3, inv), -3, inv), k, atol=1e-5)
        True
    """
    if out is None:
        out = torch.empty_like(keys)
    if isinstance(delta, int) and delta == 0:
        return out.copy_(keys)
    cos, sin = rotation(delta, inv_freq, keys.device)
    return rotate_keys(keys, cos, sin, out, interleaved)


def rotation(
    delta: int | torch.Tensor, inv_freq: torch.Tensor, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` ``[tokens or 1, rot_dim // 2]`` of a move by ``delta``
    (computed once, then applied to every layer of one rotary by :func:`rotate_keys`)."""
    delta_t = torch.as_tensor(delta, dtype=torch.float32, device=device)
    angles = delta_t.reshape(-1, 1) * inv_freq.to(device=device, dtype=torch.float32)
    return angles.cos(), angles.sin()


def rotate_keys(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    interleaved: bool = False,
) -> torch.Tensor:
    """Apply a :func:`rotation` to ``keys`` into ``out`` (``out`` may be ``keys``)."""
    half = cos.shape[-1]
    rot_dim = 2 * half
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): rotate-half, without the
    # temporaries of cat(): this runs over every cached key of every prompt.
    # Both halves are computed before either is written, so out may be keys.
    if interleaved:
        x1, x2 = keys[..., 0:rot_dim:2], keys[..., 1:rot_dim:2]
    else:
        x1, x2 = keys[..., :half], keys[..., half:rot_dim]
    if keys.dtype != torch.float32:
        x1, x2 = x1.float(), x2.float()
    o1 = x1 * cos
    o1.addcmul_(x2, sin, value=-1)
    o2 = x2 * cos
    o2.addcmul_(x1, sin)
    if interleaved:
        out[..., 0:rot_dim:2] = o1
        out[..., 1:rot_dim:2] = o2
    else:
        out[..., :half] = o1
        out[..., half:rot_dim] = o2
    if rot_dim < keys.shape[-1] and out is not keys:
        out[..., rot_dim:] = keys[..., rot_dim:]
    return out
