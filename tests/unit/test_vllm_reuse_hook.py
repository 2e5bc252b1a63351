"""The server's hook on its engine client, without vLLM: admission, salts, reuse.

A fake engine client's ``generate`` records what the hook hands on (the prompt
with its salt, the params the connector reads) and stores what an encode saves
as the connector's workers would (a private entry under its key only, never
indexed). The admission is the gateway's (``arrival.ARRIVAL``: ``run`` makes it
as the gateway does, from the request's body, where a test gives none); the
connector's own check of it is ``ClientPolicy.verified``, as the scheduler side
runs it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from test_vllm_detection import FP, GLUE, PASSAGES, TAIL, Stored, agent_call, ids, prompt

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.admission import Admission, ClientPolicy
from kvrag_integrations.vllm.params import PARAMS_KEY, BlendRequest, PieceSpec, TransferParams
from kvrag_integrations.vllm.server.arrival import ARRIVAL, Arrival, BadRequest, read_body
from kvrag_integrations.vllm.server.reuse_hook import ReuseHook
from kvrag_integrations.vllm.trust import ANON_SALT_PREFIX, Grant, Tenant, request_salt

SECRET = b"server-secret"


def policy(role: str = "write", share: bool = False) -> ClientPolicy:
    """A server's policy (default: its defaults, anonymous callers isolated)."""
    return ClientPolicy(False, role, 4096, SECRET, share)


class Engine:
    """The engine client's ``generate``: records each request, and stores what an
    encode saves (a private entry under its own namespace's key, unindexed)."""

    def __init__(self, stored: Stored) -> None:
        self.stored = stored
        self.seen: list[tuple[dict, Any, str]] = []

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        self.seen.append((dict(prompt), sampling_params, request_id))
        sent = sent_params(sampling_params)
        if request_id.startswith("kvrag-encode-") and sent is not None and sent.save:
            admission = Admission.verified(sent.admission, SECRET)
            entry = prompt["prompt_token_ids"]
            if sent.own_save:
                self.stored.keys.add(cache_key(admission.own.fingerprint(FP), entry))
            else:
                self.stored.put(entry, admission.tenant.fingerprint(FP))
        yield SimpleNamespace(request_id=request_id)

    def encodes(self) -> list[tuple[dict, Any, str]]:
        return [s for s in self.seen if s[2].startswith("kvrag-encode-")]


def sent_params(sampling_params: Any) -> TransferParams | None:
    extra = sampling_params.extra_args or {}
    return TransferParams.from_request(extra.get("kv_transfer_params"))


def hook_over(stored: Stored, rules: ClientPolicy | None = None, forget=None):
    engine = Engine(stored)
    hook = ReuseHook(engine.generate, stored.detector(), rules or policy(), SimpleNamespace, forget)
    return hook, engine


def run(
    hook: ReuseHook,
    prompt_ids: list[int],
    extra: dict | None = None,
    salt: str | None = None,
    arrival: Arrival | None = None,
    **kw: Any,
) -> tuple[dict, Any, Admission]:
    """One request through the hook as the gateway hands it on (its ``arrival``, by
    default the one the gateway makes of the body): what reached the engine, and
    the admission the connector verifies."""
    engine_prompt = {"type": "token", "prompt_token_ids": prompt_ids}
    if salt:
        engine_prompt["cache_salt"] = salt
    params = SimpleNamespace(extra_args=extra, prompt_logprobs=kw.pop("prompt_logprobs", None))
    if arrival is None:
        arrival = gateway_arrival(hook.policy, salt, (extra or {}).get("kv_transfer_params"))

    async def go() -> None:
        token = ARRIVAL.set(arrival)
        try:
            async for _ in hook.generate(engine_prompt, params, "r1", **kw):
                pass
            await hook.drain()
            await asyncio.sleep(0.01)  # (its own entries are dropped once their encodes end)
        finally:
            ARRIVAL.reset(token)

    asyncio.run(go())
    admission = Admission.verified(sent_params(params).admission, SECRET)
    return engine_prompt, params, admission


