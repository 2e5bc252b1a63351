"""The connector's settings, and the ``--kv-transfer-config`` that loads it into vLLM.

vLLM loads the connector by module path from its ``KVTransferConfig``; our
settings ride in its ``kv_connector_extra_config``. ``transfer_config`` writes
the whole value, for ``vllm.LLM(kv_transfer_config=...)`` and for the OpenAI
server's ``--kv-transfer-config`` (``python -m kvrag_integrations.vllm.serve``
passes it for you).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvrag_integrations.chunk_kv import check_precision
from kvrag_integrations.errors import StoreURLError

CONNECTOR_CLASS = "KVRAGConnector"
CONNECTOR_MODULE = "kvrag_integrations.vllm.connector"
# A worker's own memory tier in front of the shared store: hot entries are read
# from memory. Bounded, since vLLM sizes its KV cache from the memory left.
DEFAULT_MEMORY_TIER_BYTES = 512 * 2**20
# vLLM recomputes the blocks a connector could not load (instead of failing the
# request): a missing, corrupt or foreign entry is then a miss, never an error.
LOAD_FAILURE_POLICY = "recompute"


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
    """

    store: str
    cache_precision: str = "float16"
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store.strip():
            raise StoreURLError("the KV connector needs a store URL (disk:DIR or redis://...)")
        if self.store.strip() == "memory":
            raise StoreURLError(
                "the KV connector's store must be shared by vLLM's scheduler and worker "
                "processes: use disk:DIR or redis://host:port/db, not memory"
            )
        check_precision(self.cache_precision)
        tier = self.memory_tier_bytes
        if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
            raise ValueError(f"memory_tier_bytes must be an integer >= 0, got {tier!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read them from a ``kv_connector_extra_config``."""
        extra = dict(extra or {})
        unknown = set(extra) - {"store", "cache_precision", "memory_tier_bytes"}
        if unknown:
            raise ValueError(f"unknown KVRAGConnector settings {sorted(unknown)}")
        return cls(**extra)


def transfer_config(
    store: str,
    *,
    cache_precision: str = "float16",
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES,
) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` for this package's connector, as a dict.

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
    settings = ConnectorSettings(store, cache_precision, memory_tier_bytes)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": asdict(settings),
    }


def transfer_config_json(store: str, **settings: Any) -> str:
    """``transfer_config`` as the JSON the OpenAI server's ``--kv-transfer-config`` takes."""
    return json.dumps(transfer_config(store, **settings), separators=(",", ":"))
