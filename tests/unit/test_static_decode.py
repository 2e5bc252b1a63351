"""The static decode (engine/modeling/static_decode.py) on CPU: buckets, the
static step's exactness against transformers' own generate and the eager
DynamicCache steps, across the families of test_families.py it accepts, and
the models and settings it refuses (eager, named in the log once).

The CUDA graph capture and replay need a GPU (scripts/gpu_check_46.py); here
the same step runs eagerly over the same static buffers (``devices=("cpu",)``)
with tiny buckets, so prompts cross bucket boundaries in a few tokens.
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
from kvrag_integrations.engine.modeling.static_decode import (
    BUCKETS,
    StaticDecoder,
    _Bucket,
    bucket_for,
)
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
    assert list(decoder._held) == [16, 32]  # both buckets held (keep=2)


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


def test_a_bucket_is_reused_and_the_least_recent_dropped() -> None:
    model = model_of("llama")
    decoder = static(model, keep=2)
    for length in (5, 20, 5, 40):  # buckets 16, 32, 16, 64
        pre = full(model, ids(length, length))
        steps = decoder.steps(model.model, pre.kv, 4)
        greedy(steps, pre.kv, pre.logits, 4)
    assert list(decoder._held) == [16, 64]


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
    assert static(model).refusal(model.model, pre.kv, 4) is None
    # past the largest bucket
    assert "largest bucket" in static(model).refusal(model.model, pre.kv, 60)
    # CPU is not a static device by default (CUDA only)
    assert "device cpu" in StaticDecoder(model.layout).refusal(model.model, pre.kv, 4)
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
    assert got.first_token_logprobs == want.first_token_logprobs
    assert fast.loaded.decoder._held  # it did decode statically


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


def test_a_step_that_cannot_be_captured_decodes_eagerly_named_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture that fails (an op syncing with the host, as MoE routing may):
    that request's bucket runs its step eagerly, later requests the eager steps."""

    def host_sync(self: _Bucket, pool: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_Bucket, "capture", host_sync)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    model = model_of("qwen3-moe")
    decoder = static(model)
    pre = full(model, ids(9, 1))
    bucket = _Bucket(model.model, pre.kv, 16)
    with caplog.at_level(logging.INFO, logger="kvrag_integrations.engine.modeling.static_decode"):
        decoder._capture(bucket, 16)
        assert decoder.steps(model.model, pre.kv, 4) is None
        assert decoder.steps(model.model, pre.kv, 4) is None
    assert bucket.graph is None and not decoder.capture_s
    assert "cannot be captured" in decoder.last
    named = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(named) == 2 and "from now on" in named[0]  # the failure, then the refusal
    bucket.fill(pre.kv)  # the bucket it was made for still decodes (eager step)
    want = dynamic_steps(model.model, pre.kv)(5, pre.kv.next_position)
    assert (bucket.run(5, pre.kv.next_position, 9) - want).abs().max() <= 1e-4
