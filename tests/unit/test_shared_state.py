"""Shared state made explicit: the forward lock lives with the weights, and the
shared engines are an object with get / register / engines / reset.

A tiny random Llama (no weights to load) with a stand-in tokenizer.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

from kvrag_integrations import KVRAGEngine, MemoryKVStore, SharedEngines, shared_engines
from kvrag_integrations.engine import registry
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.model import LoadedModel


class StandInTokenizer:
    """Enough of a tokenizer for an engine to be built (its chunk suffix is tokenized)."""

    pad_token_id = 0

    def __call__(self, text: str, **_: object) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % 60 for c in text]}


def tiny(name: str = "tiny-llama") -> LoadedModel:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokenizer = StandInTokenizer()
    return LoadedModel(
        lm, tokenizer, name, name, torch.device("cpu"), torch.float32, ModelLayout.of(lm)
    )


def test_engines_on_one_loaded_model_share_its_forward_lock() -> None:
    loaded, other = tiny(), tiny("other")
    a = KVRAGEngine(loaded, store=MemoryKVStore())
    b = KVRAGEngine(loaded, store=MemoryKVStore(), cache_precision="int8")
    assert a.exclusive() is b.exclusive() is loaded.lock
    assert a.caches.loaded.lock is loaded.lock  # chunk encoding and the background worker
    assert KVRAGEngine(other).exclusive() is not loaded.lock  # other weights, other lock
    assert a.dtype == torch.float32
    with a.exclusive(), b.exclusive():  # re-entrant: one thread may nest
        pass


def test_shared_engines_get_register_engines_reset() -> None:
    engines = SharedEngines()
    loaded = tiny()
    default = KVRAGEngine(loaded, store=MemoryKVStore())
    assert engines.register(default, "tiny", device="cpu", dtype="float32")
    assert not engines.register(KVRAGEngine(loaded), "tiny", device="cpu", dtype="float32")
    assert engines.get("tiny", device="cpu", dtype="float32") is default

    # Another store (or precision): another engine, on the same weights and lock.
    store = MemoryKVStore()
    with_store = engines.get("tiny", device="cpu", dtype="float32", store=store)
    assert with_store is not default and with_store.store is store
    assert with_store.loaded is loaded and with_store.exclusive() is default.exclusive()
    assert engines.get("tiny", device="cpu", dtype="float32", store=store) is with_store
    int8 = engines.get("tiny", device="cpu", dtype="float32", cache_precision="int8")
    assert int8.cache_precision == "int8" and int8.loaded is loaded
    assert int8 is not default and int8 is not with_store

    keys = engines.engines()
    assert registry.shared_key("tiny", "cpu", "float32") in keys
    assert registry.shared_key("tiny", "cpu", "float32", store) in keys
    assert registry.shared_key("tiny", "cpu", "float32", None, "int8") in keys
    assert len(keys) == 3

    engines.reset(registry.shared_key("tiny", "cpu", "float32", None, "int8"))
    assert len(engines.engines()) == 2
    engines.reset()
    assert engines.engines() == {}
    assert engines.register(with_store, "tiny", device="cpu", dtype="float32")


def test_the_process_default_is_what_kvragengine_shared_uses() -> None:
    assert isinstance(shared_engines, SharedEngines)
    assert registry.shared_engines is shared_engines
    loaded = tiny()
    engine = KVRAGEngine(loaded)
    key = registry.shared_key("tiny-unit-model", "cpu", "float32")
    try:
        assert shared_engines.register(engine, "tiny-unit-model", device="cpu", dtype="float32")
        assert KVRAGEngine.shared("tiny-unit-model", dtype="float32") is engine
    finally:
        shared_engines.reset(key)
    assert key not in shared_engines.engines()
