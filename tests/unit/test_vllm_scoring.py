"""The decoder reranker's requests on vLLM (``vllm.scoring``), against a stand-in
vLLM: what each candidate's request carries, and how its score is read."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest

from kvrag_integrations.engine.protocol import check_scorer
from kvrag_integrations.errors import (
    ServerError,
    TransferParamsError,
    UnsupportedEngineError,
    UnsupportedInputError,
)
from kvrag_integrations.rerank import KVReranker
from kvrag_integrations.vllm.client import scoring
from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.client.scoring import by_token_pays, collect, judge_score, query_score
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine
from kvrag_integrations.vllm.params import PARAMS_KEY, TransferParams
from kvrag_integrations.vllm.reply import Reply


class _Tokenizer:
    """Characters as ids, but "yes" and "no" are one token each."""

    chat_template = None
    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        words = {"yes": 1000, "no": 1001}
        return {"input_ids": [words[text]] if text in words else [ord(c) for c in text]}


class _Backend:
    """A vLLM stand-in: stored entries by ids; loads what is stored; -1 per prompt
    token, and log P(token) = -token/100 for the first new token."""

    model_name = "tiny"
    context_window = 4096

    def __init__(self, prompt_rows_after_load: bool = True) -> None:
        self.prompt_rows_after_load = prompt_rows_after_load
        self.requests: list[BackendRequest] = []
        self.stored: set[tuple[int, ...]] = set()
        self.lock = threading.Lock()

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        with self.lock:
            self.requests.append(request)
        ours = (request.params or {}).get(PARAMS_KEY, {})
        ids = tuple(request.prompt_ids)
        reply = Reply("fp")
        if not ours.get("load") and ours.get("save"):
            reply.stored = int(ids not in self.stored)
            self.stored.add(ids)
        cached = 0
        if ours.get("load"):
            _, rows, _ = ours["load"][0]
            if ids[:rows] in self.stored:
                cached = reply.loaded = rows
        event = BackendEvent("", [1], cached, "length", reply)
        if request.logprob_token_ids:
            event.logprobs = {i: -i / 100 for i in request.logprob_token_ids}
        if request.prompt_logprobs:
            event.prompt_logprobs = [None, *(-1.0 for _ in ids[1:])]
        yield event

    def close(self) -> None:
        pass


@pytest.fixture()
def vllm() -> VLLMEngine:
    return VLLMEngine(_Backend(), _Tokenizer())


def test_judge_requests_load_each_document_and_ask_for_the_answer_ids(vllm: VLLMEngine) -> None:
    backend = vllm.backend
    prefixes, suffix = [[5, 6, 7], [8, 9]], [3, 4]
    cold = vllm.score_documents(prefixes, suffix, answer_ids=([10, 11], [20]))
    assert cold.reused == 0 and cold.encoded == 2
    warm = vllm.score_documents(prefixes, suffix, answer_ids=([10, 11], [20]))
    assert warm.reused == 2 and warm.encoded == 0
    want = math.log(math.exp(-0.10) + math.exp(-0.11)) + 0.20
    assert warm.scores == pytest.approx([want, want])
    scoring = [r for r in backend.requests if r.logprob_token_ids]
    assert {tuple(r.prompt_ids) for r in scoring} == {(5, 6, 7, 3, 4), (8, 9, 3, 4)}
    for request in scoring:
        head = len(request.prompt_ids) - 2
        load = TransferParams(load=TransferParams.from_request(request.params).load)
        assert load.layout == [[0, head, []]]
        assert request.salt == load.salt()  # the connector admits it
        assert request.logprob_token_ids == (10, 11, 20) and not request.prompt_logprobs


def test_query_likelihood_reads_the_query_rows(vllm: VLLMEngine) -> None:
    result = vllm.score_documents([[5, 6, 7]], [3, 4, 9], n_query=2, reuse=False)
    assert result.scores == [-1.0]
    (request,) = vllm.backend.requests
    # an exact request: no load, no salt, and the server's detection asked to stay out
    assert request.prompt_logprobs and request.salt is None
    assert request.params == {"kvrag": {"detect": False}}


@pytest.fixture()
def requests_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring by query token pays even for the stand-in's few-token documents."""
    monkeypatch.setattr(scoring, "REQUEST_TOKENS", 0)


def test_by_token_pays_only_for_documents_long_beside_the_query() -> None:
    # the shapes measured (docs/vllm.md): 250-token documents lost, 600-token ones won
    # with 15 query tokens, and were even with 18 (plain, then: never slower)
    assert not by_token_pays([[0] * 260] * 10, 29, 15)
    assert by_token_pays([[0] * 600] * 10, 29, 15)
    assert not by_token_pays([[0] * 600] * 10, 32, 18)
    assert not by_token_pays([[0] * 4000], 500, 480)  # a long query: every token a request


