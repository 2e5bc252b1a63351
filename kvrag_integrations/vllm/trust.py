"""Tenants, salts and roles: what the server's rules are made of.

The server serves whoever reaches it, so nothing a request says is taken on
trust (docs/deployment.md, "The server trusts no client", has the threat
model). Each request's rights are decided once where it enters, from these
(``admission``). Neither vLLM nor torch is imported here.

- **Tenants.** A request belongs to one namespace of entries: the shared one
  (what writers stored for every caller), the one of its ``cache_salt`` (vLLM's
  own tenant isolation; a secret its holders share), or the one an API key maps
  to. Entries are keyed by the namespace, so a request can read, and find out
  about, only its own namespace's entries. A namespace id says its kind
  (``store.namespaces``: ``key-``, ``salt-``, and ``private-`` for one
  request's own entries, named with their owner), which the store's budget
  reads to give each tenant its own quota (``store.quotas``).
- **Prefix caches.** vLLM's prefix cache is shared by the requests of one salt.
  The keys of one namespace of the key file share its salt (they share its
  entries: the key file says they share); every other key, a key of the
  shared namespace or one of ``--api-key``, has a salt of its own
  (``Tenant.of_key_holder``), and every anonymous request too.
- **Salts.** A request loads stored pieces only under the ``cache_salt``
  derived here from its tenant and its load layout (``request_salt``): vLLM's
  prefix cache then keeps the approximate blocks a load leaves apart from every
  exact request. Every request the server admits carries a salt the server set.
- **Roles.** ``read`` reuses, ``write`` may also store its whole prompt as one
  entry (chunk encoding), ``admin`` may also overwrite.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.store.namespaces import (
    KEY,
    NAMESPACE_MARK,
    SALT,
    namespace_id,
    private_namespace_id,
)

TURBO_SALT_PREFIX = "kvrag-turbo-"
"""Every salt of a request that loads stored pieces starts with this; no tenant's
exact salt may (so an exact request never shares vLLM's prefix blocks with one)."""
ANON_SALT_PREFIX = "kvrag-anon-"
"""The salt of an anonymous request's own exact blocks (a nonce per request)."""
KEY_SALT_PREFIX = "kvrag-key-"
"""The salt of a key of the shared namespace (``Tenant.of_key_holder``)."""
NAMESPACE_SALT_PREFIX = "kvrag-ns-"
"""The salt of a key namespace's requests (``Tenant.of_key_namespace``)."""
RESERVED_SALT_PREFIX = "kvrag-"
"""The server's salts start with this: a client's own ``cache_salt`` may not (but a
turbo salt a ``VLLMEngine`` client derived for its load layout, which names no
tenant and is replaced by the server's)."""

MAX_SALT_CHARS = 256
"""The longest salt a client may name (a ``cache_salt``, a tenant salt): a secret,
not a document."""

ROLES = ("read", "write", "admin")
"""``read``: reuse only; ``write``: reuse, and store prompts as their own entries
(chunk encoding); ``admin``: also overwrite entries. In this order: the first is
the strictest."""

SECRET_ENV = "KVRAG_SERVER_SECRET"
"""The secret admissions are signed with and the connector checks them by
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
        digest = hmac.new(secret, name.encode(), hashlib.sha256).hexdigest()[:32]
        return cls(namespace_id(KEY, name), NAMESPACE_SALT_PREFIX + digest)

    @classmethod
    def of_key_holder(cls, holder: str, secret: bytes) -> Tenant:
        """The tenant of a key of the shared namespace (the key file's, or one of
        ``--api-key``): the shared namespace, under a salt of the key's own
        (``holder``: its digest), so that no other caller shares its prefix blocks."""
        salt = hmac.new(secret, b"holder|" + holder.encode(), hashlib.sha256).hexdigest()[:32]
        return cls("", KEY_SALT_PREFIX + salt)

    @classmethod
    def of_request(cls, owner: str, nonce: str) -> Tenant:
        """The tenant of one request's own entries (its private prefix, its glue), under
        its own salt (the nonce ``admission`` draws for the request): a private
        namespace no other request can name, named with its ``owner`` (the
        anonymous callers', or a key's), whose entries the store's budget counts
        in the private pool with its owner's others (``store.quotas``), never in
        the shared namespace's quota."""
        return cls(private_namespace_id(owner, nonce), ANON_SALT_PREFIX + nonce)

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


def ids_digest(ids: Sequence[int]) -> str:
    """A short digest of token ids (what an admission is bound to, what a salt hashes
    of a long lead or tail).

    Examples:
        >>> ids_digest([1, 2, 3]) == ids_digest((1, 2, 3)) != ids_digest([1, 2])
        True
    """
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()[:32]


def stricter(a: str, b: str) -> str:
    """The stricter of two roles (``ROLES``' order).

    Examples:
        >>> stricter("write", "read"), stricter("admin", "write")
        ('read', 'write')
    """
    return min(check_role(a), check_role(b), key=ROLES.index)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


def key_digest(key: str, secret: bytes) -> str:
    """What an admission names its API key by (keyed by the server's secret: an
    admission in a log tells nothing of the key)."""
    return hmac.new(secret, b"key|" + key.encode(), hashlib.sha256).hexdigest()[:32]


def server_secret() -> bytes | None:
    """The secret admissions are signed with, from ``$KVRAG_SERVER_SECRET`` (None:
    unset: no admission is signed, and none verifies)."""
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


@dataclass(frozen=True)
class Grant:
    """What an API key grants: a namespace ("" : the shared one) and a role; ``key``:
    the digest of a key of the key file (``key_digest``: its admission counts while
    the file holds it alike), ``holder``: the digest of whoever holds the key (a key
    of the key file, or one of ``--api-key``: a key of the shared namespace has a
    prefix cache of its own by it)."""

    namespace: str
    role: str
    key: str = ""
    holder: str = ""


KeyLookup = Callable[[str], "Grant | None"]
"""The key file's current grant of a key digest (None: no such key, or revoked)."""
