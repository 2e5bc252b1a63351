"""The static decode (engine/modeling/static_decode.py) on CPU: buckets, the
static step's exactness against transformers' own generate and the eager
DynamicCache steps, across the families of test_families.py it accepts, and
the models and settings it refuses (eager, named in the log once).

The CUDA graph capture and replay need a GPU (scripts/gpu_check_53.py); here
the same steps run eagerly over the same static buffers (``devices=("cpu",)``;
a "capture" is the warm-up) with tiny buckets, so prompts cross bucket
boundaries in a few tokens. Attention over the filled slots runs its torch
fallback here (tests/unit/test_filled_attention.py tests the Triton kernel).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from corpus import REEF, TOWER, TOWER_QUESTION

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.engine.modeling.generate import dynamic_steps
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.modeling.static_buckets import preparing
from kvrag_integrations.engine.modeling.static_decode import BUCKETS, StaticDecoder, bucket_for
from kvrag_integrations.engine.prompting.segments import Piece, TokenizedPrompt
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.strategies import FullPrefill, TurboRAG
from tests.unit.test_families import FAMILIES, THREE_CHUNKS, build, chunk_kvs, ids, prompt_of

TINY_BUCKETS = (16, 32, 64)
REFUSED = {"gemma2", "gemma3", "mistral-short-window", "mistral-long-window"}  # windows
ACCEPTED = sorted(set(FAMILIES) - REFUSED)
_MODELS: dict[str, LoadedModel] = {}


def model_of(family: str) -> LoadedModel:
    if family not in _MODELS:
        _MODELS[family] = build(family)
    return _MODELS[family]


def static(model: LoadedModel, **kwargs: object) -> StaticDecoder:
    return StaticDecoder(model.layout, buckets=TINY_BUCKETS, devices=("cpu",), **kwargs)


def greedy(step: object, kv: object, logits: torch.Tensor, n: int) -> tuple[list[int], list]:
    tokens, all_logits, position = [], [logits], kv.next_position  # type: ignore[attr-defined]
    for _ in range(n - 1):
        token = int(logits.argmax())
        tokens.append(token)
        logits = step(token, position)  # type: ignore[operator]
        all_logits.append(logits)
        position += 1
    tokens.append(int(logits.argmax()))
    return tokens, all_logits


def full(model: LoadedModel, prompt_ids: torch.Tensor) -> object:
    return FullPrefill().prefill(model, TokenizedPrompt([Piece(prompt_ids, "text", "")]), [])


def test_default_buckets_are_six_powers_of_two_from_4k_to_128k() -> None:
    assert BUCKETS == (4096, 8192, 16384, 32768, 65536, 131072)
    assert bucket_for(1, BUCKETS) == 4096
    assert bucket_for(4096, BUCKETS) == 4096
    assert bucket_for(4097, BUCKETS) == 8192
    assert bucket_for(131073, BUCKETS) is None


def test_buckets_are_capped_at_the_context_window() -> None:
    model = model_of("llama")  # max_position_embeddings 512
    decoder = StaticDecoder(model.layout, devices=("cpu",))
    assert decoder.length(model.model, 100) == 512
    assert decoder.length(model.model, 513) is None


@pytest.mark.parametrize("family", ACCEPTED)
def test_static_greedy_equals_transformers_generate_across_buckets(family: str) -> None:
    """Prompts of 9 and 17 tokens with 6 new ones take buckets 16 and 32: the
    tokens equal transformers' generate, the logits the eager steps'."""
    model = model_of(family)
    decoder = static(model)
    for length, bucket in ((9, 16), (17, 32)):
        prompt = ids(length, 40 + length)
        pre = full(model, prompt)
        steps = decoder.steps(model.model, pre.kv, 6)
        assert steps is not None and steps.length == bucket
        got, got_logits = greedy(steps, pre.kv, pre.logits, 6)
        eager, eager_logits = greedy(dynamic_steps(model.model, pre.kv), pre.kv, pre.logits, 6)
        assert got == eager
        for a, b in zip(got_logits, eager_logits):
            assert (a.float() - b.float()).abs().max() <= 1e-4
        hf = model.model.generate(
            prompt[None],
            attention_mask=torch.ones(1, length, dtype=torch.long),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, length:].tolist()
        assert got == hf
    assert list(decoder.store.held) == [16, 32]  # both buckets kept


@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "phi3"])
def test_static_steps_after_turbo_equal_the_eager_steps(family: str) -> None:
    """Turbo's RoPE positions are not cache slots: the static step takes both."""
    model = model_of(family)
    prompt = prompt_of(*THREE_CHUNKS)
    pre = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    assert pre.kv.next_position != pre.kv.num_tokens or family  # positions as turbo lays them
    steps = static(model).steps(model.model, pre.kv, 10)
    assert steps is not None and steps.length == 64  # 54 prompt tokens + 10
    got, got_logits = greedy(steps, pre.kv, pre.logits, 10)
    eager, eager_logits = greedy(dynamic_steps(model.model, pre.kv), pre.kv, pre.logits, 10)
    assert got == eager
    assert max((a - b).abs().max().item() for a, b in zip(got_logits, eager_logits)) <= 1e-4


