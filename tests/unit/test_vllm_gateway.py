"""The gateway (ASGI middleware of vLLM's OpenAI server), driven directly.

Every route the server registers needs a key where the key file admits no
anonymous caller, but the few open ones; keyed requests get a grant bound to
their key and their tenant's salt; no client's grant reaches the model; a key
taken out of the key file stops counting at once. The routes are those of a
real vLLM app where vLLM is installed (``build_app``), else vLLM 0.32's list.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvrag_integrations.vllm.params import PARAMS_KEY
from kvrag_integrations.vllm.server import gateway
from kvrag_integrations.vllm.server.gateway import KEYS_ENV, OPEN_ROUTES, TenantGateway
from kvrag_integrations.vllm.trust import SECRET_ENV, ClientPolicy, Tenant, key_digest

SECRET = "gateway-test-secret"
KEYS = {
    "keys": {
        "sk-team-a": {"namespace": "team-a", "role": "write"},
        "sk-ops": {"namespace": "", "role": "admin"},
    },
    "anonymous": "none",
}


FALLBACK_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
    "/inference/v1/generate",
    "/tokenize",
    "/v1/models",
    "/load",
    "/ping",
    "/metrics",
)


def vllm_routes() -> list[tuple[str, str]]:
    """``(path, method)`` of every route a real vLLM OpenAI app registers
    (``FALLBACK_ROUTES`` where vLLM is not installed)."""
    try:
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM 0.32's routes, as its app registers them
        return [(path, "POST") for path in FALLBACK_ROUTES] + [("/health", "GET")]
    else:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
        routes = build_app(args, ("generate",)).routes
    found = set()
    for route in routes:
        path = getattr(route, "path", "")
        for method in getattr(route, "methods", None) or {"GET"}:
            found.add((path.replace("{", "").replace("}", ""), method))
    return sorted(found)


class Model:
    """The app behind the gateway: records what reached it, answers 200."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.seen.append((scope, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(
    app: Any, path: str, body: Any = None, key: str | None = None, method: str = "POST"
) -> tuple[int, list[dict]]:
    raw = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = [(b"content-type", b"application/json")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    chunks = [raw[i : i + 4096] for i in range(0, len(raw), 4096)] or [b""]
    sent: list[dict] = []

    async def receive() -> dict:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], sent


@pytest.fixture()
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    monkeypatch.setenv(KEYS_ENV, str(path))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    return path


ROUTES = vllm_routes()


@pytest.mark.parametrize(("path", "method"), ROUTES)
def test_every_route_but_the_open_ones_needs_a_key(keys: Path, path: str, method: str) -> None:
    model = Model()
    door = TenantGateway(model)
    status, _ = call(door, path, None, method=method)
    if path in OPEN_ROUTES:
        assert status == 200 and len(model.seen) == 1
    else:
        assert status == 401 and not model.seen  # the model never saw it
        assert call(door, path, None, "sk-team-a", method)[0] == 200
        assert call(door, path, None, "sk-wrong", method)[0] == 401


def test_the_routes_include_the_ones_that_reach_the_model() -> None:
    paths = {path for path, _ in ROUTES}
    assert {"/v1/completions", "/v1/chat/completions", "/invocations"} <= paths


def test_a_keyed_request_gets_a_grant_bound_to_its_key_and_its_tenants_salt(keys: Path) -> None:
    model = Model()
    door = TenantGateway(model)
    forged = {"namespace": "team-b", "role": "admin", "mac": "0" * 64}
    body = {"prompt": "hi", "cache_salt": "mine", PARAMS_KEY: 1}
    body["kv_transfer_params"] = {PARAMS_KEY: {"tenant": "team-b", "grant": forged}}
    for path in ("/v1/completions", "/invocations"):
        assert call(door, path, body, "sk-team-a")[0] == 200
        sent = json.loads(model.seen[-1][1])
        grant = sent["kv_transfer_params"][PARAMS_KEY]["grant"]
        assert grant["key"] == key_digest("sk-team-a", SECRET.encode())
        assert (grant["namespace"], grant["role"]) == ("team-a", "write")
        assert "tenant" not in sent["kv_transfer_params"][PARAMS_KEY]
        assert sent["cache_salt"] == Tenant.of_key_namespace("team-a", SECRET.encode()).salt
        length = dict(model.seen[-1][0]["headers"])[b"content-length"]
        assert int(length) == len(model.seen[-1][1])
        # the connector's policy, reading the same key file, admits it
        policy = ClientPolicy(secret=SECRET.encode(), keys=gateway.KeyRing.from_env())
        assert policy.grant(grant) is not None


