"""The operator's key file: API keys mapped to tenants and roles, read again when it changes.

``serve --tenant-keys FILE`` names it (``$KVRAG_TENANT_KEYS`` in every vLLM
process). The gateway looks a request's bearer key up in it where the request
enters; the connector's scheduler side checks, with the same file, that a key
an admission names still maps to the same namespace and role (a key taken out
of the file is revoked at once). The file (JSON)::

    {"keys": {"sk-team-a": {"namespace": "team-a", "role": "write"},
              "sk-ops": {"namespace": "", "role": "admin"}},
     "anonymous": "read"}

``namespace`` "" is the shared one; a key may add ``"quota_bytes": N``, the
most its namespace may hold in the store (the largest of its keys'; default: a
share of the budget, ``serve --namespace-share``); a key's ``role`` defaults to
``config.DEFAULT_CLIENT_ROLE``; ``anonymous``: the role of callers without a
listed key (``"none"``: they are refused), by default ``"read"`` where a key
writes the shared namespace (the shared namespace then has its writers, and a
stranger's write would count in its quota, able to evict what they ingested),
else ``config.DEFAULT_CLIENT_ROLE``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvrag_integrations.vllm.config import DEFAULT_CLIENT_ROLE
from kvrag_integrations.vllm.trust import ROLES, Grant, Tenant, key_digest, server_secret

logger = logging.getLogger(__name__)

KEYS_ENV = "KVRAG_TENANT_KEYS"
"""The path of the key file (``serve --tenant-keys`` sets it for vLLM's processes)."""


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
            if not isinstance(entry, dict) or entry.get("role", DEFAULT_CLIENT_ROLE) not in ROLES:
                raise ValueError(f"{path}: each key has a namespace and a role of {ROLES}")
            namespace = entry.get("namespace", "")
            if not isinstance(namespace, str):
                raise ValueError(f"{path}: a namespace is a string")
            keys[str(key)] = Grant(namespace, entry.get("role", DEFAULT_CLIENT_ROLE))
            quota = entry.get("quota_bytes")
            if quota is not None:
                if isinstance(quota, bool) or not isinstance(quota, int) or quota <= 0:
                    raise ValueError(f"{path}: quota_bytes is a number of bytes > 0")
                quotas[namespace] = max(quota, quotas.get(namespace, 0))
        # Where keys write the shared namespace, strangers only read it unless the
        # file says otherwise: their writes would count in its quota, beside (and
        # able to evict) what its writers ingested.
        shared_writers = any(g.namespace == "" and g.role != "read" for g in keys.values())
        anonymous = raw.get("anonymous", "read" if shared_writers else DEFAULT_CLIENT_ROLE)
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
        digest = key_digest(key, self.secret)
        return Grant(listed.namespace, listed.role, digest, digest)

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


def namespace_quotas(keys: KeyFile) -> dict[str, int]:
    """The connector's ``namespace_quotas``: every key namespace (by its id: the
    digest its entries are keyed by) with its keys' quota (0: the default share)."""
    secret = b"ids-do-not-depend-on-it"  # a namespace's id is not keyed by the secret
    quotas = {}
    for grant in keys.keys.values():
        name = grant.namespace
        tenant_id = Tenant.of_key_namespace(name, secret).namespace if name else ""
        quotas[tenant_id] = keys.quotas.get(name, 0)
    return quotas


API_KEYS_ENV = "KVRAG_API_KEYS"
"""The SHA-256 digests of vLLM's ``--api-key`` keys, a JSON list (``serve`` sets it):
the gateway guards every route by them, not only vLLM's ``/v1`` ones."""


class ApiKeys:
    """vLLM's ``--api-key`` keys (and ``$VLLM_API_KEY``), by digest: whoever holds one
    passes the gateway as a caller of the shared namespace."""

    def __init__(self, digests: set[bytes]) -> None:
        self.digests = digests

    @classmethod
    def from_env(cls) -> ApiKeys | None:
        """The keys ``serve`` passed (``$KVRAG_API_KEYS``) and ``$VLLM_API_KEY``
        (None: neither)."""
        digests = {bytes.fromhex(d) for d in json.loads(os.environ.get(API_KEYS_ENV) or "[]")}
        if os.environ.get("VLLM_API_KEY"):
            digests.add(hashlib.sha256(os.environ["VLLM_API_KEY"].encode()).digest())
        return cls(digests) if digests else None

    @staticmethod
    def digest_of(key: str) -> str:
        """What ``$KVRAG_API_KEYS`` lists for ``key``."""
        return hashlib.sha256(key.encode()).hexdigest()

    def holds(self, key: str) -> bool:
        digest = hashlib.sha256(key.encode()).digest()
        found = False
        for known in self.digests:  # (every one compared: the time says nothing)
            found |= hmac.compare_digest(digest, known)
        return found
