"""What KV reuse needs to know about a model, in one place: its layout.

Layers, KV heads, head size, each layer's attention window and how its keys
were rotated. Everything else (norms, multipliers, softcapping, MoE routing,
biases, QK-norms) stays the model's own code: the strategies run its forward
over the prompt cache (see ``engine.modeling.forward``), so only moving stored keys to
new positions is model-specific, and that is derived here from the model's own
rotary module and checked against its own ``apply_rotary_pos_emb`` at load.

Only architectures whose reuse the tests verify against transformers' forward
are accepted (:data:`SUPPORTED_ARCHITECTURES`); anything else is refused with
``UnsupportedModelError`` before it can answer wrongly. Adding one: add its
class name, then a case to ``tests/unit/test_families.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrag_integrations.engine.modeling.hf_compat import (
    apply_rotary_pos_emb,
    attn_implementation,
    decoder_layers,
    rope_parameters,
    rotary_cos_sin,
    rotary_inv_freq,
    self_attention,
    skeleton_model,
)
from kvrag_integrations.engine.modeling.rope import rotate_keys, rotation, shift_keys
from kvrag_integrations.errors import UnsupportedModelError

# Verified by tests/unit/test_families.py (turbo and blend against the model's own forward).
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "GraniteForCausalLM",
        "Olmo2ForCausalLM",
        "CohereForCausalLM",
    }
)

# RoPE variants whose frequencies do not depend on the sequence length, so a
# cached key moves exactly by one more rotation.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})

# Attention kernels that take the explicit 4D mask the reuse strategies need.
MASKED_ATTENTION = frozenset({"sdpa", "eager"})

_WHAT_WORKS = 'strategy="full" (plain prefill, no reuse) still works with any model'


@dataclass(frozen=True)
class RotaryShift:
    """How one layer type's keys move: ``inv_freq`` and the pairing convention."""

    inv_freq: torch.Tensor = field(repr=False)  # float32 [rot_dim // 2]
    interleaved: bool  # pairs (0,1),(2,3)... (Cohere) instead of (i, i + rot_dim/2)

    def shift(
        self, keys: torch.Tensor, delta: int | torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return shift_keys(keys, delta, self.inv_freq, out=out, interleaved=self.interleaved)

    def rotation(
        self, delta: int | torch.Tensor, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of a move by ``delta`` (one per token, or one for all)."""
        return rotation(delta, self.inv_freq, device)

    def rotate(
        self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Apply a :meth:`rotation` to ``keys`` into ``out`` (which may be ``keys``)."""
        return rotate_keys(keys, cos, sin, out, self.interleaved)


@dataclass(frozen=True)
class ModelLayout:
    """The facts KV reuse reads about a model (built once at load by :meth:`of`).

    Attributes:
        architecture: the model class name.
        num_layers, kv_heads, head_dim: the shape of a layer's K/V.
        layer_types: ``"full_attention"`` or ``"sliding_attention"`` per layer.
        windows: each layer's sliding window (None: full attention).
        rotary: per layer type, how its stored keys move to a new position.
        attn_implementation: the attention kernel the model runs.
        refused: why reuse is off for this model although it could run
            (``load_model(reuse=False)``), or None.
    """

    architecture: str
    num_layers: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]
    rotary: dict[str, RotaryShift]
    attn_implementation: str
    refused: str | None = None

    @property
    def reuse_refused(self) -> str | None:
        """Why reuse strategies cannot run on this model, or None."""
        if self.refused:
            return self.refused
        if self.attn_implementation in MASKED_ATTENTION:
            return None
        return (
            f"attn_implementation={self.attn_implementation!r} takes no explicit attention "
            f"mask; KV reuse needs one of {sorted(MASKED_ATTENTION)} ({_WHAT_WORKS})"
        )

    def rotary_of(self, layer: int) -> RotaryShift:
        """How layer ``layer``'s keys move (layer types may differ in RoPE)."""
        return self.rotary[self.layer_types[layer]]

    @classmethod
    def of(cls, lm: Any) -> ModelLayout:
        """Read and verify the layout of a loaded causal LM.

        Raises:
            UnsupportedModelError: an architecture the tests do not verify, a RoPE
                whose frequencies depend on length, or a rotary convention that
                cannot be reproduced.
        """
        arch = type(lm).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{arch} is not supported for KV reuse: only architectures verified against "
                f"transformers' own forward are ({', '.join(sorted(SUPPORTED_ARCHITECTURES))}); "
                f"{_WHAT_WORKS}"
            )
        config = lm.config
        attn = self_attention(lm)
        num_layers = len(decoder_layers(lm))
        head_dim = int(attn.head_dim)
        kv_heads = int(config.num_key_value_heads or config.num_attention_heads)
        types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
        windows = tuple(_window(config, t) for t in types)
        rotary = {t: _rotary_shift(lm, t, arch) for t in dict.fromkeys(types)}
        impl = attn_implementation(config)
        return cls(arch, num_layers, kv_heads, head_dim, types, windows, rotary, impl)

    @classmethod
    def of_config(cls, config: Any) -> ModelLayout:
        """``of`` for a model known only by its config: its class built with no
        weights (``hf_compat.skeleton_model``), rotary frequencies real. The
        vLLM connector moves stored keys with it; the same checks refuse the
        same models.
        """
        return cls.of(skeleton_model(config))


