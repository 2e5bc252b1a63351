"""Scale out on vLLM's own means: two OpenAI servers with the connector, one Redis Cluster.

Each server is ``python -m kvrag_integrations.vllm.serve --store redis+cluster://...``
(vLLM's own ``vllm serve`` with the connector); clients are ``VLLMEngine.connect``
and a plain OpenAI client.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from vllm_helpers import Corpus, VLLMServer, exact_reference, max_logprob_gap, needs_vllm

from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()
openai = pytest.importorskip("openai")  # installed with vLLM


def test_chunks_encoded_through_one_replica_are_reused_by_the_other_at_once(
    vllm_servers: list[VLLMServer], musique: Corpus, connect: Callable[..., VLLMEngine]
) -> None:
    first = connect(vllm_servers[0].url)
    second = connect(vllm_servers[1].url)
    assert first.fingerprint == second.fingerprint  # the same weights: one key space
    item, chunks = musique.item(40), musique.chunks(40, 3, tag="replicas")
    refs = first.encode_chunks(chunks, show_progress=False)
    result = second.generate(question=item.question, chunks=chunks[::-1], max_new_tokens=8)
    assert result.fallback is None and result.reused_chunks == 3
    assert result.reused_chunk_tokens >= sum(r.num_tokens for r in refs)  # all of them
    print(
        f"\nsecond replica's first request: {result.reused_tokens} of {result.prompt_tokens} cached"
    )
    stream = second.stream(question=item.question, chunks=chunks, max_new_tokens=8)
    assert "".join(stream) == stream.result.text and stream.result.reused_chunks == 3


def test_a_plain_openai_request_after_turbo_equals_a_fresh_computation(
    vllm_servers: list[VLLMServer], musique: Corpus, connect: Callable[..., VLLMEngine]
) -> None:
    """The same tokens from any OpenAI client, opted out of detection, never meet
    turbo's approximate blocks."""
    server = vllm_servers[0]
    engine = connect(server.url)
    item, chunks = musique.item(41), musique.chunks(41, 2, tag="plain")
    engine.encode_chunks(chunks, show_progress=False)
    ids = engine.tokenize(engine.build_segments(question=item.question, chunks=chunks))
    prompt = ids.input_ids.tolist()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def plain(**extra: object):  # type: ignore[no-untyped-def]
        return client.completions.create(
            model=engine.model_name, prompt=prompt, max_tokens=16, temperature=0, **extra
        )

    exact = {"kv_transfer_params": {"kvrag": {"detect": False}}}  # (else the server reuses)
    fresh = plain(extra_body={"cache_salt": "a-fresh-computation", **exact})
    turbo = engine.generate(question=item.question, chunks=chunks, max_new_tokens=16)
    assert turbo.reused_chunks == 2
    after = plain(extra_body=exact)
    assert after.choices[0].text == fresh.choices[0].text
    details = after.usage.prompt_tokens_details  # the server always reports them
    assert details.cached_tokens < 128  # no turbo block served


def test_encoding_a_stored_lossy_entry_leaves_no_lossy_block_unsalted(
    vllm_servers: list[VLLMServer], musique: Corpus, connect: Callable[..., VLLMEngine]
) -> None:
    """Encoded through one replica (float16 entries), encoded again through the other,
    whose prefix cache does not have it: the second must not load the float16 copy
    into blocks an exact request can be served."""
    first, second = (connect(s.url) for s in vllm_servers)
    item, (chunk,) = musique.item(42), musique.chunks(42, 1, tag="lossy")
    first.encode_chunks([chunk], show_progress=False)
    second.encode_chunks([chunk], show_progress=False)  # stored: nothing written
    entry = second.prompts.chunks_to_encode([chunk])[0][1].tolist()
    ids = entry + second.tokenizer(f"\nQuestion: {item.question}")["input_ids"]
    plain = exact_reference(second, ids, max_new_tokens=1, salt=None)
    # the same path on exact blocks: asked twice under a salt of its own
    salt = f"exact-{uuid.uuid4().hex}"
    exact_reference(second, ids, max_new_tokens=1, salt=salt)
    exact = exact_reference(second, ids, max_new_tokens=1, salt=salt)
    assert max_logprob_gap(plain[1], exact[1]) < 1e-5


def test_a_tenants_chunks_follow_its_key_across_replicas_and_no_one_elses(
    vllm_servers: list[VLLMServer], musique: Corpus, connect: Callable[..., VLLMEngine]
) -> None:
    url_1, url_2 = (s.url for s in vllm_servers)
    item, chunks = musique.item(43), musique.chunks(43, 2, tag="tenant-replicas")
    connect(url_1, api_key="sk-team-a").encode_chunks(chunks, show_progress=False)
    team_a = connect(url_2, api_key="sk-team-a")  # the other replica
    asked = dict(question=item.question, chunks=chunks, max_new_tokens=1)
    assert team_a.generate(**asked).reused_chunks == 2
    salted = connect(url_1, cache_salt="tenant-s")
    salted.encode_chunks(chunks, show_progress=False)
    again = connect(url_2, cache_salt="tenant-s")
    assert again.generate(**asked).reused_chunks == 2
    for other in (
        connect(url_2, api_key="sk-team-b"),
        connect(url_2),
        connect(url_2, cache_salt="tenant-t"),
    ):
        seen = other.generate(**asked)
        assert (seen.reused_chunks, seen.reused_chunk_tokens) == (0, 0)