def gateway_arrival(rules: ClientPolicy, salt: str | None, transfer: Any = None) -> Arrival:
    """The arrival the gateway makes of a keyless request's body (``read_body``, then
    ``ClientPolicy.admit``)."""
    body: dict[str, Any] = {"prompt": "x"}
    if salt is not None:
        body["cache_salt"] = salt
    if transfer is not None:
        body["kv_transfer_params"] = transfer
    arrival = read_body(json.dumps(body).encode())
    tenant_salt = arrival.params.tenant_salt if arrival.params is not None else ""
    admission = rules.admit(None, arrival.cache_salt, tenant_salt)
    return Arrival(arrival.cache_salt, arrival.params, admission)


def test_at_the_defaults_an_anonymous_request_reads_ingested_passages_its_texts_its_own() -> None:
    """No key, no salt: it loads what writers stored, shares no prefix block with any
    other request (a salt of its own), and its head and glue are encoded for it
    alone: entries of its own namespace under its secret suffix, never indexed,
    dropped once it is answered. The server keeps nothing of it."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    forgotten: list[list[int]] = []

    def forget(tenant: Tenant, entry) -> None:
        forgotten.append(list(entry))
        stored.keys.discard(cache_key(tenant.fingerprint(FP), list(entry)))

    hook, engine = hook_over(stored, forget=forget)
    p = prompt([1, 3, 0], ids(12))
    indexed = len(stored.index)
    salts = []
    for _ in range(2):
        engine.seen.clear()
        engine_prompt, params, admission = run(hook, p)
        sent = sent_params(params)
        assert sent.load_end == len(p) - 12 - len(TAIL) and not sent.save
        assert admission.tenant.namespace == "" and not admission.keeps
        assert admission.tenant.salt.startswith(ANON_SALT_PREFIX)
        # its head (with the glue before the first passage) and the glue: its own
        own = [s[0]["prompt_token_ids"] for s in engine.encodes()]
        tail = sent.load[0].tail
        assert own == [p[: p.index(PASSAGES[1][0])] + list(tail), GLUE + list(tail)]
        assert [q.own for q in sent.load] == [True, False, True, False, True, False]
        assert all(s[0]["cache_salt"] == admission.tenant.salt for s in engine.encodes())
        # the connector admits the load: the salt is the one of its tenant and layout
        assert engine_prompt["cache_salt"] == request_salt(admission.tenant, sent.layout)
        salts.append(engine_prompt["cache_salt"])
        assert sorted(forgotten[-2:]) == sorted(own)  # answered: dropped
    assert salts[0] != salts[1]  # two anonymous requests share no prefix block
    assert len(stored.index) == indexed  # nothing of theirs indexed
    assert stored.keys == {cache_key(FP, x) for x in PASSAGES}  # nor left stored
    # a prompt with nothing stored in it is computed exactly, under its own salt, unlearned
    engine_prompt, params, _ = run(hook, ids(400))
    sent = sent_params(params)
    assert not sent.save and not sent.load
    assert engine_prompt["cache_salt"].startswith(ANON_SALT_PREFIX)


def course(engine: Engine, params: Any) -> list[Any]:
    """What a request did, less its own secrets (salts, suffixes): its encodes' sizes
    and saves, and its load's layout."""
    sent = sent_params(params)
    steps = [(len(s[0]["prompt_token_ids"]), sent_params(s[1]).save) for s in engine.encodes()]
    layout = [(q.start, q.rows, q.lead, q.own, len(q.tail)) for q in sent.load]
    return [steps, layout, sent.save]


