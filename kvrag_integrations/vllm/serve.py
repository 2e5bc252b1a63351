"""``python -m kvrag_integrations.vllm.serve``: the command that starts vLLM's OpenAI
server with the connector (its code: ``server.serve``)."""

from kvrag_integrations.vllm.server.serve import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
