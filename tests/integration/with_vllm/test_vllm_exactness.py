"""Correct before fast: the connector's reuse against vLLM's own prefill and against
the in-process engine's turbo on the same model (float32, entries at model precision)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from vllm_helpers import Corpus, exact_reference, logprobs_of, max_logprob_gap, needs_vllm, send

from kvrag_integrations import Chunk, KVRAGEngine, Text
from kvrag_integrations.chunk_kv import ChunkKV, cache_key
from kvrag_integrations.engine.prompting.segments import TokenizedPrompt, cache_leading_text
from kvrag_integrations.store.codec import encode_entry
from kvrag_integrations.vllm.client.reuse import load_run
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine
from kvrag_integrations.vllm.params import PieceSpec, TransferParams

needs_vllm()


def test_one_chunk_at_position_zero_equals_vllms_own_prefill(
    vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    item = musique.item(0)
    (chunk,) = musique.chunks(0, 1)
    segments = [Chunk(chunk), Text(f"\n\nQuestion: {item.question}\nAnswer:")]
    (ref,) = vllm_engine.encode_chunks([chunk], show_progress=False)
    turbo = vllm_engine.generate(
        segments=segments, chat_template=False, max_new_tokens=32, logprobs=20
    )
    ids = vllm_engine.tokenize(segments).input_ids.tolist()
    tokens, first, _ = exact_reference(vllm_engine, ids)
    assert turbo.reused_tokens >= ref.num_tokens  # the chunk came from the store
    assert turbo.token_ids == tokens
    assert max_logprob_gap(turbo.first_token_logprobs, first) < 1e-4


def test_multi_chunk_turbo_agrees_with_the_in_process_turbo(
    vllm_engine: VLLMEngine, engine: KVRAGEngine, musique: Corpus
) -> None:
    """Six questions, two passages each asked in the other order: the same prompt
    tokens, the first token's top-20 log-probabilities within 1e-3, and the same
    32 greedy tokens on at least 5 of 6 (a near tie may part them)."""
    same, gaps = 0, []
    for i in range(6):
        item, chunks = musique.item(i), musique.chunks(i, 2, tag=f"agree-{i}")
        vllm_engine.encode_chunks(chunks, show_progress=False)
        engine.encode_chunks(chunks, show_progress=False)
        asked = dict(question=item.question, chunks=chunks[::-1], max_new_tokens=32)
        ours = vllm_engine.generate(**asked, logprobs=20)
        theirs = engine.generate(**asked, strategy="turbo")
        assert ours.prompt_tokens == theirs.prompt_tokens
        assert ours.reused_tokens >= theirs.reused_tokens  # every stored piece was read
        want = logprobs_of(theirs.first_token_logits, list(ours.first_token_logprobs))
        gaps.append(max_logprob_gap(ours.first_token_logprobs, want))
        same += ours.token_ids == theirs.token_ids
    assert max(gaps) < 1e-3, gaps
    assert same >= 5


def test_approximate_blocks_never_serve_an_exact_request(
    vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    """After a turbo request over A, B, the same tokens asked exactly (``full``)
    equal a fresh computation: vLLM's prefix cache keeps turbo's blocks under
    their salt."""
    item, chunks = musique.item(11), musique.chunks(11, 2, tag="exact")
    vllm_engine.encode_chunks(chunks, show_progress=False)
    asked = dict(question=item.question, chunks=chunks, max_new_tokens=24)
    ids = vllm_engine.tokenize(vllm_engine.build_segments(question=item.question, chunks=chunks))
    tokens, first, _ = exact_reference(vllm_engine, ids.input_ids.tolist(), 24)
    turbo = vllm_engine.generate(**asked)
    assert turbo.reused_chunks == 2 and turbo.fallback is None
    full = vllm_engine.generate(**asked, strategy="full", logprobs=20)
    assert full.reused_tokens < 128  # no turbo block (at most a block of exact text)
    assert full.token_ids == tokens
    assert max_logprob_gap(full.first_token_logprobs, first) < 1e-5


def test_the_same_layout_sent_unsalted_loads_nothing(
    vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    """Before the connector checked salts, the same turbo layout sent unsalted left
    its approximate blocks where a plain request found them (more than half the
    prompt served, log-probabilities moved by more than 1e-3). Now it loads
    nothing: a plain request after it equals a fresh computation."""
    item, chunks = musique.item(12), musique.chunks(12, 2, tag="unsalted")
    vllm_engine.encode_chunks(chunks, show_progress=False)
    vllm_engine.generate(question=item.question, chunks=chunks, max_new_tokens=1)  # leading text
    prompt = vllm_engine.tokenize(vllm_engine.build_segments(question=item.question, chunks=chunks))
    ids = prompt.input_ids.tolist()
    run = load_run(vllm_engine.prompts, cache_leading_text(prompt))
    (event,) = [
        e
        for e in send(vllm_engine, ids, salt=None, params=TransferParams(load=run).as_request())
        if e.reply
    ]
    assert event.reply.loaded == 0 and "cache_salt" in event.reply.refused
    _, after_first, _ = exact_reference(vllm_engine, ids, 8, salt=None)
    # the same path on exact blocks: asked twice under a salt of its own
    salt = f"exact-{uuid.uuid4().hex}"
    exact_reference(vllm_engine, ids, 8, salt=salt)
    _, exact_first, _ = exact_reference(vllm_engine, ids, 8, salt=salt)
    assert max_logprob_gap(after_first, exact_first) < 1e-5


@pytest.mark.parametrize("fault", ["corrupt", "foreign", "other-shape", "missing"])
def test_a_bad_entry_is_a_miss_computed_never_injected(
    vllm_engine: VLLMEngine, vllm_store: Path, musique: Corpus, fault: str
) -> None:
    """An entry the lookup finds but the worker must refuse (written straight to the
    disk store, past the worker's memory tier): a checksum that fails, another
    model's entry under our key, an intact entry of another shape; or none at all.
    The piece is computed by vLLM: the answer is exactly full prefill's, and the
    result says nothing was reused."""
    item = musique.item(20)
    (chunk,) = musique.chunks(20, 1, tag=fault)
    fingerprint = vllm_engine.fingerprint
    entry = vllm_engine.prompts.chunk(chunk)[1]
    key = cache_key(fingerprint, entry)
    layers, heads, dim = (2, 3, 64) if fault == "other-shape" else (30, 3, 64)
    shape = (layers, heads, entry.numel(), dim)
    forged = ChunkKV(entry, torch.randn(shape), torch.randn(shape), fingerprint)
    if fault == "foreign":
        other = ChunkKV(entry, forged.keys, forged.values, "another-model+kv-model")
        blob = bytearray(encode_entry(other))
    else:
        blob = bytearray(encode_entry(forged))
    if fault == "corrupt":
        blob[len(blob) // 2] ^= 0xFF
    path = vllm_store / key[:2] / f"{key}.safetensors"
    if fault != "missing":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(blob))
    segments = [Chunk(chunk), Text(f"\n\nQuestion: {item.question}\nAnswer:")]
    ids = vllm_engine.tokenize(segments).input_ids.tolist()
    tokens, first, _ = exact_reference(vllm_engine, ids)
    got = vllm_engine.generate(
        segments=segments, chat_template=False, max_new_tokens=32, logprobs=20
    )
    assert got.token_ids == tokens
    assert max_logprob_gap(got.first_token_logprobs, first) < 1e-4
    assert got.reused_tokens < 128 and got.reused_chunks == 0  # none of the bad entry
    assert got.fallback == "uncached" and got.deferred_chunks == 1  # encoded again
    assert vllm_engine.wait_for_encoding(timeout=300)
    again = vllm_engine.generate(segments=segments, chat_template=False, max_new_tokens=1)
    assert again.reused_chunks == 1


def run_of(engine: VLLMEngine, prompt: TokenizedPrompt, text: str) -> TransferParams:
    """The load of ``prompt``'s pieces up to its last chunk: chunks from their
    entries, text pieces as ``text`` says: "computed" (what the server's hook makes
    of an anonymous request's own text: no entry, a suffix of its own that salts
    the request alone) or "stored" (read from an entry of its ids)."""
    secret = tuple(int(i) for i in prompt.input_ids[:24].tolist())
    run, position = [], 0
    last = max(i for i, piece in enumerate(prompt.pieces) if piece.is_chunk)
    for piece in prompt.pieces[: last + 1]:
        rows = piece.ids.numel()
        if piece.is_cached:
            entry = engine.prompts.piece_entry_ids(piece)
            run.append(PieceSpec(position, rows, tuple(entry[rows:].tolist())))
        elif text == "computed":
            run.append(PieceSpec(position, rows, secret, computed=True))
        else:
            run.append(PieceSpec(position, rows))
        position += rows
    return TransferParams(load=tuple(run), reuse="turbo")  # (the session engine's is blend)


def loaded_answer(
    engine: VLLMEngine, ids: list[int], params: TransferParams, max_new_tokens: int = 1
) -> tuple[list[int], dict[int, float], int]:
    """``ids`` loaded by ``params``: greedy tokens, the first token's top
    log-probabilities and vLLM's count of cached prompt tokens."""
    events = send(
        engine, ids, salt=params.salt(), params=params.as_request(), max_new_tokens=max_new_tokens
    )
    tokens = [t for e in events for t in e.token_ids]
    first = next(e.logprobs for e in events if e.logprobs)
    cached = next(e.cached_tokens for e in events if e.cached_tokens is not None)
    return tokens, first, cached


def test_a_computed_head_equals_vllms_own_prefill(vllm_engine: VLLMEngine, musique: Corpus) -> None:
    """A computed piece at position 0 (an anonymous request's own head, computed in
    its load's step by vLLM's own model in a forward of ours, reading no entry):
    its rows are the prompt's own, so the answer is vLLM's own prefill (counted
    with the load, as blend's recomputed rows are)."""
    item = musique.item(21)
    ids = vllm_engine.tokenize([Text(f"Question: {item.question}\nAnswer:")]).input_ids.tolist()
    head = PieceSpec(0, len(ids) - 3, tuple(ids[:24]), computed=True)
    tokens, first, _ = exact_reference(vllm_engine, ids, 8)
    params = TransferParams(load=(head,), reuse="turbo")  # (the session engine's is blend)
    got_tokens, got, cached = loaded_answer(vllm_engine, ids, params, 8)
    assert max_logprob_gap(got, first) < 1e-4
    assert got_tokens[: len(tokens)] == tokens and cached == head.rows


def test_text_computed_in_the_loads_step_equals_it_encoded_and_loaded(
    vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    """Text between two chunks, computed in the load's step (alone, at its place)
    against the same text encoded as an entry and loaded (the server's way before,
    still its way where the workers lack the model): the same first token's top-20
    log-probabilities within 1e-4, on three questions."""
    for i in range(3):
        item, chunks = musique.item(30 + i), musique.chunks(30 + i, 2, tag=f"computed-{i}")
        vllm_engine.encode_chunks(chunks, show_progress=False)
        note = f"Note {i}: read the second passage first.\n\n"
        segments = [Chunk(chunks[0]), Text(note), Chunk(chunks[1]), Text(item.question)]
        prompt = vllm_engine.tokenize(segments)
        ids = prompt.input_ids.tolist()
        computed = run_of(vllm_engine, prompt, "computed")
        stored = run_of(vllm_engine, prompt, "stored")
        assert [p.computed for p in computed.load] == [False, True, False]
        text = stored.load[1]
        entry = ids[text.start : text.end]
        save = TransferParams(save=(PieceSpec(0, len(entry)),))
        send(vllm_engine, entry, salt=None, params=save.as_request())  # encoded alone, stored
        _, want, loaded = loaded_answer(vllm_engine, ids, stored)
        _, got, cached = loaded_answer(vllm_engine, ids, computed)
        assert loaded == cached == stored.load_end
        assert max_logprob_gap(got, want) < 1e-4
