"""``VLLMEngine``'s side of ``protocol.DocumentScorer``: the decoder reranker on vLLM.

Each document's prefix (``[instruction][document]`` ids) is one entry, stored
like a chunk by a prefill-only encode request (the whole prompt as one entry,
shared with a chunk entry whose ids agree). Scoring a candidate is one request
for ``prefix + suffix`` that loads the entry at position 0 (exact: no key moves)
under the salt of its tenant and layout, so vLLM computes only the suffix. Every
candidate of a call is in flight at once, and vLLM's continuous batching scores
them (and the candidates of concurrent calls) together.

- ``judge``: one new token with ``logprob_token_ids`` = the yes and no ids: vLLM
  returns their raw log-probabilities (``logprobs_mode="raw_logprobs"``, the
  default: before any sampling processor).
- query likelihood: the prompt's log-probabilities (``prompt_logprobs=0``) of the
  query tokens, which lie in the computed suffix. vLLM skips its prefix cache and
  external loads for such requests; the connector keeps an accepted load (the
  rows it needs are computed after it), and a request whose needed rows vLLM did
  not compute (``cached_tokens``) is scored again whole.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.engine.protocol import DocumentScores
from kvrag_integrations.errors import (
    ServerError,
    TransferParamsError,
    UnsupportedInputError,
    check_fits,
)
from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.params import PieceSpec, TransferParams
from kvrag_integrations.vllm.reply import Reply

_SCORE = {"max_tokens": 1, "temperature": 0.0}
_MAX_SCORING_THREADS = 512  # requests in flight at once (vLLM batches them)


@dataclass
class Outcome:
    """What one scoring request returned."""

    first: dict[int, float] | None = None  # first new token's log-probabilities
    prompt: list[float | None] | None = None  # per prompt position
    cached: int = 0  # prompt tokens vLLM did not compute
    reply: Reply | None = None


def collect(events: Any) -> Outcome:
    """One request's events folded into an ``Outcome``."""
    out = Outcome()
    event: BackendEvent
    for event in events:
        out.first = event.logprobs if event.logprobs is not None else out.first
        out.prompt = event.prompt_logprobs if event.prompt_logprobs is not None else out.prompt
        out.cached = event.cached_tokens if event.cached_tokens is not None else out.cached
        out.reply = event.reply or out.reply
    if out.reply is not None:
        if out.reply.refused:
            raise TransferParamsError(f"the KV connector refused the request: {out.reply.refused}")
        out.cached -= out.reply.recomputed
    return out


def judge_score(first: dict[int, float] | None, yes: Sequence[int], no: Sequence[int]) -> float:
    """``logsumexp log P(yes) - logsumexp log P(no)`` from one token's log-probabilities
    (no ``no`` ids: ``logsumexp log P(yes)``)."""
    if not first or any(i not in first for i in (*yes, *no)):
        raise ServerError("vLLM did not return the log-probabilities of the answer tokens")
    score = _logsumexp([first[i] for i in yes])
    return score - _logsumexp([first[i] for i in no]) if no else score


def query_score(prompt: list[float | None] | None, n_query: int) -> float:
    """The mean log-probability of the prompt's last ``n_query`` tokens."""
    rows = (prompt or [])[-n_query:]
    if len(rows) != n_query or any(r is None for r in rows):
        raise ServerError("vLLM did not return the query tokens' prompt log-probabilities")
    return sum(rows) / n_query  # type: ignore[arg-type]


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


# Query likelihood over a server, by query token: each request costs about this many
# prompt tokens of a plain prefill with prompt log-probabilities (which computes the
# vocabulary's logits at every row), plus a row per 64 loaded; fitted on a 2-core CPU
# with the bundled model (scripts/rerank_by_token_fit.py: 250- and 600-token
# documents, 15-18 query tokens; where the two measured within noise, plain wins).
REQUEST_TOKENS = 28
LOADED_ROWS_PER_TOKEN = 64


