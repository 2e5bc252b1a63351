"""The gateway (ASGI middleware of vLLM's OpenAI server), driven directly.

Every route the server registers needs a key where the key file admits no
anonymous caller or ``--api-key`` is given, but the few open ones; ``/metrics``
needs an admin key unless the operator opens it; bad input is a 4xx before
any route sees it; each request gets one admission, which the app behind sees
(``arrival.ARRIVAL``); a key taken out of the key file stops counting at once.
The routes are those of a real vLLM app where vLLM is installed (``build_app``),
else vLLM 0.32's list.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvrag_integrations.vllm.admission import ClientPolicy
from kvrag_integrations.vllm.keys import API_KEYS_ENV, KEYS_ENV, ApiKeys, KeyRing
from kvrag_integrations.vllm.params import PARAMS_KEY
from kvrag_integrations.vllm.server import gateway
from kvrag_integrations.vllm.server.arrival import ARRIVAL, MAX_DEPTH
from kvrag_integrations.vllm.server.gateway import METRICS, OPEN_ROUTES, TenantGateway
from kvrag_integrations.vllm.trust import ANON_SALT_PREFIX, SECRET_ENV, Tenant, key_digest

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
    """``(path, method)`` of every route a real vLLM OpenAI app registers, mounted
    apps such as ``/metrics`` included (``FALLBACK_ROUTES`` without vLLM)."""
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
    """The app behind the gateway: records what reached it (and the request's
    arrival, as the server's hook reads it), answers 200."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict, bytes, Any]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.seen.append((scope, body, ARRIVAL.get()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def server_state(role: str = "write", open_metrics: bool = False) -> SimpleNamespace:
    """The app's state as ``startup.ReuseInstaller`` leaves it."""
    ring = KeyRing.from_env()
    rules = ClientPolicy(False, role, 4096, SECRET.encode(), False, ring)
    return SimpleNamespace(
        state=SimpleNamespace(kvrag_policy=rules, kvrag_open_metrics=open_metrics)
    )


def call(
    door: Any,
    path: str,
    body: Any = None,
    key: str | None = None,
    method: str = "POST",
    app: Any = None,
    headers: list | None = None,
) -> tuple[int, list[dict]]:
    raw = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = [(b"content-type", b"application/json"), *(headers or [])]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    scope["app"] = app if app is not None else server_state()
    chunks = [raw[i : i + 4096] for i in range(0, len(raw), 4096)] or [b""]
    sent: list[dict] = []

    async def receive() -> dict:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(door(scope, receive, send))
    return sent[0]["status"], sent


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


@pytest.fixture()
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    monkeypatch.setenv(KEYS_ENV, str(path))
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
        # /metrics counts everyone's traffic: an admin key only
        writer = 401 if path.startswith(METRICS) else 200
        assert call(door, path, None, "sk-team-a", method)[0] == writer
        assert call(door, path, None, "sk-ops", method)[0] == 200
        assert call(door, path, None, "sk-wrong", method)[0] == 401


def test_the_routes_include_the_ones_that_reach_the_model_and_the_metrics() -> None:
    paths = {path for path, _ in ROUTES}
    assert {"/v1/completions", "/v1/chat/completions", "/invocations", "/metrics"} <= paths


def test_at_the_defaults_every_route_is_open_but_the_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No key file, no ``--api-key`` (the README's server): anyone may ask the model,
    nobody may watch ``/metrics``, unless the operator opens it."""
    door = TenantGateway(Model())
    for path in ("/v1/completions", "/invocations", "/tokenize", "/health"):
        assert call(door, path, {"prompt": "hi"})[0] == 200
    for path in (METRICS, METRICS + "/", METRICS + "extra"):  # vLLM mounts every such path
        assert call(door, path, None, method="GET")[0] == 401
        assert call(door, path, None, "sk-anything", method="GET")[0] == 401
        opened = server_state(open_metrics=True)
        assert call(door, path, None, method="GET", app=opened)[0] == 200


def test_api_keys_guard_every_route_as_the_key_files_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--api-key`` (vLLM's own guards only ``/v1``): every route but the open ones
    needs one, and a holder is a caller of the shared namespace."""
    monkeypatch.setenv(API_KEYS_ENV, json.dumps([ApiKeys.digest_of("sk-vllm")]))
    model = Model()
    door = TenantGateway(model)
    for path, method in ROUTES:
        if path in OPEN_ROUTES:
            continue
        assert call(door, path, None, method=method)[0] == 401, path
    assert call(door, "/invocations", {"prompt": "hi"}, "sk-vllm")[0] == 200
    admission = model.seen[-1][2].admission
    assert admission.tenant.namespace == "" and admission.role == "write"
    assert not admission.keeps and admission.own is not None  # what it sends: its own
    assert call(door, METRICS, None, "sk-vllm", method="GET")[0] == 401
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")  # vLLM's variable counts too
    assert call(TenantGateway(Model()), "/tokenize", {}, "sk-env")[0] == 200


def test_each_api_key_has_a_prefix_cache_of_its_own_unless_its_namespace_is_shared(
    keys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 59 hole 1: every ``--api-key`` holder, and every key of the shared
    namespace, had the same exact ``cache_salt``, so they shared vLLM's prefix cache
    and could confirm each other's text by ``cached_tokens`` or timing. Each has a
    salt of its own now; the keys of one namespace of the key file share theirs
    (the file says they share: they share its entries too)."""
    monkeypatch.setenv(API_KEYS_ENV, json.dumps([ApiKeys.digest_of(k) for k in ("a", "b")]))
    model = Model()
    door = TenantGateway(model)
    salts = {}
    for key in ("a", "b"):
        assert call(door, "/v1/completions", {"prompt": "hi"}, key)[0] == 200
        salts[key] = model.seen[-1][2].admission.tenant.salt
    assert salts["a"] != salts["b"] and salts["a"] is not None
    monkeypatch.delenv(API_KEYS_ENV)
    shared = {"sk-ops": {"namespace": "", "role": "admin"}, "sk-ops-2": {"namespace": ""}}
    team = {"sk-a1": {"namespace": "team-a"}, "sk-a2": {"namespace": "team-a"}}
    keys.write_text(json.dumps({"keys": {**shared, **team}}))
    door = TenantGateway(model)
    for key in ("sk-ops", "sk-ops-2", "sk-a1", "sk-a2"):
        assert call(door, "/v1/completions", {"prompt": "hi"}, key)[0] == 200
        salts[key] = model.seen[-1][2].admission.tenant.salt
    assert salts["sk-ops"] != salts["sk-ops-2"]
    assert (
        salts["sk-a1"] == salts["sk-a2"] == Tenant.of_key_namespace("team-a", SECRET.encode()).salt
    )
    assert len({salts[k] for k in ("a", "b", "sk-ops", "sk-ops-2", "sk-a1")}) == 5


@pytest.mark.parametrize("root", ["/m", "/metr", "/metrics", "/x"])
def test_the_metrics_are_closed_under_any_root_path(root: str) -> None:
    """Issue 59 hole 6: with ``--root-path /m`` the gateway took ``/m`` off
    ``/metrics`` as a bare prefix (``etrics``: an open route) where Starlette, which
    takes a root path off only before a ``/``, routes it to the metrics."""
    door = TenantGateway(Model())
    for path in ("/metrics", "/metrics/", root + "/metrics"):
        scope_path = {"path": path, "root_path": root}
        status = call_scope(door, scope_path)
        assert status == 401, (root, path)


def test_a_cors_preflight_passes_as_vllm_lets_it(keys: Path) -> None:
    """Issue 59 hole 6: once keys are required, a browser's CORS preflight (an
    ``OPTIONS`` with no key) got 401 where vLLM's own key check lets it by; the
    metrics stay closed to it."""
    model = Model()
    door = TenantGateway(model)
    preflight = [(b"origin", b"https://app"), (b"access-control-request-method", b"POST")]
    status, _ = call(door, "/v1/completions", None, method="OPTIONS", headers=preflight)
    assert status == 200 and model.seen[-1][0]["method"] == "OPTIONS"
    assert call(door, "/v1/completions", {"prompt": "hi"})[0] == 401  # a POST still needs one
    assert call(door, METRICS, None, method="OPTIONS", headers=preflight)[0] == 401


def call_scope(door: Any, extra: dict) -> int:
    """A GET with ``extra`` in its scope (a root path): its status."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "headers": [], "app": server_state(), **extra}
    asyncio.run(door(scope, receive, send))
    return sent[0]["status"]


def test_a_keyed_request_is_admitted_as_its_keys_tenant_whatever_it_sends(keys: Path) -> None:
    model = Model()
    door = TenantGateway(model)
    body = {"prompt": "hi", "cache_salt": "mine", "user": "alice"}
    body["kv_transfer_params"] = {PARAMS_KEY: {"tenant": "team-b"}, "x": 1}
    for path in ("/v1/completions", "/invocations", "/v1/anything-later"):
        assert call(door, path, body, "sk-team-a")[0] == 200
        scope, sent, arrival = model.seen[-1]
        assert json.loads(sent) == body  # the body reaches vLLM as the client sent it
        admission = arrival.admission
        assert admission.tenant == Tenant.of_key_namespace("team-a", SECRET.encode())
        assert (admission.role, admission.keeps, admission.name) == ("write", True, "team-a")
        assert admission.key == key_digest("sk-team-a", SECRET.encode())
        # the connector's policy, reading the same key file, admits it
        rules = server_state().state.kvrag_policy
        bound = admission.bound([1, 2])
        assert rules.verified(bound.signed(SECRET.encode()), [1, 2]) == bound
        assert int(dict(scope["headers"]).get(b"content-length", len(sent))) == len(sent)


def test_a_keyless_request_is_anonymous_or_its_salts_tenant(keys: Path) -> None:
    keys.write_text(json.dumps({**KEYS, "anonymous": "write"}))
    model = Model()
    door = TenantGateway(model)
    call(door, "/v1/completions", {"prompt": "hi", "prompt_cache_key": "alice"})
    first = model.seen[-1][2].admission
    call(door, "/v1/completions", {"prompt": "hi", "prompt_cache_key": "alice"})
    second = model.seen[-1][2].admission
    assert first.tenant.salt.startswith(ANON_SALT_PREFIX) and first.tenant != second.tenant
    assert first.own is not None and not first.keeps
    call(door, "/v1/completions", {"prompt": "hi", "cache_salt": "team-c"})
    assert model.seen[-1][2].admission.tenant == Tenant.of_salt("team-c")


def test_the_stricter_anonymous_role_wins(keys: Path) -> None:
    """``--client-role read`` with a key file whose anonymous callers may write: they
    read (and a file stricter than the flag wins the same way)."""
    keys.write_text(json.dumps({**KEYS, "anonymous": "write"}))
    model = Model()
    door = TenantGateway(model)
    call(door, "/v1/completions", {"prompt": "hi"}, app=server_state(role="read"))
    assert model.seen[-1][2].admission.role == "read"
    keys.write_text(json.dumps({**KEYS, "anonymous": "read"}, indent=1))
    os.utime(keys, ns=(1, 1))
    call(door, "/v1/completions", {"prompt": "hi"}, app=server_state(role="admin"))
    assert model.seen[-1][2].admission.role == "read"


DEEP = b'{"kv_transfer_params": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (DEEP, "nests deeper"),
        (b'{"x": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", "nests deeper"),
        (b'{"prompt": "hi"', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "x" * 300}, "cache_salt"),
        ({"cache_salt": "kvrag-anon-00"}, "must not start with 'kvrag-'"),
        ({"kv_transfer_params": [1]}, "kv_transfer_params is an object"),
        ({"kv_transfer_params": {PARAMS_KEY: "load"}}, "must be an object"),
        ({"kv_transfer_params": {PARAMS_KEY: {"load": "x"}}}, "load must be a list"),
        ({"kv_transfer_params": {PARAMS_KEY: {"tenant": 7}}}, "tenant must be a string"),
        ({"kv_transfer_params": {PARAMS_KEY: {"detect": "no"}}}, "true or false"),
        ({"kv_transfer_params": {PARAMS_KEY: {"grant": {}}}}, "unknown fields"),
        ({"kv_transfer_params": {PARAMS_KEY: {"admission": {}}}}, "the server's to write"),
    ],
)
def test_bad_input_is_a_400_with_its_reason(keys: Path, body: Any, reason: str) -> None:
    keys.write_text(json.dumps({**KEYS, "anonymous": "write"}))
    model = Model()
    door = TenantGateway(model)
    for key in (None, "sk-team-a"):
        status, sent = call(door, "/v1/completions", body, key)
        assert status == 400 and not model.seen
        assert reason in json.loads(sent[1]["body"])["error"]["message"]