def test_a_right_and_a_wrong_guess_of_an_anonymous_callers_text_take_the_same_path() -> None:
    """Issue 54's oracle: a victim's note between two ingested passages, then an
    attacker's right and wrong guesses in the attacker's own layouts. Every step
    is the same for both; nothing of the victim's is stored."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)

    def forget(tenant: Tenant, entry) -> None:
        stored.keys.discard(cache_key(tenant.fingerprint(FP), list(entry)))

    hook, engine = hook_over(stored, forget=forget)
    secret, wrong = ids(24), ids(24)
    victim = prompt([0], []) + GLUE + secret + GLUE + PASSAGES[1] + TAIL + ids(9)
    run(hook, victim)
    layouts = {
        "between": lambda guess: prompt([0], []) + GLUE + guess + GLUE + PASSAGES[1] + TAIL,
        "then an unknown passage": lambda guess: prompt([0], []) + GLUE + guess + ids(300),
        "first": lambda guess: guess + GLUE + PASSAGES[0] + TAIL,
    }
    for name, layout in layouts.items():
        seen = {}
        for guess in (secret, wrong):
            engine.seen.clear()
            _, params, _ = run(hook, layout(guess))
            seen[tuple(guess)] = course(engine, params)
        assert seen[tuple(secret)] == seen[tuple(wrong)], name
    assert stored.keys == {cache_key(FP, x) for x in PASSAGES}


def test_a_tenants_own_salt_learns_its_prompts() -> None:
    stored = Stored()
    hook, _ = hook_over(stored)
    engine_prompt, params, admission = run(hook, ids(400), salt="team-a")
    sent = sent_params(params)
    assert sent.save == (PieceSpec(0, 400),) and sent.deferred and admission.keeps
    assert admission.tenant == Tenant.of_salt("team-a")
    assert engine_prompt["cache_salt"] == "team-a"


@pytest.mark.parametrize("field", ["user", "prompt_cache_key", "safety_identifier"])
def test_fields_that_are_no_secret_are_no_salt(field: str) -> None:
    """Only ``cache_salt`` names a tenant; an OpenAI ``user`` or ``prompt_cache_key``
    is no secret, so a request carrying one alone is anonymous."""
    from kvrag_integrations.vllm.server.arrival import read_body

    arrival = read_body(f'{{"prompt": "hi", "{field}": "alice"}}'.encode())
    admission = policy().admit(None, arrival.cache_salt)
    assert admission.tenant.salt.startswith(ANON_SALT_PREFIX) and not admission.keeps


def test_the_gateways_admission_is_the_one_the_request_carries() -> None:
    """A keyed request's admission is made at the door; the hook signs it in as it
    is (it does not decide again from the body), with its tenant's salt."""
    stored = Stored()
    hook, _ = hook_over(stored)
    keyed = policy().admit(Grant("team-a", "write", "digest"), "mine")
    engine_prompt, _params, admission = run(
        hook, ids(100), salt="mine", arrival=Arrival("mine", None, keyed)
    )
    from kvrag_integrations.vllm.admission import ADMISSION_TTL_S

    bound = keyed.bound(engine_prompt["prompt_token_ids"], now=admission.expires - ADMISSION_TTL_S)
    assert admission == bound
    assert engine_prompt["cache_salt"] == Tenant.of_key_namespace("team-a", SECRET).salt


def test_a_clients_own_admission_or_a_prompt_without_a_salt_is_refused() -> None:
    stored = Stored()
    hook, _ = hook_over(stored)
    forged = policy().admit(Grant("", "admin"), None).signed(SECRET)
    extra = {"kv_transfer_params": {PARAMS_KEY: {"admission": forged}}}
    with pytest.raises(BadRequest, match="the server's to write"):
        run(hook, ids(100), extra)
    sampling = SimpleNamespace(extra_args=None, prompt_logprobs=None)

    async def go(prompt: Any) -> None:
        async for _ in hook.generate(prompt, sampling, "r"):
            pass

    with pytest.raises(BadRequest, match="cannot carry a salt"):
        asyncio.run(go([1, 2, 3]))
    with pytest.raises(TransferParamsError, match="must not start with 'kvrag-'"):
        run(hook, ids(100), salt="kvrag-anon-mine")  # (a ValueError: vLLM answers 400)
    beyond = {"kv_transfer_params": {PARAMS_KEY: {"load": [[0, 10**9, []]]}}}
    with pytest.raises(BadRequest, match="beyond the 100-token prompt"):
        run(hook, ids(100), beyond)


