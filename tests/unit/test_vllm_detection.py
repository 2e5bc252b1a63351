"""The server's detection of stored passages in plain requests, without vLLM.

A real ``ContentIndex`` and a real ``MemoryKVStore``'s keys; the prompts are
token ids laid out as a RAG template lays them: a head, passages with glue
between them, a question. What is planned is checked against the ids (every
piece's entry ids are the ones of an entry stored), and the hook is checked on
a fake engine client's ``generate`` (what it hands on: salt and params).
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.matching import ContentIndex
from kvrag_integrations.vllm.params import PARAMS_KEY, PieceSpec, TransferParams
from kvrag_integrations.vllm.server.detection import Detector
from kvrag_integrations.vllm.server.reuse_hook import ReuseHook
from kvrag_integrations.vllm.trust import ANON_SALT_PREFIX, ClientPolicy, Tenant, request_salt

FP = "fp+kv-float16"
rng = random.Random(0)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


HEAD, GLUE, TAIL = ids(40), [198, 198], [2, 198, 1, 4093, 198]
PASSAGES = [ids(120 + 10 * i) for i in range(5)]


def prompt(order: list[int], question: list[int], glue: list[int] = GLUE) -> list[int]:
    out = list(HEAD)
    for i in order:  # the head ends as the glue does ("...context:\n\n"), as templates do
        out += glue + PASSAGES[i]
    return out + TAIL + question


class Stored:
    """Keys of stored entries, and the index of their ids (what a worker announces)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.index = ContentIndex()

    def put(self, entry: list[int], fp: str = FP) -> None:
        self.keys.add(cache_key(fp, entry))
        self.index.add(fp, entry)

    def detector(self, **kw) -> Detector:
        return Detector(self.index, self.keys.__contains__, FP, **kw)


def check_pieces(pieces: tuple[PieceSpec, ...], prompt_ids: list[int], stored: Stored) -> int:
    """Every piece follows the last, and reads an entry that is stored."""
    position = 0
    for piece in pieces:
        assert piece.start == position
        assert cache_key(FP, piece.entry_ids(prompt_ids)) in stored.keys
        position = piece.end
    return position


def test_a_prompt_without_stored_passages_is_learned_whole_and_loads_nothing() -> None:
    stored = Stored()
    stored.put(ids(200))  # something else
    p = prompt([0, 1, 2], ids(12))
    plan = stored.detector().detect(FP, p, may_learn=True)
    assert plan.load == () and plan.learn_prompt
    assert not stored.detector().detect(FP, p, may_learn=False).learn_prompt  # a reader
    assert not stored.detector().detect(FP, p[:100], may_learn=True).learn_prompt  # short


def test_a_learned_prompt_serves_its_passages_in_another_order_and_a_new_question() -> None:
    stored = Stored()
    first = prompt([0, 1, 2, 3], ids(12))
    stored.put(first)  # what the first request stored
    second = prompt([2, 0, 3, 1], ids(15))
    plan = stored.detector().detect(FP, second, may_learn=True)
    end = check_pieces(plan.load, second, stored)
    # everything up to the question (and the template's tail before it) comes from storage
    assert end >= len(second) - 15 - len(TAIL)
    assert plan.load[0].lead == ()  # the head: rows 0.. of the stored prompt (exact)
    assert not plan.learn_prompt and plan.learn == ()


def test_ingested_passages_with_unknown_glue_and_head_teach_both() -> None:
    stored = Stored()
    for passage in PASSAGES:
        stored.put([*passage, 4093])  # ingested with a suffix the template does not use
    p = prompt([1, 3, 0], ids(12))
    plan = stored.detector().detect(FP, p, may_learn=True)
    # the head is unknown: nothing loads, the prompt is stored whole, the glue learned
    # and the prompt's prefix up to the first passage encoded (exact) before it is planned
    first = p.index(PASSAGES[1][0])
    assert plan.load == () and plan.learn_prompt and plan.glue == (tuple(p[:first]), tuple(GLUE))
    unbounded = stored.detector(max_prefix_tokens=first - 1).detect(FP, p, may_learn=True)
    assert unbounded.glue == (tuple(GLUE),)  # a longer prefix is not encoded first
    stored.put(GLUE)
    stored.put(HEAD + GLUE)  # (a head learned on its own, as a short template's would be)
    plan = stored.detector().detect(FP, p, may_learn=True)
    end = check_pieces(plan.load, p, stored)
    assert end == len(p) - 12 - len(TAIL)  # the passages and glue: up to the template's tail
    passage = plan.load[1]
    assert passage.tail == (4093,) and passage.lead == ()


