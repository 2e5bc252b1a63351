"""At its defaults the server is no oracle: attacks by plain HTTP clients on the README's server.

One server started as the README starts it (``python -m kvrag_integrations.vllm.serve
--store disk:DIR``: no key file, no flags; the run's ``README_SERVER``, which
cookbook 05 runs on after these), shared by every test here; a writer
ingests passages through it (``encode_chunks``). An anonymous victim sends a
secret; an anonymous attacker guesses it, by ``cached_tokens`` in layouts of its
own, by timing, and by ``/metrics``. Issue 47 (a learned prompt) and issue 54
(glue between passages) both found one; neither may.

Timing is judged as held-out tests judge it: interleaved pairs of a right and a
wrong guess, and the right one may not be faster in nearly all of them. With
the same path for both, each pair is a coin toss: 11 or 12 of 12 happen by
chance 13 times in 4,096 (0.3%). Issue 54's oracle had the right guess faster in
9 of 9 (176 against 263 ms, median), which that rule fails.
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_helpers import README_SERVER, Corpus, VLLMServer, needs_vllm

from kvrag_integrations.bench.openai_apps import system_prompt
from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.matching import open_index_log
from kvrag_integrations.store import DiskKVStore
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()

SECRET_LINE = "Note: the vault code for account 88-A is {code}."
RIGHT = "7 3 9 1 5 2"
PAIRS = 12  # the right guess faster in more than PAIRS - 2 of them: an oracle

pytestmark = pytest.mark.vllm_server(*README_SERVER)


class Defaults:
    """The README's server, its store and log, and passages a writer ingested
    through it."""

    def __init__(self, url: str, store: Path, model: str, passages: list[str], log: Path) -> None:
        self.url, self.store, self.model, self.passages = url, store, model, passages
        self.log = log
        self.http = httpx.Client(base_url=url, timeout=300)

    @classmethod
    def ingested(cls, server: VLLMServer, store: Path, musique: Corpus) -> Defaults:
        """``server`` on the disk ``store``, once a writer ingested passages."""
        passages = musique.chunks(57, 3, tag="defaults")
        with VLLMEngine.connect(server.url) as writer:
            writer.encode_chunks(passages, show_progress=False)
            return cls(server.url, store, writer.model_name, passages, server.log)

    def complete(self, prompt: str | list[int], **body: Any) -> tuple[dict[str, Any], float]:
        """A raw completion (one answer token), and its time to that token."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **body}
        start = time.perf_counter()
        response = self.http.post("/v1/completions", json=body)
        took = time.perf_counter() - start
        assert response.status_code == 200, response.text
        return response.json(), took

    def ask(self, context: str, salt: str | None = None) -> tuple[int, int, float]:
        """A plain chat request (LangChain's RAG prompt): cached and prompt tokens, time."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": 1, "temperature": 0}
        body["messages"] = [
            {"role": "system", "content": system_prompt(context)},
            {"role": "user", "content": "What is the vault code for account 88-A?"},
        ]
        if salt is not None:
            body["cache_salt"] = salt
        start = time.perf_counter()
        response = self.http.post("/v1/chat/completions", json=body)
        took = time.perf_counter() - start
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"], took


@pytest.fixture(scope="module")
def defaults(vllm_server: VLLMServer, musique: Corpus) -> Defaults:
    store = Path(vllm_server.store.removeprefix("disk:"))
    return Defaults.ingested(vllm_server, store, musique)


def wrong_codes(n: int) -> list[str]:
    """New wrong guesses, each unlike the others (and the right one) in every digit."""
    return [" ".join(str((i + 3 * k) % 10) for k in range(6)) for i in range(n)]


def faster_pairs(send: Any, right: Any, wrongs: list[Any]) -> tuple[int, list[float], list[float]]:
    """Interleaved pairs (the order alternating): in how many the right guess was the
    faster, and the times of each."""
    times: dict[str, list[float]] = {"right": [], "wrong": []}
    for i, wrong in enumerate(wrongs):
        order = [("right", right), ("wrong", wrong)]
        for name, guess in order if i % 2 == 0 else order[::-1]:
            times[name].append(send(guess))
    faster = sum(r < w for r, w in zip(times["right"], times["wrong"]))
    return faster, times["right"], times["wrong"]


@pytest.fixture
def timed_pairs() -> int:
    """Right/wrong guess pairs the guess tests time on this module's server (0:
    they check cached tokens only)."""
    return PAIRS


def test_no_caller_confirms_a_guess_of_anothers_learned_prompt(
    defaults: Defaults, musique: Corpus, timed_pairs: int
) -> None:
    """Issue 47: a caller sent a secret among three passages; another guesses it.
    Right and wrong guesses get the same cached tokens and no oracle in time.
    Positive control: a caller of the victim's own tenant (its salt) tells them apart."""
    # passages none ingested (a learned prompt would be the only source): item 60's
    # first passages are item 61's too, which other tests ingest on the run's store.
    # Their first 120 words: a ~750-token prompt, learned (over 256) and most of
    # a request's time if reused (whole passages made 2,500: 3.4x the compute).
    own = musique.unseen(60, 3, tag="learned", words=120)

    def context(code: str, passages: list[str] = own) -> str:
        return "\n\n".join([passages[0], SECRET_LINE.format(code=code), *passages[1:]])

    defaults.ask(context(RIGHT))  # the victim, anonymous
    time.sleep(3)  # (what a learned prompt would take to land)
    seen = {"right": set(), "wrong": set()}

    def send(code: str) -> float:
        cached, _, took = defaults.ask(context(code))
        seen["right" if code == RIGHT else "wrong"].add(cached)
        return took

    faster, right, wrong = faster_pairs(send, RIGHT, wrong_codes(timed_pairs or 3))
    print({"faster": faster, "right": statistics.median(right), "wrong": statistics.median(wrong)})
    print({"cached": seen})
    assert seen["right"] == seen["wrong"] == {0}, seen
    assert not timed_pairs or faster <= timed_pairs - 2, (faster, right, wrong)
    # the positive control: within one tenant (a salt) the guess shows
    defaults.ask(context(RIGHT), salt="tenant-v")
    time.sleep(3)
    hit, prompt, _ = defaults.ask(context(RIGHT), salt="tenant-v")
    miss, _, _ = defaults.ask(context(wrong_codes(PAIRS + 1)[-1]), salt="tenant-v")
    assert hit >= 0.85 * prompt and miss < 0.75 * prompt, (hit, miss, prompt)


