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

Nothing a request says is taken on trust (``trust``): it is admitted only
when its ``cache_salt`` is the one of its tenant and load layout, it reads and
writes only its tenant's entries, and it may store only its whole prompt as
one entry, computed exactly. A request that is not admitted loads and stores
nothing (vLLM computes it exactly); its reply says why.

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
from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.connector.messages import LoadOp, PieceOp, SaveOp, StepOps
from kvrag_integrations.vllm.params import PieceSpec, Reply, TransferParams
from kvrag_integrations.vllm.trust import ClientPolicy, Tenant, request_salt

logger = logging.getLogger(__name__)


@dataclass
class _Plan:
    """One request's transfers, from its first lookup to its end."""

    tenant: Tenant
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
    background: bool = False  # the save may land after the answer (``params.learn``)
    indexed: bool = True  # the saved entry is announced in the content index


class SchedulerSide:
    """Lookups and per-step transfer plans (one per scheduler).

    Args:
        fingerprints: the storage fingerprint of each worker rank (one per
            tensor-parallel rank): a piece counts as stored when every rank's
            entry exists.
        contains: the store's existence check.
        block_ids: ``request_id -> block ids`` (vLLM's KV cache manager's).
        policy: what requests may do (``trust.ClientPolicy``).
        lossless: entries are stored at model precision (a stored entry's
            encode may then load it back: exact).
    """

    def __init__(
        self,
        fingerprints: Sequence[str],
        contains: Callable[[str], bool],
        block_ids: Callable[[str], Sequence[int]],
        policy: ClientPolicy | None = None,
        lossless: bool = False,
    ) -> None:
        self.fingerprints = list(fingerprints)
        self.contains = contains
        self.block_ids = block_ids
        self.policy = policy or ClientPolicy()
        self.lossless = lossless
        self.plans: dict[str, _Plan] = {}

    # -------------------------------------------------------------- lookup
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Prompt tokens beyond ``num_computed_tokens`` the workers will write."""
        plan = self._plan(request)
        if plan is None or not plan.load:
            return 0
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
            plan = self._admit(params, prompt, getattr(request, "cache_salt", None))
        except TransferParamsError as exc:
            logger.warning("request %s: not admitted (%s)", request.request_id, exc)
            plan = _Plan(Tenant(), prompt, (), (), [], refused=str(exc))
        self.plans[request.request_id] = plan
        return plan

    def _admit(self, params: TransferParams, prompt: tuple[int, ...], salt: str | None) -> _Plan:
        """The plan of an admitted request (``trust``'s rules).

        Raises:
            TransferParamsError: the request may not do what it asks.
        """
        params.check_prompt(len(prompt))
        loads = bool(params.load)
        policy = self.policy
        tenant, role = policy.tenant_and_role(params.tenant, params.grant, salt, loads)
        if (salt or None) != request_salt(tenant, params.layout):
            raise TransferParamsError(
                "its cache_salt is not the one of its tenant and load layout "
                "(kvrag_integrations.vllm.trust.request_salt)"
            )
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
        keys = [self._key(p.entry_ids(prompt), tenant) for p in saves]
        load = params.load
        if saves and not params.overwrite and self._stored(prompt, tenant):
            # Stored already: nothing to save; read back only where that is exact.
            load, saves = ((saves[0],) if self.lossless else ()), ()
        indexed = not params.private
        return _Plan(tenant, prompt, load, saves, keys, background=params.learn, indexed=indexed)

    def _key(self, entry_ids: Sequence[int], tenant: Tenant, rank: int = 0) -> str:
        return cache_key(tenant.fingerprint(self.fingerprints[rank]), list(entry_ids))

    def _stored(self, entry_ids: Sequence[int], tenant: Tenant) -> bool:
        ranks = range(len(self.fingerprints))
        return all(self.contains(self._key(entry_ids, tenant, r)) for r in ranks)

    def _stored_end(self, plan: _Plan) -> int:
        end = 0
        for piece in plan.load:
            if not self._stored(piece.entry_ids(plan.prompt), plan.tenant):
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
                pieces = _overlapping(plan.load, plan.prompt, lo, hi)
                blocks = self._blocks(request_id)
                ops.loads.append(LoadOp(request_id, blocks, lo, hi, pieces, plan.tenant.namespace))
                # (a request preempted and resumed loads again: this load is what counts)
                plan.loaded, plan.pending, plan.load_hi = hi - lo, 0, hi
            if plan.saves and not plan.saved and computed + count >= len(plan.prompt):
                pieces = _overlapping(plan.saves, plan.prompt, 0, len(plan.prompt))
                blocks = self._blocks(request_id)
                namespace = plan.tenant.namespace
                op = SaveOp(request_id, blocks, pieces, namespace, plan.background, plan.indexed)
                ops.saves.append(op)
                plan.saved = True
        return ops

    def load_failed(self, request_id: str, position: int) -> None:
        """A worker could not load the request from ``position`` on (vLLM
        recomputes from there): those tokens were not reused."""
        plan = self.plans.get(request_id)
        if plan is not None and position < plan.load_hi:
            lost = plan.load_hi - position
            plan.loaded, plan.recomputed = plan.loaded - lost, plan.recomputed + lost
            plan.load_hi = position

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
        return reply


def _overlapping(
    pieces: Sequence[PieceSpec], prompt: Sequence[int], lo: int, hi: int
) -> tuple[PieceOp, ...]:
    return tuple(_op(p, prompt) for p in pieces if p.start < hi and p.end > lo)


def _op(piece: PieceSpec, prompt: Sequence[int]) -> PieceOp:
    """A piece as the workers get it: its span, its entry's ids, and the entry row
    it starts at."""
    ids = tuple(piece.entry_ids(prompt))
    return PieceOp(piece.start, piece.rows, ids, len(piece.lead))
