"""CacheBlend inside vLLM: the workers recompute part of a load with vLLM's own model.

Against vLLM's own prefill of the same prompt (``strategy="full"``: a request under
a salt of its own, so no earlier block reaches it):

- at ratio 1.0 blend is exact: first-token log-probabilities within 1e-3, with
  either selection;
- selecting by the question's attention, its first-token KL (over the exact
  answer's top 20) is below turbo's on a fixed set of held-out prompts;
- the reply says how many prompt tokens were loaded and how many recomputed, and
  a recompute stores nothing: the store holds the same entries before and after;
- a blend request's blocks are its own: the same request again reads none of them
  from vLLM's prefix cache (a nonce in its salt).
"""

from __future__ import annotations

import math
import statistics

import pytest
from vllm_helpers import needs_vllm

from kvrag_integrations.bench.common import trim_to_tokens
from kvrag_integrations.bench.metrics import kl_top

needs_vllm()

QUESTION_ITEMS = range(40, 46)  # held out: calibration samples come from items 60 on


def _chunks(engine, item, n: int = 4, tokens: int = 96) -> list[str]:
    return [trim_to_tokens(engine.tokenizer, c, tokens) for c in item.chunks[:n]]


def _first(engine, item, chunks, **options):
    return engine.generate(
        question=item.question, chunks=chunks, max_new_tokens=1, logprobs=20, **options
    )


@pytest.mark.parametrize("selection", ["deviation", "query"])
def test_blend_at_one_is_vllms_exact_prefill(vllm_engine, musique, selection: str) -> None:
    item = musique.item(QUESTION_ITEMS[0])
    chunks = _chunks(vllm_engine, item)
    vllm_engine.encode_chunks(chunks, show_progress=False)
    exact = _first(vllm_engine, item, chunks, strategy="full")
    one = _first(
        vllm_engine, item, chunks, strategy="blend", recompute_ratio=1.0, selection=selection
    )
    assert one.reused_tokens + one.recomputed_tokens > 0.9 * one.prompt_tokens  # loaded
    assert one.recomputed_tokens > 0
    common = set(exact.first_token_logprobs) & set(one.first_token_logprobs)
    assert len(common) >= 15
    gap = max(abs(exact.first_token_logprobs[t] - one.first_token_logprobs[t]) for t in common)
    assert gap < 1e-3


def test_blend_is_closer_to_exact_than_turbo_and_stores_nothing(
    vllm_engine, vllm_store, musique
) -> None:
    turbo_kl, blend_kl = [], []
    for index in QUESTION_ITEMS:
        item = musique.item(index)
        chunks = _chunks(vllm_engine, item)
        vllm_engine.encode_chunks(chunks, show_progress=False)
        before = sorted(p.name for p in vllm_store.rglob("*") if p.is_file())
        exact = _first(vllm_engine, item, chunks, strategy="full")
        turbo = _first(vllm_engine, item, chunks, strategy="turbo")
        blend = _first(
            vllm_engine, item, chunks, strategy="blend", recompute_ratio=0.3, selection="query"
        )
        assert blend.recomputed_tokens > 0 and blend.reused_tokens > 0
        loaded = blend.reused_tokens + blend.recomputed_tokens
        assert loaded == turbo.reused_tokens  # the same run loaded, part of it recomputed
        after = sorted(p.name for p in vllm_store.rglob("*") if p.is_file())
        assert after == before  # no entry from a recompute (nor from anything else here)
        turbo_kl.append(kl_top(exact.first_token_logprobs, turbo.first_token_logprobs))
        blend_kl.append(kl_top(exact.first_token_logprobs, blend.first_token_logprobs))
    assert not any(math.isnan(k) for k in turbo_kl + blend_kl)
    assert statistics.mean(blend_kl) < statistics.mean(turbo_kl)


def test_a_blend_requests_blocks_are_its_own(vllm_engine, musique) -> None:
    item = musique.item(QUESTION_ITEMS[1])
    chunks = _chunks(vllm_engine, item)
    vllm_engine.encode_chunks(chunks, show_progress=False)
    first = _first(vllm_engine, item, chunks, strategy="blend")
    again = _first(vllm_engine, item, chunks, strategy="blend")
    # The second one loads again from the store (and recomputes again): nothing of
    # the first's blocks, which its recompute wrote, was read from vLLM's prefix cache.
    assert again.recomputed_tokens > 0
    assert again.reused_tokens + again.recomputed_tokens == first.reused_tokens + (
        first.recomputed_tokens
    )