@pytest.mark.parametrize(
    "case",
    [
        "opt-out",
        "no-passage",
        "prompt-logprobs",
        "lora",
        "vllm-engine-client",
        "detection-fails",
        "other-connector",
    ],
)
def test_requests_that_run_exactly_are_still_admitted_and_salted(case: str) -> None:
    """Detection is skipped for them, never admission: even a detection that raises
    leaves the request its admission and its own salt. A field outside our schema
    (another connector's params) is ignored: it skips neither, and is dropped."""
    stored = Stored()
    stored.put(prompt([0, 1, 2], ids(10)))
    hook, _engine = hook_over(stored)
    p = prompt([2, 1, 0], ids(14))
    extra, kw = None, {}
    if case == "opt-out":
        extra = {"kv_transfer_params": {PARAMS_KEY: {"detect": False}}}
    elif case == "no-passage":
        p = ids(100)
    elif case == "prompt-logprobs":
        kw["prompt_logprobs"] = 1
    elif case == "lora":
        kw["lora_request"] = object()
    elif case == "vllm-engine-client":
        extra = {"kv_transfer_params": {PARAMS_KEY: {"load": [[0, 40, []]]}}}
    elif case == "other-connector":
        extra = {"kv_transfer_params": {"x": 1}}
    else:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("detection broke")

        hook.detector.detect = broken  # type: ignore[method-assign,union-attr]
    engine_prompt, params, admission = run(hook, p, extra, **kw)
    sent = sent_params(params)
    assert set(params.extra_args["kv_transfer_params"]) == {PARAMS_KEY}
    assert admission.tenant.salt.startswith(ANON_SALT_PREFIX)
    assert engine_prompt["cache_salt"] == request_salt(admission.tenant, sent.layout)
    loaded = {"vllm-engine-client": 40, "other-connector": len(p) - 14 - len(TAIL)}
    assert not sent.save and sent.load_end == loaded.get(case, 0)


def test_a_tenant_learns_its_prompt_and_glue_and_a_reader_stores_nothing() -> None:
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    hook, engine = hook_over(stored, policy(share=True))  # anonymous callers share
    p = prompt([1, 3, 0], ids(12))
    _, params, admission = run(hook, p)
    assert admission.keeps and admission.own is None
    # the prompt's unknown prefix up to the first passage (exact) and the glue, learned
    # (indexed, in the namespace) first; then the request loads them with the passages
    assert [s[0]["prompt_token_ids"] for s in engine.encodes()] == [p[:42], GLUE]
    assert not any(sent_params(s[1]).own_save for s in engine.encodes())
    assert (FP, p[:42]) in stored.index and (FP, GLUE) in stored.index
    assert engine.seen[-1][2] == "r1"  # the glue first: the request was planned after it
    sent = sent_params(params)
    assert sent.load_end == len(p) - 12 - len(TAIL) and not any(q.own for q in sent.load)
    # a prompt with little stored is learned whole (exact, under the shared salt: none)
    engine_prompt, params, _ = run(hook, ids(400))
    assert sent_params(params).save == (PieceSpec(0, 400),) and "cache_salt" not in engine_prompt
    # a reader teaches nothing
    hook, engine = hook_over(stored, policy("read"))
    _, params, admission = run(hook, prompt([3, 1, 0], ids(12)))
    assert not engine.encodes() and not sent_params(params).save and admission.own is None


def test_a_request_right_after_a_learning_one_waits_for_its_prompt_to_land() -> None:
    """A learned prompt is stored after its answer: a new question asked at once
    waits for it (briefly) rather than finding nothing and teaching it again."""
    stored = Stored()
    hook, _ = hook_over(stored, policy(share=True))
    first = prompt([0, 1, 2], ids(10))
    _, params, _ = run(hook, first)
    assert sent_params(params).deferred
    second = prompt([2, 0, 1], ids(12))
    engine_prompt = {"type": "token", "prompt_token_ids": second}
    sampling = SimpleNamespace(extra_args=None, prompt_logprobs=None)

    async def go() -> None:
        async def land() -> None:  # the worker's writer stores it a moment later
            await asyncio.sleep(0.1)
            stored.put(first)

        landing = asyncio.create_task(land())
        token = ARRIVAL.set(gateway_arrival(hook.policy, None))
        try:
            async for _ in hook.generate(engine_prompt, sampling, "r2"):
                pass
        finally:
            ARRIVAL.reset(token)
        await landing

    asyncio.run(go())
    sent = sent_params(sampling)
    assert sent.load and not sent.save


