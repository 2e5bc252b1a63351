"""The connector's scheduler side: what a request may load, and what to save when.

Its logic without vLLM: requests are what vLLM hands it (id, prompt ids,
``kv_transfer_params`` with the admission the server's door signed), the store
is a set of keys. The vLLM lane runs the same code inside vLLM
(tests/integration/with_vllm).
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.engine.blend_settings import BlendSettings
from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.admission import Admission, ClientPolicy
from kvrag_integrations.vllm.connector.scheduler_side import SchedulerSide
from kvrag_integrations.vllm.params import SERVER_FIELDS, BlendRequest, PieceSpec, TransferParams
from kvrag_integrations.vllm.trust import Grant, Tenant, key_digest, request_salt

FP = "fp+kv-float16"
PROMPT = list(range(100, 400))  # 300 tokens
RUN = (PieceSpec(0, 20), PieceSpec(20, 100, (7,)), PieceSpec(120, 150))  # then 30 of text


SECRET = b"s3cret"
SHARED = Admission(Tenant(), "write")  # a writer of the shared namespace


def policy(**settings: object) -> ClientPolicy:
    """An untrusted server's rules (``settings`` override them)."""
    defaults = {"trusted": False, "client_role": "write", "max_entry_tokens": 4096}
    return ClientPolicy(**{**defaults, "secret": SECRET, **settings})  # type: ignore[arg-type]


def request(
    rid: str,
    params: TransferParams,
    prompt: list[int] = PROMPT,
    salt: str | None = "derived",
    admission: Admission | None = SHARED,
) -> SimpleNamespace:
    """A request as vLLM hands it: with the admission the server's door signed, and
    by default with the salt the server's hook sets for it."""
    if admission is not None:  # (bound to its prompt, as the hook signs it)
        params = replace(params, admission=admission.bound(prompt).signed(SECRET))
    tenant = admission.tenant if admission is not None else Tenant.of_salt(params.tenant_salt)
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        kv_transfer_params=params.as_request(),
        cache_salt=request_salt(tenant, params.layout) if salt == "derived" else salt,
        prefill_stats=SimpleNamespace(
            num_cached_tokens=0, num_external_cached_tokens=0, num_computed_tokens=len(prompt)
        ),
    )


def side(
    stored: set[str],
    fingerprints: tuple[str, ...] = (FP,),
    policy: ClientPolicy | None = None,
    lossless: bool = True,
) -> SchedulerSide:
    policy = policy or globals()["policy"]()
    return SchedulerSide(fingerprints, stored.__contains__, lambda rid: [3, 5, 8], policy, lossless)


def key(piece: PieceSpec, fp: str = FP, prompt: list[int] = PROMPT) -> str:
    return cache_key(fp, piece.entry_ids(prompt))


def test_the_stored_prefix_of_the_run_is_loaded() -> None:
    everything = side({key(p) for p in RUN})
    assert everything.matched_tokens(request("a", TransferParams(load=RUN)), 0) == 270
    middle_missing = side({key(RUN[0]), key(RUN[2])})
    assert middle_missing.matched_tokens(request("b", TransferParams(load=RUN)), 0) == 20
    # vLLM's own prefix cache already has the first 128 tokens: only the rest is external
    assert everything.matched_tokens(request("c", TransferParams(load=RUN)), 128) == 142


def test_vllm_always_computes_the_last_prompt_token() -> None:
    whole = (PieceSpec(0, 300),)
    s = side({key(whole[0])})
    assert s.matched_tokens(request("a", TransferParams(load=whole)), 0) == 299


def test_tensor_parallel_needs_every_ranks_entry() -> None:
    ranks = ("fp+tp0of2", "fp+tp1of2")
    half = side({key(p, ranks[0]) for p in RUN}, ranks)
    assert half.matched_tokens(request("a", TransferParams(load=RUN)), 0) == 0
    both = side({key(p, f) for p in RUN for f in ranks}, ranks)
    assert both.matched_tokens(request("a", TransferParams(load=RUN)), 0) == 270


def test_malformed_params_load_nothing() -> None:
    s = side({key(p) for p in RUN})
    bad = SimpleNamespace(
        request_id="x",
        prompt_token_ids=PROMPT,
        kv_transfer_params={"kvrag": {"load": 5}},
        cache_salt=None,
    )
    assert s.matched_tokens(bad, 0) == 0
    beyond = TransferParams(load=(PieceSpec(0, 400),))
    assert s.matched_tokens(request("y", beyond), 0) == 0