def by_token_pays(heads: Sequence[Sequence[int]], tail: int, n_query: int) -> bool:
    """Whether scoring ``n_query`` query tokens one request each, loading the
    documents ``heads``, costs less than one plain prefill of each whole prompt
    (``tail`` tokens after its document)."""
    head = sum(map(len, heads)) / len(heads)
    return n_query * (REQUEST_TOKENS + head / LOADED_ROWS_PER_TOKEN) < head + tail


class VLLMScoring:
    """The ``DocumentScorer`` methods of ``VLLMEngine`` (a mixin)."""

    backend: Any
    tenant_salt: str
    tokenizer: Any
    context_window: int
    fingerprint: str
    _lock: threading.Lock
    _score_pool: ThreadPoolExecutor | None = None

    @property
    def tenant(self) -> str:
        """Deprecated: ``tenant_salt`` (the client's own tenant salt, "" : none)."""
        warnings.warn("VLLMEngine.tenant is named tenant_salt", DeprecationWarning, stacklevel=2)
        return self.tenant_salt

    def scoring_fingerprint(self, key_space: str) -> str:
        """The connector's: a document's entry is keyed by its ids alone (a chunk
        entry with the same ids is the same entry)."""
        return self.fingerprint

    def _scoring_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._score_pool is None:
                self._score_pool = ThreadPoolExecutor(_MAX_SCORING_THREADS, "kvrag-score")
            return self._score_pool

    def encode_documents(
        self,
        prefixes: Sequence[Sequence[int]],
        *,
        key_space: str = "",
        store: Any = None,
        batch_size: int = 16,
    ) -> DocumentScores:
        _check_store(store)
        started = time.perf_counter()
        entries = list(dict.fromkeys(tuple(p) for p in prefixes))
        params = TransferParams(tenant_salt=self.tenant_salt)
        engine: Any = self
        replies = list(self._scoring_pool().map(lambda e: engine._encode(e, params), entries))
        stored = sum(r.stored for r in replies)
        return DocumentScores([], len(entries) - stored, stored, time.perf_counter() - started)

    def score_documents(
        self,
        prefixes: Sequence[Sequence[int]],
        suffix: Sequence[int],
        *,
        n_query: int = 0,
        answer_ids: tuple[Sequence[int], Sequence[int]] = ((), ()),
        reuse: bool = True,
        key_space: str = "",
        store: Any = None,
        batch_size: int = 16,
    ) -> DocumentScores:
        _check_store(store)
        heads = [list(p) for p in prefixes]
        out = DocumentScores()
        if not heads:
            return out
        check_fits(max(map(len, heads)) + len(suffix), self.context_window, "a rerank prompt", 1)
        started = time.perf_counter()
        pool = self._scoring_pool()
        yes, no = answer_ids
        answers = tuple(sorted({*yes, *no}))
        tail = list(suffix)
        if n_query and reuse and not getattr(self.backend, "prompt_rows_after_load", False):
            if by_token_pays(heads, len(tail), n_query):
                return self._score_by_tokens(heads, tail, n_query, out, started)
            reuse = False  # plain prefill is the cheaper one: never slower than no reuse
        futures = [pool.submit(self._score_one, h, tail, n_query, answers, reuse) for h in heads]
        outcomes = [f.result() for f in futures]
        for outcome in outcomes:
            if n_query:
                out.scores.append(query_score(outcome.prompt, n_query))
            else:
                out.scores.append(judge_score(outcome.first, yes, no))
        return self._finish(heads, outcomes, reuse, out, started)

    def _score_by_tokens(
        self,
        heads: list[list[int]],
        tail: list[int],
        n_query: int,
        out: DocumentScores,
        started: float,
    ) -> DocumentScores:
        """Query likelihood where prompt rows after a load cannot be read (a server:
        its API detokenizes every row, and the loaded ones were never computed): one
        request per query token, ``logprob_token_ids`` = that token, each loading
        the document's entry.

        The first query token's requests go first (all in flight): where one did
        not load its document, the entry is not stored, and the document is scored
        by one exact request with the prompt's log-probabilities (plain prefill;
        stored after) instead of one whole prefill per query token."""
        pool = self._scoring_pool()
        prompts = [head + tail for head in heads]
        first = len(tail) - n_query  # the first query token's index in the tail

        def by_token(prompt: list[int], head: int, pos: int) -> Any:
            return pool.submit(self._request, prompt[:pos], head, 0, (prompt[pos],))

        probes = [by_token(p, len(h), len(h) + first) for p, h in zip(prompts, heads)]
        pending: list[Any] = []  # per document: its futures by query token, or one whole
        for prompt, head, probe in zip(prompts, heads, probes):
            if probe.result().cached >= len(head):  # loaded: each query token loads it
                rest = range(len(head) + first + 1, len(prompt))
                pending.append([probe, *(by_token(prompt, len(head), p) for p in rest)])
            else:
                pending.append(pool.submit(self._request, prompt, 0, n_query, ()))
        outcomes = []
        for prompt, futures in zip(prompts, pending):
            if not isinstance(futures, list):  # the whole prompt, computed exactly
                outcome = futures.result()
                out.scores.append(query_score(outcome.prompt, n_query))
                outcomes.append(outcome)
                continue
            mine = [future.result() for future in futures]
            rows = [judge_score(o.first, [t], []) for t, o in zip(prompt[-n_query:], mine)]
            out.scores.append(sum(rows) / n_query)
            outcomes.append(min(mine, key=lambda o: o.cached))
        return self._finish(heads, outcomes, True, out, started)

    def _finish(
        self,
        heads: list[list[int]],
        outcomes: list[Outcome],
        reuse: bool,
        out: DocumentScores,
        started: float,
    ) -> DocumentScores:
        """Count reuse; store the documents computed whole this time."""
        missing = []
        for head, outcome in zip(heads, outcomes):
            if reuse and outcome.cached >= len(head):
                out.reused += 1
            elif reuse:
                missing.append(head)
        if missing:  # computed whole this time: stored for the next call
            encoded = self.encode_documents(missing)
            out.encoded, out.reused = encoded.encoded, out.reused + encoded.reused
        out.forward_s = time.perf_counter() - started
        return out

    def _score_one(
        self, head: list[int], suffix: list[int], n_query: int, answers: tuple[int, ...], load: bool
    ) -> Outcome:
        """One candidate's request (query likelihood: again whole where vLLM did not
        compute a row the score needs)."""
        outcome = self._request(head + suffix, len(head) if load else 0, n_query, answers)
        first_row = len(head) + len(suffix) - n_query - 1  # predicts the first query token
        if n_query and load and outcome.cached > first_row:
            outcome = self._request(head + suffix, 0, n_query, answers)
        return outcome

    def _request(
        self, prompt: list[int], load: int, n_query: int, answers: tuple[int, ...]
    ) -> Outcome:
        pieces = (PieceSpec(0, load),) if load else ()
        # A document's entry at position 0 is exact as turbo loads it: asked for by
        # name, whatever the server's reuse (blend would recompute it, under a nonce).
        params = TransferParams(
            load=pieces, tenant_salt=self.tenant_salt, detect=False, reuse="turbo" if load else ""
        )
        request = BackendRequest(
            prompt,
            dict(_SCORE),
            params.salt(),
            params.as_request(),
            stream=False,
            logprob_token_ids=() if n_query else answers,
            prompt_logprobs=bool(n_query),
        )
        return collect(self.backend.submit(request, threading.Event()))


def _check_store(store: Any) -> None:
    if store is not None:
        raise UnsupportedInputError(
            "on vLLM, document entries live in the connector's store: pass store=None "
            "(start vLLM with the store instead)"
        )


__all__ = ["VLLMScoring", "by_token_pays", "collect", "judge_score", "query_score"]