def test_a_body_too_large_to_check_is_refused(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway, "MAX_BODY", 10_000)
    model = Model()
    door = TenantGateway(model)
    status, _ = call(door, "/v1/completions", {"prompt": "x" * 20_000}, "sk-team-a")
    assert status == 413 and not model.seen
    said = [(b"content-length", b"99999999999")]  # refused before a byte is read
    assert call(door, "/v1/completions", b"{}", "sk-team-a", headers=said)[0] == 413
    assert call(door, "/v1/completions", {"prompt": "x" * 2_000}, "sk-team-a")[0] == 200


def test_a_revoked_keys_admission_stops_counting_at_once(keys: Path) -> None:
    model = Model()
    door = TenantGateway(model)
    app = server_state()
    assert call(door, "/v1/completions", {"prompt": "hi"}, "sk-team-a", app=app)[0] == 200
    signed = model.seen[-1][2].admission.bound([1]).signed(SECRET.encode())
    rules = app.state.kvrag_policy
    assert rules.verified(signed, [1]) is not None
    revoked = {**KEYS, "keys": {"sk-ops": KEYS["keys"]["sk-ops"]}}
    keys.write_text(json.dumps(revoked, indent=1))  # (another size: seen as changed)
    os.utime(keys, ns=(1, 1))
    assert call(door, "/v1/completions", {"prompt": "hi"}, "sk-team-a", app=app)[0] == 401
    with pytest.raises(ValueError, match="key file"):
        rules.verified(signed, [1])
    keys.write_text("{not json")  # a broken file admits nobody
    assert call(door, "/v1/completions", {"prompt": "hi"}, "sk-ops", app=app)[0] == 401


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


