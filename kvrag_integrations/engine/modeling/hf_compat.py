"""Every transformers internal the engine touches, in one place.

The engine runs the model's own forward through transformers' extension points
(a ``Cache`` subclass, ``AttentionInterface``, 4D masks by layer type, the
rotary module), so a transformers release can move any of them. This module is
where the differences between releases are absorbed; nothing else in the
package imports from ``transformers.cache_utils``, ``masking_utils``,
``modeling_utils`` or ``integrations`` (``tests/unit/test_hf_compat.py``
checks), and ``docs/architecture.md`` lists each touchpoint, the versions it was
checked on and what breaks if it changes. ``engine.modeling.self_check`` runs at load
and refuses reuse (``UnsupportedModelError``) where a release breaks one of them
in a way this module does not know yet.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from transformers import AttentionInterface, Cache, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = [
    "Cache",
    "DynamicCache",
    "ForwardCache",
    "RecordingDynamicCache",
    "apply_rotary_pos_emb",
    "attention_function",
    "attn_implementation",
    "cache_argument",
    "cache_layers",
    "decoder_layers",
    "gguf_read_once",
    "layered_cache",
    "model_mask",
    "output_cache",
    "prefer_grouped_sdpa",
    "register_attention",
    "register_attention_like",
    "rope_parameters",
    "rotary_cos_sin",
    "rotary_inv_freq",
    "self_attention",
    "set_attn_implementation",
    "shallow_model",
    "skeleton_model",
    "versions",
]


def versions() -> str:
    """``"transformers X, torch Y"``: what an error about a release names."""
    return f"transformers {transformers.__version__}, torch {torch.__version__}"


# -- caches -------------------------------------------------------------------------------------
# transformers 5.24 calls ``cache.update(k, v, layer_idx, kwargs=kwargs)``; earlier 5.x
# releases ``update(k, v, layer_idx, cache_kwargs)``. Our caches accept any extra
# arguments and pass them on to transformers' own update where they call it.


class ForwardCache(Cache):
    """A cache of ours for one forward: subclasses implement ``write``.

    ``write(key_states, value_states, layer_idx)`` takes a layer's fresh K/V
    ``[1, kv_heads, n, head_dim]`` and returns the K/V the layer attends over.
    """

    def __init__(self) -> None:
        super().__init__(layers=[])

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.write(key_states, value_states, layer_idx)

    @property
    def is_compileable(self) -> bool:
        return False


class RecordingDynamicCache(DynamicCache):
    """transformers' config-less ``DynamicCache`` (every token kept on sliding
    layers too) that also hands each layer's fresh K/V to ``on_update``.
    ``keep=False``: for a forward from an empty cache, the layer attends over its
    fresh K/V (what an empty ``DynamicCache`` hands back) and nothing is kept
    (``on_update`` holds the one copy); the cache stays empty throughout."""

    def __init__(
        self, on_update: Callable[[torch.Tensor, torch.Tensor, int], None], keep: bool = True
    ) -> None:
        super().__init__()
        self.on_update = on_update
        self.keep = keep

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.on_update(key_states, value_states, layer_idx)
        if not self.keep:
            return key_states, value_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` per layer of a transformers cache object."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]


def layered_cache(
    keys: Sequence[torch.Tensor] | torch.Tensor, values: Sequence[torch.Tensor] | torch.Tensor
) -> DynamicCache:
    """A ``DynamicCache`` of per-layer K/V, each ``[batch, kv_heads, tokens, head_dim]``
    (a list, or a tensor stacked by layer; views, no copy)."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


@functools.cache
def _cache_argument_of(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(module: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a model's forward: ``cache=`` where the model takes
    it (transformers >= 5.24, which deprecates ``past_key_values=`` for removal
    in 5.40), else ``past_key_values=``."""
    return {_cache_argument_of(type(module)): cache}


def output_cache(output: Any) -> Any:
    """The cache a model's forward returned (``.cache`` from 5.24, else ``.past_key_values``)."""
    cache = output.get("cache") if hasattr(output, "get") else None
    return cache if cache is not None else output.past_key_values


# -- masks --------------------------------------------------------------------------------------


def model_mask(masks: dict[str, torch.Tensor]) -> Any:
    """What the model's forward takes as ``attention_mask`` given one 4D additive mask
    ``[1, 1, q, k]`` per layer type: a dict by layer type where its layers differ (the
    models then skip their own mask builders), else the one 4D mask."""
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def prefer_grouped_sdpa() -> None:
    """Let torch's sdpa take grouped K/V with a mask on CPU (transformers otherwise
    copies K/V once per query head group whenever a mask is given). A user's own
    setting of ``TRANSFORMERS_SDPA_FORCE_GQA`` wins."""
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


# -- attention ----------------------------------------------------------------------------------


def register_attention(name: str, function: Callable[..., Any]) -> None:
    """Register an attention function under ``name`` (``AttentionInterface``)."""
    AttentionInterface.register(name, function)


def register_attention_like(name: str, function: Callable[..., Any], like: str) -> None:
    """Register an attention function under ``name`` whose masks the model builds as
    for ``like`` (its mask function): a forward that passes no mask of its own (a
    decoding step, the reranker's padded batch) gets the masks ``like`` would get."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[like])


def attention_function(name: str, module: Any) -> Callable[..., Any]:
    """The attention function the model would run for ``name`` (its own eager one
    for ``"eager"``)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # not in 5.0.0
        return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)
    return eager if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def attn_implementation(config: Any) -> str:
    """The attention kernel a model's config selects (``"eager"`` if unset)."""
    return str(getattr(config, "_attn_implementation", None) or "eager")


def set_attn_implementation(config: Any, name: str) -> None:
    """Point a loaded model's config at another attention function (read per forward)."""
    config._attn_implementation = name


# -- model structure and rotary -----------------------------------------------------------------


def decoder_layers(lm: Any) -> Any:
    """The decoder layers of a causal LM (``lm.model.layers``)."""
    return lm.model.layers


class _VocabSlice(torch.nn.Module):
    """The model's output projection restricted to its first ``vocab`` rows (a view)."""

    def __init__(self, head: torch.nn.Linear, vocab: int) -> None:
        super().__init__()
        self.weight = head.weight[:vocab]
        self.bias = head.bias[:vocab] if head.bias is not None else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)


