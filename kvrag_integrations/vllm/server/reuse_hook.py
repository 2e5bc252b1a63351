"""Every request that reaches the model: its admission signed in, its salt, and reuse.

vLLM's OpenAI server renders a chat or completion request, tokenizes it, and
hands the token ids to its engine client's ``generate``. ``ReuseHook`` wraps
that one method (installed at the server's startup on its own engine client,
``startup.install``), so every route that reaches the model passes it.

1. **Admission.** The request's admission was made where it entered
   (``gateway``; ``arrival.current``): the one path; a request that did not pass
   the gateway is refused. The hook signs it, bound to this engine request
   (``Admission.bound``), into the connector's ``kv_transfer_params`` and sets
   the request's ``cache_salt`` to the one a load of its layout must carry
   (``trust.request_salt``), before anything else: whatever happens next, the
   request never runs without the salt the server chose. A prompt that cannot
   carry a salt is refused (HTTP 400).
2. **Reuse.** With detection on, it finds the stored passages in the request's
   token ids (``detection``) and writes the load a ``VLLMEngine`` client would
   have asked for: turbo's, or blend's where the request asks for it or the
   server's ``reuse`` is blend (a fresh nonce in its layout: its salt, and so
   the blocks its recompute writes, are its own). From there on the request is
   an ordinary one: the connector accepts it, vLLM streams, samples, parses
   tools and structured output as always, and ``usage.prompt_tokens_details``
   counts what was loaded.

A caller's heavy request waits while its previous one is in prefill and
others have requests in flight (``shares``); what reuse makes of one never does.

One API request is planned once: a beam search calls the engine client once
per beam and step under one admission; the first call plans (and encodes what
it needs), the later ones wait for that plan and reuse its load where their
prompt starts with the planned one (``arrival.Planned``), encoding nothing.

Detection is skipped (the request then runs exactly, under its salt) where the
request carries a plan of its own (a ``VLLMEngine`` client), opts out
(``"kv_transfer_params": {"kvrag": {"detect": false}}``), asks for prompt
log-probabilities (rows loaded from storage have none), uses a LoRA adapter or
multimodal input (entries hold the base model's text K/V), or where nothing
stored is found; the reason is logged at debug level.

What is stored of what a request sent follows its admission: a tenant that
keeps has its prompts learned, and its glue and prefixes stored, in its own
namespace; a request with a private namespace (an anonymous caller) has its
glue and prefix computed in its load's step (``in_place``: nothing stored), or
where the workers cannot, encoded for it alone (``detection.Own``: ids ending
in a secret suffix drawn for the request, never indexed), read as its pieces
and deleted once it is answered; a reader stores nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.matching import ContentIndex
from kvrag_integrations.vllm.admission import Admission, ClientPolicy
from kvrag_integrations.vllm.config import DEFAULT_REUSE
from kvrag_integrations.vllm.params import PARAMS_KEY, BlendRequest, PieceSpec, TransferParams
from kvrag_integrations.vllm.server.arrival import Arrival, BadRequest, current
from kvrag_integrations.vllm.server.detection import Detector, Own
from kvrag_integrations.vllm.server.encodes import Encodes, vllm_sampling_params
from kvrag_integrations.vllm.server.shares import ComputeShares
from kvrag_integrations.vllm.trust import Tenant, request_salt

logger = logging.getLogger(__name__)

MAX_PENDING_PROMPTS = 16  # prompts being stored after their answer, awaited by others
GLUE_WAIT_S = 5.0  # the longest a request waits for a tenant's glue to be stored
# ... and for its prefix, or its own texts: computed anyway, so waiting costs
# nothing, but giving up computes them twice
PREFIX_WAIT_S = 120.0
STORED_WAIT_S = 3.0  # ... and for a prompt this server is storing that would serve it
SECRET_TAIL_TOKENS = 24  # a private entry's secret suffix (ids drawn from its prompt)

Forget = Callable[[Tenant, Sequence[int]], None]
"""Deletes an entry of these ids in a namespace (every rank's)."""


@dataclass
class _Request:
    """One request as the hook sees it: what vLLM hands on, and its arrival."""

    prompt: dict[str, Any]
    sampling_params: Any
    kwargs: Mapping[str, Any]
    arrival: Arrival
    admission: Admission
    request_id: str
    loaded: int = 0  # prompt tokens its load reads from storage (the rest are computed)

    @property
    def params(self) -> TransferParams:
        return self.arrival.params or TransferParams()

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computes for it (vLLM's own prefix cache may
        hold some of them: an upper bound)."""
        ids = self.prompt.get("prompt_token_ids")
        return max(0, len(ids) - self.loaded) if isinstance(ids, list) else 0


class ReuseHook:
    """Wraps an engine client's ``generate`` (see the module docstring).

    Args:
        generate: the engine client's own ``generate``.
        detector: plans loads from the content index (None: detection is off;
            requests are still admitted and salted).
        policy: the server's client policy (admissions, and their signing secret).
        sampling_params: makes the sampling parameters of an encode (default:
            vLLM's ``SamplingParams``).
        forget: deletes a request's private entries once it is answered (None:
            the store's budget evicts them).
        reuse: the server's reuse for requests that name none (``config.REUSE_MODES``).
    """

    def __init__(
        self,
        generate: Callable[..., Any],
        detector: Detector | None,
        policy: ClientPolicy,
        sampling_params: Callable[..., Any] | None = None,
        forget: Forget | None = None,
        reuse: str = DEFAULT_REUSE,
    ):
        self.reuse = reuse
        self.in_place = False  # private texts computed in the load's step (``startup``)
        self.generate_inner = generate
        self.forget = forget
        self.detector = detector
        self.policy = policy
        self.shares = ComputeShares()
        self.encodes = Encodes(
            generate, policy, sampling_params or vllm_sampling_params, shares=self.shares
        )
        # prompts this server asked to store whole, until the index has them
        self._pending: dict[tuple[str, int], tuple[str, list[int], float]] = {}
        self._pending_index = ContentIndex()

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        request = self.request_of(prompt, sampling_params, kwargs, request_id)
        self._write(request, request.params)  # its salt, before anything can fail
        own: list[tuple[asyncio.Task[bool], list[int]]] = []
        plan, caller = request.arrival.plan, request.arrival.caller
        try:
            async with self.shares.active(caller):
                if plan.ready is None:  # the admitted request's first call: planned once
                    plan.ready = asyncio.Event()
                    try:
                        await self.prepare(request, own)
                    except Exception:  # never a crash here: it then runs exactly, salted
                        logger.exception("request %s: reuse not planned; runs exactly", request_id)
                    finally:
                        plan.ready.set()
                else:  # another call of it (a beam, a step): the plan made, nothing encoded
                    await plan.ready.wait()
                    self._reuse_plan(request)
                # its turn where it computes much and its caller has a prefill running
                async with self.shares.lane(caller, request.computed_tokens) as lane:
                    async for output in self.generate_inner(
                        prompt, request.sampling_params, request_id, *args, **kwargs
                    ):
                        lane.release()  # (its prefill is done)
                        yield output
        finally:  # (a request cancelled while planned too)
            for task, ids in own:  # its own entries, used: dropped once stored
                task.add_done_callback(lambda _, ids=ids: self._forget(request.admission, ids))

    def request_of(
        self, prompt: Any, sampling_params: Any, kwargs: Mapping[str, Any], request_id: str = ""
    ) -> _Request:
        """The request with the admission the gateway made where it entered (the one
        admission path).

        Raises:
            BadRequest: a prompt that cannot carry a salt (not a dict), a request
                that did not pass the gateway, or params of ours beyond its prompt.
        """
        if not isinstance(prompt, dict):
            raise BadRequest(f"a prompt of type {type(prompt).__name__} cannot carry a salt")
        arrival = current()
        if arrival is None or arrival.admission is None:
            raise BadRequest("the request has no admission: it did not pass the server's gateway")
        ids = prompt.get("prompt_token_ids")
        if arrival.params is not None and isinstance(ids, list):
            try:
                arrival.params.check_prompt(len(ids))
            except TransferParamsError as exc:  # (a ValueError: vLLM answers 400)
                raise BadRequest(f"kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from None
        # (a copy: a beam search hands one object to every beam's call)
        own = sampling_params.clone() if hasattr(sampling_params, "clone") else sampling_params
        return _Request(prompt, own, kwargs, arrival, arrival.admission, request_id)

    # ------------------------------------------------------------ planning
    async def prepare(
        self, request: _Request, own: list[tuple[asyncio.Task[bool], list[int]]]
    ) -> None:
        """Find stored passages and rewrite the request's load and salt (nothing,
        where it runs exactly); ``own`` gets the request's private entries."""
        why, ids = self._eligible(request)
        if why:
            logger.debug("%s: runs exactly: %s", request.request_id, why)
            return
        assert self.detector is not None
        admission = request.admission
        fingerprint = admission.tenant.fingerprint(self.detector.base_fingerprint)
        mine = None
        if admission.own is not None:
            private = admission.own.fingerprint(self.detector.base_fingerprint)
            mine = Own(private, _secret_tail(ids), in_place=self.in_place)
        detection = self.detector.detect(fingerprint, ids, admission.keeps, mine)
        if detection.glue:
            # Text no entry holds yet between (or before) found passages would stop
            # the load there: a step of a few tokens stores it (in the tenant's
            # namespace, or the request's own), then the request is planned again.
            head = tuple(ids[: detection.prefix]) if detection.prefix else None
            tasks = {span: self._encode(span, request, mine) for span in detection.glue}
            waiting = {span: task for span, task in tasks.items() if task is not None}
            if mine is not None:
                own += [(task, [*span, *mine.tail]) for span, task in waiting.items()]
            if waiting:
                await asyncio.wait(waiting.values(), timeout=GLUE_WAIT_S)
                # a prefix, and a request's own texts, are awaited longer: giving up
                # computes them twice, and its course would hang on the server's load
                late = [t for s, t in waiting.items() if mine is not None or s == head]
                if late and not all(task.done() for task in late):
                    await asyncio.wait(late, timeout=PREFIX_WAIT_S)
            if mine is not None:
                done = {span for span, task in waiting.items() if _stored(task)}
                mine = replace(mine, ready=frozenset(done))
            detection = self.detector.detect(fingerprint, ids, admission.keeps, mine)
        waits = admission.keeps and self._pending  # (a tenant's own prompts only)
        if waits and await self._await_stored(fingerprint, ids, detection.load_end):
            detection = self.detector.detect(fingerprint, ids, admission.keeps, mine)
        logger.debug(
            "%s: %d of %d tokens from storage (%s)%s",
            request.request_id,
            detection.load_end,
            len(ids),
            detection.reason,
            "; its prompt is learned" if detection.learn_prompt and not detection.load else "",
        )
        for span in detection.remainder:
            self._encode(span, request, None)
        if detection.load:
            request.arrival.plan.ids, request.arrival.plan.load = tuple(ids), detection.load
            self._write(request, self._reused(request.params, detection.load))
        elif detection.learn_prompt:
            learned = replace(request.params, save=(PieceSpec(0, len(ids)),), deferred=True)
            self._write(request, learned)
            self._pending_add(fingerprint, ids)

    def _reused(self, params: TransferParams, load: tuple[PieceSpec, ...]) -> TransferParams:
        """``params`` loading ``load`` with the reuse the request asked for (the
        server's where it named none; a blend load's nonce: ``_write``)."""
        return replace(params, load=load, reuse=params.reuse or self.reuse)

    def _eligible(self, request: _Request) -> tuple[str, list[int]]:
        """Why detection does not run for the request ("" : it does), and its ids."""
        prompt, params = request.prompt, request.params
        ids = prompt.get("prompt_token_ids")
        if self.detector is None:
            return "detection is off", []
        if prompt.get("type", "token") != "token":
            return "not a token prompt (multimodal or embeddings)", []
        if not isinstance(ids, list) or len(ids) < 2:
            return "no prompt token ids", []
        if request.kwargs.get("lora_request") is not None:
            return "a LoRA adapter (entries hold the base model's K/V)", []
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return "prompt log-probabilities (loaded rows have none)", []
        if not params.detect:
            return "the request opted out", []
        if params.load or params.save:
            return "it plans its own loads or saves (a VLLMEngine client)", []
        return "", ids

    def _reuse_plan(self, request: _Request) -> None:
        """A later call of a planned request: the plan's load, where its prompt starts
        with the planned prompt (a beam's: the prompt and the tokens it chose)."""
        plan, ids = request.arrival.plan, request.prompt.get("prompt_token_ids")
        why, _ = self._eligible(request)
        if plan.load and not why and tuple(ids[: len(plan.ids)]) == plan.ids:
            self._write(request, self._reused(request.params, plan.load))

    def _write(self, request: _Request, params: TransferParams) -> None:
        """The request's params as the connector reads them (its admission signed
        in, bound to its prompt; no field of another connector's) and the salt its
        layout needs."""
        secret = self.policy.secret
        if params.load and (params.reuse or self.reuse) == "blend":
            # a blend load's recomputed blocks are its own: a fresh nonce salts them
            # (a client's own loads too, which name no reuse on a blend server)
            blend = (params.blend or BlendRequest()).with_own_nonce()
            params = replace(params, reuse="blend", blend=blend)
        ids = request.prompt.get("prompt_token_ids")
        bound = request.admission.bound(ids if isinstance(ids, list) else [])
        signed = bound.signed(secret) if secret is not None else None
        params = replace(params, admission=signed, tenant_salt="")
        # (a computed piece reads no entry: the workers compute its rows, in one step)
        request.loaded = sum(piece.rows for piece in params.load if not piece.computed)
        salt = request_salt(request.admission.tenant, params.layout)
        if salt is None:
            request.prompt.pop("cache_salt", None)
        else:
            request.prompt["cache_salt"] = salt
        _set_params(request.sampling_params, params.as_request())

    # ------------------------------------- prompts being stored after their answer
    def _pending_add(self, fingerprint: str, ids: list[int]) -> None:
        now = time.monotonic()
        for key, (fp, entry, since) in list(self._pending.items()):
            if now - since > STORED_WAIT_S:  # stored by now, or dropped: forget it
                del self._pending[key]
                self._pending_index.remove(fp, entry)
        if len(self._pending) < MAX_PENDING_PROMPTS and self._pending_index.add(fingerprint, ids):
            self._pending[(fingerprint, hash(tuple(ids)))] = (fingerprint, ids, now)

    async def _await_stored(self, fingerprint: str, ids: list[int], loaded: int) -> bool:
        """Wait (at most ``STORED_WAIT_S``) for prompts this server is storing that
        would serve more of ``ids`` than the store does now; True if one landed.

        A learned prompt is stored after its answer (``params.deferred``): a
        client asking again at once would otherwise find nothing and teach it
        twice. (Only a tenant's own: learned prompts are in its namespace.)"""
        runs = self._pending_index.cover(fingerprint, ids)
        covered = runs[0].end if runs and runs[0].start == 0 else 0
        waited = {tuple(r.entry) for r in runs}
        if covered <= loaded or not waited:
            return False
        deadline = time.monotonic() + STORED_WAIT_S
        assert self.detector is not None
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

    # ------------------------------------------------------------ encoding
    def _encode(
        self, span: tuple[int, ...], request: _Request, mine: Own | None
    ) -> asyncio.Task[bool] | None:
        """Encode ``span`` on its own (as a chunk is) and store it: in the request's
        own namespace under its secret suffix (``mine``; never indexed, awaited by
        the request alone), else in its tenant's namespace, where the tenant's
        next request finds it (``encodes.Encodes``: bounded per tenant). The task
        (True: stored; None: dropped)."""
        admission = request.admission
        ids = [*span, *mine.tail] if mine is not None else list(span)
        save = TransferParams(save=(PieceSpec(0, len(ids)),), own_save=mine is not None)
        if mine is not None:  # its own: no other request waits on it, nor is held up
            return self.encodes.own(ids, admission, save)
        key = f"{admission.tenant.namespace}:{hash(span)}"
        return self.encodes.shared(key, ids, admission, save)

    def _forget(self, admission: Admission, ids: list[int]) -> None:
        if self.forget is not None and admission.own is not None:
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self.forget, admission.own, ids)

    async def drain(self) -> None:
        """Wait for the tenants' encodes in flight (tests, shutdown)."""
        await self.encodes.drain()


def _stored(task: asyncio.Task[bool]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None and task.result()


def _secret_tail(prompt: Sequence[int]) -> tuple[int, ...]:
    """Ids drawn at random from ``prompt`` (so the model's vocabulary has them): the
    suffix of a request's own entries, which no other caller can guess, so none
    can name them."""
    draw = secrets.SystemRandom()
    return tuple(draw.choice(prompt) for _ in range(SECRET_TAIL_TOKENS))


def _set_params(sampling_params: Any, transfer: dict[str, Any]) -> None:
    """Our params as the request's ``kv_transfer_params`` (another connector's
    fields, which no connector of this server reads, are dropped)."""
    extra = dict(getattr(sampling_params, "extra_args", None) or {})
    extra["kv_transfer_params"] = {PARAMS_KEY: transfer[PARAMS_KEY]}
    sampling_params.extra_args = extra
