"""What runs in vLLM's OpenAI API server process, around vLLM's own routes.

- ``gateway``: the door every HTTP request passes (ASGI middleware): keys,
  refusals of bad input, and the request's ``Admission``, made once.
- ``startup``: installs ``reuse_hook`` on the server's engine client.
- ``reuse_hook``: every request that reaches the model: its admission signed
  into what the connector reads, its salt, and (``detection``) the stored
  passages found in its token ids.
- ``command``: the command that starts vLLM's server with all of it
  (``python -m kvrag_integrations.vllm.serve`` runs it).
"""
