"""ChunkCaches.fetch_or_encode, the one fetch-or-encode path, on a tiny random Llama."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.engine.caching.chunk_caches import ChunkCaches
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.store import MemoryKVStore

VOCAB = 96


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokenizer = SimpleNamespace(pad_token_id=0)
    return LoadedModel(
        lm, tokenizer, "tiny", "tiny", torch.device("cpu"), torch.float32, ModelLayout.of(lm)
    )


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_reads_what_is_stored_and_encodes_the_rest_once(loaded: LoadedModel) -> None:
    store = MemoryKVStore()
    caches = ChunkCaches(loaded, store, suffix="")
    a, b = ids(7, 1), ids(11, 2)
    space = "tiny|other-key-space"
    first = caches.fetch_or_encode(
        [a, b, a], store=store, fingerprint=space, precision="model", batch_size=2
    )
    assert first.keys == [cache_key(space, t) for t in (a, b, a)]
    assert sorted(first.encoded) == sorted({first.keys[0], first.keys[1]}) and first.reused == 0
    assert first.encode_s > 0 and len(store) == 2
    for key, t in zip(first.keys, (a, b, a)):
        alone = encode_chunk_batch(loaded.model, [t], space, 0)[0]
        got = first.caches[key]
        assert got.keys.dtype == torch.float32  # "model": the compute dtype
        torch.testing.assert_close(got.keys, alone.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, alone.values, atol=1e-5, rtol=1e-5)
    again = caches.fetch_or_encode([b, a], store=store, fingerprint=space, precision="model")
    assert again.encoded == [] and again.reused == 2 and again.encode_s == 0
    for key in again.keys:
        assert torch.equal(again.caches[key].keys, first.caches[key].keys)


def test_defaults_are_the_engines_chunk_caches(loaded: LoadedModel) -> None:
    caches = ChunkCaches(loaded, MemoryKVStore(), precision="float16", suffix="")
    t = ids(5, 3)
    fetched = caches.fetch_or_encode([t])
    (key,) = fetched.keys
    assert key == cache_key(caches.fingerprint, t) and caches.store.contains(key)
    assert fetched.caches[key].keys.dtype == torch.float16  # the storage precision
