"""VLLMEngine: ``KVRAGEngine``'s methods and results, answered by vLLM.

The prompt is built and tokenized here exactly as the in-process engine builds
it (``EngineFrontend``, ``PromptTokenizer``: chunks tokenized alone, pointed
at their entries), then sent to vLLM as token ids:

- ``strategy="turbo"`` (the default): the prompt's leading run of stored
  pieces (the cached leading text, then the chunks back to back) goes to the
  connector, which writes their stored K/V into vLLM's cache, keys moved to
  their positions; vLLM computes the rest. The request carries the salt of its
  tenant and layout (``trust.request_salt``): the connector loads nothing for a
  request without it, and vLLM's own prefix cache never hands its approximate
  blocks to an exact request.
- ``strategy="blend"``: turbo's load, then the workers recompute the tokens that
  matter with vLLM's own model (``connector.blend``), with the model's
  calibrated settings under the call's own options (``recompute_ratio``,
  ``selection``, ``recompute_first``); under a salt of its own (a nonce), so no
  other request reads its blocks. A vLLM that cannot blend refuses it at the
  call (``UnsupportedInputError``, saying why).
- ``strategy="full"``: plain vLLM, its own (exact) prefix caching included.

Chunks are encoded by vLLM's own batched prefill: one prefill-only request
per entry, all in flight at once, each saved by the connector. A turbo
request whose pieces are not all stored is not held up: vLLM computes what is
missing in the same forward (never slower than a plain prefill), and the
pieces are then encoded in the background for the next request
(``on_miss="auto"`` or ``"defer"``); ``on_miss="encode"`` encodes them first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

from kvrag_integrations.engine.caching.entries import DEFAULT_CHUNK_SUFFIX
from kvrag_integrations.engine.caching.prompt_tokenizer import PromptTokenizer
from kvrag_integrations.engine.frontend import EngineFrontend
from kvrag_integrations.engine.modeling.sampling import SamplingParams, check_int
from kvrag_integrations.engine.prompting.segments import (
    cache_leading_text,
)
from kvrag_integrations.engine.request import Request, RequestOptions
from kvrag_integrations.engine.results import GenerationResult
from kvrag_integrations.engine.scheduling.ledger import EncodeLedger
from kvrag_integrations.engine.scheduling.miss_policy import DEFAULT_ON_MISS, check_on_miss
from kvrag_integrations.engine.streaming import Job
from kvrag_integrations.engine.tools.plan import ToolPlan
from kvrag_integrations.vllm.client import start
from kvrag_integrations.vllm.client.backend import Backend, BackendRequest, sampling_args
from kvrag_integrations.vllm.client.encoding import VLLMEncoding
from kvrag_integrations.vllm.client.reuse import (
    account,
    blend_request,
    check_strategy,
    load_run,
)
from kvrag_integrations.vllm.client.scoring import VLLMScoring
from kvrag_integrations.vllm.params import TransferParams
from kvrag_integrations.vllm.reply import Reply
from kvrag_integrations.vllm.trust import Tenant

logger = logging.getLogger(__name__)

_FINISH = {"abort": "cancelled", None: "length"}


class VLLMEngine(VLLMScoring, VLLMEncoding, EngineFrontend):
    """Answers over retrieved chunks on vLLM, reusing their stored KV caches.

    Build one with ``from_pretrained`` (vLLM in this process) or ``connect``
    (a running vLLM OpenAI server started with the connector).

    Args:
        backend: the vLLM that answers (``local.LocalBackend`` or ``remote.ServerBackend``).
        tokenizer: the served model's tokenizer (prompts are tokenized here).
        cache_prefix: reuse the prompt's leading text (system prompt, template
            header, instruction) like a chunk.
        chunk_suffix: text stored after every chunk, in its entry (as ``KVRAGEngine``).
        on_miss: ``"auto"`` and ``"defer"`` answer at once (vLLM computes pieces
            that are not stored) and encode those pieces in the background;
            ``"encode"`` encodes them first.
        eos_token_ids: ids that end an answer (default: the tokenizer's EOS).
        max_in_flight: encode requests in flight at once (vLLM batches them).
        max_pending: the most background encodes waiting to start (more are
            skipped: a later request asks again), as ``KVRAGEngine``'s.
        cache_salt: this client's tenant (vLLM's ``cache_salt``, a secret its
            holders share): requests reuse and store only the tenant's entries,
            and vLLM's prefix cache keeps its blocks apart. None: the shared
            namespace. (A server's API key may map to a tenant instead.)
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        *,
        cache_prefix: bool = True,
        chunk_suffix: str = DEFAULT_CHUNK_SUFFIX,
        on_miss: str = DEFAULT_ON_MISS,
        eos_token_ids: Sequence[int] | None = None,
        max_in_flight: int = 32,
        max_pending: int = 256,
        cache_salt: str | None = None,
    ) -> None:
        self.backend = backend
        self.tenant_salt = Tenant.of_salt(cache_salt).salt or ""
        self.tokenizer = tokenizer
        self.prompts = PromptTokenizer(tokenizer, chunk_suffix)  # chunks encoded alone
        self.cache_prefix = cache_prefix
        self.on_miss = check_on_miss(on_miss)
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = sorted({int(i) for i in eos if i is not None})
        self._fingerprint: str | None = None
        self._pool = ThreadPoolExecutor(check_int("max_in_flight", max_in_flight, minimum=1))
        # Background encodes by entry ids: each once, bounded (the in-process one's ledger).
        self._background: EncodeLedger[tuple[int, ...]] = EncodeLedger(max_pending)
        self._prefixes: dict[tuple[int, ...], None] = {}  # leading texts encoded (ordered)
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        *,
        cache_prefix: bool = True,
        chunk_suffix: str = DEFAULT_CHUNK_SUFFIX,
        on_miss: str = DEFAULT_ON_MISS,
        max_pending: int = 256,
        cache_salt: str | None = None,
        **launch_args: Any,
    ) -> VLLMEngine:
        """vLLM in this process with the connector (``start.start_local``: ``store``,
        ``cache_precision``, ``dtype``, ``memory_tier_bytes``, ``max_store_bytes``
        and vLLM's own engine arguments); the other arguments as the constructor's.
        """
        parts = start.start_local(model, **launch_args)
        return cls._of(parts, cache_prefix, chunk_suffix, on_miss, max_pending, cache_salt)

    @classmethod
    def connect(
        cls,
        base_url: str,
        *,
        cache_prefix: bool = True,
        chunk_suffix: str = DEFAULT_CHUNK_SUFFIX,
        on_miss: str = DEFAULT_ON_MISS,
        max_pending: int = 256,
        cache_salt: str | None = None,
        **server_args: Any,
    ) -> VLLMEngine:
        """The client of a running vLLM OpenAI server started with the connector
        (``start.join_server``: ``tokenizer``, ``model``, ``api_key``,
        ``timeout``); the other arguments as the constructor's."""
        parts = start.join_server(base_url, **server_args)
        return cls._of(parts, cache_prefix, chunk_suffix, on_miss, max_pending, cache_salt)

    @classmethod
    def _of(cls, parts: tuple[Backend, Any, Sequence[int] | None], *options: Any) -> VLLMEngine:
        """An engine of ``launch``'s parts (backend, tokenizer, end ids) and the
        factories' engine options, in the order they list them."""
        backend, tokenizer, eos = parts
        cache_prefix, chunk_suffix, on_miss, max_pending, cache_salt = options
        return cls(
            backend,
            tokenizer,
            cache_prefix=cache_prefix,
            chunk_suffix=chunk_suffix,
            on_miss=on_miss,
            eos_token_ids=eos,
            max_pending=max_pending,
            cache_salt=cache_salt,
        )

    def __repr__(self) -> str:
        return f"<VLLMEngine {self.model_name} via {type(self.backend).__name__} at {id(self):#x}>"

    # ----------------------------------------------------------------- facts
    @property
    def model_name(self) -> str:
        return self.backend.model_name

    @property
    def context_window(self) -> int:
        """vLLM's ``max_model_len``."""
        return self.backend.context_window

    @property
    def fingerprint(self) -> str:
        """The connector's storage fingerprint (asked once, with a one-token request)."""
        if self._fingerprint is None:
            probe = self.eos_token_ids[:1] or [0]  # any one token: nothing is stored
            self._run_encode(probe, TransferParams(tenant_salt=self.tenant_salt))
        assert self._fingerprint is not None
        return self._fingerprint

    def prefetch(self, chunks: Sequence[str]) -> int:
        """Nothing to start here: the connector reads entries where vLLM runs."""
        return 0

    # ---------------------------------------------------------------- chunks
    # --------------------------------------------------------------- requests
    def check_options(self, options: RequestOptions) -> None:
        """Refuse at the call what vLLM cannot run (``reuse.check_strategy``)."""
        check_strategy(options, getattr(self.backend, "blend_refused", ""))

    def forced_lead(self, plan: ToolPlan) -> str:
        """None: vLLM's structured outputs write the whole call object (``_call_schema``)."""
        return ""

    def request_job(self, request: Request, result: GenerationResult) -> Job:
        """The work a stream's worker runs for a prepared request (``_answer``)."""
        if request.strategy.name in ("turbo", "blend") and self.cache_prefix:
            request.prompt = cache_leading_text(request.prompt)
        self.prompts.remember(request.prompt)
        return partial(self._answer, request, request.sampling, request.logprobs, result)

    def _answer(
        self,
        request: Request,
        sampling: SamplingParams,
        logprobs: int | None,
        result: GenerationResult,
        cancel: threading.Event,
    ) -> Iterator[str]:
        prompt = request.prompt
        name = request.strategy.name
        run = load_run(self.prompts, prompt) if name in ("turbo", "blend") else ()
        # (this client plans its own loads: the server's detection is for plain clients)
        params = TransferParams(load=run, tenant_salt=self.tenant_salt, detect=False)
        if run:  # the reuse it asked for, whatever the server's default
            params = replace(params, reuse="turbo")
        if run and name == "blend":
            params = replace(params, reuse="blend", blend=blend_request(request.strategy_options))
        if run:  # pieces an earlier request left to the background: wait for them
            result.awaited_chunks = self._await_background(prompt, run)
        if run and request.on_miss == "encode":
            self._encode_all(prompt, run)
        elif run and prompt.pieces[0].is_prefix:
            self._ensure_prefix(prompt, run[0])
        call = BackendRequest(
            prompt.input_ids.tolist(),
            sampling_args(sampling, self.eos_token_ids),
            params.salt(),
            params.as_request(),
            logprobs,
            json_schema=request.tools.call_schema if request.tools else None,
        )
        cached: int | None = None
        recomputed = 0  # tokens vLLM counts as cached though a failed load recomputed them
        reply: Reply | None = None
        keep = sampling.max_new_tokens > 0
        for event in self.backend.submit(call, cancel):
            if event.token_ids and not result.ttft_s:
                result.ttft_s = time.perf_counter() - request.started
                result.first_token_logprobs = event.logprobs
            cached = event.cached_tokens if event.cached_tokens is not None else cached
            if event.reply is not None:
                self._fingerprint = event.reply.fingerprint
                recomputed, reply = event.reply.recomputed, event.reply
            if event.finish_reason is not None:
                result.finish_reason = _FINISH.get(event.finish_reason, event.finish_reason)
            if keep:
                result.token_ids += event.token_ids
                if event.text:
                    result.text += event.text
                    yield event.text
        if cancel.is_set():
            result.finish_reason = "cancelled"
        stops = {*self.eos_token_ids, *sampling.stop_token_ids}
        if result.finish_reason == "stop" and result.token_ids and result.token_ids[-1] in stops:
            result.token_ids.pop()  # vLLM returns the stop token; the answer ends before it
        result.generated_tokens = len(result.token_ids)
        result.total_s = time.perf_counter() - request.started
        if cached is not None:
            cached -= recomputed
        missing = account(result, prompt, run, cached, request.on_miss, reply)
        if missing:  # vLLM computed them in the request: encoded for the next one
            ids = prompt.input_ids.tolist()
            result.deferred_chunks = self.encode_in_background([p.entry_ids(ids) for p in missing])

    def close(self) -> None:
        """Stop background encoding and release vLLM (or the connection)."""
        self._background.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._score_pool is not None:
            self._score_pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
