"""The OpenAI server's door: detection of stored passages, and API keys that map to tenants.

``serve`` always installs this ASGI middleware (vLLM's ``--middleware``). At
startup it wraps the server's engine client with ``reuse_hook`` (unless
``$KVRAG_DETECT`` is ``0``: ``serve --no-detect``), so that plain OpenAI
clients' requests reuse stored passages. With ``serve --tenant-keys`` it also
guards the API.

vLLM's own ``--api-key`` lets a key in, and nothing more. This ASGI middleware
runs in vLLM's API server before vLLM reads a request: it looks the request's
bearer key up in the operator's key file, refuses an unknown one where the
file admits no anonymous caller (401), and rewrites the body of completion and
chat requests so that the key, not the client, decides the tenant:

- our ``kv_transfer_params["kvrag"]`` get a ``grant`` (the key's namespace and
  role, signed with the server's secret: ``trust.Grant``), and lose any
  ``tenant`` or ``grant`` the client sent;
- ``cache_salt`` becomes the one the connector derives for that tenant and the
  request's load layout (``trust.request_salt``), so vLLM's prefix cache keeps
  the tenant's blocks apart too; a request without our params gets the
  tenant's exact salt;
- params of ours that do not parse are dropped: the request runs exactly, as
  plain vLLM.

Requests without a key (where admitted) pass unchanged: the connector applies
its own rules to them (the anonymous role, the client's own salt).

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
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.params import PARAMS_KEY, TransferParams
from kvrag_integrations.vllm.reuse_hook import install
from kvrag_integrations.vllm.trust import ROLES, Grant, Tenant, request_salt, server_secret

logger = logging.getLogger(__name__)

KEYS_ENV = "KVRAG_TENANT_KEYS"
DETECT_ENV = "KVRAG_DETECT"  # "0": no detection of stored passages in plain requests
"""The path of the key file (``serve --tenant-keys`` sets it for vLLM's processes)."""

_GUARDED = ("/v1/", "/v2/", "/inference/")
_REWRITTEN = ("/completions", "/chat/completions", "/responses")
_MAX_BODY = 64 * 2**20  # a request body read whole to rewrite it

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class KeyFile:
    """API keys and what each may do (see the module docstring)."""

    keys: Mapping[str, Grant]
    anonymous: str  # a role, or "none"
    # namespace -> its store quota in bytes: the largest ``quota_bytes`` of its keys
    quotas: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyFile:
        """Read and check a key file.

        Raises:
            ValueError: it is not of the documented form.
        """
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict) or not isinstance(raw.get("keys"), dict):
            raise ValueError(f"{path}: expected {{'keys': {{KEY: {{namespace, role}}}}, ...}}")
        keys, quotas = {}, {}
        for key, entry in raw["keys"].items():
            if not isinstance(entry, dict) or entry.get("role", "write") not in ROLES:
                raise ValueError(f"{path}: each key has a namespace and a role of {ROLES}")
            namespace = entry.get("namespace", "")
            if not isinstance(namespace, str):
                raise ValueError(f"{path}: a namespace is a string")
            keys[str(key)] = Grant(namespace, entry.get("role", "write"))
            quota = entry.get("quota_bytes")
            if quota is not None:
                if isinstance(quota, bool) or not isinstance(quota, int) or quota <= 0:
                    raise ValueError(f"{path}: quota_bytes is a number of bytes > 0")
                quotas[namespace] = max(quota, quotas.get(namespace, 0))
        anonymous = raw.get("anonymous", "write")
        if anonymous not in (*ROLES, "none"):
            raise ValueError(f"{path}: anonymous is one of {(*ROLES, 'none')}")
        return cls(keys, anonymous, quotas)


class TenantGateway:
    """ASGI middleware (vLLM's ``--middleware``): API keys decide tenants and rights.

    Configured from the environment (``$KVRAG_TENANT_KEYS``, ``$KVRAG_SERVER_SECRET``)
    since vLLM builds it with no arguments.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.hooked = False
        path = os.environ.get(KEYS_ENV)
        self.keys: KeyFile | None = None
        if path:
            secret = server_secret()
            if secret is None:
                raise RuntimeError("TenantGateway needs $KVRAG_SERVER_SECRET (serve sets one)")
            self.secret = secret
            self.keys = KeyFile.load(path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.hooked:
            self._hook(scope)
        path = scope.get("path", "")
        if self.keys is None or scope.get("type") != "http" or not path.startswith(_GUARDED):
            await self.app(scope, receive, send)
            return
        grant = self.keys.keys.get(_bearer(scope))
        if grant is None and self.keys.anonymous == "none":
            await _answer(send, 401, {"error": "Unauthorized"})
            return
        if grant is None or scope.get("method") != "POST" or not path.endswith(_REWRITTEN):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            await _answer(send, 413, {"error": "request body too large"})
            return
        body = self.rewrite(body, grant)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)

    def _hook(self, scope: Scope) -> None:
        """Install the detection of stored passages on the server's engine client
        (at startup: the lifespan event comes after vLLM set up its app state)."""
        state = getattr(scope.get("app"), "state", None)
        engine_client = getattr(state, "engine_client", None)
        if engine_client is None:
            return
        self.hooked = True
        if os.environ.get(DETECT_ENV, "1") == "0":
            return
        try:
            install(engine_client)
        except Exception:  # the server still serves, as plain vLLM with the connector
            logger.exception("kvrag: detection of stored passages not installed")

    def rewrite(self, body: bytes, grant: Grant) -> bytes:
        """The body of a keyed request with its tenant's grant and salt."""
        try:
            data = json.loads(body)
        except ValueError:
            return body  # vLLM answers a body that is not JSON
        if not isinstance(data, dict):
            return body
        tenant = (
            Tenant.of_key_namespace(grant.namespace, self.secret) if grant.namespace else Tenant()
        )
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


async def _answer(send: Send, status: int, content: dict[str, Any]) -> None:
    payload = json.dumps(content).encode()
    length = str(len(payload)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