def test_a_load_is_handed_to_the_workers_once_with_its_range() -> None:
    s = side({key(p) for p in RUN})
    req = request("a", TransferParams(load=RUN))
    external = s.matched_tokens(req, 64)  # vLLM's own prefix cache holds 64 tokens
    s.allocated(req, external)
    ops = s.step([("a", 270, 30)])  # vLLM counts the external tokens as computed
    (load,) = ops.loads
    assert (load.lo, load.hi, load.block_ids) == (64, 270, (3, 5, 8))
    assert [(p.start, p.rows) for p in load.pieces] == [(20, 100), (120, 150)]
    assert load.pieces[0].entry_ids[-1] == 7  # the tail completes the entry's ids
    assert not s.step([("a", 300, 1)]).loads  # decoding: nothing more
    assert s.finished("a").loaded == 206


def test_a_save_waits_for_the_whole_prompt_chunked_prefill_included() -> None:
    piece = PieceSpec(0, 300)
    s = side(set())
    req = request("e", TransferParams(save=(piece,)))
    assert s.matched_tokens(req, 0) == 0
    assert not s.step([("e", 0, 128)]).saves  # first part of a chunked prefill
    assert not s.step([("e", 128, 128)]).saves
    (save,) = s.step([("e", 256, 44)]).saves  # the step that completes the prompt
    assert save.pieces[0].entry_ids == tuple(PROMPT)
    assert not s.step([("e", 300, 1)]).saves  # saved once
    reply = s.finished("e")
    assert (reply.keys, reply.stored, reply.fingerprint) == ([key(piece)], 1, FP)


ANONYMOUS = Admission(Tenant("", "kvrag-anon-1"), "write", own=Tenant("own", "kvrag-anon-1"))


def test_a_private_entry_is_the_requests_own_and_not_indexed() -> None:
    """A request's own entry (the reuse hook's glue or prefix of one anonymous request)
    is stored as any whole prompt is, in the request's private namespace, and its
    save tells the workers not to announce it; its loads read it from there."""
    s = side(set())
    own = TransferParams(save=(PieceSpec(0, 300),), own_save=True)
    s.matched_tokens(request("p", own, admission=ANONYMOUS), 0)
    s.matched_tokens(request("o", TransferParams(save=(PieceSpec(0, 300),))), 0)
    saves = s.step([("p", 0, 300), ("o", 0, 300)]).saves
    assert [(op.request_id, op.indexed) for op in saves] == [("p", False), ("o", True)]
    assert [op.pieces[0].namespace for op in saves] == ["own", ""]
    private = Tenant("own").fingerprint(FP)
    assert s.finished("p").keys == [cache_key(private, PROMPT)]
    with pytest.raises(TransferParamsError, match="private applies to a save"):
        TransferParams.from_request({"kvrag": {"private": True}})
    # a load reads its private pieces from there, the others from its tenant's
    run = (replace(RUN[0], own=True), *RUN[1:])
    stored = side({cache_key(private, RUN[0].entry_ids(PROMPT)), *(key(p) for p in RUN[1:])})
    req = request("l", TransferParams(load=run), admission=ANONYMOUS)
    stored.allocated(req, stored.matched_tokens(req, 0))
    (load,) = stored.step([("l", 270, 30)]).loads
    assert [p.namespace for p in load.pieces] == ["own", "", ""]
    # a request without a private namespace has no entries there
    for rid, params in [("s", own), ("t", TransferParams(load=run))]:
        refused = side(set())
        refused.matched_tokens(request(rid, params), 0)
        assert "private namespace" in refused.finished(rid).refused


def test_encoding_a_stored_entry_reads_it_back_and_saves_nothing() -> None:
    piece = PieceSpec(0, 300)
    s = side({key(piece)})
    req = request("e", TransferParams(save=(piece,)))
    assert s.matched_tokens(req, 0) == 299  # one token left for vLLM to compute
    s.allocated(req, 299)
    ops = s.step([("e", 299, 1)])
    assert len(ops.loads) == 1 and not ops.saves
    assert s.finished("e").stored == 0
    again = side({key(piece)}, policy=policy(trusted=True))  # the operator's own code
    forced = request("f", TransferParams(save=(piece,), overwrite=True), admission=None)
    assert again.matched_tokens(forced, 0) == 0
    assert len(again.step([("f", 0, 300)]).saves) == 1


