"""One admission per request: what it may do, decided once where it enters the server.

Where a request enters (the OpenAI server's gateway), its API key (or none),
its ``cache_salt``, the client's own params, the operator's ``--client-role``
and key file make one ``Admission`` (``ClientPolicy.admit``): its tenant, role,
salt, and where what it sends may be stored. It travels to the connector
signed with the server's secret; the server's hook, the scheduler side and the
workers read it and decide nothing again. The hook binds it, as it signs it,
to the engine request it rides with (a digest of its prompt's token ids) and
an expiry (``ADMISSION_TTL_S``): one API request's admission covers the
engine requests it makes (``n`` > 1, each step of a beam search), and no other.
The scheduler checks the signature at its process boundary
(``ClientPolicy.verified``), the binding, the expiry, and that the key it
names still maps to the same namespace and role.

**Anonymous callers share nothing but what writers stored.** A request with
neither key nor salt reads the shared namespace under a salt of its own (a
nonce: vLLM's prefix cache shares none of its blocks), and every text it brings
(glue between passages, a prefix before them) is stored for it alone: in a
private namespace of its own (``Admission.own``), under ids no one else can name,
never indexed, dropped after it. No caller can tell what another sent: a right
guess and a wrong one take the same path. Sharing learned prompts and prefix
blocks between anonymous callers is the operator's opt-in
(``share_anonymous``), for one trusted team.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.trust import (
    RESERVED_SALT_PREFIX,
    TURBO_SALT_PREFIX,
    Grant,
    KeyLookup,
    Tenant,
    check_role,
    ids_digest,
)

ADMISSION_TTL_S = 600.0
"""How long a signed admission counts: a request that waits longer in vLLM's queue
runs exactly (loads and stores nothing)."""
ANONYMOUS_OWNER = "anonymous"
"""The owner of anonymous requests' private entries (they share one bound)."""


