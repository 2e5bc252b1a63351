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
    """The rotate-half pairing used by Llama, Qwen2 and Mistral."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_keys(
    keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Return ``keys`` moved ``delta`` positions later (negative moves earlier).

    Args:
        keys: ``[..., tokens, head_dim]`` post-RoPE keys (any leading dims).
        delta: one shift for all tokens, or a ``[tokens]`` tensor of per-token shifts.
        inv_freq: the model's ``rotary_emb.inv_freq`` (``[rot_dim // 2]``); when
            ``rot_dim < head_dim`` (partial rotary) the rest passes unchanged.

    Example:
        >>> import torch
        >>> inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        >>> k = torch.randn(2, 5, 8)
        >>> torch.allclose(shift_keys(shift_keys(k, 3, inv), -3, inv), k, atol=1e-5)
        True
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    rot_dim = inv_freq.numel() * 2
    delta_t = torch.as_tensor(delta, dtype=torch.float32, device=keys.device)
    inv = inv_freq.to(device=keys.device, dtype=torch.float32)
    angles = delta_t.reshape(-1, 1) * inv  # [tokens or 1, rot_dim/2]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    rot = keys[..., :rot_dim].float()
    moved = rot * cos + rotate_half(rot) * sin
    if rot_dim == keys.shape[-1]:
        return moved.to(keys.dtype)
    return torch.cat((moved.to(keys.dtype), keys[..., rot_dim:]), dim=-1)
