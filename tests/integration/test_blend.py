"""CacheBlend against the full-prefill and turbo references, and its position mask."""

from __future__ import annotations

import pytest
import torch

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.engine.modeling import forward
from kvrag_integrations.engine.modeling.forward import PromptKV, run_tokens
from kvrag_integrations.engine.strategies.blend import CacheBlend
from kvrag_integrations.engine.strategies.reuse import with_last
from kvrag_integrations.engine.strategies.turbo import TurboRAG

CHUNKS = [
    "Marie Curie was a physicist and chemist who conducted pioneering research on "
    "radioactivity. She was the first woman to win a Nobel Prize.",
    "Polonium was named by Marie Curie after her native country, Poland, when she "
    "discovered it with Pierre Curie in 1898.",
    "The Amazon is the largest river in the world by discharge volume of water.",
]
QUESTION = "Which element did Marie Curie name after her native country?"


def logits(engine: KVRAGEngine, strategy: str, **options) -> torch.Tensor:
    return engine.prefill(question=QUESTION, chunks=CHUNKS, strategy=strategy, **options).logits


def test_ratio_one_reproduces_full_prefill(engine: KVRAGEngine) -> None:
    full = logits(engine, "full")
    blend = logits(engine, "blend", recompute_ratio=1.0)
    torch.testing.assert_close(blend, full, atol=1e-3, rtol=1e-4)


def test_ratio_zero_reproduces_turbo(engine: KVRAGEngine) -> None:
    turbo = logits(engine, "turbo")
    blend = logits(engine, "blend", recompute_ratio=0.0)
    torch.testing.assert_close(blend, turbo, atol=1e-3, rtol=1e-4)
    assert (turbo - logits(engine, "full")).abs().max() > 1e-2  # the test can tell them apart


def test_recompute_moves_logits_toward_full(engine: KVRAGEngine) -> None:
    full = logits(engine, "full")

    def kl(other: torch.Tensor) -> float:
        p = torch.log_softmax(full, -1)
        return float((p.exp() * (p - torch.log_softmax(other, -1))).sum())

    assert kl(logits(engine, "blend", recompute_ratio=0.3)) < kl(logits(engine, "turbo"))


def test_stats_report_recomputed_and_reused_tokens(engine: KVRAGEngine) -> None:
    engine.encode_chunks(CHUNKS, show_progress=False)
    kw = dict(question=QUESTION, chunks=CHUNKS, strategy="blend", recompute_ratio=0.2)
    engine.generate(max_new_tokens=1, **kw)  # stores the prompt's leading-text cache
    result = engine.generate(max_new_tokens=4, **kw)
    chunk_tokens = sum(
        len(engine.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in CHUNKS
    )
    # The "\n\n" after every chunk but the last is read with the chunk (chunk_suffix).
    chunk_tokens += (len(CHUNKS) - 1) * engine.prompts.suffix_ids.numel()
    head = engine.prefill(**kw).prompt.pieces[0]
    assert head.is_prefix  # the template header + instruction, cached exactly
    assert result.strategy == "blend"
    assert result.recomputed_tokens == round(0.2 * chunk_tokens)
    assert result.reused_tokens + result.recomputed_tokens == chunk_tokens + head.ids.numel()
    assert result.prefilled_tokens == result.prompt_tokens - chunk_tokens - head.ids.numel()
    assert result.text


def test_recompute_first_forces_each_chunk_start(engine: KVRAGEngine) -> None:
    pre = engine.prefill(
        question=QUESTION, chunks=CHUNKS, strategy="blend", recompute_ratio=0.0, recompute_first=2
    )
    _, recomputed, _ = pre.token_counts()
    assert recomputed == 2 * len(CHUNKS)


def test_keep_chunk_starts_never_recomputes_them(engine: KVRAGEngine) -> None:
    """Each chunk's first token (its attention sink) stays as cached, even at ratio 1."""
    pre = engine.prefill(
        question=QUESTION, chunks=CHUNKS, strategy="blend", recompute_ratio=1.0, keep_chunk_starts=1
    )
    reused, _, _ = pre.token_counts()
    assert reused - pre.reused_prefix_tokens == len(CHUNKS)


def test_refresh_check_layer_makes_that_layer_exact(engine: KVRAGEngine) -> None:
    """With refresh, every token's check-layer K/V are full prefill's; later layers
    of the tokens not selected stay as turbo stored them. CacheBlend's own selection
    over chunks encoded alone, named (the model's calibration may choose others)."""
    kw = dict(question=QUESTION, chunks=CHUNKS)
    own = dict(selection="deviation", chunk_context="alone")
    full = engine.prefill(strategy="full", **kw).output.kv
    turbo = engine.prefill(strategy="turbo", **kw).output.kv
    plain = engine.prefill(strategy="blend", recompute_ratio=0.0, **own, **kw).output.kv
    fresh = engine.prefill(
        strategy="blend", recompute_ratio=0.0, refresh_check_layer=True, **own, **kw
    )
    kv = fresh.output.kv
    for layer in (0, 1):
        torch.testing.assert_close(kv.keys[layer], full.keys[layer], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(kv.values[layer], full.values[layer], atol=2e-4, rtol=1e-4)
    assert (plain.values[1] - full.values[1]).abs().max() > 1e-2  # without it, layer 1 is stale
    chunk = fresh.output.reused_mask
    for layer in range(2, len(kv.values)):
        torch.testing.assert_close(kv.values[layer][:, chunk], turbo.values[layer][:, chunk])
    ratio_one = logits(engine, "blend", recompute_ratio=1.0, refresh_check_layer=True, **own)
    torch.testing.assert_close(ratio_one, logits(engine, "full"), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("deviation", ["key", "both"])
def test_deviation_variants_run(engine: KVRAGEngine, deviation: str) -> None:
    out = logits(engine, "blend", recompute_ratio=0.15, deviation=deviation)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"recompute_ratio": -0.1}, ValueError),
        ({"recompute_ratio": 1.5}, ValueError),
        ({"recompute_ratio": float("nan")}, ValueError),
        ({"recompute_ratio": "0.1"}, TypeError),
        ({"check_layer": -1}, ValueError),
        ({"deviation": "cosine"}, ValueError),
        ({"keep_chunk_starts": -1}, ValueError),
        ({"refresh_check_layer": 1}, TypeError),
    ],
)
def test_bad_options_are_typed_errors(options, error) -> None:
    with pytest.raises(error):
        CacheBlend(**options)