def test_a_request_without_our_params_gets_no_reply() -> None:
    s = side(set())
    plain = SimpleNamespace(
        request_id="p", prompt_token_ids=PROMPT, kv_transfer_params=None, cache_salt=None
    )
    assert s.matched_tokens(plain, 0) == 0
    assert s.finished("p") is None


def test_a_load_that_failed_is_not_counted_as_reused() -> None:
    """Nor in vLLM's own count of the request's cached tokens (what the server reports
    as ``cached_tokens``), which vLLM took when the lookup promised them."""
    s = side({key(p) for p in RUN})
    req = request("a", TransferParams(load=RUN))
    s.allocated(req, s.matched_tokens(req, 0))
    stats = req.prefill_stats  # as vLLM sets them when it schedules the request
    stats.num_cached_tokens = stats.num_external_cached_tokens = 270
    stats.num_computed_tokens = 30
    s.step([("a", 270, 30)])
    s.load_failed("a", 128)  # a worker could not load from 128 on: vLLM recomputed them
    reply = s.finished("a")
    assert (reply.loaded, reply.recomputed) == (128, 142)
    assert (stats.num_cached_tokens, stats.num_computed_tokens) == (128, 172)


# ------------------------------------------------------------------ trust
def test_a_load_under_any_other_salt_loads_nothing() -> None:
    s = side({key(p) for p in RUN})
    for rid, salt in [("none", None), ("other", "kvrag-turbo-0000"), ("tenant", "team-a")]:
        req = request(rid, TransferParams(load=RUN), salt=salt)
        assert s.matched_tokens(req, 0) == 0
        assert "cache_salt" in s.finished(rid).refused


@pytest.mark.parametrize(
    "save",
    [
        (PieceSpec(20, 100),),  # a span of a longer prompt: K/V computed behind other text
        (PieceSpec(0, 100),),  # a prefix of the prompt, not the prompt
        (PieceSpec(0, 300), PieceSpec(0, 300)),  # more than one entry
    ],
)
def test_a_request_stores_only_its_whole_prompt(save: tuple[PieceSpec, ...]) -> None:
    s = side(set())
    req = request("p", TransferParams(save=save))
    assert s.matched_tokens(req, 0) == 0
    assert not s.step([("p", 0, 300)]).saves
    reply = s.finished("p")
    assert reply.stored == 0 and "whole prompt" in reply.refused


def test_a_save_that_loads_is_refused() -> None:
    s = side({key(RUN[0])})
    both = TransferParams(load=(RUN[0],), save=(PieceSpec(0, 300),))
    req = request("p", both)
    assert s.matched_tokens(req, 0) == 0
    assert not s.step([("p", 0, 300)]).saves


def test_a_save_under_a_turbo_salt_is_refused() -> None:
    # vLLM's prefix cache could serve it approximate blocks of that salt
    s = side(set())
    req = request("p", TransferParams(save=(PieceSpec(0, 300),)), salt="kvrag-turbo-ab")
    s.matched_tokens(req, 0)
    assert not s.step([("p", 0, 300)]).saves


def test_overwrite_needs_the_admin_role() -> None:
    piece = PieceSpec(0, 300)
    s = side({key(piece)})  # an untrusted server's default
    req = request("o", TransferParams(save=(piece,), overwrite=True))
    s.matched_tokens(req, 0)
    assert not s.step([("o", 0, 300)]).saves
    assert "admin" in s.finished("o").refused


def test_a_read_role_stores_nothing_and_long_entries_are_refused() -> None:
    piece = PieceSpec(0, 300)
    reader = side(set())
    read = Admission(Tenant(), "read")
    reader.matched_tokens(request("r", TransferParams(save=(piece,)), admission=read), 0)
    assert not reader.step([("r", 0, 300)]).saves
    short = side(set(), policy=policy(max_entry_tokens=256))
    short.matched_tokens(request("l", TransferParams(save=(piece,))), 0)
    assert "at most 256 tokens" in short.finished("l").refused