def agent_call() -> tuple[Stored, list[int], int]:
    """An agent's second model call over ingested passages: head, a new question and
    the tool call (long, unknown), then the passages its tool returned; and where
    they begin."""
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    stored.put(GLUE)
    p = HEAD + ids(60) + GLUE + PASSAGES[2] + GLUE + PASSAGES[0] + TAIL
    return stored, p, p.index(PASSAGES[2][0])


def test_a_tenants_question_and_tool_call_before_stored_passages_are_learned_first() -> None:
    """In a tenant's own namespace the prefix up to the passages is learned as glue
    (exact: from position 0), then everything before the template's tail loads."""
    stored, p, first = agent_call()
    plan = stored.detector().detect(FP, p, may_learn=True)
    assert plan.load == () and plan.glue == (tuple(p[:first]),) and plan.prefix == first
    assert not stored.detector().detect(FP, p, may_learn=False).glue  # a reader stores none
    stored.put(p[:first])  # what the hook's encode of that glue stores
    plan = stored.detector().detect(FP, p, may_learn=True)
    assert check_pieces(plan.load, p, stored) == len(p) - len(TAIL)
    assert plan.load[0] == PieceSpec(0, first)  # the prefix: its own exact entry


def test_an_anonymous_prefix_is_no_glue_and_its_private_piece_leads_the_load() -> None:
    """In the shared namespace the prefix is private text: never glue (which is stored
    and indexed there); given as the request's own piece, the passages load after it."""
    stored, p, first = agent_call()
    plan = stored.detector().detect(FP, p, may_learn=False, fresh_glue=True)
    assert plan.prefix == first and plan.load == () and plan.glue == (tuple(GLUE),)
    private = PieceSpec(0, first, tuple(ids(24)))
    stored.keys.add(cache_key(FP, private.entry_ids(p)))  # stored, never indexed
    plan = stored.detector().detect(FP, p, may_learn=False, prefix=private)
    assert check_pieces(plan.load, p, stored) == len(p) - len(TAIL)
    assert plan.load[0] == private and plan.load[1].start == first
    # too little found after a long prefix is not worth its encode
    short = HEAD + ids(60) + GLUE + PASSAGES[2][:40] + ids(80)
    assert stored.detector().detect(FP, short, False, fresh_glue=True).prefix == 0


def test_unknown_text_between_passages_stops_the_load_and_is_learned() -> None:
    stored = Stored()
    stored.put(prompt([0, 1], ids(10)))
    new = ids(300)
    p = HEAD + GLUE + PASSAGES[1] + GLUE + PASSAGES[0] + GLUE + new + GLUE + PASSAGES[1] + TAIL
    plan = stored.detector(min_share=0.1).detect(FP, p, may_learn=True)
    end = check_pieces(plan.load, p, stored)
    assert end == p.index(new[0])  # (the glue after P0 comes with it: stored so too)
    assert plan.learn == (tuple(p[end:]),)  # the remainder, encoded in the background


def test_entries_the_store_lost_are_forgotten_and_tenants_see_only_their_own() -> None:
    stored = Stored()
    first = prompt([0, 1, 2], ids(10))
    stored.put(first)
    stored.keys.clear()  # evicted since it was indexed
    plan = stored.detector().detect(FP, prompt([1, 0, 2], ids(9)), may_learn=True)
    assert plan.load == () and len(stored.index) == 0
    other = Tenant.of_salt("team-b").fingerprint(FP)
    stored.put(first, other)
    assert stored.detector().detect(FP, prompt([1, 0, 2], ids(9)), True).load == ()


# ------------------------------------------------------------------ the hook
class FakeEngine:
    def __init__(self) -> None:
        self.seen: list[tuple[dict, object, str]] = []

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        self.seen.append((dict(prompt), sampling_params, request_id))
        yield SimpleNamespace(request_id=request_id)


