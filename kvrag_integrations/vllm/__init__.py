"""Serve it on vLLM: the package's chunk caches reused by a vLLM engine or server.

Split by the process each part runs in:

- ``connector/``: inside vLLM's engine and workers. ``KVRAGConnector``, vLLM's
  KV-connector (v1), saves the chunk caches vLLM prefills and writes stored
  ones into its paged cache, keys moved to their positions (TurboRAG). vLLM
  loads it from ``transfer_config(...)``.
- ``server/``: in vLLM's OpenAI API server, around its routes: the gateway
  (keys, bad input, each request's admission), the hook on the engine client
  and the detection of stored passages in plain clients' requests; ``serve``
  starts it all.
- ``client/``: in the user's process. ``VLLMEngine``: ``KVRAGEngine``'s methods
  and results on vLLM, in process or as the client of a running server; the
  LangChain and LlamaIndex classes take it as they take ``KVRAGEngine``.

What all three read stays here: ``config`` (the settings and every default),
``params`` (what a request tells the connector), ``trust`` (tenants, salts,
roles), ``admission`` (each request's admission, made where it enters),
``keys`` (the operator's key file), ``identity`` (what entries are keyed by)
and ``launch`` (the one recipe vLLM is started by).

Importing this package does not import vLLM: a client of a server needs only
the package and the model's tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag_integrations.lazy_exports import lazy_exports

# Imported on first use (PEP 562), as the package's top level does: vLLM's
# launcher and processes import ``server/`` and ``connector/`` without the client.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "kvrag_integrations.vllm.client.vllm_engine": ("VLLMEngine",),
    "kvrag_integrations.vllm.config": ("transfer_config", "transfer_config_json"),
}

if TYPE_CHECKING:
    from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine
    from kvrag_integrations.vllm.config import transfer_config, transfer_config_json

__all__ = ["VLLMEngine", "transfer_config", "transfer_config_json"]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
