"""Plain OpenAI clients get reuse: the server finds stored passages in their requests.

Two replicas of ``python -m kvrag_integrations.vllm.serve`` on one Redis (the
``vllm_servers`` fixture). The applications are the frameworks' documented RAG
patterns with ``ChatOpenAI`` / ``OpenAILike`` (``bench.openai_apps``): nothing of
this package between them and the server. What the server reports
(``usage.prompt_tokens_details.cached_tokens``) is what is checked; exactness is
checked against vLLM's own computation of the same ids in this process
(``vllm_engine``, a fresh salt: nothing cached).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from vllm_helpers import Corpus, VLLMServer, exact_reference, max_logprob_gap, needs_vllm

from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()
openai = pytest.importorskip("openai")
pytest.importorskip("langchain_openai")
pytest.importorskip("llama_index.llms.openai_like")

from kvrag_integrations.bench.openai_apps import (  # noqa: E402
    Meter,
    embeddings_for_langchain,
    embeddings_for_llama_index,
    langchain_agent,
    llama_index_engine,
    wait_indexed,
)

NEW_QUESTION = "Which people, places or works do these passages name?"
PASSAGES = 4


@pytest.fixture(scope="module")
def lc_embed():  # type: ignore[no-untyped-def]
    return embeddings_for_langchain()


def share(record: dict) -> float:
    return record["cached"] / record["prompt_tokens"]


def test_langchain_agent_reuses_passages_learned_by_the_other_replica(
    vllm_servers: list[VLLMServer],
    redis_servers_store: str,
    vllm_engine: VLLMEngine,
    musique: Corpus,
    lc_embed,
) -> None:
    """A tenant's first request teaches one replica; a new question over the same
    passages (in the order its retrieval gives) is served from storage by the
    other, for that tenant only (learned prompts stay in its namespace)."""
    meter = Meter()
    name = vllm_engine.model_name
    passages = musique.chunks(60, PASSAGES, tag="detect-lc")

    def app(url: str, key: str = "none") -> Callable[[str], object]:
        return langchain_agent(url, name, passages, lc_embed, meter.client(), key)

    app(vllm_servers[0].url, "sk-team-a")(musique.item(60).question)
    taught = meter.take()
    assert taught["prompt_tokens"] > 400 and share(taught) < 0.5  # computed, and stored
    wait_indexed(redis_servers_store, taught["prompt_tokens"])
    url = vllm_servers[1].url
    app(url, "sk-team-a")(NEW_QUESTION)
    assert share(meter.take()) >= 0.85  # its own tenant: served (the positive control)
    # no other caller finds it: another key's namespace, nor an anonymous caller
    other = app(url, "sk-team-b")
    other(NEW_QUESTION)
    assert share(meter.take()) < 0.2
    app(url)(NEW_QUESTION)
    assert share(meter.take()) < 0.2
    other(musique.item(60).question)  # the other tenant teaches its own
    assert share(meter.take()) >= 0.85


def test_llama_index_query_engine_with_openai_like_reuses_its_passages(
    vllm_servers: list[VLLMServer], vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    """A plain client with a ``cache_salt`` of its own (``extra_body``) finds its
    learned prompt on its second request."""
    meter = Meter()
    passages = musique.chunks(61, PASSAGES, tag="detect-li")
    embed = embeddings_for_llama_index()
    url, salt = vllm_servers[0].url, f"li-{uuid.uuid4().hex}"
    query = llama_index_engine(url, vllm_engine.model_name, passages, embed, meter.client(), salt)
    query(musique.item(61).question)
    meter.take()
    query(NEW_QUESTION)
    assert share(meter.take()) >= 0.85


def test_passages_ingested_through_the_server_are_found_on_the_first_request(
    vllm_servers: list[VLLMServer],
    vllm_engine: VLLMEngine,
    musique: Corpus,
    lc_embed,
    connect: Callable[..., VLLMEngine],
) -> None:
    """Anonymous, with nothing learned: what a writer ingested is found at once."""
    meter = Meter()
    name, url = vllm_engine.model_name, vllm_servers[0].url
    passages = musique.chunks(63, PASSAGES, tag="detect-ingest")
    connect(url).encode_chunks(passages, show_progress=False)
    app = langchain_agent(vllm_servers[1].url, name, passages, lc_embed, meter.client())
    app(musique.item(63).question)
    assert share(meter.take()) >= 0.85


def test_streaming_n_and_stop_work_on_a_request_with_reuse(
    vllm_servers: list[VLLMServer], vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    client = openai.OpenAI(base_url=f"{vllm_servers[0].url}/v1", api_key="none")
    context = "\n\n".join(musique.chunks(64, PASSAGES, tag="detect-features"))
    messages = [
        {"role": "system", "content": f"Use the following context:\n\n{context}"},
        {"role": "user", "content": musique.item(64).question},
    ]
    args = {"model": vllm_engine.model_name, "temperature": 0, "max_tokens": 12}
    args["extra_body"] = {"cache_salt": f"features-{uuid.uuid4().hex}"}  # its own tenant
    client.chat.completions.create(messages=messages, **args)  # learned
    messages[1]["content"] = NEW_QUESTION
    whole = client.chat.completions.create(messages=messages, **args)
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0.85 * whole.usage.prompt_tokens
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **args
    )
    pieces, usage = [], None
    for event in stream:
        pieces += [c.delta.content or "" for c in event.choices]
        usage = event.usage or usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    sampled = {**args, "temperature": 0.8, "seed": 7}
    two = client.chat.completions.create(messages=messages, n=2, **sampled)
    assert len(two.choices) == 2 and all(c.message.content for c in two.choices)
    assert two.usage.prompt_tokens_details.cached_tokens >= 0.85 * two.usage.prompt_tokens
    stopped = client.chat.completions.create(messages=messages, stop=["\n"], **args)
    assert "\n" not in stopped.choices[0].message.content


@pytest.mark.parametrize("case", ["no-passage", "opted-out"])
def test_requests_without_reuse_equal_vllms_own_computation(
    case: str, vllm_servers: list[VLLMServer], vllm_engine: VLLMEngine, musique: Corpus
) -> None:
    """A prompt with no stored passage, and one that opts out, are vLLM's exact answer."""
    client = openai.OpenAI(base_url=f"{vllm_servers[0].url}/v1", api_key="none")
    tok = vllm_engine.tokenizer
    if case == "no-passage":
        text = f"Spell the code {uuid.uuid4().hex} backwards, then explain why."
        extra: dict = {}
    else:  # passages the server knows (taught by a first request), opted out
        text = "\n\n".join(musique.chunks(65, PASSAGES, tag="detect-optout"))
        client.completions.create(model=vllm_engine.model_name, prompt=text, max_tokens=1)
        extra = {"kv_transfer_params": {"kvrag": {"detect": False}}}
    ids = tok(text, add_special_tokens=False).input_ids
    extra["cache_salt"] = f"fresh-{uuid.uuid4().hex}"  # computed afresh, as the reference
    got = client.completions.create(
        model=vllm_engine.model_name,
        prompt=ids,
        max_tokens=1,
        temperature=0,
        logprobs=20,
        extra_body={**extra, "return_tokens_as_token_ids": True},
    )
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    top = {int(t.split(":")[1]): lp for t, lp in got.choices[0].logprobs.top_logprobs[0].items()}
    _, want, _ = exact_reference(vllm_engine, ids, max_new_tokens=1)
    # Another vLLM (this process's: other batching) computing the same ids afresh
    # differs by vLLM's own noise, up to 3e-5 here; a loaded block moves them by
    # more than 1e-3. (bench openai compares with a plain server run alike: 1e-5.)
    assert max_logprob_gap(top, want) <= 5e-5


