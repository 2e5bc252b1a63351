"""What the connector lets a request do: its tenant, its salt, its rights.

The connector serves whoever reaches the server, so nothing a request says is
taken on trust (docs/deployment.md, "On vLLM", has the threat model). Neither
vLLM nor torch is imported here: the OpenAI gateway (``gateway``), the
connector's scheduler side and ``VLLMEngine`` clients all apply these rules.

- **Tenants.** A request belongs to one namespace of entries: the shared one
  (no salt, no key), the one of its ``cache_salt`` (vLLM's own tenant
  isolation; a secret its holders share), or the one an API key maps to (the
  gateway signs that as a ``grant``, bound to the key: a revoked key's grants
  stop counting). Entries are keyed by the namespace, so a request can read,
  and learn of, only its own namespace's entries. A namespace id says its
  kind (``store.namespaces``: ``key-``, ``salt-``, and ``private-`` for one
  anonymous request's own entries), which the store's budget reads to give
  each tenant its own quota (``store.quotas``).
- **Anonymous callers share nothing but what writers stored.** A request with
  neither key nor salt reads the shared namespace (ingested chunks and
  documents) under a salt of its own (``Grant.anonymous``: vLLM's prefix cache
  shares none of its blocks), and the server learns nothing from it
  (``ClientPolicy.may_learn``): no caller can tell what another sent. Sharing
  learned prompts and prefix blocks between anonymous callers is the operator's
  opt-in (``share_anonymous``), for one trusted team.
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
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.store.namespaces import KEY, NAMESPACE_MARK, PRIVATE, SALT, namespace_id

TURBO_SALT_PREFIX = "kvrag-turbo-"
ANON_SALT_PREFIX = "kvrag-anon-"
"""The salt of an anonymous request's own exact blocks (a nonce per request)."""
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
        return cls(namespace_id(SALT, salt), salt)

    @classmethod
    def of_key_namespace(cls, name: str, secret: bytes) -> Tenant:
        """The tenant an API key maps to: entries keyed by the namespace's name (so
        replicas sharing a store and the key file share them), its salt derived
        from the server's secret (no client can send it)."""
        salt = "kvrag-ns-" + hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:32]
        return cls(namespace_id(KEY, name), salt)

    @classmethod
    def of_anonymous_request(cls, nonce: str) -> Tenant:
        """The tenant of one anonymous request's own entries (its private prefix, its
        glue), under its own salt (``Grant.anonymous``'s nonce): a namespace no
        other request can name, whose entries the store's budget counts in the
        private pool, never in the shared namespace's quota (``store.quotas``)."""
        return cls(namespace_id(PRIVATE, nonce), ANON_SALT_PREFIX + nonce)

    def fingerprint(self, base: str) -> str:
        """The storage fingerprint of this tenant's entries under ``base``."""
        return base if not self.namespace else f"{base}{NAMESPACE_MARK}{self.namespace}"


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
    """What the server vouches for, signed with its secret (a grant that does not
    verify is ignored: the request is then anonymous).

    Attributes:
        namespace: the namespace of the request's entries.
        role: what it may do (``ROLES``).
        key: the digest of the API key it came with (``key_digest``): the grant
            counts only while that key is in the key file with this namespace and
            role (``ClientPolicy.keys``). "": an anonymous request's grant.
        nonce: an anonymous request's own salt (``ANON_SALT_PREFIX`` + nonce): the
            gateway's no key grant; "" for a key's grant.
    """

    namespace: str
    role: str
    key: str = ""
    nonce: str = ""

    @classmethod
    def anonymous(cls, role: str) -> Grant:
        """The grant of one anonymous request: the shared namespace's entries, a
        salt of its own."""
        return cls("", role, "", secrets.token_hex(16))

    def tenant(self, secret: bytes) -> Tenant:
        if self.nonce:
            return Tenant("", ANON_SALT_PREFIX + self.nonce)
        if not self.namespace:  # a key of the shared namespace
            return Tenant()
        return Tenant.of_key_namespace(self.namespace, secret)

    def _mac(self, secret: bytes) -> str:
        fields = [self.namespace, self.role, self.key, self.nonce]
        text = json.dumps(fields, separators=(",", ":"))
        return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()

    def signed(self, secret: bytes) -> dict[str, str]:
        raw = {"namespace": self.namespace, "role": self.role, "mac": self._mac(secret)}
        if self.key:
            raw["key"] = self.key
        if self.nonce:
            raw["nonce"] = self.nonce
        return raw

    @classmethod
    def verified(cls, raw: Any, secret: bytes | None) -> Grant | None:
        """The grant in ``raw`` if its signature holds (None otherwise)."""
        if secret is None or not isinstance(raw, Mapping):
            return None
        namespace, role, mac = raw.get("namespace"), raw.get("role"), raw.get("mac")
        key, nonce = raw.get("key", ""), raw.get("nonce", "")
        fields = (namespace, mac, key, nonce)
        if role not in ROLES or not all(isinstance(f, str) for f in fields):
            return None
        if nonce and (key or namespace):  # an anonymous grant names no key nor namespace
            return None
        grant = cls(namespace, role, key, nonce)
        return grant if hmac.compare_digest(grant._mac(secret), mac) else None