def run(hook: ReuseHook, prompt_ids: list[int], extra: dict | None = None, salt=None, **kw):
    engine_prompt = {"type": "token", "prompt_token_ids": prompt_ids}
    if salt:
        engine_prompt["cache_salt"] = salt
    params = SimpleNamespace(extra_args=extra, prompt_logprobs=kw.pop("prompt_logprobs", None))

    async def go() -> None:
        async for _ in hook.generate(engine_prompt, params, "r1", **kw):
            pass
        await hook.drain()

    asyncio.run(go())
    return engine_prompt, params


def hook_over(
    stored: Stored, role: str = "write", policy: ClientPolicy | None = None
) -> tuple[ReuseHook, FakeEngine]:
    """A hook over ``stored``; its default policy lets anonymous callers share (the
    operator's opt-in: what the shared namespace's learning cases need)."""
    engine = FakeEngine()
    policy = policy or ClientPolicy(client_role=role, share_anonymous=True)
    return ReuseHook(engine.generate, stored.detector(), policy, SimpleNamespace), engine


SECRET = b"server-secret"


def test_at_the_defaults_an_anonymous_request_reads_ingested_passages_under_its_own_salt() -> None:
    """No key, no salt: it loads what writers stored, shares no prefix block with any
    other request (a salt of its own), and the server learns nothing from it."""
    stored = Stored()
    for passage in [*PASSAGES, GLUE, HEAD + GLUE]:
        stored.put(passage)
    policy = ClientPolicy(secret=SECRET)  # a server's defaults
    hook, engine = hook_over(stored, policy=policy)
    p = prompt([1, 3, 0], ids(12))
    salts = []
    for turn in range(2):
        engine_prompt, params = run(hook, p)
        sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
        assert sent.load_end >= len(p) - 12 - len(TAIL) and not sent.save and not sent.tenant
        # its glue is encoded again, stored or not: its course depends on no one's text
        learned = [s for s in engine.seen if s[2].startswith("kvrag-learn-")]
        assert [s[0]["prompt_token_ids"] for s in learned] == [GLUE] * (turn + 1)
        tenant, _ = policy.tenant_and_role(sent.tenant, sent.grant, None, True)
        assert tenant.namespace == "" and tenant.salt.startswith(ANON_SALT_PREFIX)
        # the connector admits the load: the salt is the one of its tenant and layout
        assert engine_prompt["cache_salt"] == request_salt(tenant, sent.layout)
        salts.append(engine_prompt["cache_salt"])
    assert salts[0] != salts[1]  # two anonymous requests share no prefix block
    # a prompt with nothing stored in it is computed exactly, under its own salt, unlearned
    engine_prompt, params = run(hook, ids(400))
    sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
    assert not sent.save and not sent.load
    assert engine_prompt["cache_salt"].startswith(ANON_SALT_PREFIX)


def test_at_the_defaults_a_tenants_own_salt_still_learns_its_prompts() -> None:
    stored = Stored()
    hook, _ = hook_over(stored, policy=ClientPolicy(secret=SECRET))
    engine_prompt, params = run(hook, ids(400), salt="team-a")
    sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
    assert sent.save == (PieceSpec(0, 400),) and sent.learn and sent.tenant == "team-a"
    assert engine_prompt["cache_salt"] == "team-a"


def test_a_clients_own_grant_or_anonymous_salt_is_no_tenant() -> None:
    """A grant the client made up does not verify: the request is anonymous."""
    stored = Stored()
    hook, _ = hook_over(stored, policy=ClientPolicy(secret=SECRET))
    forged = {"namespace": "", "role": "admin", "nonce": "0" * 32, "mac": "0" * 64}
    extra = {"kv_transfer_params": {PARAMS_KEY: {"grant": forged}}}
    engine_prompt, params = run(hook, ids(400), extra)
    sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
    assert sent.grant["nonce"] != forged["nonce"] and not sent.save
    assert engine_prompt["cache_salt"] == ANON_SALT_PREFIX + sent.grant["nonce"]