def test_kvrag_ingest_through_the_server_is_found_by_plain_clients(
    vllm_servers: list[VLLMServer], vllm_engine: VLLMEngine, musique: Corpus, tmp_path
) -> None:
    """``kvrag ingest --server``: the files' chunks are encoded by the server, and a
    plain client holding them reuses them on its first request."""
    import subprocess
    import sys

    texts = musique.chunks(66, 2, tag="detect-cli")
    notes = tmp_path / "notes"
    notes.mkdir()
    for i, text in enumerate(texts):
        (notes / f"{i}.txt").write_text(text)
    url = vllm_servers[0].url
    command = [sys.executable, "-m", "kvrag_integrations.cli", "ingest", str(notes)]
    command += ["--collection", "notes", "--chroma", str(tmp_path / "chroma")]
    command += ["--server", url, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"stored by {url}" in done.stdout
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    head = "Answer from these notes only:\n\n"

    def ask(context: str, question: str):  # type: ignore[no-untyped-def]
        messages = [
            {"role": "system", "content": head + context},
            {"role": "user", "content": question},
        ]
        reply = client.chat.completions.create(
            model=vllm_engine.model_name, messages=messages, max_tokens=1
        )
        return reply.usage

    warm = "\n\n".join(musique.chunks(67, 3, tag="detect-cli-head"))
    ask(warm, "What is this?")  # a prompt of this template, learned: its head is known
    usage = ask("\n\n".join(texts[::-1]), musique.item(66).question)
    assert usage.prompt_tokens_details.cached_tokens >= 0.85 * usage.prompt_tokens
