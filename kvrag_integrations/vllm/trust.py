"""What the connector lets a request do: its tenant, its salt, its rights.

The connector serves whoever reaches the server, so nothing a request says is
taken on trust (docs/deployment.md, "On vLLM", has the threat model). Neither
vLLM nor torch is imported here: the OpenAI gateway (``gateway``), the
connector's scheduler side and ``VLLMEngine`` clients all apply these rules.

- **Tenants.** A request belongs to one namespace of entries: the shared one
  (no salt, no key), the one of its ``cache_salt`` (vLLM's own tenant
  isolation; a secret its holders share), or the one an API key maps to (the
  gateway signs that as a ``grant``). Entries are keyed by the namespace, so a
  request can read, and learn of, only its own namespace's entries.
- **Salts.** A request loads stored pieces only when its ``cache_salt`` is the
  one derived here from its tenant and its load layout (``request_salt``):
  vLLM's prefix cache then keeps the approximate blocks a load leaves apart
  from every exact request, whatever the client sends. Any other request loads
  nothing and is computed exactly.
- **Entries mean one thing.** A request may store only its whole prompt, as one
  entry computed from position 0 with nothing loaded and no approximate block
  in reach (its salt is its tenant's exact one). Overwriting needs the admin
  role; a read-only role stores nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.errors import TransferParamsError

TURBO_SALT_PREFIX = "kvrag-turbo-"
"""Every salt of a request that loads stored pieces starts with this; no tenant's
exact salt may (so an exact request never shares vLLM's prefix blocks with one)."""

ROLES = ("read", "write", "admin")
"""``read``: reuse only; ``write``: reuse, and store prompts as their own entries
(chunk encoding); ``admin``: also overwrite entries."""

SECRET_ENV = "KVRAG_SERVER_SECRET"
"""The secret the gateway signs grants with and the connector checks them by
(``serve`` makes one per launch where it is unset; every process of one vLLM
server inherits it)."""


@dataclass(frozen=True)
class Tenant:
    """A namespace of entries and the salt of its exact requests.

    Attributes:
        namespace: what entry keys are scoped by ("" : the shared namespace).
        salt: the ``cache_salt`` of the tenant's exact requests (None: none).
    """

    namespace: str = ""
    salt: str | None = None

    @classmethod
    def of_salt(cls, salt: str | None) -> Tenant:
        """The tenant of a client's own ``cache_salt`` (None or "": the shared one).

        Raises:
            TransferParamsError: a salt in the turbo salts' space.
        """
        if not salt:
            return cls()
        if not isinstance(salt, str) or salt.startswith(TURBO_SALT_PREFIX):
            raise TransferParamsError(f"a tenant's salt must not start with {TURBO_SALT_PREFIX!r}")
        return cls(_digest("salt", salt), salt)

    @classmethod
    def of_key_namespace(cls, name: str, secret: bytes) -> Tenant:
        """The tenant an API key maps to: entries keyed by the namespace's name (so
        replicas sharing a store and the key file share them), its salt derived
        from the server's secret (no client can send it)."""
        salt = "kvrag-ns-" + hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:32]
        return cls(_digest("key", name), salt)

    def fingerprint(self, base: str) -> str:
        """The storage fingerprint of this tenant's entries under ``base``."""
        return base if not self.namespace else f"{base}+ns-{self.namespace}"


def _digest(kind: str, name: str) -> str:
    # Key namespaces and salt namespaces never meet: a client cannot name a key's.
    return hashlib.sha256(f"{kind}|{name}".encode()).hexdigest()[:24]


def request_salt(tenant: Tenant, layout: Sequence[Sequence[Any]]) -> str | None:
    """The ``cache_salt`` a request of ``tenant`` must carry to load ``layout``
    (its load pieces as ``[start, rows, tail]``; empty: it loads nothing and
    carries the tenant's exact salt).

    A load's K/V depend on where its pieces start, not only on its tokens, so
    the salt hashes the layout (and the tenant): vLLM's prefix cache then
    shares blocks only between requests laid out alike.

    Examples:
        >>> request_salt(Tenant(), [])  # the shared namespace: exact, no salt
        >>> request_salt(Tenant(), [[0, 5, []]]).startswith(TURBO_SALT_PREFIX)
        True
        >>> a = request_salt(Tenant.of_salt("team-a"), [[0, 5, []]])
        >>> a != request_salt(Tenant(), [[0, 5, []]])
        True
    """
    if not layout:
        return tenant.salt
    text = json.dumps([tenant.salt or "", [list(p) for p in layout]], separators=(",", ":"))
    return TURBO_SALT_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:32]


# ------------------------------------------------------------------ grants
@dataclass(frozen=True)
class Grant:
    """What the gateway vouches for: the request came with an API key that maps to
    ``namespace`` with ``role``. Signed with the server's secret; a grant that does
    not verify is ignored (the request is then anonymous)."""

    namespace: str
    role: str

    def _mac(self, secret: bytes) -> str:
        text = json.dumps([self.namespace, self.role], separators=(",", ":"))
        return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()

    def signed(self, secret: bytes) -> dict[str, str]:
        return {"namespace": self.namespace, "role": self.role, "mac": self._mac(secret)}

    @classmethod
    def verified(cls, raw: Any, secret: bytes | None) -> Grant | None:
        """The grant in ``raw`` if its signature holds (None otherwise)."""
        if secret is None or not isinstance(raw, Mapping):
            return None
        namespace, role, mac = raw.get("namespace"), raw.get("role"), raw.get("mac")
        if not isinstance(namespace, str) or role not in ROLES or not isinstance(mac, str):
            return None
        grant = cls(namespace, role)
        return grant if hmac.compare_digest(grant._mac(secret), mac) else None


def server_secret() -> bytes | None:
    """The secret grants are signed with, from ``$KVRAG_SERVER_SECRET`` (None: unset:
    no grant verifies)."""
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


@dataclass(frozen=True)
class ClientPolicy:
    """What the connector lets requests do (from its settings).

    Attributes:
        trusted: every request comes from the operator's own code (``VLLMEngine``
            in process): admin rights, no grant needed.
        client_role: the role of a request without a verified grant.
        max_entry_tokens: the longest prompt a request may store as an entry.
        secret: the server's grant secret (None: no grant verifies).
    """

    trusted: bool = False
    client_role: str = "write"
    max_entry_tokens: int = 4096
    secret: bytes | None = None

    def tenant_and_role(
        self, tenant: str, grant: Any, cache_salt: str | None, loads: bool
    ) -> tuple[Tenant, str]:
        """A request's tenant and role: a verified grant's, else the client's own
        tenant salt (``tenant``, or the request's ``cache_salt`` where it loads
        nothing), else the shared namespace.

        Raises:
            TransferParamsError: a tenant salt in the turbo salts' space.
        """
        role = "admin" if self.trusted else self.client_role
        verified = Grant.verified(grant, self.secret)
        if verified is not None and self.secret is not None:
            if not verified.namespace:  # a key of the shared namespace
                return Tenant(), verified.role
            return Tenant.of_key_namespace(verified.namespace, self.secret), verified.role
        if tenant:
            return Tenant.of_salt(tenant), role
        return Tenant.of_salt(None if loads else cache_salt), role