def test_the_hook_writes_the_load_and_its_salt_for_the_connector() -> None:
    stored = Stored()
    team_a = Tenant.of_salt("team-a")
    stored.put(prompt([0, 1, 2], ids(10)), team_a.fingerprint(FP))
    hook, _engine = hook_over(stored)
    p = prompt([2, 1, 0], ids(14))
    engine_prompt, params = run(hook, p, salt="team-a")
    sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
    assert sent.load and sent.tenant == "team-a" and not sent.save
    assert sent.load_end >= len(p) - 14 - len(TAIL)
    # the salt is the one the connector admits a load of this layout under
    assert engine_prompt["cache_salt"] == request_salt(team_a, sent.layout)
    # the shared namespace finds none of team-a's: it learns the prompt instead
    engine_prompt, params = run(hook, p)
    sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
    assert not sent.load and sent.save and "cache_salt" not in engine_prompt


@pytest.mark.parametrize(
    "case",
    ["opt-out", "no-passage", "prompt-logprobs", "lora", "vllm-engine-client", "other-connector"],
)
def test_requests_that_pass_through_are_untouched(case: str) -> None:
    stored = Stored()
    stored.put(prompt([0, 1, 2], ids(10)))
    hook, _engine = hook_over(stored)
    p = prompt([2, 1, 0], ids(14))
    extra, kw = None, {}
    if case == "opt-out":
        extra = {"kv_transfer_params": {PARAMS_KEY: {"detect": False}}}
    elif case == "no-passage":
        p = ids(100)  # short: not learned either
    elif case == "prompt-logprobs":
        kw["prompt_logprobs"] = 1
    elif case == "lora":
        kw["lora_request"] = object()
    elif case == "vllm-engine-client":
        extra = {"kv_transfer_params": {PARAMS_KEY: {"load": [[0, 40, []]]}}}
    else:
        extra = {"kv_transfer_params": {"do_remote_prefill": True}}
    before = None if extra is None else {k: dict(v) for k, v in extra.items()}
    engine_prompt, params = run(hook, p, extra, **kw)
    assert "cache_salt" not in engine_prompt
    assert params.extra_args == before


def test_the_hook_learns_a_new_prompt_in_the_request_and_glue_in_the_background() -> None:
    stored = Stored()
    for passage in PASSAGES:
        stored.put(passage)
    hook, engine = hook_over(stored)
    p = prompt([1, 3, 0], ids(12))
    engine_prompt, params = run(hook, p)
    sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
    assert sent.save == (PieceSpec(0, len(p)),) and not sent.load
    assert "cache_salt" not in engine_prompt  # the shared namespace's exact requests: no salt
    learned = [s for s in engine.seen if s[2].startswith("kvrag-learn-")]
    # the prompt's unknown prefix up to the first passage (exact) and the glue
    assert [s[0]["prompt_token_ids"] for s in learned] == [HEAD + GLUE, GLUE]
    assert engine.seen[-1][2] == "r1"  # the glue first: the request was planned after it
    glue_params = TransferParams.from_request(learned[1][1].extra_args["kv_transfer_params"])
    assert glue_params.save == (PieceSpec(0, 2),)
    # a reader teaches nothing
    hook, engine = hook_over(stored, role="read")
    engine_prompt, params = run(hook, p)
    assert params.extra_args is None and len(engine.seen) == 1


def test_a_request_right_after_a_learning_one_waits_for_its_prompt_to_land() -> None:
    """A learned prompt is stored after its answer: a new question asked at once
    waits for it (briefly) rather than finding nothing and teaching it again."""
    stored = Stored()
    hook, _ = hook_over(stored)
    first = prompt([0, 1, 2], ids(10))
    _, params = run(hook, first)
    assert TransferParams.from_request(params.extra_args["kv_transfer_params"]).learn
    second = prompt([2, 0, 1], ids(12))
    engine_prompt = {"type": "token", "prompt_token_ids": second}
    sampling = SimpleNamespace(extra_args=None, prompt_logprobs=None)

    async def go() -> None:
        async def land() -> None:  # the worker's writer stores it a moment later
            await asyncio.sleep(0.1)
            stored.put(first)

        landing = asyncio.create_task(land())
        async for _ in hook.generate(engine_prompt, sampling, "r2"):
            pass
        await landing

    asyncio.run(go())
    sent = TransferParams.from_request(sampling.extra_args["kv_transfer_params"])
    assert sent.load and not sent.save