def _window(config: Any, layer_type: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    if getattr(config, "layer_types", None) and layer_type != "sliding_attention":
        return None
    return int(window)


def rope_type(config: Any, layer_type: str | None = None) -> str:
    """The RoPE variant of a config (of one layer type, where they differ)."""
    params = rope_parameters(config)
    if params and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    if not params:
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def _rotary_shift(lm: Any, layer_type: str, arch: str) -> RotaryShift:
    """Derive the key shift of a layer type from the model's own rotary module.

    ``inv_freq`` comes from the module; the pairing convention is whichever of
    rotate-half or interleaved reproduces the model's ``apply_rotary_pos_emb``
    on its own cos/sin (so partial rotary, per-type bases and scaled variants
    are checked, not assumed).
    """
    rope = rope_type(lm.config, layer_type)
    if rope not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch} uses RoPE type {rope!r}, whose frequencies change with sequence length, "
            f"so cached keys cannot be moved exactly (supported: {sorted(STATIC_ROPE_TYPES)}); "
            f"{_WHAT_WORKS}"
        )
    inv_freq = rotary_inv_freq(lm, layer_type)
    apply = apply_rotary_pos_emb(lm)
    if inv_freq is None or apply is None:
        raise UnsupportedModelError(f"{arch}: no rotary frequencies to move cached keys by")
    cos_sin = rotary_cos_sin(lm, layer_type)
    inv_freq = inv_freq.detach().float().cpu()
    head_dim = int(self_attention(lm).head_dim)
    for interleaved in (False, True):
        candidate = RotaryShift(inv_freq, interleaved)
        if _reproduces(candidate, apply, cos_sin, head_dim):
            return candidate
    raise UnsupportedModelError(
        f"{arch}: its rotary embedding is neither rotate-half nor interleaved over "
        f"inv_freq, so cached keys cannot be moved exactly; {_WHAT_WORKS}"
    )


def _reproduces(candidate: RotaryShift, apply: Callable, cos_sin: Callable, head_dim: int) -> bool:
    """Does ``candidate`` move keys as the model's own rotation does (positions 0 -> d)?"""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 4, head_dim, generator=gen)
    for delta in (1, 7, 513):
        cos, sin = cos_sin(torch.full((4,), delta))
        _, expect = apply(keys, keys, cos, sin)
        got = candidate.shift(keys, delta)
        if not torch.allclose(got, expect, atol=1e-4, rtol=1e-4):
            return False
    return True