def test_serve_names_the_risks_and_the_stricter_role(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvrag_integrations.vllm import launch, serve

    # (the command only: no checkpoint is read in this tier)
    monkeypatch.setattr(launch, "checkpoint_folder", lambda model: (str(tmp_path), "tiny"))

    with pytest.raises(SystemExit):
        serve.main(["--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert helped.count("RISK") == 2 and "/metrics" in helped
    args = ["--store", f"disk:{tmp_path}", "--print-command"]
    for share in (False, True):
        serve.main(args + (["--share-anonymous-prompts"] if share else []))
        command = capsys.readouterr().out
        assert f'"share_anonymous":{str(share).lower()}' in command
        assert '"open_metrics":false' in command
        assert "gateway.TenantGateway" in command and "startup.ReuseInstaller" in command
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({**KEYS, "anonymous": "write"}))
    serve.main([*args, "--tenant-keys", str(keys), "--client-role", "read", "--open-metrics"])
    command = capsys.readouterr().out
    assert '"client_role":"read"' in command and '"open_metrics":true' in command
    serve.main([*args, "--api-key", "sk-1", "sk-2"])
    assert "--api-key sk-1 sk-2" in capsys.readouterr().out  # vLLM's own check stays
    seen = {}
    monkeypatch.setattr(
        "kvrag_integrations.vllm.server.command.os.execvpe", lambda c, a, env: seen.update(env)
    )
    monkeypatch.setattr("kvrag_integrations.vllm.server.command._size_budget", lambda store: 10**9)
    serve.main(["--store", f"disk:{tmp_path}", "--", "--api-key", "sk-3"])  # after "--" too
    assert json.loads(seen["KVRAG_API_KEYS"]) == [ApiKeys.digest_of("sk-3")]
    with pytest.raises(SystemExit):
        serve.main([*args, "--api-key", "sk-1", "--tenant-keys", str(keys)])


def test_the_key_file_is_read_alike_by_replicas_started_either_side_of_an_edit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 59 hole 8: ``serve`` folded the key file's ``anonymous`` role and its
    quotas into the command at launch, though every process re-reads the file: two
    replicas started either side of an edit disagreed. The command names the file
    only; the gateway and the connector read all of it as it is now."""
    from kvrag_integrations.vllm import launch, serve

    monkeypatch.setattr(launch, "checkpoint_folder", lambda model: (str(tmp_path), "tiny"))
    # (a CPU's KV cache is sized from the memory available at launch, which moves)
    monkeypatch.setattr(launch, "cpu_kv_cache_bytes", lambda: 2**30)
    keys = tmp_path / "keys.json"
    args = ["--store", f"disk:{tmp_path}", "--print-command", "--tenant-keys", str(keys)]
    commands = []
    for anonymous, quota in (("write", 10**6), ("read", 10**9)):
        sk_a = {"namespace": "team-a", "role": "write", "quota_bytes": quota}
        keys.write_text(json.dumps({"keys": {"sk-a": sk_a}, "anonymous": anonymous}))
        serve.main(args)
        commands.append(capsys.readouterr().out)
    assert commands[0] == commands[1]
    assert '"client_role":"write"' in commands[0] and '"namespace_quotas":{}' in commands[0]


def test_the_served_process_refuses_an_unverified_architecture_before_vllm(
    tmp_path: Path,
) -> None:
    """The launcher reads no model config (that import is ~4.5 s of CPU a start);
    the served process checks the connector's model before it imports vLLM: an
    architecture reuse is not verified for exits naming it. A plain vLLM command
    (no connector) is not checked."""
    from transformers import GPT2Config

    from kvrag_integrations.vllm import launch
    from kvrag_integrations.vllm.server import vllm_serve

    GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10).save_pretrained(tmp_path)
    transfer = json.dumps({"kv_connector": "KVRAGConnector", "kv_role": "kv_both"})
    argv = ["--model", str(tmp_path), "--kv-transfer-config", transfer, "--port", "1"]
    assert launch.connector_model(argv) == str(tmp_path)
    joined = [f"--model={tmp_path}", f"--kv-transfer-config={transfer}"]
    assert launch.connector_model(joined) == str(tmp_path)
    assert launch.connector_model(["--model", str(tmp_path)]) is None
    assert launch.connector_model([*argv, "--kv-transfer-config", "{not json"]) is None
    with pytest.raises(SystemExit, match="GPT2LMHeadModel"):
        vllm_serve.main(argv)


def test_vllm_alone_keeps_vllms_own_scheduling(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a CPU our server slices long prefills and caps a step (``FAIRNESS_ARGS``:
    what keeps one caller's prompts from stalling everyone's steps); vLLM alone,
    which ``bench serve`` compares with, runs vLLM's own scheduling."""
    from kvrag_integrations.vllm import launch

    monkeypatch.setattr(launch, "checkpoint_folder", lambda model: (str(tmp_path), "tiny"))
    monkeypatch.setattr(launch, "_has_cuda", lambda: False)
    monkeypatch.setattr(launch, "cpu_kv_cache_bytes", lambda: 2**30)
    ours = launch.server_command(None, f"disk:{tmp_path}", [])
    plain = launch.plain_server_command(None, [])
    for name in launch.FAIRNESS_ARGS:
        flag = "--" + name.replace("_", "-")
        assert flag in ours and flag not in plain, flag
    assert "--enforce-eager" in plain  # (the platform's settings stay)