def test_a_lossy_stored_entry_is_computed_not_loaded_when_encoded_again() -> None:
    piece = PieceSpec(0, 300)
    s = side({key(piece)}, lossless=False)
    req = request("e", TransferParams(save=(piece,)))
    assert s.matched_tokens(req, 0) == 0  # float16 blocks must not enter an exact salt
    assert not s.step([("e", 0, 300)]).saves
    assert s.finished("e").stored == 0


def test_tenants_see_only_their_own_entries() -> None:
    mine = Tenant.of_salt("team-a")
    stored = {cache_key(mine.fingerprint(FP), p.entry_ids(PROMPT)) for p in RUN}
    s = side(stored)
    team_b = Admission(Tenant.of_salt("team-b"), "write", True)
    theirs = request("b", TransferParams(load=RUN), admission=team_b)
    assert s.matched_tokens(theirs, 0) == 0  # nothing loads: nothing is learnt
    shared = request("s", TransferParams(load=RUN))
    assert s.matched_tokens(shared, 0) == 0
    own = request("a", TransferParams(load=RUN), admission=Admission(mine, "write", True))
    assert s.matched_tokens(own, 0) == 270
    s.allocated(own, 270)
    (load,) = s.step([("a", 270, 30)]).loads
    assert {p.namespace for p in load.pieces} == {mine.namespace}  # the workers key by it too
    assert s.finished("a").fingerprint == mine.fingerprint(FP)


def test_an_admission_counts_only_when_signed_with_the_servers_secret() -> None:
    """The door's admission is the one a request is planned by: one that does not
    verify (forged, unsigned, signed with another secret, or a field changed), or
    that was signed for another request or has expired, loads and stores nothing;
    the client's own ``tenant`` decides nothing."""
    tenant = Tenant.of_key_namespace("team-a", SECRET)
    digest = key_digest("sk-team-a", SECRET)
    keys = {digest: Grant("team-a", "write")}
    s = side(set(), policy=policy(keys=keys.get))
    piece = PieceSpec(0, 300)
    admitted = Admission(tenant, "write", True, None, digest, "team-a")
    signed = admitted.bound(PROMPT).signed(SECRET)
    from kvrag_integrations.vllm.admission import ADMISSION_TTL_S

    late = time.time() - ADMISSION_TTL_S - 1
    cases = {
        "signed": signed,
        "forged": {**signed, "mac": "0" * 64},
        "other secret": admitted.bound(PROMPT).signed(b"not-ours"),
        "raised": {**signed, "role": "admin"},
        "none": None,
        # issue 59 hole 7: an admission replayed on another request, or expired
        "another request": admitted.bound(PROMPT[1:]).signed(SECRET),
        "expired": admitted.bound(PROMPT, now=late).signed(SECRET),
    }
    for rid, raw in cases.items():
        params = TransferParams(save=(piece,), admission=raw, tenant_salt="team-a")
        s.matched_tokens(request(rid, params, salt=tenant.salt, admission=None), 0)
    saves = s.step([(rid, 0, 300) for rid in cases]).saves
    assert [op.request_id for op in saves] == ["signed"]
    assert saves[0].pieces[0].namespace == tenant.namespace
    refused = {rid: s.finished(rid).refused for rid in list(cases)[1:]}
    assert "another request" in refused.pop("another request")
    assert "expired" in refused.pop("expired")
    assert all("no admission" in why for why in refused.values())


def test_a_revoked_or_changed_keys_admission_stops_counting() -> None:
    """An admission is bound to its key: once the key file drops the key (or gives it
    another role), the admissions signed for it count no more."""
    tenant = Tenant.of_key_namespace("team-a", SECRET)
    digest = key_digest("sk-team-a", SECRET)
    keys = {digest: Grant("team-a", "write")}
    s = side(set(), policy=policy(keys=keys.get))
    admitted = Admission(tenant, "write", True, None, digest, "team-a")
    cases = ["now", "changed", "revoked"]
    for rid in cases:
        if rid == "changed":
            keys[digest] = Grant("team-a", "read")
        if rid == "revoked":
            keys.clear()
        s.matched_tokens(
            request(rid, TransferParams(save=(PieceSpec(0, 300),)), admission=admitted), 0
        )
    saves = s.step([(rid, 0, 300) for rid in cases]).saves
    assert [op.request_id for op in saves] == ["now"]
    assert all("key file" in s.finished(rid).refused for rid in ("changed", "revoked"))