def test_a_passage_stored_after_text_this_prompt_lacks_is_not_read_from_there() -> None:
    """Rows carry what they attended to: a passage inside a stored prompt after an
    injected instruction is not loaded into a prompt without that instruction."""
    stored = Stored()
    injection = ids(40)
    stored.put(HEAD + GLUE + injection + GLUE + PASSAGES[0] + GLUE + PASSAGES[1] + TAIL)
    victim = prompt([1, 0], ids(12))
    plan = stored.detector().detect(FP, victim, may_learn=True)
    end = check_pieces(plan.load, victim, stored)
    assert end <= len(HEAD) + len(GLUE)  # only the head (what the victim sent too)
    # the same passages after text the victim does send are read as before
    stored.put(prompt([0, 1], ids(10)))
    plan = stored.detector().detect(FP, victim, may_learn=True)
    assert check_pieces(plan.load, victim, stored) >= len(victim) - 12 - len(TAIL)


class StoringEngine(FakeEngine):
    """Stores what a background encode saves, as the connector's workers do: a
    private entry under its key only (never announced to the index)."""

    def __init__(self, stored: Stored) -> None:
        super().__init__()
        self.stored = stored

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        async for out in super().generate(prompt, sampling_params, request_id, **kwargs):
            extra = sampling_params.extra_args or {}
            sent = TransferParams.from_request(extra.get("kv_transfer_params"))
            if request_id.startswith("kvrag-learn-") and sent and sent.save:
                entry = prompt["prompt_token_ids"]
                if sent.private:
                    self.stored.keys.add(cache_key(FP, entry))
                else:
                    self.stored.put(entry)
            yield out


def test_at_the_defaults_an_anonymous_agents_prefix_is_its_own_and_its_passages_load() -> None:
    """An anonymous agent's second call: the question and tool call before the tool's
    passages are encoded for this request alone (a private entry: ids with a secret
    suffix, unindexed, under its own salt), it loads them then the passages, and the
    entry is deleted once it is answered. Another caller never finds it."""
    stored, p, first = agent_call()
    policy = ClientPolicy(secret=SECRET)  # a server's defaults
    engine = StoringEngine(stored)
    forgotten = []

    def forget(tenant: Tenant, entry) -> None:
        forgotten.append(list(entry))
        stored.keys.discard(cache_key(tenant.fingerprint(FP), list(entry)))

    hook = ReuseHook(engine.generate, stored.detector(), policy, SimpleNamespace, forget)
    tails = []
    for _ in range(2):
        engine.seen.clear()
        engine_prompt, params = run(hook, p)
        sent = TransferParams.from_request(params.extra_args["kv_transfer_params"])
        encodes = [s for s in engine.seen if s[2].startswith("kvrag-learn-")]
        (own,) = [s for s in encodes if s[0]["prompt_token_ids"] != GLUE]
        entry = own[0]["prompt_token_ids"]
        own_params = TransferParams.from_request(own[1].extra_args["kv_transfer_params"])
        assert entry[:first] == p[:first] and len(entry) == first + 24
        assert own_params.private and own_params.save == (PieceSpec(0, len(entry)),)
        assert own[0]["cache_salt"].startswith(ANON_SALT_PREFIX)  # its own exact salt
        tenant, _ = policy.tenant_and_role("", sent.grant, None, True)
        assert own[0]["cache_salt"] == tenant.salt  # the request's own tenant
        assert sent.load[0] == PieceSpec(0, first, tuple(entry[first:]))
        # the passages and glue after it load from what writers stored
        assert all(cache_key(FP, x.entry_ids(p)) in stored.keys for x in sent.load[1:])
        assert sent.load_end == len(p) - len(TAIL)
        assert engine_prompt["cache_salt"] == request_salt(tenant, sent.layout)
        assert forgotten[-1] == entry  # answered: dropped
        assert (FP, p[:first]) not in stored.index  # never indexed
        tails.append(tuple(entry[first:]))
    assert tails[0] != tails[1]  # each request's own secret suffix
    assert cache_key(FP, list(p[:first]) + list(tails[0])) not in stored.keys
    # the prefix was never stored where a lookup of its ids finds it
    assert stored.detector().detect(FP, p, False, fresh_glue=True).load == ()
    # a reader stores nothing: no private prefix either, the passages are computed
    engine.seen.clear()
    hook = ReuseHook(
        engine.generate, stored.detector(), ClientPolicy(client_role="read", secret=SECRET)
    )
    _, params = run(hook, p)
    assert not any(s[2].startswith("kvrag-learn-") for s in engine.seen)
