"""Mask-free attention where the visible keys are exactly lower-right causal.

Exactness is against transformers' own forward (full prefill, the block-masked
forward of test_families); here: that the path is taken exactly where it
applies (a contiguous tail, a window that does not cut in, an SDPA model, the
switch on), and that nothing else changes (scattered rows, other forwards
running meanwhile, the switch off).
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvrag_integrations.engine.modeling import lower_right
from kvrag_integrations.engine.modeling.forward import PromptKV, run_tokens
from kvrag_integrations.engine.modeling.hf_compat import attn_implementation
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.strategies import TurboRAG
from tests.unit.test_families import (
    CHUNK_FIRST,
    THREE_CHUNKS,
    assert_close,
    block_reference,
    build,
    chunk_kvs,
    full_logits,
    prompt_of,
)

# family -> layer types expected to run lower-right for CHUNK_FIRST (23 tokens)
EXPECTED = {
    "llama": True,
    "qwen3-moe": True,
    "mistral-long-window": True,  # window 256 >= 23: does not cut in
    "mistral-short-window": False,  # window 6 cuts in: additive mask
    "gemma3": True,  # its full-attention layer; the sliding ones keep their mask
    "gemma2": False,  # eager (softcapping): today's path
}


@pytest.fixture
def hits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(q, kv) of every attention call that ran lower-right."""
    seen: list[tuple[int, int]] = []
    original = lower_right._is_placeholder

    def spy(mask):
        taken = original(mask)
        if taken:
            seen.append(tuple(mask.shape[2:]))
        return taken

    monkeypatch.setattr(lower_right, "_is_placeholder", spy)
    return seen


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_tail_runs_lower_right_exactly(family: str, hits: list) -> None:
    model = build(family)
    prompt = prompt_of(*CHUNK_FIRST)
    turbo = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    assert_close(turbo.logits, full_logits(model, prompt))
    layers = model.layout.num_layers
    if not EXPECTED[family]:
        assert hits == []
        return
    # one call per layer of each lower-right type, the 9-token tail over 23 keys
    assert set(hits) == {(9, 23)}
    full_layers = sum(w is None for w in model.layout.windows)
    assert len(hits) == (full_layers if family == "gemma3" else layers)
    # the config is back to what it was, for every other forward
    assert attn_implementation(model.model.config) == "sdpa"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_cuda_route_is_exact_too(
    family: str, hits: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route CUDA takes (torch's ``causal_lower_right`` bias, grouped K/V) run
    on the CPU, where torch materializes it: equal to full prefill as well."""
    monkeypatch.setattr(lower_right, "_FLAG_DEVICES", ("cuda", "cpu"))
    biases = []
    real = lower_right.causal_lower_right
    monkeypatch.setattr(
        lower_right, "causal_lower_right", lambda q, k: biases.append((q, k)) or real(q, k)
    )
    model = build(family)
    prompt = prompt_of(*CHUNK_FIRST)
    turbo = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    assert_close(turbo.logits, full_logits(model, prompt))
    assert hits and biases == hits


def test_scattered_rows_keep_the_additive_mask(hits: list) -> None:
    model = build("llama")
    prompt = prompt_of(*THREE_CHUNKS)
    turbo = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    assert_close(turbo.logits, block_reference(model, prompt))
    # the last text run is a contiguous tail, but the turbo forward computes all
    # three text runs at once: scattered, so no placeholder
    assert hits == []


def test_switch_off_runs_today_s_path(hits: list, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama")
    prompt = prompt_of(*CHUNK_FIRST)
    kvs = chunk_kvs(model, prompt)
    fast = TurboRAG().prefill(model, prompt, kvs).logits
    assert hits
    hits.clear()
    monkeypatch.setenv("KVRAG_FAST_PATH", "0")
    slow = TurboRAG().prefill(model, prompt, kvs).logits
    assert hits == []
    assert_close(fast, slow, atol=1e-5)


def test_one_row_and_blocks(hits: list) -> None:
    """A one-row tail (no mask at all) and a long tail run in two blocks, each
    lower-right over its own keys: equal to the model's own prefill."""
    model = build("qwen2")
    ids = torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(5))
    ref = model.model(input_ids=ids[None]).logits[0, -1]
    for start in (199, 40):
        kv = PromptKV.empty(model.layout, torch.arange(200), ids, torch.float32, "cpu")
        run_tokens(model.model, model.layout, kv, torch.arange(start))  # the cached head
        hits.clear()
        logits = run_tokens(model.model, model.layout, kv, torch.arange(start, 200))
        assert_close(logits, ref)
        want = {(1, 200)} if start == 199 else {(80, 120), (80, 200)}
        assert set(hits) == want, hits


def test_other_threads_forwards_meanwhile_get_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one thread's forward is inside, a padded batch on another thread (the
    reranker's kind) builds and uses transformers' own SDPA masks."""
    model: LoadedModel = build("llama")
    lm = model.model
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    want = lm(input_ids=ids, attention_mask=mask).logits
    got: list[torch.Tensor] = []
    with lower_right.lower_right_forward(lm):
        assert attn_implementation(lm.config) != "sdpa"
        worker = threading.Thread(
            target=lambda: got.append(lm(input_ids=ids, attention_mask=mask).logits)
        )
        worker.start()
        worker.join()
    assert attn_implementation(lm.config) == "sdpa"
    assert torch.allclose(got[0][0], want[0], atol=1e-5)
    assert torch.allclose(got[0][1, 5:], want[1, 5:], atol=1e-5)
