"""Storage precision on the real default model: float16 and int8 caches keep turbo close.

The bounds were measured on the bundled SmolLM2-135M, so this test needs its
weights; the precision codecs themselves are tested in
tests/unit/test_cache_precision.py.
"""

from __future__ import annotations

from kvrag_integrations import KVRAGEngine, MemoryKVStore

TOWER = "The Eiffel Tower, completed in 1889, is 330 metres tall and stands in Paris."
REEF = "The Great Barrier Reef off Queensland is the largest coral reef system on Earth."
QUESTION = "How tall is the Eiffel Tower?"


def test_default_float16_storage_keeps_turbo_close_to_model_precision(
    engine: KVRAGEngine,
) -> None:
    """Measured on the bundled SmolLM2-135M (float32 on CPU), this prompt: max |logit
    diff| of turbo's first token 0.0022 for float16 (bound 0.01), 0.027 for int8
    (bound 0.25), the same top token."""
    kw = dict(question=QUESTION, chunks=[TOWER, REEF], strategy="turbo")
    reference = KVRAGEngine(
        engine.loaded, store=MemoryKVStore(), on_miss="encode", cache_precision="model"
    ).prefill(**kw)
    for precision, bound in (("float16", 0.01), ("int8", 0.25)):
        e = KVRAGEngine(
            engine.loaded, store=MemoryKVStore(), on_miss="encode", cache_precision=precision
        )
        e.prefill(**kw)  # encodes and stores
        got = e.prefill(**kw)
        assert got.lazily_encoded_chunks == 0 and got.strategy == "turbo"
        diff = (got.logits - reference.logits).abs().max().item()
        assert diff <= bound, (precision, diff)
        assert got.logits.argmax() == reference.logits.argmax()
