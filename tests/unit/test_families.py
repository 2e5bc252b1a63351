"""Every supported decoder family: reuse equals transformers' own forward, or is refused.

Tiny randomly initialised float32 models built from transformers' config classes
(no download). For each family:

(a) turbo with the chunk leading the prompt equals full prefill;
(b) blend at ratio 1.0 equals full prefill;
(c) three chunks after a cached leading text: turbo equals the model's own forward
    given the block mask and reordered positions that turbo means (each chunk sees
    only itself, text sees everything before it, windows applied);
(d) 8 greedy tokens from turbo's cache equal full prefill's where (a) holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from kvrag_integrations.chunk_kv import QUANT_NAMES
from kvrag_integrations.engine.caching.chunk_caches import attach_suffix
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.modeling.generate import to_dynamic_cache
from kvrag_integrations.engine.modeling.hf_compat import DynamicCache, cache_argument
from kvrag_integrations.engine.modeling.layout import (
    SUPPORTED_ARCHITECTURES,
    ModelLayout,
    RotaryShift,
)
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.modeling.self_check import check_reuse
from kvrag_integrations.engine.prompting.segments import Piece, TokenizedPrompt
from kvrag_integrations.engine.strategies import CacheBlend, FullPrefill, TurboRAG
from kvrag_integrations.errors import UnsupportedModelError

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # large weights: a wrong layer shows in the logits
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SLIDING_3 = ["sliding_attention", "full_attention", "sliding_attention"]

# name -> (config class, extra config, attn_implementation)
FAMILIES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama": ("LlamaConfig", {}, None),
    "llama-llama3-rope": ("LlamaConfig", {"rope_parameters": LLAMA3}, None),
    "llama-yarn-rope": ("LlamaConfig", {"rope_parameters": YARN}, None),
    "qwen2": ("Qwen2Config", {}, None),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, None),
    "qwen2-moe": ("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}, None),
    "qwen3-moe": ("Qwen3MoeConfig", {**MOE, "head_dim": 16}, None),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
    "mistral-short-window": ("MistralConfig", {"sliding_window": 6}, None),
    "mistral-long-window": ("MistralConfig", {"sliding_window": 256}, None),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 6,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 16,
            "layer_types": SLIDING_3,
        },
        "eager",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 6,
            "query_pre_attn_scalar": 16,
            "layer_types": SLIDING_3,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        },
        None,
    ),
    "phi3": (
        "Phi3Config",
        {"partial_rotary_factor": 0.5, "sliding_window": None, "pad_token_id": 0},
        None,
    ),
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
            "attention_multiplier": 0.2,
        },
        None,
    ),
    "olmo2": ("Olmo2Config", {}, None),
    "cohere": ("CohereConfig", {"logit_scale": 0.5, "use_qk_norm": False}, None),
}


def build(family: str) -> LoadedModel:
    config_name, extra, attn = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**BASE, **extra})
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attn} if attn else {}
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()
    fp = f"tiny-{family}"
    return LoadedModel(lm, None, fp, fp, torch.device("cpu"), torch.float32, ModelLayout.of(lm))


_MODELS: dict[str, LoadedModel] = {}


@pytest.fixture(params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest) -> LoadedModel:
    if request.param not in _MODELS:
        _MODELS[request.param] = build(request.param)
    return _MODELS[request.param]


def ids(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen)


def prompt_of(*pieces: tuple[torch.Tensor, str]) -> TokenizedPrompt:
    """Pieces as (ids, kind) with kind "text", "chunk" or "prefix"."""
    return TokenizedPrompt([Piece(t, kind, "") for t, kind in pieces])


def chunk_kvs(model: LoadedModel, prompt: TokenizedPrompt) -> list:
    return [
        encode_chunk_batch(model.model, [p.entry_ids], model.fingerprint, 0)[0]
        for p in prompt.cached_pieces
    ]


def full_logits(model: LoadedModel, prompt: TokenizedPrompt) -> torch.Tensor:
    flat = TokenizedPrompt([Piece(p.ids, "text", "") for p in prompt.pieces])
    return FullPrefill().prefill(model, flat, []).logits


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-4) -> None:
    assert want.abs().max() > 0.5, "logits too small for the check to mean anything"
    diff = (got - want).abs().max().item()
    assert diff <= atol, f"max logit diff {diff:.2e}"


CHUNK_FIRST = ((ids(14, 1), "chunk"), (ids(9, 2), "text"))
THREE_CHUNKS = (
    (ids(5, 10), "prefix"),
    (ids(12, 11), "chunk"),
    (ids(2, 12), "text"),
    (ids(9, 13), "chunk"),
    (ids(2, 14), "text"),
    (ids(16, 15), "chunk"),
    (ids(8, 16), "text"),
)


def test_every_supported_architecture_is_tested() -> None:
    tested = {build(f).layout.architecture for f in FAMILIES}
    assert tested == SUPPORTED_ARCHITECTURES


def test_a_turbo_with_leading_chunk_equals_full(model: LoadedModel) -> None:
    prompt = prompt_of(*CHUNK_FIRST)
    turbo = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    assert_close(turbo.logits, full_logits(model, prompt))


def test_a_load_time_self_check_passes(model: LoadedModel) -> None:
    """What ``load_model`` runs on every model: exact on every verified family."""
    assert check_reuse(model.model, model.layout) < 1e-4


LONG = ((ids(6, 20), "text"), (ids(70, 21), "chunk"), (ids(60, 22), "chunk"), (ids(9, 23), "text"))


@pytest.mark.parametrize("shape", ["three-chunks", "long"])
def test_b_blend_ratio_one_equals_full(model: LoadedModel, shape: str) -> None:
    """ "long" has enough tokens to run the second pass in blocks."""
    prompt = prompt_of(*(THREE_CHUNKS if shape == "three-chunks" else LONG))
    kvs = chunk_kvs(model, prompt)
    for options in ({}, {"keep_chunk_starts": 0, "refresh_check_layer": True}):
        blend = CacheBlend(recompute_ratio=1.0, **options).prefill(model, prompt, kvs)
        assert_close(blend.logits, full_logits(model, prompt))


def block_reference(model: LoadedModel, prompt: TokenizedPrompt) -> torch.Tensor:
    """The model's own forward with turbo's block mask and reordered positions."""
    kinds, spans, start = [], [], 0
    for piece in prompt.pieces:
        spans.append((start, start + piece.ids.numel()))
        kinds.append(piece.is_cached)
        start += piece.ids.numel()
    total = start
    allowed = torch.zeros(total, total, dtype=torch.bool)
    causal = torch.ones(total, total).tril().bool()
    for (a, b), is_cached in zip(spans, kinds):
        if is_cached:  # a chunk (or the leading text) was encoded alone
            allowed[a:b, a:b] = causal[a:b, a:b]
        else:
            allowed[a:b, :b] = causal[a:b, :b]
    layout = model.layout
    masks = {}
    for layer_type, window in zip(layout.layer_types, layout.windows):
        seen = allowed.clone()
        if window is not None:
            q, k = torch.arange(total)[:, None], torch.arange(total)[None, :]
            seen &= k > q - window
        add = torch.zeros(total, total).masked_fill_(~seen, torch.finfo(torch.float32).min)
        masks[layer_type] = add[None, None]
    mask = masks if len(masks) > 1 else next(iter(masks.values()))
    out = model.model(
        input_ids=prompt.input_ids[None],
        position_ids=torch.arange(total)[None],
        attention_mask=mask,
        **cache_argument(model.model, DynamicCache()),
        use_cache=True,
    )
    return out.logits[0, -1].float()


def test_c_turbo_equals_the_block_masked_forward(model: LoadedModel) -> None:
    prompt = prompt_of(*THREE_CHUNKS)
    turbo = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    assert_close(turbo.logits, block_reference(model, prompt))
    # blend at ratio 0 recomputes nothing cached: the same as turbo
    zero = CacheBlend(recompute_ratio=0.0).prefill(model, prompt, chunk_kvs(model, prompt))
    assert_close(zero.logits, turbo.logits)


def greedy(model: LoadedModel, kv: Any, logits: torch.Tensor, n: int = 8) -> list[int]:
    cache, out, position = to_dynamic_cache(kv), [], kv.next_position
    for _ in range(n):
        token = int(logits.argmax())
        out.append(token)
        step = model.model(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.tensor([[position]]),
            **cache_argument(model.model, cache),
            use_cache=True,
        )
        logits, position = step.logits[0, -1], position + 1
    return out


def test_d_greedy_tokens_equal_full(model: LoadedModel) -> None:
    prompt = prompt_of(*CHUNK_FIRST)
    turbo = TurboRAG().prefill(model, prompt, chunk_kvs(model, prompt))
    flat = TokenizedPrompt([Piece(p.ids, "text", "") for p in prompt.pieces])
    full = FullPrefill().prefill(model, flat, [])
    assert greedy(model, turbo.kv, turbo.logits) == greedy(model, full.kv, full.logits)


def test_a_wrong_rotation_is_caught(model: LoadedModel) -> None:
    """The checks are sensitive: moving keys in the other pairing convention shows."""
    prompt = prompt_of((ids(6, 3), "prefix"), (ids(14, 1), "chunk"), (ids(9, 2), "text"))
    kvs = chunk_kvs(model, prompt)
    right = TurboRAG().prefill(model, prompt, kvs).logits
    assert_close(right, block_reference(model, prompt))
    flipped = {
        t: RotaryShift(r.inv_freq, not r.interleaved) for t, r in model.layout.rotary.items()
    }
    wrong_model = dataclasses.replace(
        model, layout=dataclasses.replace(model.layout, rotary=flipped)
    )
    wrong = TurboRAG().prefill(wrong_model, prompt, kvs).logits
    assert (right - wrong).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("config_name", "extra", "match"),
    [
        (
            "LlamaConfig",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "dynamic",
        ),
        ("GPT2Config", {"n_layer": 1, "n_head": 2, "n_embd": 16}, "GPT2LMHeadModel"),
        ("FalconConfig", {"num_hidden_layers": 1, "alibi": True}, "FalconForCausalLM"),
    ],
)
def test_unverified_families_are_refused(config_name: str, extra: dict, match: str) -> None:
    base = {k: v for k, v in BASE.items() if config_name == "LlamaConfig" or k == "vocab_size"}
    config = getattr(transformers, config_name)(**{**base, **extra})
    lm = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=match) as err:
        ModelLayout.of(lm)
    assert 'strategy="full"' in str(err.value)


@pytest.mark.parametrize("precision", ["float16", "bfloat16", "int8"])
def test_e_stored_precisions_are_cast_exactly_where_laid_out(
    model: LoadedModel, precision: str
) -> None:
    """Caches in a storage form give turbo exactly what the same values already in
    float32 give: the cast (or dequantization) in the assembly changes nothing else,
    for every family's rotary layout (Gemma3: two rotary types)."""
    prompt = prompt_of(*THREE_CHUNKS)
    stored = [kv.stored_as(precision) for kv in chunk_kvs(model, prompt)]
    widened = [
        dataclasses.replace(kv, keys=k, values=v, **dict.fromkeys(QUANT_NAMES, None))
        for kv, (k, v) in ((kv, kv.dequantize(torch.float32)) for kv in stored)
    ]
    got = TurboRAG().prefill(model, prompt, stored).logits
    want = TurboRAG().prefill(model, prompt, widened).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_f_chunk_suffix_read_with_its_chunk(model: LoadedModel) -> None:
    """Entries hold each chunk followed by the chunk suffix. Where the prompt
    continues a chunk with it, turbo reads the suffix's rows too: the same as the
    block-masked forward with the suffix in the chunk's block. Where it does not,
    turbo takes the chunk's rows alone: the same as entries of the chunk alone."""
    suffix = ids(2, 30)
    plain = prompt_of(
        (ids(5, 10), "prefix"),
        (ids(12, 11), "chunk"),
        (suffix, "text"),  # continued by the suffix: read from the entry
        (ids(9, 13), "chunk"),
        (torch.cat([suffix, ids(3, 31)]), "text"),  # the suffix, then more text
        (ids(16, 15), "chunk"),
        (ids(8, 16), "text"),  # not the suffix: the chunk's rows alone
    )
    attached = attach_suffix(plain, suffix)
    assert [p.ids.numel() for p in attached.pieces] == [5, 14, 11, 3, 16, 8]
    assert all(torch.equal(p.entry_ids[-2:], suffix) for p in attached.chunk_pieces)
    assert torch.equal(attached.input_ids, plain.input_ids)
    turbo = TurboRAG().prefill(model, attached, chunk_kvs(model, attached))
    assert_close(turbo.logits, block_reference(model, attached))
    assert int(turbo.reused_mask.sum()) == 5 + 14 + 11 + 16
    if all(w is None for w in model.layout.windows):  # (short windows hide the rows)
        alone = TurboRAG().prefill(model, plain, chunk_kvs(model, plain))
        assert (turbo.logits - alone.logits).abs().max() > 1e-4  # the suffix rows differ


def test_g_layout_from_the_config_alone_is_the_loaded_models(model: LoadedModel) -> None:
    """What the vLLM connector reads (``ModelLayout.of_config``: no weights) moves keys
    exactly as the loaded model's layout does."""
    got = ModelLayout.of_config(model.model.config)
    want = model.layout
    assert (got.architecture, got.num_layers, got.kv_heads, got.head_dim) == (
        want.architecture,
        want.num_layers,
        want.kv_heads,
        want.head_dim,
    )
    assert (got.layer_types, got.windows) == (want.layer_types, want.windows)
    assert got.rotary.keys() == want.rotary.keys()
    for kind, rot in want.rotary.items():
        assert got.rotary[kind].interleaved == rot.interleaved
        assert torch.equal(got.rotary[kind].inv_freq, rot.inv_freq)
