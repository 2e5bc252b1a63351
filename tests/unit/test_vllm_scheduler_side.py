"""The connector's scheduler side: what a request may load, and what to save when.

Its logic without vLLM: requests are what vLLM hands it (id, prompt ids,
``kv_transfer_params``), the store is a set of keys. The vLLM lane runs the
same code inside vLLM (tests/integration/with_vllm).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.connector.scheduler_side import SchedulerSide
from kvrag_integrations.vllm.params import PieceSpec, TransferParams
from kvrag_integrations.vllm.trust import ClientPolicy, Grant, Tenant, key_digest

FP = "fp+kv-float16"
PROMPT = list(range(100, 400))  # 300 tokens
RUN = (PieceSpec(0, 20), PieceSpec(20, 100, (7,)), PieceSpec(120, 150))  # then 30 of text


def request(
    rid: str, params: TransferParams, prompt: list[int] = PROMPT, salt: str | None = "derived"
) -> SimpleNamespace:
    """A request as vLLM hands it; by default with the salt an honest client sends."""
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        kv_transfer_params=params.as_request(),
        cache_salt=params.salt() if salt == "derived" else salt,
    )


def side(
    stored: set[str],
    fingerprints: tuple[str, ...] = (FP,),
    policy: ClientPolicy | None = None,
    lossless: bool = True,
) -> SchedulerSide:
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


def test_a_private_save_is_not_indexed_and_private_needs_a_save() -> None:
    """A private entry (the reuse hook's prefix of one anonymous request) is stored as
    any whole prompt is, but its save tells the workers not to announce it."""
    s = side(set())
    s.matched_tokens(request("p", TransferParams(save=(PieceSpec(0, 300),), private=True)), 0)
    s.matched_tokens(request("o", TransferParams(save=(PieceSpec(0, 300),))), 0)
    saves = s.step([("p", 0, 300), ("o", 0, 300)]).saves
    assert [(op.request_id, op.indexed) for op in saves] == [("p", False), ("o", True)]
    with pytest.raises(TransferParamsError, match="private applies to a save"):
        TransferParams.from_request({"kvrag": {"private": True}})


def test_encoding_a_stored_entry_reads_it_back_and_saves_nothing() -> None:
    piece = PieceSpec(0, 300)
    s = side({key(piece)})
    req = request("e", TransferParams(save=(piece,)))
    assert s.matched_tokens(req, 0) == 299  # one token left for vLLM to compute
    s.allocated(req, 299)
    ops = s.step([("e", 299, 1)])
    assert len(ops.loads) == 1 and not ops.saves
    assert s.finished("e").stored == 0
    again = side({key(piece)}, policy=ClientPolicy(trusted=True))  # the operator's own code
    forced = request("f", TransferParams(save=(piece,), overwrite=True))
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
    s = side({key(p) for p in RUN})
    req = request("a", TransferParams(load=RUN))
    s.allocated(req, s.matched_tokens(req, 0))
    s.step([("a", 270, 30)])
    s.load_failed("a", 128)  # a worker could not load from 128 on: vLLM recomputed them
    reply = s.finished("a")
    assert (reply.loaded, reply.recomputed) == (128, 142)


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
    s = side({key(piece)}, policy=ClientPolicy())  # an untrusted server's default
    req = request("o", TransferParams(save=(piece,), overwrite=True))
    s.matched_tokens(req, 0)
    assert not s.step([("o", 0, 300)]).saves
    assert "admin" in s.finished("o").refused


def test_a_read_role_stores_nothing_and_long_entries_are_refused() -> None:
    piece = PieceSpec(0, 300)
    reader = side(set(), policy=ClientPolicy(client_role="read"))
    reader.matched_tokens(request("r", TransferParams(save=(piece,))), 0)
    assert not reader.step([("r", 0, 300)]).saves
    short = side(set(), policy=ClientPolicy(max_entry_tokens=256))
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
    theirs = request("b", TransferParams(load=RUN, tenant="team-b"))
    assert s.matched_tokens(theirs, 0) == 0  # nothing loads: nothing is learnt
    shared = request("s", TransferParams(load=RUN))
    assert s.matched_tokens(shared, 0) == 0
    own = request("a", TransferParams(load=RUN, tenant="team-a"))
    assert s.matched_tokens(own, 0) == 270
    s.allocated(own, 270)
    (load,) = s.step([("a", 270, 30)]).loads
    assert load.namespace == mine.namespace  # the workers key by it too
    assert s.finished("a").fingerprint == mine.fingerprint(FP)


def test_a_grant_counts_only_when_signed_with_the_servers_secret() -> None:
    secret = b"s3cret"
    tenant = Tenant.of_key_namespace("team-a", secret)
    digest = key_digest("sk-team-a", secret)
    keys = {digest: Grant("team-a", "write")}
    s = side(set(), policy=ClientPolicy(client_role="read", secret=secret, keys=keys.get))
    piece = PieceSpec(0, 300)
    forged = {"namespace": "team-a", "role": "admin", "mac": "0" * 64}
    signed = Grant("team-a", "write", digest).signed(secret)
    for rid, grant in [("forged", forged), ("signed", signed)]:
        params = TransferParams(save=(piece,), grant=grant)
        salt = tenant.salt if rid == "signed" else None
        s.matched_tokens(request(rid, params, salt=salt), 0)
    saves = s.step([("forged", 0, 300), ("signed", 0, 300)]).saves
    assert [op.request_id for op in saves] == ["signed"]  # forged: anonymous, read-only
    assert saves[0].namespace == tenant.namespace


def test_a_revoked_or_changed_keys_grant_stops_counting() -> None:
    """A grant is bound to its key: once the key file drops the key (or gives it
    another role), the grants signed for it are anonymous requests'."""
    secret = b"s3cret"
    tenant = Tenant.of_key_namespace("team-a", secret)
    digest = key_digest("sk-team-a", secret)
    keys = {digest: Grant("team-a", "write")}
    s = side(set(), policy=ClientPolicy(client_role="read", secret=secret, keys=keys.get))
    signed = Grant("team-a", "write", digest).signed(secret)
    unbound = Grant("team-a", "write").signed(secret)  # signed, but of no key
    cases = {"now": signed, "unbound": unbound, "changed": signed, "revoked": signed}
    for rid, grant in cases.items():
        if rid == "changed":
            keys[digest] = Grant("team-a", "read")
        if rid == "revoked":
            keys.clear()
        params = TransferParams(save=(PieceSpec(0, 300),), grant=grant)
        s.matched_tokens(request(rid, params, salt=tenant.salt), 0)
    saves = s.step([(rid, 0, 300) for rid in cases]).saves
    assert [op.request_id for op in saves] == ["now"]
    assert all(s.finished(rid).refused for rid in ("unbound", "changed", "revoked"))