def test_an_anonymous_agents_prefix_is_its_own_and_its_passages_load() -> None:
    """An anonymous agent's second call: the question and tool call before the tool's
    passages are encoded for this request alone (its own entry, under its own salt),
    it loads them then the passages, and the entry is deleted once it is answered.
    A reader stores nothing: no prefix either, its passages are computed."""
    stored, p, first = agent_call()
    forgotten: list[list[int]] = []

    def forget(tenant: Tenant, entry) -> None:
        forgotten.append(list(entry))
        stored.keys.discard(cache_key(tenant.fingerprint(FP), list(entry)))

    hook, engine = hook_over(stored, forget=forget)
    tails = set()
    for _ in range(2):
        engine.seen.clear()
        engine_prompt, params, admission = run(hook, p)
        sent = sent_params(params)
        own = engine.encodes()[0]
        entry = own[0]["prompt_token_ids"]
        assert entry[:first] == p[:first] and len(entry) == first + 24
        assert sent_params(own[1]).own_save and own[0]["cache_salt"] == admission.tenant.salt
        assert sent.load[0] == PieceSpec(0, first, tuple(entry[first:]), own=True)
        assert sent.load_end == len(p) - len(TAIL)
        assert engine_prompt["cache_salt"] == request_salt(admission.tenant, sent.layout)
        assert entry in forgotten  # answered: dropped
        tails.add(tuple(entry[first:]))
    assert len(tails) == 2  # each request's own secret suffix
    assert stored.detector().detect(FP, p, False).load == ()  # never where a lookup finds it
    hook, engine = hook_over(stored, policy("read"))
    _, params, _ = run(hook, p)
    assert not engine.encodes() and sent_params(params).load == ()


def test_a_request_that_did_not_pass_the_gateway_is_refused() -> None:
    """Issue 59 hole 9: the hook made an admission of its own for a request that did
    not pass the gateway (a second path, deriving the role otherwise). The one
    path is the gateway's: without its admission a request is refused."""
    stored = Stored()
    hook, engine = hook_over(stored)
    sampling = SimpleNamespace(extra_args=None, prompt_logprobs=None)

    async def go() -> None:
        async for _ in hook.generate({"type": "token", "prompt_token_ids": ids(50)}, sampling, "r"):
            pass

    with pytest.raises(BadRequest, match="did not pass the server's gateway"):
        asyncio.run(go())
    assert not engine.seen


def test_one_api_request_is_planned_once_whatever_calls_it_makes() -> None:
    """Issue 59 hole 3: vLLM's beam search calls ``generate`` once per beam and step
    under one admission, and each call was planned again (its glue and head encoded
    again, under a fresh secret suffix): 4 beams x 5 steps were 20 plans and 40
    encodes. The first call plans; the others (the prompt and a beam's tokens)
    reuse its load and encode nothing."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    hook, engine = hook_over(stored)
    p = prompt([1, 3, 0], ids(12))
    arrival = gateway_arrival(hook.policy, None)
    loads = []

    async def go() -> None:
        token = ARRIVAL.set(arrival)
        try:
            for step in range(5):
                for beam in range(4):
                    beam_ids = p + [100 + beam] * step
                    sampling = SimpleNamespace(extra_args=None, prompt_logprobs=None)
                    request = {"type": "token", "prompt_token_ids": beam_ids}
                    async for _ in hook.generate(request, sampling, f"r-{beam}-{step}"):
                        pass
                    loads.append(sent_params(sampling).load)
                    signed = sent_params(sampling).admission  # bound to this call's ids
                    assert hook.policy.verified(signed, beam_ids).tenant == arrival.admission.tenant
        finally:
            ARRIVAL.reset(token)

    asyncio.run(go())
    assert len(engine.encodes()) == 2  # its head and its glue, once
    assert loads[0] and all(load == loads[0] for load in loads)


def test_one_tenants_encodes_leave_room_for_anothers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59 hole 12: one cap of 16 encodes in flight for all tenants: one
    tenant's glue could take them all and starve everyone's. Each tenant (a key
    namespace, a key of the shared namespace, every keyless caller together) has
    ``MAX_TENANT_ENCODES`` of its own."""
    from kvrag_integrations.vllm.server import encodes, reuse_hook

    monkeypatch.setattr(reuse_hook, "GLUE_WAIT_S", 0.01)
    monkeypatch.setattr(reuse_hook, "PREFIX_WAIT_S", 0.01)
    monkeypatch.setattr(reuse_hook, "STORED_WAIT_S", 0.01)
    stored = Stored()
    for namespace in ("team-a", "team-b"):  # what each team ingested, in its namespace
        for passage in PASSAGES:
            stored.put(passage, Tenant.of_key_namespace(namespace, SECRET).fingerprint(FP))
    held = Engine(stored)
    release = None

    async def slow(prompt, sampling_params, request_id, **kwargs):  # encodes stay in flight
        if request_id.startswith("kvrag-encode-"):
            await release.wait()
        async for output in held.generate(prompt, sampling_params, request_id, **kwargs):
            yield output

    hook = ReuseHook(slow, stored.detector(), policy(), SimpleNamespace)
    rules = hook.policy

    def keyed(namespace: str) -> Arrival:
        digest = f"digest-{namespace}"
        return Arrival(None, None, rules.admit(Grant(namespace, "write", digest, digest), None))

    async def go() -> None:
        nonlocal release
        release = asyncio.Event()
        # two encodes each (its head and its glue): 18 for team-a, then 2 for team-b
        for i, namespace in enumerate(["team-a"] * 9 + ["team-b"]):
            token = ARRIVAL.set(keyed(namespace))
            try:
                p = prompt([1, 3, 0], ids(12), glue=[198, 500 + i])
                sampling = SimpleNamespace(extra_args=None, prompt_logprobs=None)
                request = {"type": "token", "prompt_token_ids": p}
                async for _ in hook.generate(request, sampling, "r"):
                    pass
            finally:
                ARRIVAL.reset(token)
        await asyncio.sleep(0.05)
        release.set()
        await hook.drain()

    asyncio.run(go())
    by_tenant: dict[str, int] = {}
    for _, sampling, _ in held.encodes():
        admission = Admission.verified(sent_params(sampling).admission, SECRET)
        by_tenant[admission.name] = by_tenant.get(admission.name, 0) + 1
    assert by_tenant["team-a"] == encodes.MAX_TENANT_ENCODES
    assert by_tenant.get("team-b", 0) == 2


