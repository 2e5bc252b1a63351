"""Turbo's request path over cached chunks: its cost must not grow with chunks x layers.

The op count is the CPU proxy of GPU kernel launches: assembly once issued two
copies per chunk per layer (4,096 launches for 64 chunks on an 8B model), and
every request re-tokenized every chunk. Exactness of the assembly itself is
checked against transformers' forward in test_families.py; here, what the
batched paths add: mixed storage forms in one prompt, CUDA against CPU.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvrag_integrations import Chunk, KVRAGEngine, Text
from kvrag_integrations.chunk_kv import QUANT_NAMES
from kvrag_integrations.engine.caching.chunk_tokens import ChunkTokens
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.prompting import tokenize as tokenize_module
from kvrag_integrations.engine.prompting.segments import cache_leading_text
from kvrag_integrations.engine.strategies import reuse
from kvrag_integrations.engine.strategies.turbo import TurboRAG
from kvrag_integrations.store import DiskKVStore, TieredKVStore

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def chunk_text(i: int) -> str:
    return f"Document {i}: " + " ".join(WORDS[(i * j + i) % len(WORDS)] for j in range(40))


def top_level_ops(fn) -> collections.Counter:
    """The torch ops ``fn`` issues itself (an op's own sub-ops are its business)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)


@pytest.mark.parametrize("precision", ["float16", "int8"])
def test_turbo_ops_do_not_grow_with_chunks(tiny_loaded: LoadedModel, precision: str) -> None:
    """A turbo request over 32 cached chunks issues at most 1.5x the torch ops of
    one over 8 (tokenization, store reads, assembly, forward: ``prefill``)."""
    engine = KVRAGEngine(tiny_loaded, cache_precision=precision, on_miss="encode")
    counts = {}
    for n in (8, 32):
        chunks = [chunk_text(i) for i in range(n)]
        engine.encode_chunks(chunks, show_progress=False)
        request = dict(question="Which document?", chunks=chunks, strategy="turbo")
        engine.prefill(**request)  # the leading text's cache, allocator warm
        ops = top_level_ops(lambda r=request: engine.prefill(**r))
        counts[n] = sum(ops.values())
    assert counts[32] <= 1.5 * counts[8], counts
    # and not because assembly is off: every chunk token was reused
    pre = engine.prefill(question="Which document?", chunks=chunks, strategy="turbo")
    assert pre.output.token_counts()[0] > 32 * 40


@pytest.mark.parametrize("precision", ["model", "float16", "int8"])
def test_turbo_prefill_dispatches_the_same_ops_at_4_and_16_chunks(precision: str) -> None:
    """The whole turbo prefill (assembly, masks, the model's forward) issues exactly
    as many torch ops over 16 cached chunks as over 4: nothing per chunk, only per
    layer; and the forward runs lower-right, without building a mask."""
    from tests.unit.test_families import build, chunk_kvs, ids, prompt_of

    model = build("llama")
    counts = {}
    for n in (4, 16):
        chunks = [(ids(12, 100 + i), "chunk") for i in range(n)]
        prompt = prompt_of((ids(5, 1), "prefix"), *chunks, (ids(7, 2), "text"))
        kvs = chunk_kvs(model, prompt)
        if precision != "model":
            kvs = [kv.stored_as(precision) for kv in kvs]
        TurboRAG().prefill(model, prompt, kvs)  # allocator warm
        counts[n] = top_level_ops(lambda p=prompt, k=kvs: TurboRAG().prefill(model, p, k))
    assert counts[16] == counts[4], counts[16] - counts[4] or counts[4] - counts[16]
    assert counts[16]["aten::scaled_dot_product_attention"] == model.layout.num_layers
    assert counts[16]["aten::masked_fill_"] == 0  # no additive mask built


class Recording:
    """A tokenizer backend that records the texts it encodes, then encodes them."""

    def __init__(self, backend, texts: list[str]) -> None:
        self.backend, self.texts = backend, texts

    def encode(self, text: str, *args, **kwargs):
        self.texts.append(text)
        return self.backend.encode(text, *args, **kwargs)


def record_tokenizer(monkeypatch: pytest.MonkeyPatch, tokenizer) -> list[str]:
    """Every text the engine's tokenizer encodes from now on (both of its backends:
    literal text and markup)."""
    texts: list[str] = []
    pair = tokenize_module._backends(tokenizer)
    assert pair is not None, "the bundled tokenizer has a Rust backend"
    spies = tuple(Recording(b, texts) for b in pair)
    # the cache keeps the template its structural tokens were read from
    template = tokenize_module._template_text(tokenizer)
    monkeypatch.setitem(tokenize_module._BACKENDS, tokenizer, (template, *spies))
    return texts


def test_second_request_tokenizes_no_chunk(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks seen once (encoded, or in a request) are never tokenized again: not in
    a question-and-chunks request, not in messages split at known chunks, not for
    their keys."""
    engine = KVRAGEngine(tiny_loaded, cache_precision="model", on_miss="encode")
    chunks = [chunk_text(i) for i in range(6)]
    engine.encode_chunks(chunks[:3], show_progress=False)
    first = engine.generate(question="First?", chunks=chunks, max_new_tokens=2)
    texts = record_tokenizer(monkeypatch, tiny_loaded.tokenizer)
    again = engine.prefill(question="Which document says iota?", chunks=chunks[::-1])
    content = "Context:\n" + "\n\n".join(chunks[1:4]) + "\n\nWhich one?"
    chat = engine.prefill(messages=[{"role": "user", "content": content}])
    keys = [engine.chunk_key(c) for c in chunks]
    assert any("iota" in t for t in texts), "the spy sees the question being tokenized"
    assert not [t for t in texts for c in chunks if c in t], "a chunk was re-tokenized"
    assert first.reused_tokens and again.output.reused_mask.sum() > 6 * 40
    assert chat.output.reused_mask.sum() > 3 * 40
    assert keys == [engine.caches.key(c) for c in chunks]


def test_remembered_ids_are_the_tokenizers(tiny_loaded: LoadedModel) -> None:
    """The ids kept per text are exactly what tokenizing it gives (keys derive from
    them), special-token strings and odd whitespace included; the LRU stays bounded."""
    engine = KVRAGEngine(tiny_loaded, cache_precision="model")
    texts = [
        "Plain text.",
        "<|im_end|> not a control token <|im_start|>system",
        "  leading and trailing spaces \n\n",
        "émigré naïve 東京 🙂",
    ]
    for text in texts:
        ids, entry = engine.prompts.tokens.get(text)
        want = tokenize_module.tokenize_text(tiny_loaded.tokenizer, text)
        assert torch.equal(ids, want)
        assert torch.equal(entry, torch.cat([want, engine.prompts.suffix_ids]))
        assert engine.prompts.tokens.get(text)[0] is ids  # remembered
    segments = [Text("Q: "), *(Chunk(t) for t in texts), Text("\n\nA:")]
    plain = tokenize_module.tokenize_segments(tiny_loaded.tokenizer, segments)
    assert torch.equal(engine.tokenize(segments).input_ids, plain.input_ids)
    per_chunk = engine.prompts.tokens.get(chunk_text(0))
    small = ChunkTokens(tiny_loaded.tokenizer, engine.prompts.suffix_ids, 3 * len(per_chunk[1]))
    for i in range(10):
        small.get(chunk_text(i))
    assert len(small) == 1  # chunk and entry ids counted: one pair fits in 3 entries' ids
    assert small.misses == 10 and small.get(chunk_text(9))[0] is not None and small.hits == 1


@pytest.mark.parametrize("precision", ["float16", "int8"])
def test_mixed_storage_forms_in_one_prompt(engine: KVRAGEngine, precision: str) -> None:
    """Chunks stored in float16 or int8 beside the leading text's float32 entry
    (what such an engine's prompts hold) give exactly what the same values all
    in float32 give: one batched cast or dequantization per layer, per form."""
    mixed = KVRAGEngine(engine.loaded, cache_precision=precision, on_miss="encode")
    chunks = [chunk_text(i) for i in range(4)]
    mixed.prefill(question="Which?", chunks=chunks)  # encodes chunks and leading text
    segments = mixed.build_segments(question="Which?", chunks=chunks)
    prompt = cache_leading_text(mixed.tokenize(segments))
    found, missing = mixed.caches.lookup(prompt)
    assert not missing
    stored = mixed.caches.on_device(prompt, found)
    assert [kv.precision for kv in stored] == ["float32"] + [precision] * 4
    widened = [
        dataclasses.replace(kv, keys=k, values=v, **dict.fromkeys(QUANT_NAMES, None))
        for kv, (k, v) in ((kv, kv.dequantize(torch.float32)) for kv in stored)
    ]
    got = TurboRAG().prefill(engine.loaded, prompt, stored).logits
    want = TurboRAG().prefill(engine.loaded, prompt, widened).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_both_ways_of_placing_mixed_dtypes_agree() -> None:
    """CPU's cat into place and CUDA's one block per dtype write the same rows
    (leading text at model precision, float16 and bfloat16 chunks), and leave the
    rows outside the span alone; so does the scattered path."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, n, 8, generator=gen) for n in (3, 4, 2, 5)]
    parts[1], parts[2], parts[3] = parts[1].half(), parts[2].half(), parts[3].bfloat16()
    want = torch.cat([p.float() for p in parts], dim=1)
    for cast_in_cat in (True, False):
        dest = torch.full((2, 20, 8), 7.0)
        reuse.put(dest, parts, (3, 17), None, cast_in_cat)
        assert torch.equal(dest[:, 3:17], want) and (dest[:, :3] == 7).all()
        assert (dest[:, 17:] == 7).all()
    rows = torch.tensor([0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 15, 18, 19])
    dest = torch.full((2, 20, 8), 7.0)
    reuse.put(dest, parts, (0, 20), rows)
    assert torch.equal(dest[:, rows], want) and (dest[:, [3, 4, 13, 14, 16, 17]] == 7).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_turbo_on_cuda_equals_cpu(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    """The CUDA paths (cat into contiguous memory; host entries pinned by the tiered
    store and copied without blocking) give what CPU gives, float32 on both."""
    lm = copy.deepcopy(tiny_loaded.model).to("cuda")
    on_cuda = dataclasses.replace(tiny_loaded, model=lm, device=torch.device("cuda"))
    chunks = [chunk_text(i) for i in range(8)]
    request = dict(question="Which?", chunks=chunks, strategy="turbo")
    cpu = KVRAGEngine(tiny_loaded, on_miss="encode")
    cpu.encode_chunks(chunks, show_progress=False)
    cpu.prefill(**request)
    want = cpu.prefill(**request).logits.float()
    tiered = TieredKVStore(DiskKVStore(tmp_path))
    for store in (None, tiered):
        gpu = KVRAGEngine(on_cuda, store=store, on_miss="encode")
        gpu.encode_chunks(chunks, show_progress=False)
        gpu.prefill(**request)
        if store is tiered:  # read back from disk: host entries, pinned in memory
            tiered.clear_memory()
            gpu.prefill(**request)
            held = [tiered.memory.get(i.key, gpu.fingerprint) for i in tiered.memory.entries()]
            assert held and all(kv.keys.is_pinned() for kv in held if kv is not None)
        got = gpu.prefill(**request)
        assert got.output.kv.device.type == "cuda"
        torch.testing.assert_close(got.logits.float().cpu(), want, atol=1e-4, rtol=0)
