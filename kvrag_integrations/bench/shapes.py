"""Named model shapes with random weights, for timing without a download.

``python -m kvrag_integrations.bench scaling --model llama-3.1-8b --dummy-weights``
builds the named architecture from its transformers config class (the
published dimensions, RoPE scaling included), fills it with random weights
(like vLLM's ``load_format="dummy"``) and pairs it with the bundled SmolLM2
tokenizer (its ids are below every shape's vocabulary). The forward, the
caches and their assembly cost what the real model's do; the answers are
noise, so only timings mean anything. bfloat16 on CUDA, float32 on CPU.
``tiny-llama`` is a 2-layer shape for smoke runs on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from kvrag_integrations import model_files
from kvrag_integrations.engine.modeling.hf_compat import gguf_read_once, prefer_grouped_sdpa
from kvrag_integrations.engine.modeling.host_memory import keep_freed_memory
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.model import (
    LoadedModel,
    model_fingerprint,
    resolve_device,
    resolve_dtype,
)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# config class, then its arguments (each model's published config.json values).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
            max_position_embeddings=131072, rope_parameters=_llama3_rope(32.0),
            tie_word_embeddings=True, rms_norm_eps=1e-5,
        ),
    ),
    "llama-3.1-8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
            max_position_embeddings=131072, rope_parameters=_llama3_rope(8.0),
            tie_word_embeddings=False, rms_norm_eps=1e-5,
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
        ),
    ),
    "mistral-7b": (
        "MistralConfig",
        dict(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
            max_position_embeddings=32768, sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False, rms_norm_eps=1e-5,
        ),
    ),
    "tiny-llama": (
        "LlamaConfig",
        dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            # 49280: room for the bundled tokenizer's added tokens (49157 on transformers 5.0)
            num_key_value_heads=2, vocab_size=49280, max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            tie_word_embeddings=True,
        ),
    ),
}  # fmt: skip


def shape_config(name: str, tokenizer: Any = None) -> transformers.PretrainedConfig:
    """The config of shape ``name`` (special token ids from ``tokenizer`` if given)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; one of {sorted(SHAPES)}")
    class_name, kwargs = SHAPES[name]
    if tokenizer is not None:
        kwargs = dict(
            kwargs,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return getattr(transformers, class_name)(**kwargs)


def bundled_tokenizer() -> Any:
    """The bundled SmolLM2 tokenizer, read from the GGUF file's metadata (no weights)."""
    path = model_files.default_model_file()
    with gguf_read_once():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


DUMMY_SUFFIX = " (dummy weights)"  # the model name of a shape with random weights


def dummy_model(
    name: str,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = None,
    tokenizer: Any = None,
    seed: int = 0,
) -> LoadedModel:
    """Shape ``name`` with random weights, on ``device`` (built there directly: an 8B
    model is never materialized on the host), ready for ``KVRAGEngine``.

    ``dtype`` None: bfloat16 on CUDA, float32 on CPU. ``tokenizer`` None: the
    bundled one.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if dev.type == "cpu":  # as load_model does for CPU models (see there why)
        prefer_grouped_sdpa()
        keep_freed_memory()
    tokenizer = tokenizer if tokenizer is not None else bundled_tokenizer()
    if len(tokenizer) > SHAPES[name][1]["vocab_size"]:
        raise ValueError(f"{name}'s vocabulary is smaller than the tokenizer's")
    config = shape_config(name, tokenizer)
    torch.manual_seed(seed)
    with dev:
        lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    fingerprint = model_fingerprint(lm, tokenizer, torch_dtype, extra=f"dummy:{name}:{seed}")
    label = f"{name}{DUMMY_SUFFIX}"
    return LoadedModel(lm, tokenizer, label, fingerprint, dev, torch_dtype, ModelLayout.of(lm))


def shape_folder(name: str) -> str:
    """A checkpoint folder of shape ``name`` without weights (its config and the
    bundled tokenizer), made once under ``$KVRAG_HOME/shapes``: what vLLM loads
    with ``load_format="dummy"`` (random weights) for the vLLM suite's timings."""
    from kvrag_integrations.model_files import kvrag_home

    folder = kvrag_home() / "shapes" / name
    if not (folder / "config.json").is_file():
        tokenizer = bundled_tokenizer()
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(folder)
        shape_config(name, tokenizer).save_pretrained(folder)
    return str(folder)


__all__ = ["SHAPES", "bundled_tokenizer", "dummy_model", "shape_config", "shape_folder"]
