"""Installs the server's hook on its engine client at startup (vLLM's ``--middleware``).

``serve`` adds this ASGI middleware beside the gateway (outside it: it runs
first). vLLM builds the app before it sets up the engine client, so the hook
(``install``) is installed at the first event that sees it: the lifespan
startup. From then on every route that reaches the model passes the hook:
each request's admission is signed into what the connector reads and its salt
set, and, unless ``serve --no-detect``, stored passages are found in plain
clients' requests. It leaves the server's policy in the app's state, where the
gateway makes each request's admission by it. A hook that cannot be installed
stops the server: it would serve every request unsalted.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvrag_integrations.vllm.config import CONNECTOR_CLASS, ConnectorSettings
from kvrag_integrations.vllm.server.detection import Detector
from kvrag_integrations.vllm.server.gateway import (
    OPEN_METRICS_STATE,
    POLICY_STATE,
    ASGIApp,
    Receive,
    Scope,
    Send,
)
from kvrag_integrations.vllm.server.reuse_hook import Forget, ReuseHook
from kvrag_integrations.vllm.trust import Tenant

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
            hook = install(engine_client)
        except Exception:
            logger.exception("kvrag: the server's hook is not installed: the server stops")
            raise
        settings = _settings(engine_client)
        if hook is not None and settings is not None:
            setattr(state, POLICY_STATE, hook.policy)
            setattr(state, OPEN_METRICS_STATE, settings.open_metrics)


def install(engine_client: Any) -> ReuseHook | None:
    """Wrap ``engine_client.generate`` (vLLM's ``EngineClient`` of the OpenAI server)
    with a ``ReuseHook`` configured from its own connector settings (detection
    only where they ask for it); None where it serves without our connector.
    Idempotent."""
    hook = getattr(engine_client, "_kvrag_reuse_hook", None)
    if hook is not None:
        return hook
    from kvrag_integrations.vllm.keys import KeyRing

    _log_beside_vllm()
    settings = _settings(engine_client)
    if settings is None:
        return None
    config = engine_client.vllm_config
    policy = settings.policy(KeyRing.from_env())
    if policy.secret is None:
        logger.error("kvrag: no $KVRAG_SERVER_SECRET: requests are salted, nothing is reused")
    detector, forget = _detector(config, settings) if settings.detect else (None, None)
    hook = ReuseHook(engine_client.generate, detector, policy, forget=forget)
    engine_client.generate = hook.generate
    engine_client._kvrag_reuse_hook = hook
    if detector is not None:
        indexed = len(detector.index)  # type: ignore[arg-type]
        logger.info("kvrag: finds stored passages in plain requests (%d entries indexed)", indexed)
    return hook


def _settings(engine_client: Any) -> ConnectorSettings | None:
    """The connector's settings in the server's vLLM config (None: it serves without
    our connector)."""
    transfer = engine_client.vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector != CONNECTOR_CLASS:
        return None
    return ConnectorSettings.from_extra(transfer.kv_connector_extra_config)


def _detector(config: Any, settings: Any) -> tuple[Detector, Forget]:
    """The detector over the connector's store, and what drops a private entry
    there (every rank's)."""
    from kvrag_integrations.chunk_kv import cache_key
    from kvrag_integrations.matching import SyncedIndex, index_log_for
    from kvrag_integrations.store import open_store
    from kvrag_integrations.vllm.identity import connector_fingerprints

    fingerprints = connector_fingerprints(config, settings.cache_precision)
    store = open_store(settings.store)
    index = SyncedIndex(index_log_for(store))  # the store's own connection
    index.refresh()  # what replicas and earlier runs stored, before the first request
    detector = Detector(
        index,
        store.contains,
        fingerprints[0],
        max_entry_tokens=settings.max_entry_tokens,
        learn_min_tokens=settings.learn_min_tokens,
        control_ids=_control_ids(config),
    )

    def forget(tenant: Tenant, ids: Sequence[int]) -> None:
        for fingerprint in fingerprints:
            store.delete(cache_key(tenant.fingerprint(fingerprint), list(ids)))

    return detector, forget


def _control_ids(config: Any) -> frozenset[int]:
    """The served model's special token ids (``detection.markup_after``); none where
    its tokenizer cannot be read here."""
    try:
        from transformers import AutoTokenizer

        name = config.model_config.tokenizer
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
        return frozenset(tokenizer.all_special_ids) | frozenset(tokenizer.added_tokens_decoder)
    except Exception:  # a tokenizer transformers cannot load: the check is off
        logger.warning("kvrag: the model's control tokens are unknown; markup is not checked")
        return frozenset()


def _log_beside_vllm() -> None:
    """This package's log lines in the server's log, through vLLM's own handlers, at
    ``$KVRAG_LOG_LEVEL`` (default INFO; DEBUG: why each request was or was not planned)."""
    package = logging.getLogger("kvrag_integrations")
    if package.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)  # (vLLM's own filter at its level)
    for theirs in logging.getLogger("vllm").handlers:
        handler.setFormatter(theirs.formatter)
    package.addHandler(handler)
    package.setLevel(os.environ.get("KVRAG_LOG_LEVEL", "INFO").upper())
    package.propagate = False