@pytest.mark.parametrize("key_file", [True, False])
def test_no_clients_grant_reaches_the_model(
    keys: Path, monkeypatch: pytest.MonkeyPatch, key_file: bool
) -> None:
    if key_file:
        keys.write_text(json.dumps({**KEYS, "anonymous": "write"}))
    else:
        monkeypatch.delenv(KEYS_ENV)
    model = Model()
    door = TenantGateway(model)
    forged = {"namespace": "team-a", "role": "admin", "mac": "0" * 64}
    ours = {"tenant": "my-salt", "grant": forged, "load": [[0, 4, []]]}
    for path in ("/v1/completions", "/v1/messages", "/tokenize"):
        assert (
            call(door, path, {"prompt": "hi", "kv_transfer_params": {PARAMS_KEY: ours}})[0] == 200
        )
        sent = json.loads(model.seen[-1][1])["kv_transfer_params"][PARAMS_KEY]
        assert "grant" not in sent and sent["tenant"] == "my-salt" and sent["load"]


def test_a_revoked_keys_grant_stops_counting_at_once(keys: Path) -> None:
    model = Model()
    door = TenantGateway(model)
    assert call(door, "/v1/completions", {"prompt": "hi"}, "sk-team-a")[0] == 200
    grant = json.loads(model.seen[-1][1])["kv_transfer_params"][PARAMS_KEY]["grant"]
    ring = gateway.KeyRing.from_env()
    policy = ClientPolicy(secret=SECRET.encode(), keys=ring)
    assert policy.grant(grant) is not None
    revoked = {**KEYS, "keys": {"sk-ops": KEYS["keys"]["sk-ops"]}}
    keys.write_text(json.dumps(revoked, indent=1))  # (another size: seen as changed)
    os.utime(keys, ns=(1, 1))
    assert call(door, "/v1/completions", {"prompt": "hi"}, "sk-team-a")[0] == 401
    assert policy.grant(grant) is None
    keys.write_text("{not json")  # a broken file admits nobody
    assert call(door, "/v1/completions", {"prompt": "hi"}, "sk-ops")[0] == 401


def test_a_body_too_large_to_rewrite_is_refused(
    keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway, "_MAX_BODY", 10_000)
    model = Model()
    door = TenantGateway(model)
    status, _ = call(door, "/v1/completions", {"prompt": "x" * 20_000}, "sk-team-a")
    assert status == 413 and not model.seen
    assert call(door, "/v1/completions", {"prompt": "x" * 2_000}, "sk-team-a")[0] == 200


def test_anonymous_none_refuses_a_websocket_and_admits_lifespan(keys: Path) -> None:
    model = Model()
    door = TenantGateway(model)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "websocket.connect"}

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    asyncio.run(door(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and not model.seen
    asyncio.run(door({"type": "lifespan"}, receive, send))
    assert len(model.seen) == 1


def test_serve_names_the_risk_of_sharing_and_adds_both_middlewares(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvrag_integrations.vllm import launch, serve

    # (the command only: no checkpoint is read in this tier)
    monkeypatch.setattr(launch, "served_checkpoint", lambda model: (str(tmp_path), "tiny"))

    with pytest.raises(SystemExit):
        serve.main(["--help"])
    assert "RISK" in " ".join(capsys.readouterr().out.split())
    for share in (False, True):
        args = ["--store", f"disk:{tmp_path}", "--print-command"]
        serve.main(args + (["--share-anonymous-prompts"] if share else []))
        command = capsys.readouterr().out
        assert f'"share_anonymous":{str(share).lower()}' in command
        assert "gateway.TenantGateway" in command and "startup.ReuseInstaller" in command
