"""Unit tier fixtures: a tiny random model in place of real weights.

Nothing in this tier loads real weights, starts a server or builds docs. Engine
level tests get ``engine``: the same settings as the integration tier's
``engine`` (``on_miss="encode"``, ``cache_precision="model"``) around a tiny
randomly initialised Llama (2 layers, hidden size 64, float32) and the bundled
SmolLM2 tokenizer, so tokenization, chat template and special tokens are the
real ones. Exactness checks compare against transformers' own forward of that
model, which is as strict on random weights as on trained ones.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kvrag_integrations import KVRAGEngine, model_files
from kvrag_integrations import embeddings as embeddings_module
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.model import LoadedModel, model_fingerprint

TINY_NAME = "tiny-llama"
_default_model_file = model_files.default_model_file  # before no_real_weights patches it


def smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The bundled SmolLM2 tokenizer, read from the GGUF file's metadata (no weights)."""
    path = _default_model_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if tokenizer.pad_token_id is None:  # as load_model does
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tiny_llama(tokenizer: transformers.PreTrainedTokenizerBase) -> LoadedModel:
    """A SmolLM2-shaped Llama (same vocabulary, tied embeddings), tiny and random."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        initializer_range=0.2,  # large weights: a wrong cache shows in the logits
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    fp = model_fingerprint(lm, tokenizer, torch.float32)
    return LoadedModel(
        lm, tokenizer, TINY_NAME, fp, torch.device("cpu"), torch.float32, ModelLayout.of(lm)
    )


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    """The tiny model and the real tokenizer, built once per run (a few seconds)."""
    return tiny_llama(smollm2_tokenizer())


@pytest.fixture(scope="session")
def engine(tiny_loaded: LoadedModel) -> KVRAGEngine:
    """The unit tier's engine: ``tiny_loaded`` with the integration ``engine``'s settings.

    Encodes missed chunks on the request path (``on_miss="encode"``) and stores
    chunk caches at model precision (``cache_precision="model"``), like the
    integration tier's ``engine``; tests of other settings build their own
    engine on ``engine.loaded``. Not registered as a shared engine.
    """
    return KVRAGEngine(tiny_loaded, on_miss="encode", cache_precision="model")


@pytest.fixture(autouse=True)
def no_real_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the bundled default model or MiniLM fails in this tier (tests/integration has them).

    Per test, not per session: a run of both tiers goes on to tests/integration.
    """

    def refuse() -> None:
        raise RuntimeError(
            "the unit tier loads no real weights: use the `engine` fixture (tiny model) "
            "or move the test to tests/integration"
        )

    monkeypatch.setattr(model_files, "default_model_file", refuse)
    monkeypatch.setattr(embeddings_module, "default_embedding_path", refuse)
