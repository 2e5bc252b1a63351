"""The engine against the full-prefill reference, on the unit tier's tiny model.

Every reference is transformers' own forward of the same model, so the checks
are as strict on tiny random weights as on the real ones (loading the real
weights: tests/integration/test_engine_loading.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from corpus import REEF, TOWER
from corpus import TOWER_QUESTION as QUESTION

from kvrag_integrations import (
    Chunk,
    ContextWindowExceededError,
    InvalidChunkError,
    KVRAGEngine,
    MemoryKVStore,
    Text,
    UnknownStrategyError,
    UnsupportedModelError,
    cache_key,
)
from kvrag_integrations.engine.modeling.hf_compat import output_cache
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.rope import shift_keys


def first_logits(engine: KVRAGEngine, segments, strategy: str, **kw) -> torch.Tensor:
    return engine.prefill(segments, strategy=strategy, chat_template=False, **kw).logits


def test_rope_shift_matches_encoding_at_offset(engine: KVRAGEngine) -> None:
    """A chunk encoded at offset p equals the chunk encoded at 0 moved by p, every layer."""
    ids = engine.tokenize([Chunk(TOWER)]).input_ids.unsqueeze(0)
    inv_freq = engine.model.model.rotary_emb.inv_freq
    at_zero = output_cache(engine.model.model(input_ids=ids, use_cache=True))
    for p in (7, 300):
        pos = torch.arange(p, p + ids.shape[1]).unsqueeze(0)
        at_p = output_cache(engine.model.model(input_ids=ids, position_ids=pos, use_cache=True))
        for layer0, layer_p in zip(at_zero.layers, at_p.layers):
            moved = shift_keys(layer0.keys, p, inv_freq)
            torch.testing.assert_close(moved, layer_p.keys, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(layer0.values, layer_p.values, atol=2e-4, rtol=1e-4)


def test_turbo_with_leading_chunk_equals_full(engine: KVRAGEngine) -> None:
    """[Chunk, Text] is exact by construction: same first-token logits and greedy answer."""
    segments = [Chunk(TOWER), Text(f"\nQuestion: {QUESTION}\nAnswer:")]
    full = first_logits(engine, segments, "full")
    turbo = first_logits(engine, segments, "turbo")
    torch.testing.assert_close(turbo, full, atol=1e-3, rtol=1e-4)
    kw = dict(segments=segments, chat_template=False, max_new_tokens=12)
    assert (
        engine.generate(strategy="turbo", **kw).text == engine.generate(strategy="full", **kw).text
    )


def test_turbo_differs_from_full_when_text_precedes_chunk(engine: KVRAGEngine) -> None:
    """The chunk never saw the text before it: that is the method, so logits differ."""
    segments = [Text("Context:\n"), Chunk(TOWER), Text(f"\nQuestion: {QUESTION}\nAnswer:")]
    full = first_logits(engine, segments, "full")
    turbo = first_logits(engine, segments, "turbo")
    assert (full - turbo).abs().max() > 1e-2


def test_turbo_reuses_chunk_tokens_and_reports_counts(engine: KVRAGEngine) -> None:
    engine.encode_chunks([TOWER, REEF], show_progress=False)
    kw = dict(question=QUESTION, chunks=[TOWER, REEF])
    engine.generate(max_new_tokens=1, **kw)  # stores the leading text's cache
    result = engine.generate(max_new_tokens=8, **kw)
    chunk_tokens = sum(engine.tokenize([Chunk(c)]).num_tokens for c in (TOWER, REEF))
    chunk_tokens += engine.prompts.suffix_ids.numel()  # the "\n\n" after TOWER, read with it
    head = engine.prefill(**kw).prompt.pieces[0]
    assert head.is_prefix and not head.text.startswith(TOWER[:10])
    assert result.strategy == "turbo"
    assert result.reused_tokens == chunk_tokens + head.ids.numel()
    assert result.recomputed_tokens == 0
    assert result.prefilled_tokens == result.prompt_tokens - result.reused_tokens
    assert result.lazily_encoded_chunks == 0
    assert 0 < result.ttft_s <= result.total_s
    assert result.generated_tokens == len(result.token_ids) > 0
    full = engine.generate(strategy="full", **kw)
    assert full.reused_tokens == 0 and full.prefilled_tokens == full.prompt_tokens


def test_prefix_caching_is_exact(engine: KVRAGEngine) -> None:
    """Caching the text before the first chunk changes nothing but the work done."""
    kw = dict(question=QUESTION, chunks=[TOWER, REEF], strategy="turbo")
    exact = dict(on_miss="encode", cache_precision="model")
    plain = KVRAGEngine(engine.loaded, store=MemoryKVStore(), cache_prefix=False, **exact)
    cached = KVRAGEngine(engine.loaded, store=MemoryKVStore(), **exact)
    first = cached.prefill(**kw)
    assert first.lazily_encoded_chunks == 2  # the leading text is not counted as a chunk
    again = cached.prefill(**kw)
    plain.prefill(**kw)
    reference = plain.prefill(**kw)
    assert not reference.prompt.pieces[0].is_cached
    torch.testing.assert_close(again.logits, reference.logits, atol=1e-3, rtol=1e-4)
    assert (
        again.token_counts()[0] == reference.token_counts()[0] + again.prompt.pieces[0].ids.numel()
    )


def test_turbo_reordered_keeps_the_cache_consistent_with_positions(engine: KVRAGEngine) -> None:
    """Assembled keys equal each chunk's stored keys moved to the chunk's start."""
    pre = engine.prefill(question=QUESTION, chunks=[TOWER, REEF], strategy="turbo")
    kv, inv_freq = pre.output.kv, engine.model.model.rotary_emb.inv_freq
    keys, _ = kv.stacked()
    start = 0
    for piece in pre.prompt.pieces:
        n = piece.ids.numel()
        if piece.is_cached and start + n < kv.num_tokens:
            store = engine.prefix_store if piece.is_prefix else engine.store
            stored = store.get(cache_key(engine.fingerprint, piece.entry_ids), engine.fingerprint)
            expect = shift_keys(stored.keys[:, :, :n], start, inv_freq)
            torch.testing.assert_close(keys[:, :, start : start + n], expect)
            assert kv.positions[start].item() == start
        start += n


def test_composite_positions_restart_each_chunk_at_zero(engine: KVRAGEngine) -> None:
    pre = engine.prefill(
        question=QUESTION, chunks=[TOWER, REEF], strategy="turbo", positions="composite"
    )
    starts = [0]
    for piece in pre.prompt.pieces:
        starts.append(starts[-1] + piece.ids.numel())
    chunk_starts = [s for s, p in zip(starts, pre.prompt.pieces) if p.is_chunk]
    assert [pre.output.kv.positions[s].item() for s in chunk_starts] == [0, 0]
    result = engine.generate(
        question=QUESTION, chunks=[TOWER, REEF], positions="composite", max_new_tokens=4
    )
    assert result.text


def test_lazy_fill_counts_as_not_reused(engine: KVRAGEngine) -> None:
    fresh = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="encode")
    first = fresh.generate(question=QUESTION, chunks=[TOWER], max_new_tokens=2)
    assert first.lazily_encoded_chunks == 1
    assert first.reused_tokens == 0
    assert first.recomputed_tokens + first.prefilled_tokens == first.prompt_tokens
    second = fresh.generate(question=QUESTION, chunks=[TOWER], max_new_tokens=2)
    assert second.lazily_encoded_chunks == 0 and second.reused_tokens > 0
    torch.testing.assert_close(second.first_token_logits, first.first_token_logits)


def test_batched_encoding_equals_encoding_alone(engine: KVRAGEngine) -> None:
    store = MemoryKVStore()
    batched = KVRAGEngine(engine.loaded, store=store, cache_precision="model")
    refs = batched.encode_chunks([TOWER, REEF, "Short one."], batch_size=3, show_progress=False)
    alone = KVRAGEngine(engine.loaded, store=MemoryKVStore(), cache_precision="model")
    alone.encode_chunks([REEF], batch_size=1, show_progress=False)
    a = store.get(refs[1].key, engine.fingerprint)
    b = alone.store.get(refs[1].key, engine.fingerprint)
    torch.testing.assert_close(a.keys, b.keys, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(a.values, b.values, atol=2e-4, rtol=1e-4)
    # The entry holds the chunk, then the chunk suffix ("\n\n") read where a prompt continues it.
    assert refs[1].num_tokens + batched.prompts.suffix_ids.numel() == a.num_tokens


def test_encode_chunks_is_idempotent(engine: KVRAGEngine) -> None:
    store = MemoryKVStore()
    e = KVRAGEngine(engine.loaded, store=store)
    e.encode_chunks([TOWER, TOWER], show_progress=False)
    assert store.stats.writes == 1
    e.encode_chunks([TOWER], show_progress=False)
    assert store.stats.writes == 1


def test_empty_chunk_list_answers_the_plain_question(engine: KVRAGEngine) -> None:
    result = engine.generate(question="What is 2 + 2?", chunks=[], max_new_tokens=6)
    assert result.reused_tokens == 0 and result.prefilled_tokens == result.prompt_tokens
    assert result.text


@pytest.mark.parametrize("bad", ["", "   \n\t", None, 42])
def test_bad_chunks_raise_typed_errors(engine: KVRAGEngine, bad) -> None:
    with pytest.raises(InvalidChunkError):
        engine.encode_chunks([bad], show_progress=False)
    with pytest.raises(InvalidChunkError):
        engine.generate(question=QUESTION, chunks=[bad], max_new_tokens=1)


def test_one_string_instead_of_a_list_is_refused(engine: KVRAGEngine) -> None:
    with pytest.raises(TypeError):
        engine.encode_chunks(TOWER, show_progress=False)
    with pytest.raises(TypeError):
        engine.generate(question=QUESTION, chunks=TOWER)


def test_prompt_over_the_context_window(engine: KVRAGEngine) -> None:
    huge = "word " * (engine.context_window + 10)
    with pytest.raises(ContextWindowExceededError):
        engine.generate(question=huge, max_new_tokens=1)
    with pytest.raises(ContextWindowExceededError):
        engine.encode_chunks([huge], show_progress=False)


def test_unknown_strategy(engine: KVRAGEngine) -> None:
    with pytest.raises(UnknownStrategyError, match="turbo"):
        engine.generate(question=QUESTION, strategy="warp")


def test_bad_positions_option(engine: KVRAGEngine) -> None:
    with pytest.raises(ValueError, match="positions"):
        engine.generate(question=QUESTION, chunks=[TOWER], positions="sideways")


def test_unsupported_architecture_is_named() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelLayout.of(tiny)


def test_dynamic_rope_is_refused() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelLayout.of(LlamaForCausalLM(config))


def test_stop_strings_and_streaming(engine: KVRAGEngine) -> None:
    kw = dict(question=QUESTION, chunks=[TOWER], max_new_tokens=24)
    plain = engine.generate(**kw)
    assert plain.text
    word = plain.text.split()[1]
    stopped = engine.generate(stop=[word], **kw)
    assert word not in stopped.text and stopped.finish_reason == "stop"
    assert plain.text.startswith(stopped.text)
    stream = engine.stream(**kw)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == plain.text == stream.result.text


def test_sampling_is_seeded_and_max_tokens_bounds_length(engine: KVRAGEngine) -> None:
    kw = dict(question=QUESTION, chunks=[TOWER], max_new_tokens=10, temperature=1.0, top_p=0.9)
    a = engine.generate(seed=3, **kw)
    b = engine.generate(seed=3, **kw)
    assert a.token_ids == b.token_ids
    assert a.generated_tokens <= 10
    short = engine.generate(question=QUESTION, chunks=[TOWER], max_new_tokens=2)
    assert short.generated_tokens <= 2


def test_system_prompt_reaches_the_template(engine: KVRAGEngine) -> None:
    segs = engine.build_segments(question="Hi?", system_prompt="You are terse.")
    assert "You are terse." in "".join(getattr(s, "text", "") for s in segs)


def test_messages_reuse_known_chunks_found_in_flat_text(engine: KVRAGEngine) -> None:
    """A flat prompt with a chunk pasted in reuses it like the segment form does."""
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    e.encode_chunks([TOWER], show_progress=False)
    text = f"Context:\n{TOWER}\n\nQuestion: {QUESTION}"
    from_messages = e.generate(messages=[{"role": "user", "content": text}], max_new_tokens=4)
    from_segments = e.generate(
        segments=[Text("Context:\n"), Chunk(TOWER), Text(f"\n\nQuestion: {QUESTION}")],
        max_new_tokens=4,
    )
    assert from_messages.reused_tokens == e.tokenize([Chunk(TOWER)]).num_tokens
    torch.testing.assert_close(from_messages.first_token_logits, from_segments.first_token_logits)
    assert from_messages.text == from_segments.text


def test_known_chunks_argument_and_altered_text(engine: KVRAGEngine) -> None:
    """Chunks passed as known_chunks are found; altered chunk text is just prefilled."""
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    text = f"{REEF}\n\nQuestion: How many reefs?"
    found = e.prefill(messages=[{"role": "user", "content": text}], known_chunks=[REEF])
    assert [p.text for p in found.prompt.chunk_pieces] == [REEF]
    altered = e.prefill(
        messages=[{"role": "user", "content": text.replace("coral", "Coral")}], known_chunks=[REEF]
    )
    assert altered.prompt.cached_pieces == []  # no chunk found: no prefix caching either
    assert altered.token_counts()[0] == 0


def test_bad_messages_are_type_errors(engine: KVRAGEngine) -> None:
    with pytest.raises(TypeError):
        engine.generate(messages=["just a string"])
    with pytest.raises(TypeError):
        engine.generate(messages=[{"role": "user", "content": 3}])
    with pytest.raises(ValueError):
        engine.generate(question=QUESTION, messages=[{"role": "user", "content": "x"}])


def test_closing_a_stream_early_frees_the_engine(engine: KVRAGEngine) -> None:
    stream = engine.stream(question=QUESTION, chunks=[TOWER], max_new_tokens=30)
    next(stream)
    stream.close()
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (engine.generate(question=QUESTION, max_new_tokens=1), done.set())
    )
    worker.start()
    worker.join(timeout=60)
    assert done.is_set()


# ------------------------------------------------- never slower than no reuse
def test_cold_request_is_a_full_prefill_and_the_next_one_reuses(engine: KVRAGEngine) -> None:
    # on_miss="defer" (the default "auto" defers too until it has measured costs
    # saying otherwise, test_miss_policy.py)
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="defer")
    kw = dict(question=QUESTION, chunks=[TOWER, REEF], max_new_tokens=2)
    cold = e.generate(strategy="turbo", **kw)
    assert (cold.fallback, cold.strategy, cold.deferred_chunks) == ("uncached", "full", 2)
    assert cold.reused_tokens == cold.lazily_encoded_chunks == 0
    assert cold.prefilled_tokens == cold.prompt_tokens
    # The first token's logits are transformers' own forward over the prompt.
    ids = e.prefill(strategy="full", question=QUESTION, chunks=[TOWER, REEF]).prompt.input_ids
    with torch.no_grad():
        own = engine.model(input_ids=ids.unsqueeze(0)).logits[0, -1].float()
    torch.testing.assert_close(cold.first_token_logits, own, atol=1e-4, rtol=0)

    assert e.wait_for_encoding(timeout=120)
    keys = [e.chunk_key(c) for c in (TOWER, REEF)]
    assert all(e.store.contains(k) for k in keys) and e.encoder.encoded >= 2
    warm = e.generate(strategy="turbo", **kw)
    assert warm.fallback is None and warm.strategy == "turbo" and warm.deferred_chunks == 0
    chunk_tokens = sum(e.tokenize([Chunk(c)]).num_tokens for c in (TOWER, REEF))
    chunk_tokens += e.prompts.suffix_ids.numel()  # the "\n\n" after TOWER, read with it
    assert warm.reused_chunk_tokens == chunk_tokens
    assert warm.reused_prefix_tokens > 0  # the leading text was encoded in the background too
    assert warm.reused_tokens == warm.reused_chunk_tokens + warm.reused_prefix_tokens
    same = e.prefill(strategy="turbo", question=QUESTION, chunks=[TOWER, REEF])
    torch.testing.assert_close(warm.first_token_logits, same.logits, rtol=0, atol=0)


def test_on_miss_encode_keeps_the_synchronous_fill(engine: KVRAGEngine) -> None:
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    lazy = e.generate(question=QUESTION, chunks=[REEF], max_new_tokens=1, on_miss="encode")
    assert lazy.fallback is None and lazy.lazily_encoded_chunks == 1 and lazy.strategy == "turbo"
    assert e.encoder.pending == 0 and e.store.contains(e.chunk_key(REEF))
    with pytest.raises(ValueError, match="on_miss"):
        KVRAGEngine(engine.loaded, on_miss="sometimes")
    with pytest.raises(ValueError, match="on_miss"):
        e.generate(question=QUESTION, chunks=[REEF], on_miss="later")


def test_the_background_queue_is_bounded_and_never_blocks(engine: KVRAGEngine) -> None:
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore(), max_pending=1, on_miss="defer")
    release = threading.Event()
    encode = e.encoder._encode
    e.encoder._encode = lambda jobs: (release.wait(60), encode(jobs))  # a slow worker
    started = time.perf_counter()
    cold = e.prefill(question=QUESTION, chunks=[TOWER, REEF], strategy="blend")
    assert time.perf_counter() - started < 30  # did not wait for the worker
    assert cold.fallback == "uncached" and cold.deferred_chunks == 1  # one queued, one dropped
    assert e.encoder.dropped == 2  # the other chunk and the leading text
    assert not e.wait_for_encoding(timeout=0.2)
    release.set()
    assert e.wait_for_encoding(timeout=120)
    stored = [e.store.contains(e.chunk_key(c)) for c in (TOWER, REEF)]
    assert sorted(stored) == [False, True]
    again = e.prefill(question=QUESTION, chunks=[TOWER, REEF], strategy="blend")
    assert again.fallback == "uncached" and again.deferred_chunks == 1  # the dropped one
