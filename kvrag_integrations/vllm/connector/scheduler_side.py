"""The connector in vLLM's scheduler: what a request can load, and what to save when.

It reads a request's ``TransferParams`` (see ``params``), checks which of its
pieces are stored (the store's ``contains``: a file's existence, a Redis
``EXISTS``; never the entry itself, which the worker verifies when it reads
it), and tells the scheduler how many leading prompt tokens the workers will
write: the longest stored prefix of the load run, at most all but the last
prompt token (vLLM computes at least one). Each step it hands the workers
what to load into the blocks just allocated, and what to save once a prompt
that carries ``save`` pieces has been prefilled (a long one may arrive over
several steps: chunked prefill).

Nothing a request says is taken on trust: what it may do was decided where it
entered the server, and it carries that admission signed
(``admission.Admission``). Here, at the process boundary, the signature is
checked (``ClientPolicy.verified``), and the request is accepted only when its
``cache_salt`` is the one of its admission's tenant and its load layout; it
reads and writes only its tenant's entries (and its own private ones), and it
may store only its whole prompt as one entry, computed exactly. A request that
is refused loads and stores nothing (vLLM computes it exactly); its reply
says why.

``cached_tokens`` stays true: where a worker could not load what the lookup
promised (an entry corrupt, foreign or gone since), vLLM recomputes it, and the
request's prefill counts (what vLLM reports as its cached tokens) lose those
tokens too (``load_failed``).

A blend load (``params.reuse == "blend"``, where the server's ``reuse`` allows
it) carries a nonce in its layout (so its salt, and its blocks in vLLM's prefix
cache, are its own) and, each time it loads, a ``BlendOp`` for the workers: the
model's calibrated settings for the prompt's chunk length and its entries'
encoding context (``engine.blend_settings``, read by the connector off the
engine step) under the call's own options; the run's exact leading piece,
its chunk and text spans, and the prompt's ids after the run.

An encode request for an entry that is stored already saves nothing. Where
entries are lossless (precision ``"model"``) its prompt loads from the entry
(exact: the same tokens at the same positions, under its exact salt) and vLLM
computes one token; otherwise vLLM computes it (a lossy load would leave
inexact blocks under an exact salt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.engine.blend_settings import BlendSettings
from kvrag_integrations.errors import CalibrationError, TransferParamsError
from kvrag_integrations.vllm.admission import Admission, ClientPolicy
from kvrag_integrations.vllm.connector.messages import BlendOp, LoadOp, PieceOp, SaveOp, StepOps
from kvrag_integrations.vllm.connector.stats import REQUESTS_REFUSED
from kvrag_integrations.vllm.params import BlendRequest, PieceSpec, TransferParams
from kvrag_integrations.vllm.reply import Reply
from kvrag_integrations.vllm.trust import Tenant, request_salt

logger = logging.getLogger(__name__)

TEXT_TOKENS = 16  # a blend load's pieces this short are text between passages: recomputed


@dataclass
class _Plan:
    """One request's transfers, from its first lookup to its end."""

    admission: Admission
    prompt: tuple[int, ...]
    load: tuple[PieceSpec, ...]  # the load run, or the stored save pieces read back
    saves: tuple[PieceSpec, ...]  # the save pieces still to store
    keys: list[str]  # every save piece's key, in order
    until: int | None = None  # the end of the stored prefix of ``load`` (checked once)
    pending: int = 0  # external tokens allocated, not handed to the workers yet
    loaded: int = 0
    load_hi: int = 0  # where the last load handed to the workers ends
    recomputed: int = 0
    saved: bool = False
    refused: str = ""
    background: bool = False  # the save may land after the answer (``params.deferred``)
    own_save: bool = False  # the save goes to the request's private namespace, unindexed
    request: Any = None  # vLLM's request (its prefill counts are corrected on a failed load)
    blend: BlendRequest | None = None  # a blend load's own part (None: turbo)
    blended: int = 0  # loaded tokens the workers recomputed (blend)

    @property
    def tenant(self) -> Tenant:
        return self.admission.tenant

    def tenant_of(self, own: bool) -> Tenant:
        """Where a piece's entry is: the tenant's namespace, or the request's private one."""
        if not own:
            return self.admission.tenant
        assert self.admission.own is not None  # (checked with the admission)
        return self.admission.own


