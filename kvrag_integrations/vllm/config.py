"""The server's settings (each default set here, once), and the ``--kv-transfer-config``.

vLLM loads the connector by module path from its ``KVTransferConfig``; our
settings ride in its ``kv_connector_extra_config``, where every process of the
server reads them: the connector's scheduler and workers, and in the OpenAI
API server the gateway and the hook. ``transfer_config`` writes the whole
value, for ``vllm.LLM(kv_transfer_config=...)`` and for the OpenAI server's
``--kv-transfer-config`` (``python -m kvrag_integrations.vllm.serve`` passes it
for you).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvrag_integrations.chunk_kv import DEFAULT_PRECISION, check_precision
from kvrag_integrations.errors import StoreURLError
from kvrag_integrations.store.quotas import DEFAULT_SHARE
from kvrag_integrations.vllm.admission import ClientPolicy
from kvrag_integrations.vllm.trust import KeyLookup, check_role, server_secret

CONNECTOR_CLASS = "KVRAGConnector"
CONNECTOR_MODULE = "kvrag_integrations.vllm.connector.kv_connector"
# vLLM's ``worker_extension_cls`` for blend, and the method vLLM's ``collective_rpc``
# calls on every worker at start: it hands the model to the connector.
WORKER_EXTENSION = "kvrag_integrations.vllm.connector.worker_extension.BlendWorkerExtension"
ATTACH_METHOD = "kvrag_attach_model"
# A worker's own memory tier in front of the shared store: hot entries are read
# from memory. Bounded, since vLLM sizes its KV cache from the memory left.
DEFAULT_MEMORY_TIER_BYTES = 512 * 2**20
# vLLM recomputes the blocks a connector could not load (instead of failing the
# request): a missing, corrupt or foreign entry is then a miss, never an error.
LOAD_FAILURE_POLICY = "recompute"
# What a caller without a listed API key may do (``trust.ROLES``): reuse, and store
# chunks it asks to encode.
DEFAULT_CLIENT_ROLE = "write"
# The longest prompt a request may store as one entry (a chunk, a template's
# head): bounds what one request writes.
DEFAULT_MAX_ENTRY_TOKENS = 4096
# The shortest prompt the OpenAI server stores whole so that its passages are found
# in later requests (``detection``): shorter ones are rarely a retrieval prompt.
DEFAULT_LEARN_MIN_TOKENS = 256
# The store's budget when none is given: sized from the store (``store.sizing``).
AUTO_BUDGET = "auto"
# What says "no budget": named, so that no default and no 0 means unbounded.
NO_BUDGET = "none"
# The share of the budget each group of namespaces may hold unless its keys say
# otherwise: the quotas' own default (``store.quotas.DEFAULT_SHARE``).
DEFAULT_NAMESPACE_SHARE = DEFAULT_SHARE
# What the server's reuse does for requests that name none: "turbo" (stored caches
# as they are) or "blend" (CacheBlend's recompute over them, in the workers; a
# request may then ask for turbo too). A turbo server refuses blend.
REUSE_MODES = ("turbo", "blend")
DEFAULT_REUSE = "turbo"


def parse_store_bytes(value: Any) -> int | str:
    """A store budget as the settings take it: bytes > 0, ``"auto"`` or ``"none"``
    (from an int, or a string such as ``"64000000"``, ``"auto"``, ``"none"``).

    Raises:
        ValueError: anything else, 0 included (it once meant "no budget": say ``none``).

    Examples:
        >>> parse_store_bytes("1000"), parse_store_bytes("auto"), parse_store_bytes(NO_BUDGET)
        (1000, 'auto', 'none')
    """
    if isinstance(value, str) and value.strip().lower() in (AUTO_BUDGET, NO_BUDGET):
        return value.strip().lower()
    try:
        number = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < 0:
        raise ValueError(f"max_store_bytes is bytes > 0, 'auto' or 'none', got {value!r}")
    if number == 0:
        raise ValueError(
            "max_store_bytes 0 no longer means no budget: give bytes, 'auto' (sized from "
            "the store, the default) or 'none' (unbounded)"
        )
    return number


@dataclass(frozen=True)
class ConnectorSettings:
    """How the connector stores entries.

    Attributes:
        store: the store URL (``disk:DIR`` or ``redis://host:port/db``), opened in
            every vLLM process: the scheduler checks what is stored, the workers
            read and write. It must be one they share; ``memory`` is refused.
        cache_precision: how entries are stored (``"float16"``, ``"bfloat16"``,
            ``"int8"`` or ``"model"``, as ``KVRAGEngine``'s ``cache_precision``).
        memory_tier_bytes: each worker's in-memory tier in front of the store
            (0: none).
        trusted_clients: every request comes from the operator's own code
            (``VLLMEngine.from_pretrained``, in this process): it may overwrite.
            Never for a server: its clients are anyone who reaches the port.
        client_role: what a request without an API key's grant may do:
            ``"write"`` (reuse, and store prompts as their own entries: chunk
            encoding), ``"read"`` (reuse only) or ``"admin"`` (also overwrite).
        max_store_bytes: the store's budget in bytes: least recently used
            entries are evicted to make room for a new one (the content index's
            log counts, and is compacted). ``"auto"`` (the default): sized from
            the store at start (``store.sizing.store_budget``); ``"none"``:
            unbounded (only where something else bounds the store).
        namespace_share: the share of the budget the shared namespace and each
            key's may hold (client salts and anonymous requests' own entries are
            in pools of their own: ``store.quotas``).
        namespace_quotas: key namespaces (ids: ``Tenant.namespace``) with their
            own quota in bytes (0: ``namespace_share``), from the key file's
            ``quota_bytes``.
        max_entry_tokens: the longest prompt a request may store as an entry.
        detect: the OpenAI server finds stored passages in plain clients' requests
            (``reuse_hook``), and the workers index what they store for it.
        learn_min_tokens: the shortest prompt the server stores whole to find its
            passages in later requests (0: it learns nothing from requests).
            It learns only into a tenant's own namespace (an API key's or a
            ``cache_salt``'s), unless ``share_anonymous``.
        share_anonymous: callers without a key or salt share what the server
            learns from them, and vLLM's prefix blocks (default False: each
            anonymous request reads only what writers stored, under a salt of
            its own). Any of them can then tell whether another sent a given
            text: for one trusted team only.
        open_metrics: vLLM's ``/metrics`` answers anyone (default False: only an
            admin key of the key file). Its counters move with every caller's
            requests (prefix-cache queries and hits among them): whoever reads
            them watches the server's aggregate traffic.
        reuse: ``"turbo"`` (default) or ``"blend"``: what the server's reuse does
            for requests that name none; ``"blend"`` (the workers recompute
            part of every load with vLLM's model, ``connector.blend``) lets a
            request ask for turbo too, a turbo server refuses blend.
    """

    store: str
    cache_precision: str = DEFAULT_PRECISION
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES
    trusted_clients: bool = False
    client_role: str = DEFAULT_CLIENT_ROLE
    max_store_bytes: int | str = AUTO_BUDGET
    namespace_share: float = DEFAULT_NAMESPACE_SHARE
    namespace_quotas: dict[str, int] = field(default_factory=dict)
    max_entry_tokens: int = DEFAULT_MAX_ENTRY_TOKENS
    detect: bool = True
    learn_min_tokens: int = DEFAULT_LEARN_MIN_TOKENS
    share_anonymous: bool = False
    open_metrics: bool = False
    reuse: str = DEFAULT_REUSE

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store.strip():
            raise StoreURLError("the KV connector needs a store URL (disk:DIR or redis://...)")
        if self.store.strip() == "memory":
            raise StoreURLError(
                "the KV connector's store must be shared by vLLM's scheduler and worker "
                "processes: use disk:DIR or redis://host:port/db, not memory"
            )
        check_precision(self.cache_precision)
        object.__setattr__(self, "max_store_bytes", parse_store_bytes(self.max_store_bytes))
        if not isinstance(self.namespace_share, (int, float)) or not 0 < self.namespace_share <= 1:
            raise ValueError(f"namespace_share is in (0, 1], got {self.namespace_share!r}")
        for name, quota in dict(self.namespace_quotas).items():
            if not isinstance(name, str) or isinstance(quota, bool) or not isinstance(quota, int):
                raise ValueError("namespace_quotas maps namespace ids to bytes")
            if quota < 0:
                raise ValueError(f"the quota of namespace {name!r} must be >= 0")
        counts = ("memory_tier_bytes", "max_entry_tokens", "learn_min_tokens")
        for name in counts:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("trusted_clients", "detect", "share_anonymous", "open_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false")
        check_role(self.client_role)
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {REUSE_MODES}, got {self.reuse!r}")

    def policy(self, keys: KeyLookup | None = None) -> ClientPolicy:
        """The rules the server's door admits requests by, and the connector checks
        admissions by (``keys``: the key file's current grants)."""
        return ClientPolicy(
            self.trusted_clients,
            self.client_role,
            self.max_entry_tokens,
            server_secret(),
            self.share_anonymous,
            keys,
        )

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read them from a ``kv_connector_extra_config``."""
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown KVRAGConnector settings {sorted(unknown)}")
        return cls(**extra)


def transfer_config(store: str, **settings: Any) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` for this package's connector, as a dict
    (``settings``: ``ConnectorSettings``' other fields).

    Examples:
        >>> config = transfer_config("disk:/srv/kv")
        >>> config["kv_connector"], config["kv_load_failure_policy"]
        ('KVRAGConnector', 'recompute')
        >>> transfer_config("memory")
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.StoreURLError: the KV connector's store must be shared by \
vLLM's scheduler and worker processes: use disk:DIR or redis://host:port/db, not memory
    """
    config = ConnectorSettings(store, **settings)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": asdict(config),
    }


def transfer_config_json(store: str, **settings: Any) -> str:
    """``transfer_config`` as the JSON the OpenAI server's ``--kv-transfer-config`` takes."""
    return json.dumps(transfer_config(store, **settings), separators=(",", ":"))