def test_buckets_are_kept_within_max_bytes_least_recent_released_first() -> None:
    """Three sizes alternating: kept while they fit (no release, no recapture);
    with room for two, the least recently used is released, and a step captured
    again is counted, not hidden."""
    model = model_of("llama")
    per_slot = 2 * 3 * 2 * 16 * 4  # layers, kv heads, head size, float32
    roomy = static(model, max_bytes=per_slot * (16 + 32 + 64))
    tight = static(model, max_bytes=per_slot * (32 + 64))
    for decoder in (roomy, tight):
        for length in (5, 20, 40, 5, 20, 40):  # buckets 16, 32, 64, 16, 32, 64
            pre = full(model, ids(length, length))
            greedy(decoder.steps(model.model, pre.kv, 4), pre.kv, pre.logits, 4)
    assert list(roomy.store.held) == [16, 32, 64]
    assert (roomy.stats["released"], roomy.stats["captures"], roomy.stats["recaptures"]) == (
        0,
        3,
        0,
    )
    assert list(tight.store.held) == [32, 64]
    assert tight.stats["released"] == 4 and tight.stats["recaptures"] == 3
    assert tight.stats["captures"] == 6 and set(tight.capture_s) == {"16", "32", "64"}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_windowed_models_decode_eagerly_named_once(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = model_of(family)
    decoder = static(model)
    pre = full(model, ids(9, 1))
    with caplog.at_level(logging.INFO, logger="kvrag_integrations.engine.modeling.static_decode"):
        assert decoder.steps(model.model, pre.kv, 4) is None
        assert decoder.steps(model.model, pre.kv, 4) is None
    named = [r for r in caplog.records if "decodes eagerly" in r.getMessage()]
    assert len(named) == 1
    assert "sliding-window" in named[0].getMessage() or "sdpa" in named[0].getMessage()


def test_what_it_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of("llama")
    pre = full(model, ids(9, 1))
    cpu = torch.device("cpu")
    assert static(model).refusal(model.model, cpu, 9, 4) is None
    # past the largest bucket
    assert "largest bucket" in static(model).refusal(model.model, cpu, 9, 60)
    # CPU is not a static device by default (CUDA only)
    assert "device cpu" in StaticDecoder(model.layout).refusal(model.model, cpu, 9, 4)
    # the one switch
    monkeypatch.setenv("KVRAG_FAST_PATH", "0")
    assert static(model).steps(model.model, pre.kv, 4) is None


# -- through the engine: decode()'s step hook, with streaming, stops, sampling, logprobs --


@pytest.fixture(scope="module")
def engines(tiny_loaded: LoadedModel) -> tuple[KVRAGEngine, KVRAGEngine]:
    """The tiny engine decoding eagerly, and the same weights decoding statically on CPU."""
    fast = dataclasses.replace(tiny_loaded)
    fast.decoder = StaticDecoder(fast.layout, buckets=(128, 256, 512), devices=("cpu",))
    kw = dict(store=MemoryKVStore(), on_miss="encode", cache_precision="model")
    return KVRAGEngine(tiny_loaded, **kw), KVRAGEngine(fast, **kw)


def run(e: KVRAGEngine, **kw: object) -> tuple[list[str], GenerationResult]:
    stream = e.stream(question=TOWER_QUESTION, chunks=[TOWER, REEF], **kw)
    pieces = list(stream)
    return pieces, stream.result


@pytest.mark.parametrize(
    "options",
    [
        dict(strategy="turbo", max_new_tokens=24),
        dict(strategy="blend", max_new_tokens=12, logprobs=3),
        dict(strategy="full", max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7),
    ],
    ids=["turbo-greedy", "blend-logprobs", "full-seeded"],
)
def test_the_engine_decodes_the_same_on_the_static_path(
    engines: tuple[KVRAGEngine, KVRAGEngine], options: dict
) -> None:
    eager, fast = engines
    want_pieces, want = run(eager, **options)
    got_pieces, got = run(fast, **options)
    assert got.token_ids == want.token_ids and len(want.token_ids) > 1
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert "".join(got_pieces) == got.text and got_pieces == want_pieces
    # the prompt's computed tokens ran as a tail step: the same up to rounding
    got_top, want_top = got.first_token_logprobs or {}, want.first_token_logprobs or {}
    assert got_top.keys() == want_top.keys()
    assert all(abs(got_top[t] - p) <= 1e-5 for t, p in want_top.items())
    assert fast.loaded.decoder.last.startswith("static")  # it did decode statically
    held = fast.loaded.decoder.store.held
    assert 1 in next(iter(held.values())).steps
    if options["strategy"] == "turbo":  # the question's forward ran as a tail step
        assert max(next(iter(held.values())).steps) > 1


def test_stop_strings_cut_the_same_on_the_static_path(
    engines: tuple[KVRAGEngine, KVRAGEngine],
) -> None:
    eager, fast = engines
    _, free = run(eager, strategy="turbo", max_new_tokens=20)
    stop = free.text[len(free.text) // 2 :][:3]
    assert stop.strip()
    _, want = run(eager, strategy="turbo", max_new_tokens=20, stop=[stop])
    got_pieces, got = run(fast, strategy="turbo", max_new_tokens=20, stop=[stop])
    assert (got.text, got.finish_reason) == (want.text, "stop")
    assert "".join(got_pieces) == got.text


# -- one copy of the prompt's K/V: the strategy lays it out in the reserved bucket --


@pytest.mark.parametrize("family", ["llama", "qwen3-moe", "phi3"])
def test_turbo_lays_the_prompt_out_in_the_bucket_and_its_tail_runs_there(family: str) -> None:
    """Within a reservation turbo's buffer is the bucket's slots (no copy before
    decoding), its question's forward runs as a tail step of 16 rows, and the
    logits and greedy tokens equal the eager path's."""
    model = model_of(family)
    prompt = prompt_of(*THREE_CHUNKS)
    kvs = chunk_kvs(model, prompt)
    want = TurboRAG().prefill(model, prompt, kvs)
    eager, _ = greedy(dynamic_steps(model.model, want.kv), want.kv, want.logits, 8)
    decoder = model.decoder = static(model)
    try:
        with decoder.reserve(model.model, prompt.num_tokens, 8):
            got = TurboRAG().prefill(model, prompt, kvs)
            (bucket,) = decoder.store.held.values()
            assert got.kv.home is decoder and decoder.holding(got.kv) is bucket
            for layer in (0, -1):
                assert got.kv.keys[layer].data_ptr() == bucket.keys[layer].data_ptr()
            assert sorted(bucket.steps) == [16]  # 12 text tokens (3 pieces), padded to 16 rows
            steps = decoder.steps(model.model, got.kv, 8)
            assert steps is not None and steps.bucket is bucket and steps.filled  # no copy
            tokens, _ = greedy(steps, got.kv, got.logits, 8)
    finally:
        model.decoder = StaticDecoder(model.layout)
    assert (got.logits - want.logits).abs().max() <= 1e-4
    for a, b in zip(got.kv.keys + got.kv.values, want.kv.keys + want.kv.values):
        assert (a - b).abs().max() <= 1e-4
    assert tokens == eager


def test_full_prefill_writes_into_the_bucket_exactly() -> None:
    """Full prefill within a reservation: the model's own forward, its K/V written
    straight into the bucket, the same logits and K/V as transformers' cache."""
    model = model_of("qwen2")
    prompt = TokenizedPrompt([Piece(ids(30, 3), "text", "")])
    want = FullPrefill().prefill(model, prompt, [])
    decoder = model.decoder = static(model)
    try:
        with decoder.reserve(model.model, 30, 4):
            got = FullPrefill().prefill(model, prompt, [])
            assert decoder.holding(got.kv) is decoder.store.held[64]
    finally:
        model.decoder = StaticDecoder(model.layout)
    assert torch.equal(got.logits, want.logits)
    for a, b in zip(got.kv.keys + got.kv.values, want.kv.keys + want.kv.values):
        assert torch.equal(a, b)


# -- failures: the request goes on eagerly, the next one tries again --


class Raising:
    """A forward pre-hook on the first decoder layer that raises while a step is
    prepared (``capture=True``: as an op syncing with the host makes a CUDA
    capture fail), or on the ``at``-th forward outside preparation."""

    def __init__(self, model: LoadedModel, capture: bool = False, at: int = -1) -> None:
        self.capture, self.at, self.calls = capture, at, 0
        layer = model.model.model.layers[0]
        self.handle = layer.register_forward_pre_hook(self)

    def __call__(self, module: object, args: object) -> None:
        if self.capture and preparing():
            raise RuntimeError("operation not permitted when stream is capturing")
        if not preparing():
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError("a step that fails eagerly")

    def __enter__(self) -> Raising:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def _request(decoder: StaticDecoder, model: LoadedModel, n: int = 8, budget: int = 0) -> list[int]:
    """One request through the decoder (reserved for ``budget`` or ``n`` new tokens,
    full prefill, ``n`` greedy tokens; eager steps where the decoder refuses)."""
    prompt = TokenizedPrompt([Piece(ids(9, 5), "text", "")])
    with decoder.reserve(model.model, 9, budget or n):
        pre = FullPrefill().prefill(model, prompt, [])
        steps = decoder.steps(model.model, pre.kv, budget or n)
        return greedy(steps or dynamic_steps(model.model, pre.kv), pre.kv, pre.logits, n)[0]


def test_a_failed_capture_decodes_eagerly_and_the_next_request_captures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = model_of("llama")
    prompt = TokenizedPrompt([Piece(ids(9, 5), "text", "")])
    pre = FullPrefill().prefill(model, prompt, [])
    want = greedy(dynamic_steps(model.model, pre.kv), pre.kv, pre.logits, 8)[0]
    decoder = model.decoder = static(model)
    try:
        with caplog.at_level(logging.INFO, "kvrag_integrations.engine.modeling.static_decode"):
            with Raising(model, capture=True):
                assert _request(decoder, model) == want  # the capture failed: eager steps
                assert _request(decoder, model) == want  # and again, tried once more
            step = decoder.store.held[32].steps[1]
            assert step.failed and decoder.stats["capture_failures"] == 2
            assert _request(decoder, model) == want  # the next request captures
            assert not step.failed and decoder.stats["captures"] == 1
            with Raising(model, capture=True):  # three in a row: steps stay eager for good
                for _ in range(3):
                    decoder.store.release()
                    assert _request(decoder, model) == want
        messages = [r.getMessage() for r in caplog.records]
        named = [m for m in messages if "capture of 32 failed" in m]
        assert len(named) == 1 and "stream is capturing" in named[0]
        assert decoder.stats["capture_failures"] == 5 and decoder._no_graphs
        assert sum("from now on" in m for m in messages) == 1
    finally:
        model.decoder = StaticDecoder(model.layout)


def test_a_step_that_fails_eagerly_hands_the_request_to_the_eager_steps() -> None:
    """The 4th decode step raises: decoding goes on over the slots filled so far."""
    model = model_of("qwen3")
    prompt = TokenizedPrompt([Piece(ids(9, 5), "text", "")])
    pre = FullPrefill().prefill(model, prompt, [])
    want = greedy(dynamic_steps(model.model, pre.kv), pre.kv, pre.logits, 10)[0]
    decoder = model.decoder = static(model)
    try:
        _request(decoder, model, 2)  # the steps are prepared: later forwards are steps
        with Raising(model, at=4):
            assert _request(decoder, model, 10) == want
    finally:
        model.decoder = StaticDecoder(model.layout)
    assert decoder.stats["step_failures"] == 1


def test_a_bucket_that_cannot_be_allocated_leaves_the_request_eager_not_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real failed allocation (a 2**40-slot bucket): the kept buckets are released,
    it is tried once more, the request decodes eagerly; the next request that fits
    decodes statically."""
    model = model_of("llama")
    prompt = TokenizedPrompt([Piece(ids(9, 5), "text", "")])
    pre = FullPrefill().prefill(model, prompt, [])
    want = greedy(dynamic_steps(model.model, pre.kv), pre.kv, pre.logits, 6)[0]
    monkeypatch.setattr(model.model.config, "max_position_embeddings", 1 << 41)
    decoder = model.decoder = static(model)
    decoder.buckets = (16, 1 << 40)
    try:
        assert _request(decoder, model, 6) == want
        assert list(decoder.store.held) == [16]
        assert _request(decoder, model, 6, budget=1 << 39) == want  # its bucket: 2**40 slots
        assert decoder.last == "eager: out of memory" and decoder.stats["out_of_memory"] == 2
        assert not decoder.store.held  # released to make room
        assert _request(decoder, model, 6) == want
        assert decoder.last.startswith("static, bucket 16")
    finally:
        model.decoder = StaticDecoder(model.layout)
