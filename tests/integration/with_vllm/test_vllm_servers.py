"""Scale out on vLLM's own means: two OpenAI servers with the connector, one Redis.

Each server is ``python -m kvrag_integrations.vllm.serve --store redis://...``
(vLLM's own ``api_server`` with the connector); clients are ``VLLMEngine.connect``
and a plain OpenAI client.
"""

from __future__ import annotations

import pytest
from vllm_helpers import Corpus, VLLMServer, needs_vllm

from kvrag_integrations.vllm.engine import VLLMEngine

needs_vllm()
openai = pytest.importorskip("openai")  # installed with vLLM


def test_chunks_encoded_through_one_replica_are_reused_by_the_other_at_once(
    vllm_servers: list[VLLMServer], musique: Corpus
) -> None:
    first = VLLMEngine.connect(vllm_servers[0].url)
    second = VLLMEngine.connect(vllm_servers[1].url)
    assert first.fingerprint == second.fingerprint  # the same weights: one key space
    item, chunks = musique.item(40), musique.chunks(40, 3, tag="replicas")
    refs = first.encode_chunks(chunks, show_progress=False)
    result = second.generate(question=item.question, chunks=chunks[::-1], max_new_tokens=8)
    assert result.fallback is None and result.reused_chunks == 3
    assert result.reused_chunk_tokens >= sum(r.num_tokens for r in refs)
    stream = second.stream(question=item.question, chunks=chunks, max_new_tokens=8)
    assert "".join(stream) == stream.result.text and stream.result.reused_chunks == 3
    first.close()
    second.close()


def test_a_plain_openai_request_after_turbo_equals_a_fresh_computation(
    vllm_servers: list[VLLMServer], musique: Corpus
) -> None:
    """The same tokens from any OpenAI client never meet turbo's approximate blocks."""
    server = vllm_servers[0]
    engine = VLLMEngine.connect(server.url)
    item, chunks = musique.item(41), musique.chunks(41, 2, tag="plain")
    engine.encode_chunks(chunks, show_progress=False)
    ids = engine.tokenize(engine.build_segments(question=item.question, chunks=chunks))
    prompt = ids.input_ids.tolist()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def plain(**extra: object):  # type: ignore[no-untyped-def]
        return client.completions.create(
            model=engine.model_name, prompt=prompt, max_tokens=16, temperature=0, **extra
        )

    fresh = plain(extra_body={"cache_salt": "a-fresh-computation"})
    turbo = engine.generate(question=item.question, chunks=chunks, max_new_tokens=16)
    assert turbo.reused_chunks == 2
    after = plain()
    assert after.choices[0].text == fresh.choices[0].text
    details = after.usage.prompt_tokens_details
    assert details is None or (details.cached_tokens or 0) < 128  # no turbo block served
    engine.close()
