"""Installs the server's hook on its engine client at startup (vLLM's ``--middleware``).

``serve`` adds this ASGI middleware beside the gateway. vLLM builds the app
before it sets up the engine client, so the hook (``reuse_hook.install``) is
installed at the first event that sees it: the lifespan startup. From then on
every route that reaches the model passes the hook: anonymous requests get a
salt of their own, and, unless ``serve --no-detect``, stored passages are found
in plain clients' requests. Nothing else: keys and grants are the gateway's.
"""

from __future__ import annotations

import logging
from typing import Any

from kvrag_integrations.vllm.gateway import ASGIApp, Receive, Scope, Send
from kvrag_integrations.vllm.reuse_hook import install

logger = logging.getLogger(__name__)


class ReuseInstaller:
    """ASGI middleware that wraps the server's engine client once (``install``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.installed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.installed:
            self._install(scope)
        await self.app(scope, receive, send)

    def _install(self, scope: Scope) -> None:
        state = getattr(scope.get("app"), "state", None)
        engine_client: Any = getattr(state, "engine_client", None)
        if engine_client is None:
            return
        self.installed = True
        try:
            install(engine_client)
        except Exception:  # the server still serves, as plain vLLM with the connector
            logger.exception("kvrag: the server's hook is not installed")
