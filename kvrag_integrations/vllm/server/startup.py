"""Installs the server's hook on its engine client at startup (vLLM's ``--middleware``).

``serve`` adds this ASGI middleware beside the gateway (outside it: it runs
first). vLLM builds the app before it sets up the engine client, so the hook
(``install``) is installed at the first event that sees it: the lifespan
startup. From then on every route that reaches the model passes the hook:
each request's admission is signed into what the connector reads and its salt
set, and, unless ``serve --no-detect``, stored passages are found in plain
clients' requests. It leaves the server's policy in the app's state, where the
gateway makes each request's admission by it. A hook that cannot be installed
stops the server (it would serve every request unsalted), and no request
passes before it is installed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

from kvrag_integrations.errors import UnsupportedModelError
from kvrag_integrations.vllm.config import ATTACH_METHOD, CONNECTOR_CLASS, ConnectorSettings
from kvrag_integrations.vllm.logs import log_beside_vllm
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
    """ASGI middleware that wraps the server's engine client once (``install``).

    No request reaches a route before the hook is installed: at the lifespan
    startup (a hook that cannot be installed fails the startup: the server
    stops), else at the first request that sees the engine client. A request
    that comes before the engine client exists, or after installing failed, is
    answered 503; a failure at a request stops the server too (``stop``). A
    server without our connector has nothing to install: every request passes.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.ready = False  # installed, or nothing to install
        self.failed = ""  # why installing failed: the server stops

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.ready and not self.failed:
            try:
                await self._install(scope)
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                logger.exception("kvrag: the server's hook is not installed: the server stops")
                if scope.get("type") != "lifespan":
                    self.stop()
        if scope.get("type") == "lifespan" and self.failed:
            await receive()  # lifespan.startup: answered failed (uvicorn exits)
            await send({"type": "lifespan.startup.failed", "message": self.failed})
            return
        if scope.get("type") in ("http", "websocket") and not self.ready:
            why = self.failed or "the server is starting"
            await _unavailable(scope, send, f"kvrag: the server's hook is not installed ({why})")
            return
        await self.app(scope, receive, send)

    async def _install(self, scope: Scope) -> None:
        state = getattr(scope.get("app"), "state", None)
        engine_client: Any = getattr(state, "engine_client", None)
        if engine_client is None:
            return
        hook = install(engine_client)
        settings = _settings(engine_client)
        if settings is not None:
            in_place = await attach_model(engine_client, settings.reuse == "blend")
            if hook is not None:
                hook.in_place = in_place
        if hook is not None and settings is not None:
            setattr(state, POLICY_STATE, hook.policy)
            setattr(state, OPEN_METRICS_STATE, settings.open_metrics)
        self.ready = True

    @staticmethod
    def stop() -> None:
        """Stop the server (uvicorn shuts down on SIGTERM)."""
        os.kill(os.getpid(), signal.SIGTERM)


async def _unavailable(scope: Scope, send: Send, message: str) -> None:
    if scope.get("type") == "websocket":
        await send({"type": "websocket.close", "code": 1013})  # try again later
        return
    payload = json.dumps({"error": {"message": message, "code": 503}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def install(engine_client: Any) -> ReuseHook | None:
    """Wrap ``engine_client.generate`` (vLLM's ``EngineClient`` of the OpenAI server)
    with a ``ReuseHook`` configured from its own connector settings (detection
    only where they ask for it); None where it serves without our connector.
    Idempotent."""
    hook = getattr(engine_client, "_kvrag_reuse_hook", None)
    if hook is not None:
        return hook
    from kvrag_integrations.vllm.keys import KeyRing

    settings = _settings(engine_client)
    if settings is None:
        return None
    log_beside_vllm()
    config = engine_client.vllm_config
    policy = settings.policy(KeyRing.from_env())
    if policy.secret is None:
        logger.error("kvrag: no $KVRAG_SERVER_SECRET: requests are salted, nothing is reused")
    detector, forget = _detector(config, settings) if settings.detect else (None, None)
    hook = ReuseHook(engine_client.generate, detector, policy, forget=forget, reuse=settings.reuse)
    engine_client.generate = hook.generate
    engine_client._kvrag_reuse_hook = hook
    if detector is not None:
        indexed = len(detector.index)  # type: ignore[arg-type]
        logger.info("kvrag: finds stored passages in plain requests (%d entries indexed)", indexed)
    return hook


async def attach_model(engine_client: Any, blend: bool) -> bool:
    """Hand each worker's model to the connector (vLLM's ``collective_rpc`` on the
    worker extension): blend's recompute, and an anonymous request's own texts
    computed in its load's step, run on it. Whether they can (on a turbo server
    that cannot, those texts are encoded and stored for the request instead).

    Raises:
        UnsupportedModelError: ``blend`` and blend cannot run on the served model
            (the server, started with ``--reuse blend``, stops saying why: it
            never serves turbo in blend's place).
    """
    try:
        reasons = await engine_client.collective_rpc(ATTACH_METHOD)
    except Exception as exc:  # (no worker extension: a server started by hand)
        reasons = [f"the workers have no {ATTACH_METHOD} ({type(exc).__name__}: {exc})"]
    refused = sorted({str(r) for r in reasons if r})
    if refused and blend:
        raise UnsupportedModelError(
            "--reuse blend: blend cannot run on this model in vLLM: " + "; ".join(refused)
        )
    if refused:
        logger.info("kvrag: anonymous requests' own texts are encoded: %s", "; ".join(refused))
        return False
    logger.info(
        "kvrag: %s in vLLM's workers on the served model",
        "blend runs"
        if blend
        else "anonymous requests' own texts are computed in their load's step",
    )
    return True


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