def test_the_hook_is_installed_or_no_request_passes_and_the_server_stops() -> None:
    """Issue 59 hole 9: the installer marked itself installed before installing, so
    where installing failed on a request rather than at startup, later requests ran
    without the hook (no salt, no admission). Now no request passes until it is
    installed; a failure at startup fails the startup (uvicorn exits), one at a
    request stops the server, and every request is answered 503 meanwhile."""
    from kvrag_integrations.vllm.server.startup import ReuseInstaller

    transfer = SimpleNamespace(kv_connector="KVRAGConnector", kv_connector_extra_config={})
    broken = SimpleNamespace(  # our connector, settings that do not load (no store)
        vllm_config=SimpleNamespace(kv_transfer_config=transfer), generate=None
    )
    reached: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    def served(installer: ReuseInstaller, kind: str, state: Any) -> list[dict]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "lifespan.startup"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": kind, "method": "GET", "path": "/v1/models", "headers": []}
        scope["app"] = SimpleNamespace(state=state)
        asyncio.run(installer(scope, receive, send))
        return sent

    stops: list[bool] = []
    installer = ReuseInstaller(app)
    installer.stop = lambda: stops.append(True)  # type: ignore[method-assign]
    starting = SimpleNamespace()  # no engine client yet
    assert served(installer, "http", starting)[0]["status"] == 503 and not reached
    for _ in range(2):  # installing fails at a request: it stops the server, none passes
        assert served(installer, "http", SimpleNamespace(engine_client=broken))[0]["status"] == 503
    assert stops == [True] and not reached
    at_start = ReuseInstaller(app)
    sent = served(at_start, "lifespan", SimpleNamespace(engine_client=broken))
    assert sent[0]["type"] == "lifespan.startup.failed" and "store" in sent[0]["message"]
    assert not reached
    without = SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=None))
    plain = ReuseInstaller(app)  # a server without our connector: nothing to install
    served(plain, "http", SimpleNamespace(engine_client=without))
    assert reached == ["http"]


def test_a_blend_servers_plain_requests_load_as_blend_each_under_a_nonce_of_its_own() -> None:
    """``serve --reuse blend``: a plain client's load is blended (a fresh nonce in its
    layout: its salt, and the blocks its recompute writes, are its own, even for a
    keyed tenant's two identical requests); a request may ask for turbo."""
    team = Tenant.of_salt("team-secret")
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage, team.fingerprint(FP))  # what the team ingested
    engine = Engine(stored)
    hook = ReuseHook(engine.generate, stored.detector(), policy(), SimpleNamespace, reuse="blend")
    p = prompt([1, 3, 0], ids(12))
    keyed = Arrival("", None, Admission(team, "write", keeps=True))
    seen = []
    for _ in range(2):
        engine_prompt, params, admission = run(hook, p, arrival=keyed)
        sent = sent_params(params)
        assert sent.reuse == "blend" and sent.blend is not None and len(sent.blend.nonce) >= 16
        assert engine_prompt["cache_salt"] == request_salt(admission.tenant, sent.layout)
        seen.append((sent.blend.nonce, engine_prompt["cache_salt"]))
    assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1]
    # (the gateway read the body's kv_transfer_params into the arrival)
    asked = Arrival("", TransferParams(reuse="turbo"), keyed.admission)
    _, params, _ = run(hook, p, arrival=asked)
    sent = sent_params(params)
    assert sent.reuse == "turbo" and sent.blend is None and sent.load