# ---------------------------------------------------------------- blend
NONCE = "n" * 32
BLEND_RUN = (PieceSpec(0, 20), PieceSpec(20, 100, (7,)), PieceSpec(120, 6), PieceSpec(126, 150))


def blend_side(
    stored: set[str], reuse: str = "blend", calibrated: BlendSettings | None = None
) -> SchedulerSide:
    asked: list[tuple[float, str]] = []

    def settings(tokens: float, context: str) -> BlendSettings | None:
        asked.append((tokens, context))
        return calibrated

    s = SchedulerSide(
        (FP,), stored.__contains__, lambda rid: [3, 5, 8], policy(), True, reuse, settings, 1
    )
    s.asked = asked  # type: ignore[attr-defined]
    return s


def blend_params(**options: object) -> TransferParams:
    return TransferParams(
        load=BLEND_RUN, reuse="blend", blend=BlendRequest(options=options, nonce=NONCE)
    )


def test_a_blend_load_hands_the_workers_its_spans_settings_and_question() -> None:
    tuned = BlendSettings("alone", "query", 0.3)
    s = blend_side({key(p) for p in BLEND_RUN}, calibrated=tuned)
    req = request("b", blend_params())
    external = s.matched_tokens(req, 0)
    assert external == 276
    s.allocated(req, external)
    (load,) = s.step([("b", 276, 24)]).loads
    op = load.blend
    assert op is not None
    assert op.exact == 20  # the leading piece: read at 0 from row 0, exact
    assert op.texts == ((120, 126),)  # a short piece: text between passages
    assert op.chunks == ((20, 120), (126, 276))
    assert op.tail == tuple(PROMPT[276:])  # the question's ids, after the run
    assert op.settings == tuned
    assert s.asked == [(150, "alone")]  # the calibration asked for the chunks' median length
    # the call's own options win over the calibrated ones
    s2 = blend_side({key(p) for p in BLEND_RUN}, calibrated=tuned)
    req2 = request("c", blend_params(recompute_ratio=1.0))
    s2.allocated(req2, s2.matched_tokens(req2, 0))
    (load2,) = s2.step([("c", 276, 24)]).loads
    assert load2.blend is not None and load2.blend.settings.recompute_ratio == 1.0
    assert load2.blend.settings.selection == "query"
    # What it recomputes is known when the load is handed over (a request answered
    # in that step is replied to before the workers report): every text row and all
    # the chunk rows at ratio 1.
    assert load2.blend.recomputed == 6 + 250
    reply = s2.finished("c")
    assert (reply.reuse, reply.blended, reply.loaded) == ("blend", 256, 276)


def test_an_uncalibrated_model_blends_with_cacheblends_own_defaults() -> None:
    s = blend_side({key(p) for p in BLEND_RUN})
    req = request("d", blend_params())
    s.allocated(req, s.matched_tokens(req, 0))
    (load,) = s.step([("d", 276, 24)]).loads
    assert load.blend is not None
    assert load.blend.settings == BlendSettings("alone", "deviation", 0.15)


def test_blend_is_refused_where_the_server_reuses_by_turbo_or_without_a_nonce() -> None:
    turbo_server = blend_side({key(p) for p in BLEND_RUN}, reuse="turbo")
    assert turbo_server.matched_tokens(request("e", blend_params()), 0) == 0
    assert "reuse is turbo" in turbo_server.finished("e").refused
    s = blend_side({key(p) for p in BLEND_RUN})
    no_nonce = TransferParams(load=BLEND_RUN, reuse="blend", blend=BlendRequest())
    assert s.matched_tokens(request("f", no_nonce), 0) == 0
    assert "nonce" in s.finished("f").refused
    bad = blend_params(recompute_ratio=3.0)
    assert s.matched_tokens(request("g", bad), 0) == 0
    assert "recompute_ratio" in s.finished("g").refused