class SchedulerSide:
    """Lookups and per-step transfer plans (one per scheduler).

    Args:
        fingerprints: the storage fingerprint of each worker rank (one per
            tensor-parallel rank): a piece counts as stored when every rank's
            entry exists.
        contains: the store's existence check.
        block_ids: ``request_id -> block ids`` (vLLM's KV cache manager's).
        policy: how admissions are checked (``admission.ClientPolicy``).
        lossless: entries are stored at model precision (a stored entry's
            encode may then load it back: exact).
        reuse: the server's reuse (``config.REUSE_MODES``): "blend" allows it.
        blend_settings: ``(chunk_tokens, context) -> BlendSettings | None``: the
            model's calibrated settings (None: ``BlendSettings()``, CacheBlend's).
        bos_id: the model's BOS id (a chunk read behind it was encoded in the
            ``"sink"`` context).
    """

    def __init__(
        self,
        fingerprints: Sequence[str],
        contains: Callable[[str], bool],
        block_ids: Callable[[str], Sequence[int]],
        policy: ClientPolicy | None = None,
        lossless: bool = False,
        reuse: str = "turbo",
        blend_settings: Callable[[float, str], BlendSettings | None] | None = None,
        bos_id: int | None = None,
    ) -> None:
        self.fingerprints = list(fingerprints)
        self.contains = contains
        self.block_ids = block_ids
        self.policy = policy or ClientPolicy(False, "read", 0, None)  # accepts nothing unsigned
        self.lossless = lossless
        self.reuse = reuse
        self.blend_settings = blend_settings or (lambda tokens, context: None)
        self.bos_id = bos_id
        self.plans: dict[str, _Plan] = {}
        self.refused = 0  # requests refused since the last ``take_stats``

    # -------------------------------------------------------------- lookup
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Prompt tokens beyond ``num_computed_tokens`` the workers will write."""
        plan = self._plan(request)
        if plan is None or not plan.load:
            return 0
        plan.request = request
        if plan.until is None:
            plan.until = self._stored_end(plan)
        limit = min(plan.until, len(plan.prompt) - 1)  # vLLM computes at least one token
        return max(0, limit - num_computed_tokens)

    def allocated(self, request: Any, num_external_tokens: int) -> None:
        """Blocks are allocated for ``num_external_tokens`` external tokens."""
        plan = self.plans.get(request.request_id)
        if plan is not None and num_external_tokens > 0:
            plan.pending = num_external_tokens

    def _plan(self, request: Any) -> _Plan | None:
        plan = self.plans.get(request.request_id)
        if plan is not None:
            return plan
        try:
            params = TransferParams.from_request(request.kv_transfer_params)
        except TransferParamsError as exc:
            logger.warning("request %s: kv_transfer_params ignored (%s)", request.request_id, exc)
            return None
        if params is None:
            return None
        prompt = tuple(request.prompt_token_ids or ())
        try:
            plan = self._checked_plan(params, prompt, getattr(request, "cache_salt", None))
        except TransferParamsError as exc:
            logger.warning("request %s: refused (%s)", request.request_id, exc)
            self.refused += 1
            plan = _Plan(Admission(Tenant(), "read"), prompt, (), (), [], refused=str(exc))
        self.plans[request.request_id] = plan
        return plan

    def _checked_plan(
        self, params: TransferParams, prompt: tuple[int, ...], salt: str | None
    ) -> _Plan:
        """The plan of a request its admission allows (``trust``'s rules).

        Raises:
            TransferParamsError: the request may not do what it asks.
        """
        params.check_prompt(len(prompt))
        loads = bool(params.load)
        policy = self.policy
        admission = policy.verified(params.admission, prompt, params.tenant_salt)
        tenant, role = admission.tenant, admission.role
        if (salt or None) != request_salt(tenant, params.layout):
            raise TransferParamsError(
                "its cache_salt is not the one of its tenant and load layout "
                "(kvrag_integrations.vllm.trust.request_salt)"
            )
        if admission.own is None and (params.own_save or any(piece.own for piece in params.load)):
            raise TransferParamsError("only a request with a private namespace has entries there")
        saves = params.save
        if saves:
            if role == "read":
                raise TransferParamsError("this caller may not store entries")
            if loads or saves != (PieceSpec(0, len(prompt)),):
                raise TransferParamsError(
                    "a request stores only its whole prompt, as one entry, loading nothing"
                )
            if len(prompt) > policy.max_entry_tokens:
                raise TransferParamsError(
                    f"an entry has at most {policy.max_entry_tokens} tokens, not {len(prompt)}"
                )
            if params.overwrite and role != "admin":
                raise TransferParamsError("overwriting entries needs the admin role")
        plan = _Plan(admission, prompt, params.load, saves, [], background=params.deferred)
        plan.own_save = params.own_save
        if (params.reuse or self.reuse) == "blend" and loads:
            plan.blend = self._blend_of(params)
        home = plan.tenant_of(params.own_save)  # where the save goes
        plan.keys = [self._key(p.entry_ids(prompt), home) for p in saves]
        if saves and not params.overwrite and self._stored(prompt, home):
            # Stored already: nothing to save; read back only where that is exact.
            read_back = PieceSpec(0, len(prompt), own=params.own_save)
            plan.load, plan.saves = ((read_back,) if self.lossless else ()), ()
        return plan

    def _blend_of(self, params: TransferParams) -> BlendRequest:
        """A blend load's own part, checked (``TransferParamsError`` if refused)."""
        if self.reuse != "blend":
            raise TransferParamsError(
                "this server's reuse is turbo: blend is refused (start it with --reuse blend)"
            )
        blend = params.blend or BlendRequest()
        if len(blend.nonce) < BlendRequest.NONCE_CHARS:
            raise TransferParamsError(
                f"a blend load carries a nonce of {BlendRequest.NONCE_CHARS} to 64 characters "
                "(its blocks are its own)"
            )
        try:
            BlendSettings(**{**BlendSettings().as_json(), **blend.options})
        except (CalibrationError, TypeError) as exc:
            raise TransferParamsError(f"blend options: {exc}") from exc
        return blend

    def _blend_op(self, plan: _Plan, end: int) -> BlendOp:
        """What the workers recompute of a blend plan's run, loaded up to ``end``
        (see the module docstring; its computed pieces are text)."""
        assert plan.blend is not None
        run = [p for p in plan.load if p.start < end]
        head = run[0]
        exact = min(head.rows, end) if not (head.lead or head.computed) else 0  # read at 0
        spans = [(p, p.start, min(p.end, end)) for p in run if p.start >= exact]
        texts = tuple((lo, hi) for p, lo, hi in spans if p.rows <= TEXT_TOKENS or p.computed)
        chunked = [(p, lo, hi) for p, lo, hi in spans if p.rows > TEXT_TOKENS and not p.computed]
        sink = [p.lead == (self.bos_id,) for p, _, _ in chunked]
        context = "sink" if sink and sum(sink) * 2 > len(sink) else "alone"
        lengths = sorted(p.rows for p, _, _ in chunked) or [0]
        tuned = self.blend_settings(lengths[len(lengths) // 2], context) or BlendSettings(
            context,
            "query" if context == "sink" else "deviation",  # CacheBlend's "auto"
        )
        settings = BlendSettings(**{**tuned.as_json(), **plan.blend.options})
        chunks = tuple((lo, hi) for _, lo, hi in chunked)
        return BlendOp(settings, exact, chunks, texts, tuple(plan.prompt[end:]))

    def _key(self, entry_ids: Sequence[int], tenant: Tenant, rank: int = 0) -> str:
        return cache_key(tenant.fingerprint(self.fingerprints[rank]), list(entry_ids))

    def _stored(self, entry_ids: Sequence[int], tenant: Tenant) -> bool:
        ranks = range(len(self.fingerprints))
        return all(self.contains(self._key(entry_ids, tenant, r)) for r in ranks)

    def _stored_end(self, plan: _Plan) -> int:
        end = 0
        for piece in plan.load:
            tenant = plan.tenant_of(piece.own)
            if not piece.computed and not self._stored(piece.entry_ids(plan.prompt), tenant):
                break
            end = piece.end
        return end

    # ---------------------------------------------------------------- steps
    def step(self, scheduled: Sequence[tuple[str, int, int]]) -> StepOps:
        """The workers' transfers for one step.

        Args:
            scheduled: ``(request_id, num_computed_tokens, num_scheduled_tokens)``
                of every request in the step (computed tokens counting the
                external ones just allocated).
        """
        ops = StepOps()
        for request_id, computed, count in scheduled:
            plan = self.plans.get(request_id)
            if plan is None:
                continue
            if plan.pending:
                lo, hi = computed - plan.pending, computed
                pieces = _overlapping(plan, plan.load, lo, hi)
                blocks = self._blocks(request_id)
                blend = self._blend_op(plan, hi) if plan.blend is not None else None
                ops.loads.append(LoadOp(request_id, blocks, lo, hi, pieces, blend))
                # (known now: a request answered in this step is replied to before the
                # workers' report comes back)
                plan.blended = blend.recomputed if blend is not None else 0
                # (a request preempted and resumed loads again: this load is what counts)
                plan.loaded, plan.pending, plan.load_hi = hi - lo, 0, hi
            if plan.saves and not plan.saved and computed + count >= len(plan.prompt):
                pieces = _overlapping(plan, plan.saves, 0, len(plan.prompt), plan.own_save)
                blocks = self._blocks(request_id)
                indexed = not plan.own_save  # (a private entry: found by no one)
                op = SaveOp(request_id, blocks, pieces, plan.background, indexed)
                ops.saves.append(op)
                plan.saved = True
        return ops

    def load_failed(self, request_id: str, position: int) -> None:
        """A worker could not load the request from ``position`` on (vLLM
        recomputes from there): those tokens were not reused, and vLLM's count
        of the request's cached tokens loses them (vLLM counted them when the
        lookup promised them; it reports the count with the request's first
        output, which comes after the recompute)."""
        plan = self.plans.get(request_id)
        if plan is not None and position < plan.load_hi:
            lost = plan.load_hi - position
            plan.loaded, plan.recomputed = plan.loaded - lost, plan.recomputed + lost
            plan.load_hi = position
            _uncount(plan.request, lost)

    def take_stats(self) -> dict[str, int]:
        """Requests refused since the last call (``stats.KVRAGStats``' names)."""
        refused, self.refused = self.refused, 0
        return {REQUESTS_REFUSED: refused}

    def recomputed_by_blend(self, request_id: str, count: int) -> None:
        """The workers recomputed ``count`` of the request's loaded tokens (blend)."""
        plan = self.plans.get(request_id)
        if plan is not None and count != plan.blended:
            logger.warning(
                "request %s: blend recomputed %d tokens, %d planned",
                request_id,
                count,
                plan.blended,
            )
            plan.blended = count

    def _blocks(self, request_id: str) -> tuple[int, ...]:
        return tuple(self.block_ids(request_id))

    def finished(self, request_id: str) -> Reply | None:
        """Forget a request; what its output reports (None: it carried no params
        of ours, and its output gets nothing of ours)."""
        plan = self.plans.pop(request_id, None)
        if plan is None:
            return None
        fingerprint = plan.tenant.fingerprint(self.fingerprints[0])
        reply = Reply(fingerprint, plan.loaded, plan.recomputed, plan.keys)
        reply.stored = len(plan.saves) if plan.saved else 0
        reply.refused = plan.refused
        if plan.blend is not None:
            reply.reuse, reply.blended = "blend", plan.blended
        return reply


def _overlapping(
    plan: _Plan, pieces: Sequence[PieceSpec], lo: int, hi: int, own: bool = False
) -> tuple[PieceOp, ...]:
    """The pieces over positions ``lo .. hi`` as the workers get them: each span, its
    entry's ids, the entry row it starts at, and the namespace its entry is in."""
    return tuple(
        PieceOp(
            p.start,
            p.rows,
            tuple(p.entry_ids(plan.prompt)),
            len(p.lead),
            plan.tenant_of(p.own or own).namespace,
            p.computed,
        )
        for p in pieces
        if p.start < hi and p.end > lo
    )


def _uncount(request: Any, lost: int) -> None:
    """Take ``lost`` tokens out of the cached ones vLLM counted for ``request``'s
    prefill (``Request.prefill_stats``, vLLM 0.32: ``num_cached_tokens`` is what
    the server reports as ``cached_tokens``)."""
    stats = getattr(request, "prefill_stats", None)
    if stats is None or not hasattr(stats, "num_external_cached_tokens"):
        return
    lost = min(lost, stats.num_external_cached_tokens)
    stats.num_external_cached_tokens -= lost
    stats.num_cached_tokens -= lost
    stats.num_computed_tokens += lost
