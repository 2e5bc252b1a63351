"""What the connector's entries are keyed by: the weights vLLM serves, read from their files.

vLLM holds the weights in its own modules (fused projections, sharded), so the
in-process engine's fingerprint (``model_fingerprint``, over transformers'
parameters) cannot be taken there. This one is taken from the checkpoint the
server loads: its config, its tokenizer files, and a strided sample of every
weight file's bytes (any fine-tune or merged adapter changes it), plus the
compute dtype, the cache format version and, under tensor parallelism, the
rank's share of the heads. The connector's scheduler and worker processes
compute it alike; a replica serving the same files computes the same one, so
replicas share entries; entries of another model, dtype or precision are other
keys and are never read.

Entries of the in-process engine are not read by the connector nor the other
way round: the two engines' kernels round differently, and keeping their key
spaces apart keeps every comparison between them honest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrag_integrations.chunk_kv import FORMAT_VERSION, storage_fingerprint
from kvrag_integrations.engine.modeling.checkpoint_identity import folder_fingerprint, local_folder

if TYPE_CHECKING:
    from kvrag_integrations.engine.modeling.layout import ModelLayout

ENGINE_TAG = "vllm"


def model_folder(model: str, revision: str | None = None) -> Path:
    """The local folder of the checkpoint vLLM serves (a directory, or a Hugging
    Face id already in the local cache).

    Raises:
        FileNotFoundError: neither (the connector cannot key entries by the weights).
    """
    try:
        return local_folder(model, revision)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"the KV connector keys entries by the checkpoint's files: {exc}"
        ) from exc


def weights_fingerprint(
    folder: str | os.PathLike[str], dtype: str, extra: str = "", *, weights: bool = True
) -> str:
    """A short hash of a checkpoint folder's config, tokenizer and weights
    (``checkpoint_identity.folder_fingerprint``), the compute ``dtype`` and the cache
    format version.

    Examples:
        >>> import tempfile, pathlib
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = (pathlib.Path(tmp) / "config.json").write_text('{"model_type": "llama"}')
        ...     _ = (pathlib.Path(tmp) / "model.safetensors").write_bytes(bytes(range(256)) * 8)
        ...     a = weights_fingerprint(tmp, "float32")
        ...     a != weights_fingerprint(tmp, "bfloat16")
        True
    """
    return folder_fingerprint(
        folder, ENGINE_TAG, f"{dtype}|{FORMAT_VERSION}|{extra}", weights=weights
    )


def connector_fingerprint(
    model_fingerprint: str, precision: str, tp_rank: int = 0, tp_size: int = 1
) -> str:
    """The storage fingerprint of one worker's entries: the weights', the storage
    precision and, under tensor parallelism, which share of the KV heads it holds.

    Examples:
        >>> connector_fingerprint("abc", "float16")
        'abc+kv-float16'
        >>> connector_fingerprint("abc", "float16", 1, 2)
        'abc+tp1of2+kv-float16'
    """
    base = model_fingerprint if tp_size == 1 else f"{model_fingerprint}+tp{tp_rank}of{tp_size}"
    return storage_fingerprint(base, precision)


def connector_fingerprints(vllm_config: Any, precision: str) -> list[str]:
    """Each tensor-parallel rank's storage fingerprint for what ``vllm_config``
    serves (its checkpoint's files, or the seed of ``load_format="dummy"``'s
    random weights), its dtype and the storage ``precision``."""
    model = vllm_config.model_config
    dtype = str(model.dtype).removeprefix("torch.")
    dummy = str(vllm_config.load_config.load_format) == "dummy"  # random weights of a seed
    extra = f"dummy-seed:{model.seed}" if dummy else ""
    folder = model_folder(model.model, model.revision)
    weights = weights_fingerprint(folder, dtype, extra, weights=not dummy)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return [connector_fingerprint(weights, precision, rank, tp_size) for rank in range(tp_size)]


def rank_layout(folder: str | os.PathLike[str], tp_size: int) -> ModelLayout:
    """The layout a tensor-parallel rank's entries have: the model's (built from its
    config, rotary checked), with its share of the KV heads (at least one).

    Raises:
        UnsupportedModelError: an architecture reuse is not verified for.
    """
    from dataclasses import replace

    from transformers import AutoConfig

    from kvrag_integrations.engine.modeling.layout import ModelLayout

    layout = ModelLayout.of_config(AutoConfig.from_pretrained(folder))
    return layout if tp_size == 1 else replace(layout, kv_heads=max(1, layout.kv_heads // tp_size))