def test_a_blend_server_blends_a_request_that_names_no_reuse_and_turbos_one_that_does() -> None:
    s = blend_side({key(p) for p in BLEND_RUN})
    plain = TransferParams(
        load=BLEND_RUN, blend=None
    )  # (the server's reuse: blend, but no nonce: refused, never silently turbo)
    assert s.matched_tokens(request("h", plain), 0) == 0
    turbo = TransferParams(load=BLEND_RUN, reuse="turbo")
    req = request("i", turbo)
    s.allocated(req, s.matched_tokens(req, 0))
    (load,) = s.step([("i", 276, 24)]).loads
    assert load.blend is None


def test_a_blend_salt_is_its_nonces() -> None:
    a, b = (
        blend_params(),
        TransferParams(load=BLEND_RUN, reuse="blend", blend=BlendRequest(nonce="m" * 32)),
    )
    salts = {request_salt(Tenant(), p.layout) for p in (a, b, TransferParams(load=BLEND_RUN))}
    assert len(salts) == 3  # two blend loads of one layout, and turbo: three salts


# ------------------------------------------------------- computed pieces
SECRET_TAIL = (9, 9, 9)
TEXT = PieceSpec(20, 6, SECRET_TAIL, computed=True)  # a request's own text, read from nowhere
COMPUTED_RUN = (PieceSpec(0, 20), TEXT, PieceSpec(26, 150))


def test_a_computed_piece_needs_no_entry_and_its_rows_are_not_counted_as_cached() -> None:
    """A turbo load's computed piece: the run loads through it (nothing stored under
    it) and the workers get it marked: they compute its rows alone, as its entry
    would have been encoded (counted with the load, as blend's recomputed rows are;
    where they cannot, the whole load is a miss)."""
    s = side({key(COMPUTED_RUN[0]), key(COMPUTED_RUN[2])})
    req = request("t", TransferParams(load=COMPUTED_RUN))
    assert s.matched_tokens(req, 0) == 176
    s.allocated(req, 176)
    stats = req.prefill_stats  # as vLLM sets them when it schedules the request
    stats.num_cached_tokens = stats.num_external_cached_tokens = 176
    (load,) = s.step([("t", 176, 124)]).loads
    assert [p.computed for p in load.pieces] == [False, True, False]
    assert load.pieces[1].entry_ids == (*PROMPT[20:26], *SECRET_TAIL)
    assert load.blend is None
    s.load_failed("t", 0)  # the workers could not compute it: all of it recomputed
    reply = s.finished("t")
    assert (reply.loaded, reply.recomputed, reply.reuse) == (0, 176, "turbo")
    assert stats.num_cached_tokens == 0
    # computed or not, the stored pieces around it must be there
    assert side({key(COMPUTED_RUN[0])}).matched_tokens(req, 0) == 26


def test_a_blend_loads_computed_head_is_recomputed_not_taken_as_exact() -> None:
    """A computed piece at position 0, however long, is text the op computes: never
    the exact leading piece, never a candidate chunk left unselected."""
    head = PieceSpec(0, 40, SECRET_TAIL, computed=True)
    run = (head, PieceSpec(40, 100, (7,)), PieceSpec(140, 150))
    s = blend_side({key(p) for p in run[1:]})
    params = TransferParams(load=run, reuse="blend", blend=BlendRequest(nonce=NONCE))
    req = request("h", params)
    s.allocated(req, s.matched_tokens(req, 0))
    (load,) = s.step([("h", 290, 10)]).loads
    assert load.blend is not None
    assert (load.blend.exact, load.blend.texts) == (0, ((0, 40),))
    assert load.blend.chunks == ((40, 140), (140, 290))


def test_computed_pieces_are_the_servers_and_salt_the_layout() -> None:
    """``computed_load`` is a server field (a client's is refused where it enters),
    round-trips, cannot also be read privately, and changes the request's salt."""
    params = TransferParams(load=COMPUTED_RUN)
    again = TransferParams.from_request(params.as_request())
    assert again == params and params.as_request()["kvrag"]["computed_load"] == [1]
    plain = TransferParams(load=(COMPUTED_RUN[0], replace(TEXT, computed=False), COMPUTED_RUN[2]))
    assert request_salt(Tenant(), params.layout) != request_salt(Tenant(), plain.layout)
    both = {**params.as_request()["kvrag"], "private_load": [1]}
    with pytest.raises(TransferParamsError, match="not private_load"):
        TransferParams.from_request({"kvrag": both})
    assert "computed_load" in SERVER_FIELDS