def test_an_anonymous_callers_glue_is_no_oracle_in_cached_tokens_or_time(
    defaults: Defaults, musique: Corpus, timed_pairs: int
) -> None:
    """Issue 54: the victim's prompt is an ingested passage, a short note holding a
    secret, another ingested passage and a question: the note is glue between found
    passages. It is computed in the victim's own load step, stored nowhere (before:
    encoded for the victim alone and dropped): an attacker's right
    and wrong guesses, in the victim's layout and in layouts of its own (the guess
    between a passage and an unstored one; a completion that starts with it), get
    the same cached tokens, and the right one is no faster."""
    a, b, c = defaults.passages
    unstored = musique.chunks(58, 1, tag="never-ingested")[0]
    question = "\n\nWhat is the vault code for account 88-A?"

    def note(code: str) -> str:
        return SECRET_LINE.format(code=code)

    layouts = {
        "the victim's": lambda code: f"{a}\n\n{note(code)}\n\n{b}{question}",
        "then an unstored passage": lambda code: f"{a}\n\n{note(code)}\n\n{unstored}",
        "starting with it": lambda code: f"{note(code)}\n\n{c}",
    }
    victim, _ = defaults.complete(layouts["the victim's"](RIGHT))
    # it loaded the ingested passages around its note (what makes it a victim at all)
    assert victim["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    time.sleep(2)
    for name, layout in layouts.items():
        cached = {
            code: defaults.complete(layout(code))[0]["usage"]["prompt_tokens_details"][
                "cached_tokens"
            ]
            for code in (RIGHT, *wrong_codes(3))
        }
        print({name: cached})
        assert len(set(cached.values())) == 1, (name, cached)

    def send(code: str) -> float:
        return defaults.complete(layouts["the victim's"](code))[1]

    if timed_pairs:
        faster, right, wrong = faster_pairs(send, RIGHT, wrong_codes(timed_pairs))
        med = {"right": statistics.median(right), "wrong": statistics.median(wrong)}
        print({"faster": faster, **med})
        assert faster <= timed_pairs - 2, (faster, right, wrong)


def test_nothing_an_anonymous_request_brings_stays_in_the_store(defaults: Defaults) -> None:
    """Its glue and prefix are computed in its load's step (the workers took the
    model: the server's log says so), stored nowhere: afterwards the index holds
    only what the writer ingested, and no other entry is in the store."""
    log = defaults.log.read_text(errors="replace")
    assert "anonymous requests' own texts are computed in their load's step" in log
    a, b, _ = defaults.passages
    for i in range(3):
        defaults.complete(f"{a}\n\nA note of request {i}: {uuid.uuid4().hex}\n\n{b}\n\nWhy?")
    time.sleep(2)  # (its own entries are dropped once it is answered)
    log = open_index_log(f"disk:{defaults.store}")
    indexed = {cache_key(fingerprint, ids.tolist()) for fingerprint, ids in log.read_new()}
    stored = {info.key for info in DiskKVStore(defaults.store).entries()}
    assert stored and stored <= indexed, f"{len(stored - indexed)} entries outside the index"


def test_at_the_defaults_metrics_is_closed_and_bad_input_a_400(defaults: Defaults) -> None:
    """``/metrics`` counts every caller's traffic: closed at the defaults (open only
    with ``serve --open-metrics``). Bad input is a 400, and the server stays up."""
    for path in ("/metrics", "/metrics/", "/metrics/x"):
        assert defaults.http.get(path).status_code == 401
    for path in ("/health", "/ping", "/version", "/v1/models"):
        assert defaults.http.get(path).status_code == 200, path
    deep = b'{"kv_transfer_params": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001
    headers = {"content-type": "application/json"}
    assert defaults.http.post("/v1/completions", content=deep, headers=headers).status_code == 400
    bad = {"model": defaults.model, "prompt": "hi", "cache_salt": 7}
    assert defaults.http.post("/v1/completions", json=bad).status_code == 400
    assert defaults.http.get("/health").status_code == 200


def test_a_client_cannot_fill_the_private_pool_with_its_own_saves(defaults: Defaults) -> None:
    """Issue 59 hole 2, on the README's disk store: an anonymous client's own
    ``"private": true`` saves were stored in private namespaces and never deleted
    (a flood of them refused every other anonymous request's glue for 10 minutes).
    The fields of a request's private namespace are the server's to write: a 400,
    and nothing stored."""
    before = sorted(p.name for p in defaults.store.rglob("*.safetensors"))
    for i in range(3):
        ids = list(range(1000 + 300 * i, 1300 + 300 * i))
        body = {"model": defaults.model, "prompt": ids, "max_tokens": 1}
        body["kv_transfer_params"] = {"kvrag": {"save": [[0, len(ids), []]], "private": True}}
        response = defaults.http.post("/v1/completions", json=body)
        assert response.status_code == 400 and "the server's to write" in response.text
    assert sorted(p.name for p in defaults.store.rglob("*.safetensors")) == before
