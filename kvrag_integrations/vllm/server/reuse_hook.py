"""Reuse for plain OpenAI clients: the server plans what a ``VLLMEngine`` client would.

vLLM's OpenAI server renders a chat or completion request, tokenizes it, and
hands the token ids to its engine client's ``generate``. ``ReuseHook`` wraps
that one method (installed at the server's startup on its own engine client,
``startup.install``), so every route that reaches the
model passes it. First it gives an anonymous request (no key's grant, no salt
of its own) a salt and grant of its own (``trust.Grant.anonymous``): it reads
what writers stored, and shares no prefix block with any other caller. Then,
with detection on, before the request reaches the engine, it finds the
stored passages in its token ids (``detection``), and writes the connector's
``kv_transfer_params`` and the ``cache_salt`` a load of that layout must carry
(``trust.request_salt``). From there on the request is an ordinary one: the
connector admits it under ``trust``'s rules, vLLM streams, samples, parses
tools and structured output as always, and ``usage.prompt_tokens_details``
counts what was loaded.

A request passes through untouched (exactly as plain vLLM, its prefix caching
intact) where it carries our params already (a ``VLLMEngine`` client), opts
out (``"kv_transfer_params": {"kvrag": {"detect": false}}``), asks for prompt
log-probabilities (rows loaded from storage have none), uses a LoRA adapter or
multimodal input (entries hold the base model's text K/V), or where nothing
stored is found; the reason is logged at debug level.

Learning runs under the request's own tenant and rights
(``trust.ClientPolicy.may_learn``): the server learns only into a tenant's own
namespace (an API key's or a ``cache_salt``'s), never into the shared one that
every caller reads, unless the operator lets anonymous callers share
(``--share-anonymous-prompts``); a caller that may not store entries teaches
the server nothing (it reuses what writers stored).

Passages after a longer unknown text (an agent's second model call: the system
prompt, a new question and the model's tool call, then the passages its tool
returned) load only behind that text, computed exactly from position 0
(``Detection.prefix``). In a tenant's own namespace it is learned as glue. An
anonymous request's prefix is private text: it is stored only for that request,
as a private entry (``params`` ``private``: never indexed) whose ids end in a
secret suffix drawn for the request (so no other caller can name its key; the
rows before the suffix are the prefix's own, computed causally), read by the
request as its first piece and deleted once it is answered.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.matching import ContentIndex
from kvrag_integrations.vllm.params import PARAMS_KEY, PieceSpec, TransferParams
from kvrag_integrations.vllm.server.detection import Detection, Detector
from kvrag_integrations.vllm.trust import ClientPolicy, Grant, Tenant, request_salt

logger = logging.getLogger(__name__)

MAX_PENDING_LEARNS = 16  # background encodes in flight at once (more are dropped)
GLUE_WAIT_S = 5.0  # the longest a request waits for its glue to be stored
# ... and for its private prefix: computed anyway, so waiting costs nothing, but
# giving up computes it twice
PREFIX_WAIT_S = 120.0
LEARN_WAIT_S = 3.0  # ... and for a prompt this server is storing that would serve it
SECRET_TAIL_TOKENS = 24  # a private prefix's secret suffix (ids drawn from its prompt)

Forget = Callable[[Tenant, Sequence[int]], None]
"""Deletes a tenant's entry of these ids from the store (every rank's)."""


class ReuseHook:
    """Wraps an engine client's ``generate`` (see the module docstring).

    Args:
        generate: the engine client's own ``generate``.
        detector: plans loads from the content index (None: detection is off;
            anonymous requests still get salts of their own).
        policy: the connector's client policy (tenants and roles, as it applies them).
        sampling_params: makes the sampling parameters of a background encode
            (default: vLLM's ``SamplingParams``).
        forget: deletes a private prefix's entry once its request is answered
            (None: the store's budget evicts it).
    """

    def __init__(
        self,
        generate: Callable[..., Any],
        detector: Detector | None,
        policy: ClientPolicy,
        sampling_params: Callable[..., Any] | None = None,
        forget: Forget | None = None,
    ):
        self.generate_inner = generate
        self.forget = forget
        self.detector = detector
        self.policy = policy
        self.sampling_params = sampling_params or _vllm_sampling_params
        self._learning: dict[str, asyncio.Task[None]] = {}
        # prompts this server asked to store whole, until the index has them
        self._pending: dict[tuple[str, int], tuple[str, list[int], float]] = {}
        self._pending_index = ContentIndex()

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        private = None
        try:
            private = await self.prepare(prompt, sampling_params, kwargs, request_id)
        except Exception:  # never a crash here: the request then runs as plain vLLM
            logger.exception("request %s: reuse not planned; runs as plain vLLM", request_id)
        try:
            async for output in self.generate_inner(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                yield output
        finally:
            if private is not None and self.forget is not None:  # its own, used: dropped
                loop = asyncio.get_running_loop()
                loop.run_in_executor(None, self.forget, *private)

    # ------------------------------------------------------------ planning
    async def prepare(
        self, prompt: Any, sampling_params: Any, kwargs: Mapping[str, Any], request_id: str = ""
    ) -> tuple[Tenant, list[int]] | None:
        """Rewrite ``prompt``'s salt and ``sampling_params``' transfer params in place
        (nothing, where the request passes through). Returns the private entry it
        stored for the request (its tenant and ids), to be dropped after it."""
        self._isolate(prompt, sampling_params)
        if self.detector is None:
            return None
        why, ids, params = self._eligible(prompt, sampling_params, kwargs)
        if why:
            logger.debug("%s: runs as plain vLLM: %s", request_id, why)
            return None
        assert ids is not None and params is not None
        try:
            tenant, role = self.policy.tenant_and_role(
                params.tenant, params.grant, prompt.get("cache_salt"), False
            )
        except TransferParamsError as exc:
            logger.debug("%s: runs as plain vLLM: %s", request_id, exc)
            return None
        may_learn = self.policy.may_learn(tenant, role)
        # In the shared namespace (nothing learned), glue is encoded by every request:
        # none then takes another course for what others sent before it.
        fresh_glue = not may_learn and role != "read"
        fingerprint = tenant.fingerprint(self.detector.base_fingerprint)
        detection = self.detector.detect(fingerprint, ids, may_learn, fresh_glue)
        # An unknown prefix before found passages that is not learned (the shared
        # namespace): stored for this request alone, under a secret suffix.
        private = None
        if detection.prefix and not may_learn and role != "read":
            private = PieceSpec(0, detection.prefix, _secret_tail(ids[: detection.prefix]))
        if detection.glue or private is not None:
            # Glue no entry holds yet (a template's separator between passages) would
            # stop the load at the first seam: a step of a few tokens stores it, then
            # the request is planned again.
            learned = [self._learn(span, tenant, params) for span in detection.glue]
            own = None
            if private is not None:
                own = self._learn(tuple(private.entry_ids(ids)), tenant, params, private=True)
                learned.append(own)
            waiting = [task for task in learned if task is not None]
            if waiting:
                await asyncio.wait(waiting, timeout=GLUE_WAIT_S)
                if own is not None and not own.done():
                    await asyncio.wait([own], timeout=PREFIX_WAIT_S)
                if own is None or not own.done():
                    private = None
                detection = self.detector.detect(fingerprint, ids, may_learn, prefix=private)
        if self._pending and await self._await_learning(fingerprint, ids, detection.load_end):
            detection = self.detector.detect(fingerprint, ids, may_learn)
        logger.debug(
            "%s: %d of %d tokens from storage (%s)%s",
            request_id,
            detection.load_end,
            len(ids),
            detection.reason,
            "; its prompt is learned" if detection.learn_prompt and not detection.load else "",
        )
        for span in detection.learn:
            self._learn(span, tenant, params)
        if detection.load:
            self._rewrite(prompt, sampling_params, tenant, params, detection)
        elif detection.learn_prompt:
            learned = replace(params, save=(PieceSpec(0, len(ids)),), learn=True)
            self._rewrite(prompt, sampling_params, tenant, learned, None)
            self._pending_add(fingerprint, ids)
        return None if private is None else (tenant, private.entry_ids(ids))

    def _isolate(self, prompt: Any, sampling_params: Any) -> None:
        """An anonymous request's own salt and grant (``trust.Grant.anonymous``): it
        reads the shared namespace, and no prefix block of it is anyone else's."""
        secret = self.policy.secret
        if secret is None or not isinstance(prompt, dict):
            return
        extra = getattr(sampling_params, "extra_args", None) or {}
        transfer = extra.get("kv_transfer_params") if isinstance(extra, Mapping) else None
        if isinstance(transfer, Mapping) and set(transfer) - {PARAMS_KEY}:
            return  # another connector's request
        ours = transfer.get(PARAMS_KEY) if isinstance(transfer, Mapping) else None
        try:
            params = TransferParams.from_request({PARAMS_KEY: ours or {}})
        except TransferParamsError:
            params = None  # dropped: the request runs exactly, as plain vLLM
        params = params or TransferParams()
        salt = prompt.get("cache_salt")
        if not self.policy.isolates(params.tenant, params.grant, salt, bool(params.load)):
            return
        grant = Grant.anonymous(self.policy.client_role)
        params = replace(params, grant=grant.signed(secret))
        prompt["cache_salt"] = request_salt(grant.tenant(secret), params.layout)
        _set_params(sampling_params, params.as_request())

    # ------------------------------------- prompts being stored after their answer
    def _pending_add(self, fingerprint: str, ids: list[int]) -> None:
        now = time.monotonic()
        for key, (fp, entry, since) in list(self._pending.items()):
            if now - since > LEARN_WAIT_S:  # stored by now, or dropped: forget it
                del self._pending[key]
                self._pending_index.remove(fp, entry)
        if len(self._pending) < MAX_PENDING_LEARNS and self._pending_index.add(fingerprint, ids):
            self._pending[(fingerprint, hash(tuple(ids)))] = (fingerprint, ids, now)

    async def _await_learning(self, fingerprint: str, ids: list[int], loaded: int) -> bool:
        """Wait (at most ``LEARN_WAIT_S``) for prompts this server is storing that
        would serve more of ``ids`` than the store does now; True if one landed.

        A learned prompt is stored after its answer (``params.learn``): a client
        asking again at once would otherwise find nothing and teach it twice."""
        runs = self._pending_index.cover(fingerprint, ids)
        covered = runs[0].end if runs and runs[0].start == 0 else 0
        waited = {tuple(r.entry) for r in runs}
        if covered <= loaded or not waited:
            return False
        deadline = time.monotonic() + LEARN_WAIT_S
        index = self.detector.index
        while time.monotonic() < deadline:
            refresh = getattr(index, "refresh", None)
            if refresh is not None:
                refresh()
            landed = {e for e in waited if (fingerprint, list(e)) in index}
            if landed:
                for entry in landed:
                    self._pending.pop((fingerprint, hash(entry)), None)
                    self._pending_index.remove(fingerprint, entry)
                return True
            await asyncio.sleep(0.02)
        return False

    def _eligible(
        self, prompt: Any, sampling_params: Any, kwargs: Mapping[str, Any]
    ) -> tuple[str, list[int] | None, TransferParams | None]:
        """Why the request passes through ("" : it does not), its ids and params."""
        if not isinstance(prompt, dict) or prompt.get("type", "token") != "token":
            return "not a token prompt (multimodal or embeddings)", None, None
        ids = prompt.get("prompt_token_ids")
        if not isinstance(ids, list) or len(ids) < 2:
            return "no prompt token ids", None, None
        if kwargs.get("lora_request") is not None:
            return "a LoRA adapter (entries hold the base model's K/V)", None, None
        if getattr(sampling_params, "prompt_logprobs", None) is not None:
            return "prompt log-probabilities (loaded rows have none)", None, None
        extra = getattr(sampling_params, "extra_args", None) or {}
        transfer = extra.get("kv_transfer_params") if isinstance(extra, Mapping) else None
        if isinstance(transfer, Mapping) and set(transfer) - {PARAMS_KEY}:
            return "kv_transfer_params of another connector", None, None
        ours = transfer.get(PARAMS_KEY) if isinstance(transfer, Mapping) else None
        try:
            params = TransferParams.from_request({PARAMS_KEY: ours or {}})
        except TransferParamsError as exc:
            return f"its params do not parse ({exc})", None, None
        assert params is not None
        if not params.detect:
            return "the request opted out", None, None
        if params.load or params.save:
            return "it plans its own loads or saves (a VLLMEngine client)", None, None
        return "", ids, params

    def _rewrite(
        self,
        prompt: dict[str, Any],
        sampling_params: Any,
        tenant: Tenant,
        params: TransferParams,
        detection: Detection | None,
    ) -> None:
        if detection is not None:
            params = replace(params, load=detection.load)
        if params.grant is None:  # the client's own tenant travels as the connector reads it
            params = replace(params, tenant=tenant.salt or "")
        salt = request_salt(tenant, params.layout)
        if salt is None:
            prompt.pop("cache_salt", None)
        else:
            prompt["cache_salt"] = salt
        _set_params(sampling_params, params.as_request())

    # ------------------------------------------------------------ learning
    def _learn(
        self, ids: tuple[int, ...], tenant: Tenant, params: TransferParams, private: bool = False
    ) -> asyncio.Task[None] | None:
        """Encode ``ids`` on their own in the background (as a chunk is): an entry
        the next request with this glue or passage finds (``private``: one that is
        not indexed). The task (None: too many in flight)."""
        key = f"{tenant.namespace}:{hash(ids)}"
        if key in self._learning:
            return self._learning[key]
        if len(self._learning) >= MAX_PENDING_LEARNS:
            return None
        loop = asyncio.get_running_loop()
        save = TransferParams(
            save=(PieceSpec(0, len(ids)),),
            tenant=tenant.salt or "" if params.grant is None else "",
            grant=params.grant,
            private=private,
        )
        task = loop.create_task(self._encode(list(ids), tenant.salt, save))
        self._learning[key] = task
        task.add_done_callback(lambda _: self._learning.pop(key, None))
        return task

    async def _encode(self, ids: list[int], salt: str | None, params: TransferParams) -> None:
        prompt: dict[str, Any] = {"type": "token", "prompt_token_ids": ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        extra = {"kv_transfer_params": params.as_request()}
        sampling = self.sampling_params(max_tokens=1, extra_args=extra)
        # unique across the server's API processes (each has its own hook)
        request_id = f"kvrag-learn-{uuid.uuid4().hex}"
        try:
            async for _ in self.generate_inner(prompt, sampling, request_id):
                pass
        except Exception as exc:  # learning is best effort: the next request may teach it
            logger.info("background encode %s failed: %s", request_id, exc)

    async def drain(self) -> None:
        """Wait for the background encodes in flight (tests, shutdown)."""
        while self._learning:
            await asyncio.gather(*list(self._learning.values()), return_exceptions=True)


def _secret_tail(prefix: Sequence[int]) -> tuple[int, ...]:
    """Ids drawn at random from ``prefix`` (so the model's vocabulary has them): a
    private entry's suffix, which no other caller can guess, so none can name it."""
    draw = secrets.SystemRandom()
    return tuple(draw.choice(prefix) for _ in range(SECRET_TAIL_TOKENS))


def _vllm_sampling_params(**kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def _set_params(sampling_params: Any, transfer: dict[str, Any] | None) -> None:
    extra = dict(getattr(sampling_params, "extra_args", None) or {})
    if transfer is None:
        extra.pop("kv_transfer_params", None)
    else:
        extra["kv_transfer_params"] = transfer
    sampling_params.extra_args = extra or None
