"""Chunk encoding contexts, query-driven selection and key temperature, on every family.

Against transformers' own forward of the tiny random models of ``test_families``:

(g) chunks encoded behind a sink token (its rows dropped): turbo equals the
    model's forward in which each chunk is preceded by its own copy of the sink,
    seen by nothing else, at the position before the chunk's;
(h) blend at ratio 1.0 with query-driven selection, and with the sink context,
    equals full prefill; at ratio 0 it is turbo;
(i) the attention mass recorded inside the forward equals the eager forward's
    own attention weights;
(j) turbo's key temperature T equals turbo over chunk keys divided by T.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import test_families as families
import torch
from test_families import THREE_CHUNKS, assert_close, full_logits, ids, prompt_of

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.engine.caching.chunks import encode_chunk_batch
from kvrag_integrations.engine.caching.entries import attach_suffix
from kvrag_integrations.engine.modeling.attention_mass import attention_mass
from kvrag_integrations.engine.modeling.forward import PromptKV, run_tokens
from kvrag_integrations.engine.modeling.hf_compat import DynamicCache, cache_argument
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies import CacheBlend, TurboRAG

SINK = ids(1, 40)


@pytest.fixture(params=sorted(families.FAMILIES))
def model(request: pytest.FixtureRequest) -> LoadedModel:
    if request.param not in families._MODELS:
        families._MODELS[request.param] = families.build(request.param)
    return families._MODELS[request.param]


def sink_prompt() -> TokenizedPrompt:
    """The sink leads the prompt (as BOS does), then text and chunks."""
    plain = prompt_of((SINK, "text"), *THREE_CHUNKS[1:])
    return attach_suffix(plain, torch.zeros(0, dtype=torch.long), stored_at=SINK.numel())


def sink_kvs(model: LoadedModel, prompt: TokenizedPrompt, context=SINK) -> list[ChunkKV]:
    return [
        encode_chunk_batch(model.model, [p.entry_ids], model.fingerprint, 0, context)[0]
        for p in prompt.cached_pieces
    ]


def sink_copies_reference(model: LoadedModel, prompt: TokenizedPrompt) -> torch.Tensor:
    """The model's forward with a private copy of the sink before every chunk."""
    tokens, positions, owner, kinds = [], [], [], []  # owner: block id of each row
    pos = 0
    for block, piece in enumerate(prompt.pieces):
        if piece.is_chunk:
            tokens.append(SINK)
            positions.append(torch.arange(pos - 1, pos))
            owner += [block]
            kinds += ["copy"]
        n = piece.ids.numel()
        tokens.append(piece.ids)
        positions.append(torch.arange(pos, pos + n))
        owner += [block] * n
        kinds += ["chunk" if piece.is_chunk else "text"] * n
        pos += n
    ids_all, pos_all = torch.cat(tokens), torch.cat(positions)
    total = ids_all.numel()
    owner_t = torch.tensor(owner)
    causal = torch.ones(total, total).tril().bool()
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for q in range(total):
        for k in range(q + 1):
            if kinds[q] in ("chunk", "copy"):
                allowed[q, k] = bool(owner_t[k] == owner_t[q])  # its block and its copy
            else:
                allowed[q, k] = kinds[k] != "copy"  # text never sees the copies
    allowed &= causal
    masks = {}
    for layer_type, window in zip(model.layout.layer_types, model.layout.windows):
        seen = allowed.clone()
        if window is not None:
            seen &= pos_all[None, :] > pos_all[:, None] - window
        add = torch.zeros(total, total).masked_fill_(~seen, torch.finfo(torch.float32).min)
        masks[layer_type] = add[None, None]
    mask = masks if len(masks) > 1 else next(iter(masks.values()))
    out = model.model(
        input_ids=ids_all[None],
        position_ids=pos_all[None],
        attention_mask=mask,
        **cache_argument(model.model, DynamicCache()),
        use_cache=True,
    )
    return out.logits[0, -1].float()


def test_g_sink_context_turbo_equals_its_reference(model: LoadedModel) -> None:
    prompt = sink_prompt()
    assert [p.stored_at for p in prompt.pieces if p.is_chunk] == [1, 1, 1]
    turbo = TurboRAG().prefill(model, prompt, sink_kvs(model, prompt))
    assert_close(turbo.logits, sink_copies_reference(model, prompt))
    if any(w is not None for w in model.layout.windows):
        return  # (short windows hide the chunks from the last row)
    # ... and is not turbo over chunks encoded alone (the context is used)
    alone_prompt = TokenizedPrompt([replace(p, stored_at=0) for p in prompt.pieces])
    empty = torch.zeros(0, dtype=torch.long)
    alone = TurboRAG().prefill(model, alone_prompt, sink_kvs(model, prompt, empty))
    assert (turbo.logits - alone.logits).abs().max() > 1e-3


def test_g_first_chunk_after_the_sink_equals_full(model: LoadedModel) -> None:
    """A chunk right after the prompt's own sink is where it was encoded: exact."""
    plain = prompt_of((SINK, "text"), (ids(14, 1), "chunk"), (ids(9, 2), "text"))
    prompt = attach_suffix(plain, torch.zeros(0, dtype=torch.long), stored_at=1)
    turbo = TurboRAG().prefill(model, prompt, sink_kvs(model, prompt))
    assert_close(turbo.logits, full_logits(model, prompt))


