"""The chunk encoding context through the engine (``chunk_context``), on the tiny model.

Identity: the context is part of the entries' fingerprint, so engines that
encode differently never read each other's entries in one store. Entries are
the model's own K/V of the chunk behind BOS, BOS's rows dropped; blend at
ratio 1.0 equals full prefill (positions: tests/unit/test_chunk_context.py).
The leading-text cache is encoded alone, whatever the engine's chunk context.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from corpus import REEF, TOWER
from corpus import TOWER_QUESTION as QUESTION

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.chunk_kv import storage_fingerprint
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.caching.entries import CHUNK_CONTEXTS, context_ids
from kvrag_integrations.engine.modeling.hf_compat import output_cache
from kvrag_integrations.store import DiskKVStore

EXACT = dict(on_miss="encode", cache_precision="model")


@pytest.fixture(scope="module")
def sink(engine: KVRAGEngine) -> KVRAGEngine:
    return KVRAGEngine(engine.loaded, chunk_context="sink", **EXACT)


def test_the_context_is_part_of_the_fingerprint(
    engine: KVRAGEngine, sink: KVRAGEngine, tmp_path: Path
) -> None:
    bos = engine.tokenizer.bos_token_id
    assert sink.fingerprint == storage_fingerprint(
        engine.loaded.fingerprint, "model", f"sink:{bos}"
    )
    assert engine.prompts.context == "alone" and engine.fingerprint.endswith("+kv-model")
    shared = DiskKVStore(tmp_path)
    alone = KVRAGEngine(engine.loaded, store=shared, **EXACT)
    behind = KVRAGEngine(engine.loaded, store=shared, chunk_context="sink", **EXACT)
    (ref,) = behind.encode_chunks([TOWER], show_progress=False)
    assert alone.chunk_key(TOWER) != ref.key
    first = alone.prefill(question=QUESTION, chunks=[TOWER])
    assert first.lazily_encoded_chunks == 1  # the sink entry is not the alone engine's
    assert len(shared) == 2
    a = shared.get(alone.chunk_key(TOWER), alone.fingerprint)
    b = shared.get(ref.key, behind.fingerprint)
    assert torch.equal(a.token_ids, b.token_ids)  # same tokens, other K/V
    assert (a.values[-1] - b.values[-1]).abs().max() > 1e-3


def test_entries_are_encoded_behind_bos_and_its_rows_dropped(sink: KVRAGEngine) -> None:
    (ref,) = sink.encode_chunks([REEF], show_progress=False)
    stored = sink.caches.store.get(ref.key, sink.fingerprint)
    ids = stored.token_ids
    bos = torch.tensor([sink.tokenizer.bos_token_id])
    full = sink.model.model(input_ids=torch.cat([bos, ids])[None], use_cache=True)
    for layer, cache in enumerate(output_cache(full).layers):
        torch.testing.assert_close(stored.keys[layer], cache.keys[0, :, 1:], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            stored.values[layer], cache.values[0, :, 1:], atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("selection", ["deviation", "query"])
def test_blend_at_one_equals_full_with_the_sink(sink: KVRAGEngine, selection: str) -> None:
    kw = dict(question=QUESTION, chunks=[TOWER, REEF])
    full = sink.prefill(strategy="full", **kw)
    one = sink.prefill(strategy="blend", recompute_ratio=1.0, selection=selection, **kw)
    torch.testing.assert_close(one.logits, full.logits, atol=1e-3, rtol=1e-4)
    part = sink.generate(strategy="blend", recompute_ratio=0.15, selection=selection, **kw)
    assert part.recomputed_tokens > 0 and part.reused_tokens > 0


def test_leading_text_is_encoded_alone(engine: KVRAGEngine, sink: KVRAGEngine) -> None:
    """The prompt's leading text starts at position 0 for real: no context before it."""
    kw = dict(question=QUESTION, chunks=[TOWER])
    sink.prefill(**kw)
    head = sink.prefill(**kw).prompt.pieces[0]
    assert head.is_prefix and head.stored_at == 0
    key = sink.caches.piece_key(head)
    stored = sink.caches.prefix_store.get(key, sink.fingerprint)
    alone = encode_chunk_batch(sink.model, [head.entry_ids], sink.fingerprint, 0)[0]
    torch.testing.assert_close(stored.keys, alone.keys, atol=1e-5, rtol=1e-4)


def test_unknown_context_and_a_tokenizer_without_bos(engine: KVRAGEngine) -> None:
    assert CHUNK_CONTEXTS == ("alone", "sink")
    with pytest.raises(ValueError, match="chunk_context"):
        KVRAGEngine(engine.loaded, chunk_context="bos")

    class NoBos:
        bos_token_id = None

    with pytest.raises(ValueError, match="BOS"):
        context_ids(NoBos(), "sink")
    assert context_ids(NoBos(), "alone").numel() == 0


@pytest.mark.parametrize("strategy", ["turbo", "blend"])
def test_a_strategy_reads_another_contexts_entries_kept_apart(
    engine: KVRAGEngine, sink: KVRAGEngine, tmp_path: Path, strategy: str
) -> None:
    """On an engine encoding chunks alone, ``chunk_context="sink"`` reads (or encodes)
    the sink entries: the same logits as an engine whose own context is the sink,
    and the engine's own entries are left as they are."""
    store = DiskKVStore(tmp_path)
    alone = KVRAGEngine(engine.loaded, store=store, **EXACT)
    kw = dict(question=QUESTION, chunks=[TOWER, REEF], strategy=strategy)
    options = {"recompute_ratio": 0.5, "selection": "query"} if strategy == "blend" else {}
    own = alone.prefill(**kw, **options)
    other = alone.prefill(**kw, **options, chunk_context="sink")
    reference = sink.prefill(**kw, **options)
    torch.testing.assert_close(other.logits, reference.logits, atol=1e-4, rtol=1e-4)
    assert (own.logits - other.logits).abs().max() > 1e-4  # other entries, other K/V
    fingerprints = {info.fingerprint for info in store.entries()}
    assert fingerprints == {alone.fingerprint, sink.fingerprint}
    assert other.lazily_encoded_chunks == 2  # (encoded on the spot: on_miss="encode")
    again = alone.prefill(**kw, **options, chunk_context="sink")
    assert again.lazily_encoded_chunks == 0


def test_ingestion_stores_blends_context_once_blend_is_in_use(
    engine: KVRAGEngine, tmp_path: Path
) -> None:
    from kvrag_integrations.engine.blend_settings import (
        BlendSettings,
        CalibratedChoice,
        Calibration,
    )

    store = DiskKVStore(tmp_path)
    alone = KVRAGEngine(engine.loaded, store=store, **EXACT)
    choice = CalibratedChoice(64, BlendSettings("sink", "query", 0.2), 0.1, 0.3, 0.4, 4, True)
    alone.calibrations.save(Calibration(alone.calibrations.identity, "tiny", (choice,)))
    alone.encode_chunks([TOWER], show_progress=False)
    assert len(store) == 1  # turbo's entries only, while blend is not in use
    alone.use_strategy("blend")
    assert alone.entry_contexts() == ("alone", "sink")
    alone.encode_chunks([TOWER, REEF], show_progress=False)
    assert len(store) == 4