def test_a_clients_own_load_on_a_blend_server_is_blended_under_a_nonce_of_its_own() -> None:
    """A client that plans its own load and names no reuse gets the server's blend:
    the hook gives the load a fresh nonce where it has none (the connector refuses a
    blend load without one); a nonce of the client's own stays."""
    stored = Stored()
    engine = Engine(stored)
    hook = ReuseHook(engine.generate, stored.detector(), policy(), SimpleNamespace, reuse="blend")
    p = prompt([1, 3, 0], ids(12))
    keyed = Admission(Tenant.of_salt("team-secret"), "write", keeps=True)
    own_load = TransferParams(load=(PieceSpec(0, 8),))
    nonces = []
    for given in (None, BlendRequest(nonce="short"), BlendRequest(nonce="n" * 20)):
        asked = Arrival("", replace(own_load, blend=given), keyed)
        engine_prompt, params, admission = run(hook, p, arrival=asked)
        sent = sent_params(params)
        assert sent.reuse == "blend" and sent.load == own_load.load
        assert sent.blend is not None and len(sent.blend.nonce) >= BlendRequest.NONCE_CHARS
        assert engine_prompt["cache_salt"] == request_salt(admission.tenant, sent.layout)
        nonces.append(sent.blend.nonce)
    assert nonces[0] != nonces[1] and nonces[2] == "n" * 20


def test_where_the_workers_have_the_model_an_anonymous_requests_texts_are_computed_in_place() -> (
    None
):
    """``in_place`` (the server attached the model to its workers): the same request
    encodes nothing and waits for nothing; its head and glue are computed pieces of
    its load (under its secret suffix: its salt is its own), nothing of it is stored
    or forgotten, and the same request sent twice takes the same course."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    forgotten: list[Any] = []
    hook, engine = hook_over(stored, forget=lambda tenant, entry: forgotten.append(entry))
    hook.in_place = True
    keys = set(stored.keys)
    p = prompt([1, 3, 0], ids(12))
    salts, courses = [], []
    for _ in range(2):
        engine.seen.clear()
        engine_prompt, params, admission = run(hook, p)
        sent = sent_params(params)
        assert not engine.encodes() and not sent.save
        assert sent.load_end == len(p) - 12 - len(TAIL)
        assert [q.computed for q in sent.load] == [True, False, True, False, True, False]
        assert not any(q.own for q in sent.load)
        assert all(q.tail == sent.load[0].tail for q in sent.load if q.computed)
        assert engine_prompt["cache_salt"] == request_salt(admission.tenant, sent.layout)
        salts.append(engine_prompt["cache_salt"])
        courses.append(course(engine, params))
    assert salts[0] != salts[1] and courses[0] == courses[1]
    assert stored.keys == keys and not forgotten


@pytest.mark.parametrize(
    ("answers", "blend", "in_place"),
    [
        ([""], False, True),  # every worker took the model
        (["layer 3 uses ALiBi"], False, False),  # turbo: own texts encoded instead
        (RuntimeError("no kvrag_attach_model"), False, False),  # no worker extension
        ([""], True, True),
        (["layer 3 uses ALiBi"], True, None),  # blend: the server stops, saying why
    ],
)
def test_the_workers_model_decides_whether_own_texts_are_computed_in_place(
    answers: Any, blend: bool, in_place: bool | None
) -> None:
    from kvrag_integrations.errors import UnsupportedModelError
    from kvrag_integrations.vllm.server.startup import attach_model

    async def collective_rpc(method: str) -> list[str]:
        if isinstance(answers, Exception):
            raise answers
        return answers

    client = SimpleNamespace(collective_rpc=collective_rpc)
    if in_place is None:
        with pytest.raises(UnsupportedModelError, match="ALiBi"):
            asyncio.run(attach_model(client, blend))
    else:
        assert asyncio.run(attach_model(client, blend)) is in_place
