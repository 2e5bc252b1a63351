"""The OpenAI server's door: API keys that map to tenants, and the grants that say so.

``serve`` always installs this ASGI middleware (vLLM's ``--middleware``); it
does one job. (Finding stored passages in plain requests is installed at
startup by ``startup.ReuseInstaller``.)

- **Every request loses any grant its client sent** (keyed or not): only this
  middleware and the server's hook sign grants.
- **With ``serve --tenant-keys``** it looks the request's bearer key up in the
  operator's key file. Where the file admits no anonymous caller
  (``"anonymous": "none"``), every route answers 401 without a listed key, but
  the few that reach no model (``OPEN_ROUTES``: health, metrics, version): an
  allow-list, so a route a later vLLM adds is guarded too. A keyed request to a
  route that generates (``_REWRITTEN``, ``/invocations`` included) gets its
  tenant:

  - our ``kv_transfer_params["kvrag"]`` get a ``grant`` (the key's namespace
    and role, bound to the key by its digest, signed with the server's secret:
    ``trust.Grant``), and lose any ``tenant`` the client sent;
  - ``cache_salt`` becomes the one the connector derives for that tenant and
    the request's load layout (``trust.request_salt``), so vLLM's prefix cache
    keeps the tenant's blocks apart too;
  - params of ours that do not parse are dropped: the request runs exactly.

  The key file is read again when it changes: a key removed from it (or given
  another namespace or role) is revoked at once, and the grants signed for it
  stop counting in the connector and the hook, which read the same file
  (``KeyRing``, ``trust.ClientPolicy.keys``).

Requests without a key (where admitted) keep their body, less any grant: the
server's hook gives each a salt of its own (``trust.Grant.anonymous``).

The key file (JSON)::

    {"keys": {"sk-team-a": {"namespace": "team-a", "role": "write"},
              "sk-ops": {"namespace": "", "role": "admin"}},
     "anonymous": "read"}

``namespace`` "" is the shared one; a key may add ``"quota_bytes": N``, the
most its namespace may hold in the store (the largest of its keys'; default: a
share of the budget, ``serve --namespace-share``); ``anonymous``: the role of callers without
a listed key (``"none"``: they are refused); it is passed to the connector as
its ``client_role``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.keys import KEYS_ENV, KeyRing
from kvrag_integrations.vllm.params import PARAMS_KEY, TransferParams
from kvrag_integrations.vllm.trust import (
    Grant,
    Tenant,
    request_salt,
)

logger = logging.getLogger(__name__)

OPEN_ROUTES = frozenset({"/health", "/ping", "/metrics", "/version"})
"""The routes that need no key: they reach no model. Every other one does."""
_REWRITTEN = ("/completions", "/chat/completions", "/responses", "/invocations")
_MAX_BODY = 64 * 2**20  # a request body read whole to rewrite it

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class TenantGateway:
    """ASGI middleware (vLLM's ``--middleware``): API keys decide tenants and rights.

    Configured from the environment (``$KVRAG_TENANT_KEYS``, ``$KVRAG_SERVER_SECRET``)
    since vLLM builds it with no arguments.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.ring: KeyRing | None = None
        if os.environ.get(KEYS_ENV):
            self.ring = KeyRing.from_env()
            if self.ring is None:
                raise RuntimeError("TenantGateway needs $KVRAG_SERVER_SECRET (serve sets one)")
            self.secret = self.ring.secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        grant = self.ring.grant(_bearer(scope)) if self.ring is not None else None
        refused = self.ring is not None and self.ring.current().anonymous == "none"
        if grant is None and refused and path not in OPEN_ROUTES:
            await _refuse(scope, send)
            return
        if kind != "http" or scope.get("method") != "POST" or not _json_body(scope):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            await _answer(send, 413, {"error": "request body too large"})
            return
        if grant is not None and path.endswith(_REWRITTEN):
            body = self.rewrite(body, grant)
        else:
            body = strip_grant(body)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)

    def rewrite(self, body: bytes, grant: Grant) -> bytes:
        """The body of a keyed request with its tenant's grant and salt."""
        try:
            data = json.loads(body)
        except ValueError:
            return body  # vLLM answers a body that is not JSON
        if not isinstance(data, dict):
            return body
        tenant: Tenant = grant.tenant(self.secret)
        transfer = data.get("kv_transfer_params")
        params = None
        if isinstance(transfer, dict) and PARAMS_KEY in transfer:
            try:
                params = TransferParams.from_request(transfer)
            except TransferParamsError:
                transfer = {k: v for k, v in transfer.items() if k != PARAMS_KEY}
                data["kv_transfer_params"] = transfer  # runs exactly, as plain vLLM
        # Every keyed request carries its grant: the server's detection of stored
        # passages (``reuse_hook``) reads the tenant from it, as the connector does.
        ours = dict(transfer[PARAMS_KEY]) if params is not None else {}  # type: ignore[index]
        ours.pop("tenant", None)
        ours["grant"] = grant.signed(self.secret)
        others = transfer if isinstance(transfer, dict) else {}
        data["kv_transfer_params"] = {**others, PARAMS_KEY: ours}
        # (a request without a load carries the tenant's exact salt: its exact
        # blocks stay apart from other tenants' in vLLM's cache)
        salt = request_salt(tenant, params.layout if params is not None else [])
        if salt is None:
            data.pop("cache_salt", None)
        else:
            data["cache_salt"] = salt
        return json.dumps(data).encode()


def strip_grant(body: bytes) -> bytes:
    """``body`` without a grant in its ``kv_transfer_params["kvrag"]`` (unchanged
    where it has none, or is not a JSON object)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    transfer = data.get("kv_transfer_params") if isinstance(data, dict) else None
    ours = transfer.get(PARAMS_KEY) if isinstance(transfer, dict) else None
    if not isinstance(ours, dict) or "grant" not in ours:
        return body
    ours.pop("grant")
    return json.dumps(data).encode()


def _json_body(scope: Scope) -> bool:
    """Whether a request's body may be JSON (a client without a content type is
    read as JSON by vLLM too); uploads (audio, files) pass as they are."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-type":
            return b"json" in value.lower()
    return True


def _bearer(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


async def _read_body(receive: Receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The rewritten body, then the client's own messages (a stream learns of its
    client's disconnect from them)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(scope: Scope, send: Send) -> None:
    if scope.get("type") == "websocket":
        await send({"type": "websocket.close", "code": 1008})  # policy violation (HTTP 403)
        return
    await _answer(send, 401, {"error": "Unauthorized"})


async def _answer(send: Send, status: int, content: dict[str, Any]) -> None:
    payload = json.dumps(content).encode()
    length = str(len(payload)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
