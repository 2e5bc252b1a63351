"""The server's own encode requests: a text a request brought, stored on its own.

The hook (``reuse_hook``) stores glue between found passages, a prefix before
them and a long unknown remainder as entries of their own (as a chunk is): a
request of those ids alone, computed exactly from position 0 under its
tenant's exact salt, whose prompt the connector saves. ``Encodes`` runs them
through the engine client's own ``generate`` (not the hook: they are the
server's), each admitted as the request that brought the text (its
admission, bound to the encode's ids), and bounds them: in a tenant's
namespace, one encode per text at once and ``MAX_TENANT_ENCODES`` per tenant
(a key's, or every keyless caller's together), so that no tenant's encodes
hold up another's; a request's own (private) texts are bounded by the request
(``detection.MAX_ENCODES_PER_REQUEST``) and awaited by it alone.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvrag_integrations.vllm.admission import Admission, ClientPolicy
from kvrag_integrations.vllm.params import TransferParams
from kvrag_integrations.vllm.server.arrival import current
from kvrag_integrations.vllm.server.shares import ComputeShares
from kvrag_integrations.vllm.trust import KEY_SALT_PREFIX, NAMESPACE_SALT_PREFIX, request_salt

logger = logging.getLogger(__name__)

# A tenant's encodes in flight at once (more are dropped): a key namespace's, a key
# of the shared namespace's, and every caller without a key together (salts and
# anonymous requests: any client can mint those); one request's glue fits.
MAX_TENANT_ENCODES = 8


class Encodes:
    """The encode requests the hook starts (see the module docstring).

    Args:
        generate: the engine client's own ``generate``.
        policy: the server's policy (the secret admissions are signed with).
        sampling_params: makes an encode's sampling parameters (vLLM's
            ``SamplingParams``).
        shares: the callers' shares of the engine: an encode is its request's
            caller's compute (``shares.ComputeShares``).
    """

    def __init__(
        self,
        generate: Callable[..., Any],
        policy: ClientPolicy,
        sampling_params: Callable[..., Any],
        shares: ComputeShares | None = None,
    ) -> None:
        self.generate = generate
        self.shares = shares or ComputeShares()
        self.policy = policy
        self.sampling_params = sampling_params
        self._running: dict[str, asyncio.Task[bool]] = {}  # in a tenant's namespace, by text
        self._by_tenant: dict[str, int] = {}  # how many of them, by ``encoder``

    def own(self, ids: list[int], admission: Admission, save: TransferParams) -> asyncio.Task[bool]:
        """Encode a request's own text (awaited by it alone: never dropped here)."""
        return asyncio.get_running_loop().create_task(self.run(ids, admission, save))

    def shared(
        self, key: str, ids: list[int], admission: Admission, save: TransferParams
    ) -> asyncio.Task[bool] | None:
        """Encode a text into the tenant's namespace: the encode of ``key`` running
        already, a new one, or None (dropped: the tenant has ``MAX_TENANT_ENCODES``)."""
        if key in self._running:
            return self._running[key]
        tenant = encoder(admission)
        if self._by_tenant.get(tenant, 0) >= MAX_TENANT_ENCODES:
            return None
        task = asyncio.get_running_loop().create_task(self.run(ids, admission, save))
        self._running[key] = task
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
        task.add_done_callback(lambda _: self._ended(key, tenant))
        return task

    def _ended(self, key: str, tenant: str) -> None:
        self._running.pop(key, None)
        left = self._by_tenant.pop(tenant, 1) - 1
        if left:
            self._by_tenant[tenant] = left

    async def run(self, ids: list[int], admission: Admission, params: TransferParams) -> bool:
        """One encode request of ``ids`` (True: it ran; what it stored is the connector's)."""
        prompt: dict[str, Any] = {"type": "token", "prompt_token_ids": ids}
        secret = self.policy.secret
        signed = admission.bound(ids).signed(secret) if secret is not None else None
        params = replace(params, admission=signed)
        salt = request_salt(admission.tenant, [])  # exact: its tenant's own salt
        if salt is not None:
            prompt["cache_salt"] = salt
        extra = {"kv_transfer_params": params.as_request()}
        sampling = self.sampling_params(max_tokens=1, extra_args=extra)
        # unique across the server's API processes (each has its own hook)
        request_id = f"kvrag-encode-{uuid.uuid4().hex}"
        arrival = current()  # (the task runs in the context of the request that started it)
        caller = arrival.caller if arrival is not None else ""
        try:
            async with self.shares.lane(caller, len(ids)):  # its caller's compute
                async for _ in self.generate(prompt, sampling, request_id):
                    pass
        except Exception as exc:  # best effort: the request then loads less
            logger.info("encode %s failed: %s", request_id, exc)
            return False
        return True

    async def drain(self) -> None:
        """Wait for the encodes in tenants' namespaces in flight (tests, shutdown)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)


def encoder(admission: Admission) -> str:
    """Whose encodes an admission's are, for their bound: its key's (a key namespace,
    or a key of the shared namespace, by their salt), else every keyless caller's
    together (a client can mint any number of salts and anonymous requests)."""
    salt = admission.tenant.salt or ""
    return salt if salt.startswith((NAMESPACE_SALT_PREFIX, KEY_SALT_PREFIX)) else ""


def vllm_sampling_params(**kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(**kwargs)
