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
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.params import PARAMS_KEY, TransferParams
from kvrag_integrations.vllm.trust import (
    ROLES,
    Grant,
    Tenant,
    key_digest,
    request_salt,
    server_secret,
)

logger = logging.getLogger(__name__)

KEYS_ENV = "KVRAG_TENANT_KEYS"
"""The path of the key file (``serve --tenant-keys`` sets it for vLLM's processes)."""

OPEN_ROUTES = frozenset({"/health", "/ping", "/metrics", "/version"})
"""The routes that need no key: they reach no model. Every other one does."""
_REWRITTEN = ("/completions", "/chat/completions", "/responses", "/invocations")
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


class KeyRing:
    """The key file as it is now: read again when it changes, so that a key taken
    out of it is revoked at once (in the gateway, and for the grants the
    connector and the hook check: ``__call__`` is a ``trust.KeyLookup``).

    A file that no longer parses admits nobody (logged): a revoked key never
    counts again because of a typo.
    """

    def __init__(self, path: str | os.PathLike[str], secret: bytes) -> None:
        self.path = Path(path)
        self.secret = secret
        self._stamp: tuple[int, int, int] | None = None
        self._file = KeyFile.load(self.path)  # a bad file fails at start
        self._by_digest = self._digests(self._file)
        self._stamp = self._stat()

    @classmethod
    def from_env(cls) -> KeyRing | None:
        """The key file ``serve --tenant-keys`` named (None: none, or no secret)."""
        path, secret = os.environ.get(KEYS_ENV), server_secret()
        return cls(path, secret) if path and secret is not None else None

    def current(self) -> KeyFile:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._file = KeyFile.load(self.path)
            except (OSError, ValueError) as exc:
                logger.error("kvrag: key file %s unreadable, nobody admitted: %s", self.path, exc)
                self._file = KeyFile({}, "none")
            self._by_digest = self._digests(self._file)
        return self._file

    def grant(self, key: str) -> Grant | None:
        """The grant of an API key (bound to it by its digest; None: not listed)."""
        listed = self.current().keys.get(key) if key else None
        if listed is None:
            return None
        return Grant(listed.namespace, listed.role, key_digest(key, self.secret))

    def __call__(self, digest: str) -> Grant | None:
        self.current()
        return self._by_digest.get(digest)

    def _digests(self, file: KeyFile) -> dict[str, Grant]:
        return {key_digest(k, self.secret): g for k, g in file.keys.items()}

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)


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
