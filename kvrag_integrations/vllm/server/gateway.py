"""The OpenAI server's door: every HTTP request passes it before any of vLLM's routes.

``serve`` always installs this ASGI middleware (vLLM's ``--middleware``). It
does three things, in this order:

1. **Who may reach what.** A request's bearer key is looked up in the
   operator's key file (``serve --tenant-keys``: ``keys.KeyRing``, read again
   when it changes) and among vLLM's own ``--api-key`` keys (``keys.ApiKeys``),
   alike. Only ``OPEN_ROUTES`` (health, ping, version: they reach no model and
   count nobody's traffic) need no key, and an ``OPTIONS`` request (a browser's
   CORS preflight carries none; vLLM's own key check lets it by too). Every
   other route (an allow-list, so a route a later vLLM adds is guarded too)
   answers 401 without a key where the key file says ``"anonymous": "none"``
   or ``--api-key`` is given. vLLM's ``/metrics`` counts every caller's traffic
   (prefix-cache queries and hits among it): it needs an admin key of the key
   file, unless the operator opens it (``serve --open-metrics``), whatever the
   method and whatever the root path (matched as Starlette routes it:
   ``route_path``); at the defaults nobody reads it.
2. **Bad input is a 4xx, here.** A JSON body is read whole (more than
   ``MAX_BODY`` bytes: 413) and its fields the server acts on are checked once
   (``arrival.read_body``: 400 with the reason); the model never sees it.
3. **One admission per request** (``admission.ClientPolicy.admit``): the key's
   tenant and role, or the client's own ``cache_salt``, or an anonymous
   request's own salt and private namespace. It rides with the request's
   handling (``arrival.ARRIVAL``) to the server's hook, which signs it into what
   the connector reads and sets the request's salt; the body reaches vLLM as
   the client sent it. So does who sent it (``shares.caller_of``: the key's
   holder, else the client's address), for its share of the engine.

The policy is the connector's own (its settings, read from the server's vLLM
config by ``startup.ReuseInstaller``, which runs first); a server without our
connector gets the key checks only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.admission import ClientPolicy
from kvrag_integrations.vllm.keys import KEYS_ENV, ApiKeys, KeyRing
from kvrag_integrations.vllm.server.arrival import ARRIVAL, Arrival, BadRequest, read_body
from kvrag_integrations.vllm.server.shares import caller_of
from kvrag_integrations.vllm.trust import Grant, key_digest, stricter

logger = logging.getLogger(__name__)

OPEN_ROUTES = frozenset({"/health", "/ping", "/version"})
"""The routes that need no key: they reach no model and count no one's traffic."""
METRICS = "/metrics"  # vLLM mounts its Prometheus app at every path starting with it
MAX_BODY = 64 * 2**20  # a request body read whole to check it

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

POLICY_STATE = "kvrag_policy"
"""Where ``startup.ReuseInstaller`` leaves the server's ``ClientPolicy`` (``app.state``)."""
OPEN_METRICS_STATE = "kvrag_open_metrics"
"""Where it leaves whether ``/metrics`` is open to anyone (``app.state``)."""


class TenantGateway:
    """ASGI middleware (vLLM's ``--middleware``): see the module docstring.

    Configured from the environment (``$KVRAG_TENANT_KEYS``, ``$KVRAG_API_KEYS``,
    ``$KVRAG_SERVER_SECRET``) and the app's state, since vLLM builds it with no
    arguments.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.ring = KeyRing.from_env()
        if self.ring is None and os.environ.get(KEYS_ENV):
            raise RuntimeError("TenantGateway needs $KVRAG_SERVER_SECRET (serve sets one)")
        self.api_keys = ApiKeys.from_env()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        state = getattr(scope.get("app"), "state", None)
        policy: ClientPolicy | None = getattr(state, POLICY_STATE, None)
        grant = self._grant(_bearer(scope), policy)
        open_metrics = bool(getattr(state, OPEN_METRICS_STATE, False))
        metrics = any(p.startswith(METRICS) for p in (path, scope.get("path", "")))
        options = scope.get("method") == "OPTIONS"
        if not self._may_reach(path, metrics, grant, open_metrics, options):
            await _refuse(scope, send)
            return
        body = None
        if kind == "http" and scope.get("method") == "POST" and _json_body(scope):
            body = await _read_body(scope, receive)
            if body is None:
                await _answer(send, 413, f"the request body is over {MAX_BODY} bytes")
                return
        try:
            arrival = read_body(body) if body is not None else Arrival()
            if policy is not None:
                tenant_salt = arrival.params.tenant_salt if arrival.params is not None else ""
                role = self.anonymous_role(policy)
                admission = policy.admit(grant, arrival.cache_salt, tenant_salt, role)
                caller = caller_of(scope, grant)
                arrival = Arrival(arrival.cache_salt, arrival.params, admission, caller=caller)
        except (BadRequest, TransferParamsError) as exc:
            await _answer(send, 400, str(exc))
            return
        token = ARRIVAL.set(arrival)
        try:
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
        finally:
            ARRIVAL.reset(token)

    def _grant(self, key: str, policy: ClientPolicy | None) -> Grant | None:
        """What the bearer key grants (None: no listed key): the key file's entry, or
        for one of ``--api-key``'s, the shared namespace under the callers' role."""
        if not key:
            return None
        if self.ring is not None:
            grant = self.ring.grant(key)
            if grant is not None:
                return grant
        if self.api_keys is not None and self.api_keys.holds(key):
            role = policy.client_role if policy is not None else "read"
            secret = policy.secret if policy is not None and policy.secret else b""
            return Grant("", role, holder=key_digest(key, secret))  # a salt of its own
        return None

    def _may_reach(
        self, path: str, metrics: bool, grant: Grant | None, open_metrics: bool, options: bool
    ) -> bool:
        if metrics:  # (by the route's path or the raw one)
            return open_metrics or (grant is not None and grant.role == "admin")
        if options or grant is not None or path in OPEN_ROUTES:
            return True  # (OPTIONS: a CORS preflight carries no key, as vLLM lets it by)
        closed = self.api_keys is not None or (
            self.ring is not None and self.ring.current().anonymous == "none"
        )
        return not closed

    def anonymous_role(self, policy: ClientPolicy) -> str:
        """The role of a caller without a key: the operator's ``--client-role``, or
        the key file's ``anonymous`` where that is stricter."""
        if self.ring is None or self.ring.current().anonymous == "none":
            return policy.client_role
        return stricter(policy.client_role, self.ring.current().anonymous)


def route_path(scope: Scope) -> str:
    """The path a route is matched by, as Starlette takes it: the root path taken
    off only where a ``/`` follows it (``/metrics`` under root path ``/m`` is
    ``/metrics``, not ``etrics``).

    Examples:
        >>> route_path({"path": "/metrics", "root_path": "/m"})
        '/metrics'
        >>> route_path({"path": "/m/v1/models", "root_path": "/m"})
        '/v1/models'
    """
    path, root = scope.get("path", ""), scope.get("root_path", "") or ""
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        return path[len(root) :]
    return path


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


async def _read_body(scope: Scope, receive: Receive) -> bytes | None:
    """The whole body (None: over ``MAX_BODY``, said or sent)."""
    for name, value in scope.get("headers", []):
        said = value.strip()
        if name.lower() == b"content-length" and said.isdigit() and int(said) > MAX_BODY:
            return None
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read, then the client's own messages (a stream hears of its
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
    await _answer(send, 401, "Unauthorized")


async def _answer(send: Send, status: int, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "code": status}}).encode()
    length = str(len(payload)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
