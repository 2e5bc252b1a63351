"""Serve it on vLLM: the package's chunk caches reused by a vLLM engine or server.

- ``KVRAGConnector`` (``kvrag_integrations.vllm.connector``): vLLM's KV-connector
  (v1) that saves chunk caches vLLM prefills and writes stored ones into its
  paged cache, keys moved to their positions (TurboRAG). Loaded by vLLM from
  ``transfer_config(...)``.
- ``VLLMEngine``: ``KVRAGEngine``'s methods and results on vLLM, in process or
  as the client of a running OpenAI server started with the connector; the
  LangChain and LlamaIndex classes take it as they take ``KVRAGEngine``.

Importing this package does not import vLLM: a client of a server needs only
the package and the model's tokenizer.
"""

from kvrag_integrations.vllm.config import transfer_config, transfer_config_json
from kvrag_integrations.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine", "transfer_config", "transfer_config_json"]