def key_digest(key: str, secret: bytes) -> str:
    """What a grant names its API key by (keyed by the server's secret: a grant in a
    log tells nothing of the key)."""
    return hmac.new(secret, b"key|" + key.encode(), hashlib.sha256).hexdigest()[:32]


KeyLookup = Callable[[str], "Grant | None"]
"""The key file's current grant of a key digest (None: no such key, or revoked)."""


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
        share_anonymous: anonymous callers share one namespace for what the server
            learns, and vLLM's prefix blocks (an opt-in: each can then tell
            what another sent; for one trusted team).
        keys: the key file's current grants by key digest (None: no key file:
            no key's grant counts). A grant counts only while its key maps to
            the same namespace and role there.
    """

    trusted: bool = False
    client_role: str = "write"
    max_entry_tokens: int = 4096
    secret: bytes | None = None
    share_anonymous: bool = False
    keys: KeyLookup | None = None

    def grant(self, raw: Any) -> Grant | None:
        """The verified grant in ``raw``: signed with the server's secret and, for a
        key's grant, of a key the key file still holds alike."""
        grant = Grant.verified(raw, self.secret)
        if grant is None or grant.nonce:
            return grant
        current = self.keys(grant.key) if self.keys is not None and grant.key else None
        if current is None or (current.namespace, current.role) != (grant.namespace, grant.role):
            return None  # revoked, changed, or no key at all
        return grant

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
        verified = self.grant(grant)
        if verified is not None and self.secret is not None:
            return verified.tenant(self.secret), verified.role
        if tenant:
            return Tenant.of_salt(tenant), role
        return Tenant.of_salt(None if loads else cache_salt), role

    def may_learn(self, tenant: Tenant, role: str) -> bool:
        """Whether the server may store what a request of ``tenant`` sent without
        asking (learned prompts, glue, remainders): only in a tenant's own
        namespace (a key's or a salt's), never in the shared one, where every
        caller would find it, unless anonymous callers share by the operator's
        choice."""
        return role != "read" and (bool(tenant.namespace) or self.share_anonymous)

    def isolates(self, tenant: str, grant: Any, cache_salt: str | None, loads: bool) -> bool:
        """Whether a request is anonymous (no verified grant, no tenant salt of its
        own: a load's ``cache_salt`` names none) and gets a salt of its own
        (``Grant.anonymous``)."""
        if self.trusted or self.share_anonymous or self.secret is None:
            return False
        own = tenant or (None if loads else cache_salt)
        return not own and self.grant(grant) is None
