"""The vLLM connector's key space: the checkpoint's files, not where they lie."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from kvrag_integrations.vllm.identity import (
    connector_fingerprint,
    model_folder,
    weights_fingerprint,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved as vLLM would load it (config, safetensors)."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_copy_elsewhere_has_the_same_fingerprint(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    assert weights_fingerprint(copy, "float32") == weights_fingerprint(checkpoint, "float32")


def test_weights_dtype_and_config_change_it(checkpoint: Path, tmp_path: Path) -> None:
    base = weights_fingerprint(checkpoint, "float32")
    assert weights_fingerprint(checkpoint, "bfloat16") != base
    assert weights_fingerprint(checkpoint, "float32", "dummy-seed:0") != base
    tuned = tmp_path / "tuned"
    shutil.copytree(checkpoint, tuned)
    model = transformers.AutoModelForCausalLM.from_pretrained(tuned)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1e-3)  # a fine-tune: same names, shapes and sizes
    model.save_pretrained(tuned)
    assert weights_fingerprint(tuned, "float32") != base
    config = tmp_path / "config"
    shutil.copytree(checkpoint, config)
    text = (
        (config / "config.json")
        .read_text()
        .replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05')
    )
    (config / "config.json").write_text(text)
    assert weights_fingerprint(config, "float32") != base


def test_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weight files"):
        weights_fingerprint(tmp_path, "float32")
    with pytest.raises(FileNotFoundError, match="keys entries by the checkpoint's files"):
        model_folder("no-such-org/no-such-model-kvrag")


def test_tensor_parallel_ranks_key_apart() -> None:
    one = connector_fingerprint("w", "float16")
    ranks = {connector_fingerprint("w", "float16", r, 2) for r in range(2)}
    assert one not in ranks and len(ranks) == 2
    assert connector_fingerprint("w", "int8") != one