def test_check_layer_beyond_the_model(engine: KVRAGEngine) -> None:
    with pytest.raises(ValueError, match="check_layer"):
        logits(engine, "blend", check_layer=99)


def _bottom_right(query_idx: torch.Tensor, total: int, window: int | None) -> torch.Tensor:
    """The reference implementations' alignment: query i sees keys <= total - n + i."""
    n = query_idx.numel()
    keys = torch.arange(total, device=query_idx.device)
    return keys.unsqueeze(0) <= (total - n + torch.arange(n, device=query_idx.device)).unsqueeze(1)


def _kept_outputs_after_perturbing_later_keys(engine: KVRAGEngine) -> tuple[torch.Tensor, ...]:
    """Fresh K/V of kept tokens in chunk 1, before and after noising chunk 2's cache."""
    e = KVRAGEngine(engine.loaded, store=MemoryKVStore())
    pre = e.prefill(question=QUESTION, chunks=CHUNKS, strategy="turbo")
    prompt = pre.prompt
    kvs, _ = e.caches.for_prompt(prompt)
    starts, spans = 0, []
    for piece in prompt.pieces:
        if piece.is_chunk:
            spans.append((starts, starts + piece.ids.numel()))
        starts += piece.ids.numel()
    (a0, a1), (b0, b1) = spans[0], spans[1]
    kept = torch.tensor([a0 + 2, a0 + 5, a1 - 1])

    def run(noise: bool) -> PromptKV:
        kv, uncached = TurboRAG().assemble(e.loaded, prompt, kvs)
        if noise:
            gen = torch.Generator().manual_seed(0)
            for layer in range(1, len(kv.keys)):
                shape = kv.keys[layer][:, b0:b1].shape
                kv.keys[layer][:, b0:b1] = torch.randn(shape, generator=gen)
                kv.values[layer][:, b0:b1] = torch.randn(shape, generator=gen)
        rows = torch.unique(torch.cat([with_last(uncached, kv.num_tokens), kept]))
        run_tokens(e.model, e.loaded.layout, kv, rows)
        return kv

    (clean_k, clean_v), (noisy_k, noisy_v) = run(False).stacked(), run(True).stacked()
    return (
        clean_k[:, :, kept],
        noisy_k[:, :, kept],
        clean_v[:, :, kept],
        noisy_v[:, :, kept],
    )


def test_kept_tokens_never_see_later_keys(engine: KVRAGEngine) -> None:
    """Changing a later chunk's cached K/V leaves earlier kept tokens' outputs unchanged."""
    k_clean, k_noisy, v_clean, v_noisy = _kept_outputs_after_perturbing_later_keys(engine)
    torch.testing.assert_close(k_noisy, k_clean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_noisy, v_clean, atol=1e-5, rtol=1e-5)


def test_the_mask_test_fails_with_bottom_right_alignment(engine, monkeypatch) -> None:
    """The check above is sensitive: with bottom-right alignment the outputs move."""
    monkeypatch.setattr(forward, "visible", _bottom_right)
    k_clean, k_noisy, _, _ = _kept_outputs_after_perturbing_later_keys(engine)
    assert (k_clean - k_noisy).abs().max() > 1e-3