def test_a_server_scores_short_documents_by_plain_prefill() -> None:
    """Where one request per query token would cost more than the plain prefill, the
    candidates are scored exactly, as without reuse: nothing loaded, nothing stored."""
    vllm = VLLMEngine(_Backend(prompt_rows_after_load=False), _Tokenizer())
    result = vllm.score_documents([[5, 6, 7], [8, 9]], [3, 4, 9], n_query=2)
    assert result.scores == [-1.0, -1.0] and (result.reused, result.encoded) == (0, 0)
    assert all(r.prompt_logprobs and r.salt is None for r in vllm.backend.requests)
    assert len(vllm.backend.requests) == 2


@pytest.mark.usefixtures("requests_cost_nothing")
def test_a_server_scores_query_likelihood_token_by_token() -> None:
    """Over HTTP no prompt row after a load is read: one request per query token."""
    vllm = VLLMEngine(_Backend(prompt_rows_after_load=False), _Tokenizer())
    vllm.encode_documents([[5, 6, 7]])
    result = vllm.score_documents([[5, 6, 7]], [3, 4, 9], n_query=2)
    assert result.scores == pytest.approx([-(4 + 9) / 200]) and result.reused == 1
    asked = [r for r in vllm.backend.requests if r.logprob_token_ids]
    assert sorted((tuple(r.prompt_ids), r.logprob_token_ids) for r in asked) == [
        ((5, 6, 7, 3), (4,)),
        ((5, 6, 7, 3, 4), (9,)),
    ]
    assert all(TransferParams.from_request(r.params).load_end == 3 for r in asked)


@pytest.mark.usefixtures("requests_cost_nothing")
def test_a_server_scores_a_document_not_stored_by_one_exact_request() -> None:
    """Over HTTP, a document whose entry is not stored costs one whole prefill, not
    one per query token: after the first query token's request misses, the rest of
    its query is read from one exact request's prompt rows; then it is stored."""
    vllm = VLLMEngine(_Backend(prompt_rows_after_load=False), _Tokenizer())
    vllm.encode_documents([[8, 9]])  # the other document is stored
    result = vllm.score_documents([[5, 6, 7], [8, 9]], [3, 4, 9, 2], n_query=3)
    assert result.scores == pytest.approx([-1.0, -(4 + 9 + 2) / 300])
    assert (result.reused, result.encoded) == (1, 1)
    asked = [(tuple(r.prompt_ids), bool(r.prompt_logprobs)) for r in vllm.backend.requests]
    whole = [ids for ids, rows in asked if rows]
    assert whole == [(5, 6, 7, 3, 4, 9, 2)]  # exact: no load, no salt
    missed = [ids for ids, _ in asked if ids[:3] == (5, 6, 7) and ids != whole[0]]
    assert missed == [(5, 6, 7, 3), (5, 6, 7)]  # the probe that missed, then its encode
    again = vllm.score_documents([[5, 6, 7], [8, 9]], [3, 4, 9, 2], n_query=3)
    assert again.reused == 2 and again.scores[1] == pytest.approx(result.scores[1])


def test_a_tenant_scores_under_its_own_salts() -> None:
    vllm = VLLMEngine(_Backend(), _Tokenizer(), cache_salt="team-a")
    vllm.score_documents([[5, 6]], [3], answer_ids=([10], [20]))
    for request in vllm.backend.requests:
        params = TransferParams.from_request(request.params)
        assert params is not None and params.tenant_salt == "team-a"
        assert request.salt == params.salt()


def test_scores_come_from_the_right_rows() -> None:
    assert query_score([None, -9.0, -1.0, -3.0], 2) == -2.0
    assert judge_score({1: math.log(0.5), 2: math.log(0.25)}, [1], [2]) == pytest.approx(
        math.log(2)
    )
    with pytest.raises(ServerError):
        judge_score({1: -1.0}, [1], [2])
    with pytest.raises(ServerError):
        query_score([None, None], 1)
    refused = BackendEvent(reply=Reply("fp", refused="no"))
    with pytest.raises(TransferParamsError):
        collect([refused])


def test_the_reranker_takes_a_vllm_engine_and_refuses_others(vllm: VLLMEngine) -> None:
    reranker = KVReranker(vllm, template="bge-gemma", scoring="judge")
    scores = reranker.score("q", ["a doc", "", "a doc"])
    assert scores[1] == -math.inf and scores[0] == scores[2]
    assert reranker.fingerprint == vllm.fingerprint
    with pytest.raises(UnsupportedInputError):
        vllm.score_documents([[1]], [2], store=object())
    with pytest.raises(UnsupportedEngineError, match="score_documents"):
        KVReranker(object())
    with pytest.raises(UnsupportedEngineError):
        check_scorer(object())