@pytest.mark.parametrize("context", ["alone", "sink"])
def test_h_blend_query_selection_bounds(model: LoadedModel, context: str) -> None:
    prompt = sink_prompt()
    if context == "alone":
        prompt = TokenizedPrompt([replace(p, stored_at=0) for p in prompt.pieces])
    kvs = sink_kvs(model, prompt, SINK if context == "sink" else torch.zeros(0, dtype=torch.long))
    for selection in ("deviation", "query"):
        one = CacheBlend(recompute_ratio=1.0, selection=selection).prefill(model, prompt, kvs)
        assert_close(one.logits, full_logits(model, prompt))
    zero = CacheBlend(recompute_ratio=0.0, selection="query").prefill(model, prompt, kvs)
    assert_close(zero.logits, TurboRAG().prefill(model, prompt, kvs).logits, atol=0)
    part = CacheBlend(recompute_ratio=0.25, selection="query").prefill(model, prompt, kvs)
    n_chunk = sum(p.ids.numel() for p in prompt.chunk_pieces)
    assert int(part.chunk_mask.sum() - part.reused_mask.sum()) == round(0.25 * n_chunk)


def test_i_attention_mass_equals_eager_weights(model: LoadedModel) -> None:
    """The recorded mass of the last rows equals the weights an eager forward returns."""
    prompt = prompt_of(*THREE_CHUNKS)
    n = prompt.num_tokens
    kv = PromptKV.empty(model.layout, torch.arange(n), prompt.input_ids, torch.float32, "cpu")
    rows, tail = torch.arange(n), 5
    last = torch.arange(n - tail, n)
    full = run_tokens(model.model, model.layout, kv, rows)  # fills the buffer
    layers = {1, model.layout.num_layers - 1}
    with attention_mass(model.model, layers, tail) as mass:
        run_tokens(model.model, model.layout, kv, last)
    config = model.model.config
    original = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        out = model.model(input_ids=prompt.input_ids[None], output_attentions=True)
    finally:
        config._attn_implementation = original
    want = sum(out.attentions[i][0, :, -tail:].sum(dim=(0, 1)) for i in layers)
    torch.testing.assert_close(mass.mass, want.float(), rtol=1e-4, atol=1e-4)
    assert full is not None and config._attn_implementation == original


def test_j_key_temperature_divides_chunk_keys(model: LoadedModel) -> None:
    prompt = prompt_of(*THREE_CHUNKS)
    kvs = sink_kvs(model, prompt, torch.zeros(0, dtype=torch.long))
    hot = TurboRAG(key_temperature=0.5).prefill(model, prompt, kvs)
    scaled = []
    for kv, piece in zip(kvs, prompt.cached_pieces):
        keys = kv.keys / 0.5 if piece.is_chunk else kv.keys  # the leading text: as stored
        scaled.append(ChunkKV(kv.token_ids, keys, kv.values, kv.fingerprint))
    assert_close(hot.logits, TurboRAG().prefill(model, prompt, scaled).logits)
    plain = TurboRAG().prefill(model, prompt, kvs).logits
    assert (hot.logits - plain).abs().max() > 1e-3
    same = TurboRAG(key_temperature=1.0).prefill(model, prompt, kvs).logits
    torch.testing.assert_close(same, plain, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "0.9"])
def test_key_temperature_is_checked(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        TurboRAG(key_temperature=bad)


@pytest.mark.parametrize(
    "options", [{"selection": "attention"}, {"query_layers": []}, {"query_layers": [-1]}]
)
def test_selection_options_are_checked(options: dict) -> None:
    with pytest.raises(ValueError):
        CacheBlend(**options)


def test_auto_selection_follows_the_encoding_context(model: LoadedModel) -> None:
    """``selection="auto"`` (the default) is query-driven over chunks encoded behind
    a sink and deviation-driven over chunks encoded alone."""
    sink = sink_prompt()
    alone = TokenizedPrompt([replace(p, stored_at=0) for p in sink.pieces])
    empty = torch.zeros(0, dtype=torch.long)
    for prompt, kvs, expected in (
        (sink, sink_kvs(model, sink), "query"),
        (alone, sink_kvs(model, sink, empty), "deviation"),
    ):
        auto = CacheBlend(recompute_ratio=0.3)
        assert auto.selection == "auto" and auto.selection_for(prompt) == expected
        got = auto.prefill(model, prompt, kvs)
        want = CacheBlend(recompute_ratio=0.3, selection=expected).prefill(model, prompt, kvs)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
        assert torch.equal(got.reused_mask, want.reused_mask)


def test_query_selection_on_a_prompt_ending_in_a_chunk(model: LoadedModel) -> None:
    """The last row (always computed) is then the only query: still a valid selection."""
    prompt = prompt_of((ids(6, 50), "text"), (ids(12, 51), "chunk"), (ids(10, 52), "chunk"))
    kvs = sink_kvs(model, prompt, torch.zeros(0, dtype=torch.long))
    one = CacheBlend(recompute_ratio=1.0, selection="query").prefill(model, prompt, kvs)
    assert_close(one.logits, full_logits(model, prompt))
    half = CacheBlend(recompute_ratio=0.5, selection="query").prefill(model, prompt, kvs)
    recomputed = int(half.chunk_mask.sum() - half.reused_mask.sum())
    assert recomputed in (11, 12)  # half of 22 chunk tokens, and the last if not among them
