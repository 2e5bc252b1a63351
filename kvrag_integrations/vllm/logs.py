"""This package's log lines in a vLLM server's log, in every one of its processes.

vLLM configures its own ``vllm`` logger in each process it starts (the API
server, the engine core with the scheduler, each worker); a logger of ours has
no handler there, and Python's last resort prints warnings only: the
connector's own start line and every INFO line of the scheduler and the
workers (a tenant's writes refused by the store's budget among them) were lost.
``log_beside_vllm`` gives the package's logger a handler with vLLM's format in
the process that calls it: the API server's hook at startup, the connector in
the engine's processes.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "KVRAG_LOG_LEVEL"


def log_beside_vllm(unless_configured: bool = False) -> None:
    """This package's log lines in the server's log, through vLLM's own handlers, at
    ``$KVRAG_LOG_LEVEL`` (default INFO; DEBUG: why each request was or was not planned).

    ``unless_configured``: leave a process whose root logger has handlers as it is
    (the connector in a user's own process: its records go where the user sends
    them)."""
    package = logging.getLogger("kvrag_integrations")
    if package.handlers or (unless_configured and logging.getLogger().handlers):
        return
    handler = logging.StreamHandler(sys.stdout)  # (vLLM's own filter at its level)
    for theirs in logging.getLogger("vllm").handlers:
        handler.setFormatter(theirs.formatter)
    package.addHandler(handler)
    package.setLevel(os.environ.get(LEVEL_ENV, "INFO").upper())
    package.propagate = False
