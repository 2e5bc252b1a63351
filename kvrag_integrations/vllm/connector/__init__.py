"""What runs inside vLLM's engine and workers: the KV connector.

vLLM loads ``KVRAGConnector`` by its module path (``config.CONNECTOR_MODULE``,
``connector.kv_connector``): one instance in the scheduler process
(``scheduler_side``: lookups, admission checks, per-step plans) and one in each
worker (``worker_side``, ``paged``: the paged cache in and out). ``messages``
is what the two tell each other. Only ``kv_connector`` imports vLLM at load;
``KVRAGConnector`` is also found here, by the module path of earlier releases
(``kvrag_integrations.vllm.connector``), without importing vLLM before it is
asked for.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KVRAGConnector":
        from kvrag_integrations.vllm.connector.kv_connector import KVRAGConnector

        return KVRAGConnector
    raise AttributeError(name)