@contextmanager
def shallow_model(lm: Any, layers: int, vocab: int) -> Iterator[None]:
    """Within the block, the model's forward runs only its first ``layers`` decoder
    layers (the same modules, layer indices and types unchanged: models index
    ``config.layer_types`` by position, so it must be a prefix) and scores only
    the first ``vocab`` tokens. Not thread-safe: only for a model nothing else
    runs yet (at load)."""
    blocks, head = decoder_layers(lm), lm.lm_head
    lm.model.layers = torch.nn.ModuleList(list(blocks)[:layers])
    lm.lm_head = _VocabSlice(head, vocab)
    try:
        yield
    finally:
        lm.model.layers, lm.lm_head = blocks, head


def skeleton_model(config: Any) -> Any:
    """The causal LM of ``config`` with its parameters on the meta device and its
    buffers (the rotary frequencies) real: what ``ModelLayout.of`` reads, for a
    process that serves the weights with another runtime (the vLLM connector),
    in milliseconds and no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config)


def self_attention(lm: Any) -> Any:
    """The first decoder layer's attention module (head size, module of its family)."""
    return decoder_layers(lm)[0].self_attn


def rope_parameters(config: Any) -> dict[str, Any] | None:
    """A config's RoPE parameters (``rope_parameters`` in 5.x, ``rope_scaling`` before)."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)


def rotary_inv_freq(lm: Any, layer_type: str) -> torch.Tensor | None:
    """The inverse frequencies of one layer type's rotary embedding (per-type first)."""
    rotary = lm.model.rotary_emb
    inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
    return inv_freq if inv_freq is not None else getattr(rotary, "inv_freq", None)


def apply_rotary_pos_emb(lm: Any) -> Callable[..., Any] | None:
    """The family's own ``apply_rotary_pos_emb`` (from its modeling module)."""
    module = sys.modules[type(self_attention(lm)).__module__]
    return getattr(module, "apply_rotary_pos_emb", None)


def rotary_cos_sin(
    lm: Any, layer_type: str
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``positions -> (cos, sin)`` from the model's rotary module, without attention scaling."""
    rotary = lm.model.rotary_emb
    per_type = len(inspect.signature(rotary.forward).parameters) >= 3
    scaling = getattr(rotary, f"{layer_type}_attention_scaling", None)
    if scaling is None:
        scaling = getattr(rotary, "attention_scaling", 1.0)

    def cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = next((b.device for b in rotary.buffers()), torch.device("cpu"))
        x = torch.zeros(1, dtype=torch.float32, device=device)
        pos = positions.to(device).unsqueeze(0)
        cos, sin = rotary(x, pos, layer_type) if per_type else rotary(x, pos)
        return (cos / scaling).cpu(), (sin / scaling).cpu()

    return cos_sin


_GGUF_PATCH = threading.RLock()


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within this block each GGUF file is parsed once, and each tensor name map
    built once.

    transformers' ``load_gguf_checkpoint`` makes a new ``gguf.GGUFReader`` for the
    config, again for the tokenizer and again for the weights, and gguf-py parses
    the whole vocabulary each time, element by element; mapping names builds a
    ``TensorNameMap`` for every module of the model (SmolLM2: 397 of them). Both
    are looked up on ``gguf`` at call time, read only, and depend only on their
    arguments, so one of each serves every call: a first load of SmolLM2 takes
    ~7 s instead of ~17 s, of Gemma-3-270M (262k tokens) ~30 s instead of ~55 s
    (2-core CPU). Where a release reads GGUF another way, this changes nothing."""
    try:
        import gguf
    except ImportError:  # transformers raises its own error when it needs gguf
        yield
        return
    with _GGUF_PATCH:  # one patch at a time, undone in the order it was made
        originals = {name: getattr(gguf, name, None) for name in _GGUF_MEMOIZED}
        for name, original in originals.items():
            if original is not None:
                setattr(gguf, name, _memoized(original, _GGUF_MEMOIZED[name]))
        try:
            yield
        finally:
            for name, original in originals.items():
                if original is not None:
                    setattr(gguf, name, original)


def _memoized(function: Callable[..., Any], key: Callable[..., Any]) -> Callable[..., Any]:
    results: dict[Any, Any] = {}

    def once(*args: Any, **kwargs: Any) -> Any:
        k = key(*args, **kwargs)
        if k not in results:
            results[k] = function(*args, **kwargs)
        return results[k]

    return once


# gguf's callables memoized by gguf_read_once, with the key of their arguments.
_GGUF_MEMOIZED: dict[str, Callable[..., Any]] = {
    "GGUFReader": lambda path, mode="r": (os.path.realpath(path), mode),
    "get_tensor_name_map": lambda arch, n_blocks: (arch, n_blocks),
}