@dataclass(frozen=True)
class Admission:
    """What one request may do, decided once where it enters the server
    (``ClientPolicy.admit``) and carried to the connector signed (``signed``,
    ``ClientPolicy.verified``). Its store quota group is the namespace an entry
    is stored in (``tenant``'s, or ``own``'s), which the store's budget reads
    off each entry's fingerprint.

    Attributes:
        tenant: the namespace the request reads (and stores in), and the salt of
            its exact requests.
        role: what it may do (``ROLES``).
        keeps: the server may store what the request sent without asking (its
            prompt, glue, a prefix, an unknown remainder) in ``tenant``'s
            namespace, where that tenant's later requests find it: a key's or a
            salt's namespace, or the shared one where anonymous callers share.
        own: where the texts it brings are stored for it alone (its private
            namespace: never indexed, dropped after it), where it may write but
            does not keep: an anonymous caller, a key of the shared namespace.
            None: it keeps, or stores nothing.
        key: the digest of its API key ("" : none); with ``name``, the key file's
            namespace name: the admission counts only while the key file maps
            that key to the same namespace and role.
        name: see ``key``.
        prompt: the digest of the prompt ids of the engine request it is signed
            for (``bound``).
        expires: when it stops counting (unix time; ``bound``).
    """

    tenant: Tenant
    role: str
    keeps: bool = False
    own: Tenant | None = None
    key: str = ""
    name: str = ""
    prompt: str = ""
    expires: float = 0.0

    def bound(self, prompt_ids: Sequence[int], now: float | None = None) -> Admission:
        """This admission for the engine request of ``prompt_ids``, until
        ``ADMISSION_TTL_S`` from now."""
        now = time.time() if now is None else now
        return replace(self, prompt=ids_digest(prompt_ids), expires=now + ADMISSION_TTL_S)

    def _fields(self) -> dict[str, Any]:
        own = _tenant_fields(self.own) if self.own is not None else None
        return {
            "tenant": _tenant_fields(self.tenant),
            "role": self.role,
            "keeps": self.keeps,
            "own": own,
            "key": self.key,
            "name": self.name,
            "prompt": self.prompt,
            "expires": self.expires,
        }

    def signed(self, secret: bytes) -> dict[str, Any]:
        """The admission as a request's params carry it, with its signature."""
        fields_ = self._fields()
        return {**fields_, "mac": _mac(fields_, secret)}

    @classmethod
    def verified(cls, raw: Any, secret: bytes | None) -> Admission | None:
        """The admission in ``raw`` if the server's secret signed it (None otherwise)."""
        if secret is None or not isinstance(raw, Mapping) or not isinstance(raw.get("mac"), str):
            return None
        fields_ = {k: v for k, v in raw.items() if k != "mac"}
        try:
            if not hmac.compare_digest(_mac(fields_, secret), raw["mac"]):
                return None
            own = fields_["own"]
            admission = cls(
                _tenant_of(fields_["tenant"]),
                check_role(fields_["role"]),
                bool(fields_["keeps"]),
                _tenant_of(own) if own is not None else None,
                str(fields_["key"]),
                str(fields_["name"]),
                str(fields_["prompt"]),
                float(fields_["expires"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        return admission


def _tenant_fields(tenant: Tenant) -> dict[str, Any]:
    return {f.name: getattr(tenant, f.name) for f in fields(tenant)}


def _tenant_of(raw: Any) -> Tenant:
    if not isinstance(raw, Mapping) or not all(
        isinstance(v, (str, type(None))) for v in raw.values()
    ):
        raise ValueError("not a tenant")
    return Tenant(**raw)


def _mac(fields_: Mapping[str, Any], secret: bytes) -> str:
    text = json.dumps(fields_, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def _own_tenant(owner: str) -> Tenant:
    """Where a request's own texts are stored, for it alone (a ``private-``
    namespace of ``owner``'s: the store's budget counts it in the private pool,
    with the owner's others, never in the shared namespace's quota)."""
    return Tenant.of_request(owner, secrets.token_hex(16))


@dataclass(frozen=True)
class ClientPolicy:
    """The operator's rules for requests (from the connector's settings).

    Attributes:
        trusted: every request comes from the operator's own code (``VLLMEngine``
            in process): admin rights, no signed admission needed.
        client_role: the role of a request without a listed key.
        max_entry_tokens: the longest prompt a request may store as an entry.
        secret: the server's signing secret (None: no admission verifies).
        share_anonymous: anonymous callers share one namespace for what the server
            keeps, and vLLM's prefix blocks (an opt-in: each can then tell what
            another sent; for one trusted team).
        keys: the key file's current grants by key digest (None: no key file: no
            key's admission counts). An admission counts only while its key maps
            to the same namespace and role there.
    """

    trusted: bool
    client_role: str
    max_entry_tokens: int
    secret: bytes | None
    share_anonymous: bool = False
    keys: KeyLookup | None = None

    def admit(
        self,
        grant: Grant | None,
        cache_salt: str | None,
        tenant_salt: str = "",
        role: str | None = None,
    ) -> Admission:
        """A request's admission where it enters: a listed key's ``grant``, else the
        client's own tenant salt (``tenant_salt``: a ``VLLMEngine`` client's, or
        its ``cache_salt`` where that is not a turbo salt, which names no tenant),
        else anonymous; ``role``: a keyless caller's (default ``client_role``).
        Fields such as ``user``, ``prompt_cache_key`` or ``safety_identifier`` are
        no salt: they are not secrets.

        Raises:
            TransferParamsError: a client salt in the server's salts' space.
        """
        salt = tenant_salt or (cache_salt if not _names_no_tenant(cache_salt) else "")
        if salt.startswith(RESERVED_SALT_PREFIX):  # (a salt the server makes, or a typo)
            raise TransferParamsError(
                f"a client's cache_salt must not start with {RESERVED_SALT_PREFIX!r}"
            )
        if grant is not None:
            role = grant.role
            if grant.namespace:  # its keys share its entries, and its prefix blocks
                tenant = Tenant.of_key_namespace(grant.namespace, self._secret())
                return Admission(tenant, role, role != "read", None, grant.key, grant.namespace)
            # a key of the shared namespace (a writer's): what it sends stays its own,
            # and its prefix blocks too (a salt of the key's own)
            holder = grant.holder or grant.key
            shared = Tenant.of_key_holder(holder, self._secret())
            own = _own_tenant(holder) if role != "read" else None
            return Admission(shared, role, False, own, grant.key)
        role = check_role(role or self.client_role)
        if salt:
            return Admission(Tenant.of_salt(salt), role, role != "read")
        if self.share_anonymous:
            return Admission(Tenant(), role, role != "read")
        own = _own_tenant(ANONYMOUS_OWNER)
        # its exact blocks under the salt of its own namespace: shared with no one
        exact = Tenant("", own.salt)
        return Admission(exact, role, False, own if role != "read" else None)

    def verified(
        self,
        raw: Any,
        prompt_ids: Sequence[int],
        tenant_salt: str = "",
        now: float | None = None,
    ) -> Admission:
        """The admission a request's params carry, checked where the connector reads
        it: signed by this server for this request (its ``prompt_ids``), not
        expired, and of a key the key file still holds alike (the operator's own
        code: ``trusted``, its tenant salt, admin).

        Raises:
            TransferParamsError: no admission this server signed, one signed for
                another request or expired, or of a revoked key.
        """
        if self.trusted:
            return Admission(Tenant.of_salt(tenant_salt), "admin")
        admission = Admission.verified(raw, self.secret)
        if admission is None:
            raise TransferParamsError("no admission signed by this server")
        if admission.prompt != ids_digest(prompt_ids):
            raise TransferParamsError("its admission was signed for another request")
        if (time.time() if now is None else now) > admission.expires:
            raise TransferParamsError("its admission has expired")
        if admission.key:
            current = self.keys(admission.key) if self.keys is not None else None
            if current is None or (current.namespace, current.role) != (
                admission.name,
                admission.role,
            ):
                raise TransferParamsError("its API key is no longer in the key file alike")
        return admission

    def _secret(self) -> bytes:
        if self.secret is None:
            raise TransferParamsError("the server has no secret to sign admissions with")
        return self.secret


def _names_no_tenant(cache_salt: str | None) -> bool:
    """A turbo salt (a load layout's) or none names no tenant."""
    return not cache_salt or cache_salt.startswith(TURBO_SALT_PREFIX)
