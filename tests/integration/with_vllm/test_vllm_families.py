"""Other families through the connector, and tensor parallelism.

Tiny random models of a config class (saved with the bundled tokenizer, float32),
served by vLLM with the connector and by the in-process engine from the same
folder: turbo over three chunks gives the same greedy tokens and first-token
log-probabilities within 1e-3 on both. Gemma-3 moves keys with two rotary
bases (sliding and full layers) and has sliding-window layers; Qwen2 has QKV
biases; Phi-3 has fused QKV and gate-up projections (vLLM loads them its own
way); tensor parallelism (two ranks on the CPU) stores and reads each rank's
share of the heads under keys of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from vllm_helpers import Corpus, logprobs_of, max_logprob_gap, needs_vllm

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.bench.shapes import bundled_tokenizer
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()

GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny(family: str, folder: Path) -> str:
    """A tiny random ``family`` model saved to ``folder`` (head size 64: vLLM's CPU
    attention takes 32 and up)."""
    tokenizer = bundled_tokenizer()
    common = dict(
        vocab_size=len(tokenizer) + 128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,  # large weights: a misplaced key shows in the logits
        tie_word_embeddings=True,
    )
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(
            **common,
            head_dim=64,
            sliding_window=32,
            query_pre_attn_scalar=64,
            layer_types=GEMMA3_TYPES,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        )
    elif family == "phi3":
        config = transformers.Phi3Config(**{**common, "hidden_size": 256})
    else:
        config = transformers.Qwen2Config(
            **{**common, "hidden_size": 256},
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    ("family", "ranks"), [("gemma3", 1), ("qwen2", 1), ("phi3", 1), ("qwen2", 2)]
)
def test_turbo_through_vllm_equals_the_in_process_turbo(
    family: str,
    ranks: int,
    musique: Corpus,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    private_vllm_engine: Callable[..., VLLMEngine],
) -> None:
    if ranks > 1:
        if (os.cpu_count() or 1) < ranks:
            pytest.skip(f"{ranks} tensor-parallel CPU workers need {ranks} cores")
        # one core per CPU worker (vLLM binds a worker per NUMA node by default)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(ranks))))
    folder = tiny(family, tmp_path / family)
    served = private_vllm_engine(  # another model: an engine of its own
        folder,
        store=f"disk:{tmp_path / 'kv'}",
        cache_precision="model",
        max_model_len=4096,
        kv_cache_memory_bytes=256 * 2**20,
        tensor_parallel_size=ranks,
    )
    engine = KVRAGEngine.from_pretrained(
        folder, cache_precision="model", store=MemoryKVStore(), on_miss="encode", share=False
    )
    gaps, texts = [], set()
    for i in range(3):
        item = musique.item(50 + i)
        chunks = [text[:800] for text in musique.chunks(50 + i, 3, tag=family)]
        texts.update(chunks)
        served.encode_chunks(chunks, show_progress=False)
        engine.encode_chunks(chunks, show_progress=False)
        asked = dict(
            question=item.question, chunks=chunks[::-1], max_new_tokens=16, chat_template=False
        )
        ours = served.generate(**asked, logprobs=20)
        theirs = engine.generate(**asked)
        assert ours.reused_chunks == 3 and ours.fallback is None
        assert ours.token_ids == theirs.token_ids
        want = logprobs_of(theirs.first_token_logits, list(ours.first_token_logprobs))
        gaps.append(max_logprob_gap(ours.first_token_logprobs, want))
    assert max(gaps) < 1e-3, gaps
    if ranks > 1:  # each rank stored its share: two entries per chunk
        assert len(list((tmp_path / "kv").rglob("*.safetensors"))) >= 2 * len(texts)
