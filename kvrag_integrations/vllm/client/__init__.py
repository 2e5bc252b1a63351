"""What runs in the user's process: ``VLLMEngine`` and the vLLM it talks to.

``vllm_engine.VLLMEngine`` (``KVRAGEngine``'s methods on vLLM) plans its
requests' loads itself (``turbo``), scores documents (``scoring``), and sends
them through a ``backend``: vLLM in this process (``local``) or a running
OpenAI server (``remote``), made by ``start``. None of it imports vLLM at load.
"""
