"""``python -m kvrag_integrations.vllm.serve``: the command that starts vLLM's OpenAI
server with the connector (its code: ``server.command``)."""

from kvrag_integrations.vllm.server.command import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
