"""What a stored entry's namespace is, read from its fingerprint alone.

A server keys each tenant's entries by the tenant's namespace: the storage
fingerprint of an entry ends with ``+ns-<namespace id>``
(``vllm.trust.Tenant.fingerprint``); the shared namespace's has no suffix. A
namespace id is ``<kind>-<digest>`` (``namespace_id``), its kind one of:

- ``key``: an API key's namespace (``Tenant.of_key_namespace``), one per
  namespace the key file names;
- ``salt``: a client ``cache_salt``'s (``Tenant.of_salt``): any client can name
  as many as it likes;
- ``private``: one request's own entries (``Tenant.of_request``: the private
  prefix and glue of an anonymous request, or of a key of the shared
  namespace), which that request alone reads. Its id names its owner (the
  anonymous callers, or the key) in its first ``OWNER_CHARS`` digest characters
  (``private_namespace_id``), so the budget bounds each owner's private entries
  together (``private_group``); they expire after ``PRIVATE_TTL_S``.

The store's budget (``quotas``) groups entries by what it reads here, so an
entry's group needs nothing but what ``KVStore.entries`` lists. An id of no
kind (a bare digest, as ids were before they named their kind) belongs to no
namespace a request reads any more.
"""

from __future__ import annotations

import hashlib
import re

NAMESPACE_MARK = "+ns-"  # what Tenant.fingerprint puts before a namespace id
SHARED_ID = ""  # the shared namespace's id (its fingerprint has no suffix)

SHARED = "shared"
KEY = "key"
SALT = "salt"
PRIVATE = "private"
KINDS = (KEY, SALT, PRIVATE)  # the kinds an id names (the shared namespace has none)

_DIGEST_CHARS = 24
OWNER_CHARS = 8  # of a private namespace id's digest: its owner's
PRIVATE_TTL_S = 600.0
"""How long a private entry lives unused: its request is long answered (a
server killed mid-request leaves its requests' private entries; they go)."""
_ID = re.compile(rf"({'|'.join(KINDS)})-[0-9a-f]{{{_DIGEST_CHARS}}}")


def namespace_id(kind: str, name: str) -> str:
    """The id of the namespace called ``name`` among those of ``kind``: the kind, then
    a digest of both (so ids of two kinds never meet: a salt cannot name a key's).

    Examples:
        >>> namespace_id("salt", "team-a")
        'salt-9a51e03850686e3a5c0fd28a'
        >>> namespace_kind(namespace_id("key", "team-a"))
        'key'
    """
    if kind not in KINDS:
        raise ValueError(f"a namespace's kind is one of {KINDS}, got {kind!r}")
    digest = hashlib.sha256(f"{kind}|{name}".encode()).hexdigest()[:_DIGEST_CHARS]
    return f"{kind}-{digest}"


def private_namespace_id(owner: str, nonce: str) -> str:
    """The id of one request's private namespace: its owner's digest, then the
    request's nonce's (a namespace id of kind ``private``).

    Examples:
        >>> a, b = private_namespace_id("anonymous", "1"), private_namespace_id("anonymous", "2")
        >>> namespace_kind(a), a != b, private_group(a) == private_group(b)
        ('private', True, True)
    """
    mine = hashlib.sha256(f"{PRIVATE}-owner|{owner}".encode()).hexdigest()[:OWNER_CHARS]
    rest = hashlib.sha256(f"{PRIVATE}|{nonce}".encode()).hexdigest()
    return f"{PRIVATE}-{mine}{rest[: _DIGEST_CHARS - OWNER_CHARS]}"


def private_group(namespace: str) -> str:
    """The id of the group a private namespace's entries count in: its owner's (the
    owner's digest, zeros after it)."""
    head = len(PRIVATE) + 1 + OWNER_CHARS
    return namespace[:head] + "0" * (_DIGEST_CHARS - OWNER_CHARS)


def expires_in(fingerprint: str | None) -> float | None:
    """How long an entry of ``fingerprint`` lives: ``PRIVATE_TTL_S`` for a private
    one (its request is long answered by then), else None (until evicted)."""
    return PRIVATE_TTL_S if namespace_kind(namespace_of(fingerprint)) == PRIVATE else None


def base_fingerprint(fingerprint: str) -> str:
    """The storage fingerprint without its namespace (what made the entry).

    Examples:
        >>> base_fingerprint("model+kv-float16+ns-salt-0123abcd"), base_fingerprint("m")
        ('model+kv-float16', 'm')
    """
    base, mark, _ = fingerprint.rpartition(NAMESPACE_MARK)
    return base if mark else fingerprint


def namespace_of(fingerprint: str | None) -> str | None:
    """The namespace id a storage fingerprint names (``""``: the shared one; None: an
    unreadable header).

    Examples:
        >>> namespace_of("model+ctx-sink:1+ns-salt-0123abcd"), namespace_of("model")
        ('salt-0123abcd', '')
    """
    if fingerprint is None:
        return None
    _, mark, namespace = fingerprint.rpartition(NAMESPACE_MARK)
    return namespace if mark else SHARED_ID


def namespace_kind(namespace: str | None) -> str | None:
    """``"shared"``, ``"key"``, ``"salt"`` or ``"private"``; None for an id of no kind
    (or None: an unreadable header).

    Examples:
        >>> namespace_kind(""), namespace_kind("0123456789abcdef01234567")
        ('shared', None)
    """
    if namespace is None:
        return None
    if namespace == SHARED_ID:
        return SHARED
    return namespace.split("-", 1)[0] if _ID.fullmatch(namespace) else None
