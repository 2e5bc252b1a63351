"""Admissions and the parsers of what a client sends, as property tests.

Whatever bytes reach the gateway, ``read_body`` answers with what it found or a
``BadRequest`` (a 400), never another error; whatever a client puts in our
``kv_transfer_params["kvrag"]``, ``TransferParams.from_request`` answers with
params or a ``TransferParamsError``, and what it accepts goes through a
request unchanged, but for the fields only the server writes (a request's
private namespace, its admission: refused); an admission verifies only as the
server signed it, for the request it was bound to and until it expires, and a
client's fields other than ``cache_salt`` never make it a tenant.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.admission import Admission, ClientPolicy
from kvrag_integrations.vllm.params import PARAMS_KEY, PieceSpec, TransferParams
from kvrag_integrations.vllm.server.arrival import MAX_DEPTH, Arrival, BadRequest, read_body
from kvrag_integrations.vllm.trust import ANON_SALT_PREFIX, Grant, Tenant

SECRET = b"property-secret"
RULES = ClientPolicy(False, "write", 4096, SECRET)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
# what a client might put where we read: our fields with any values, and others
ours_fields = st.sampled_from(
    [
        *("load", "save", "overwrite", "tenant", "detect", "deferred"),
        *("private", "private_load", "computed_load", "x"),
    ]
)
ours_objects = st.dictionaries(ours_fields, json_values, max_size=5)
small_ints = st.integers(min_value=0, max_value=50)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_read_or_refused_with_a_400(body: bytes) -> None:
    with contextlib.suppress(BadRequest):
        assert isinstance(read_body(body), Arrival)


@settings(max_examples=300, deadline=None)
@given(
    cache_salt=json_values,
    transfer=json_values | st.fixed_dictionaries({PARAMS_KEY: ours_objects | json_values}),
    other=st.dictionaries(st.text(), json_values, max_size=3),
)
def test_any_json_body_is_read_or_refused_with_a_400(
    cache_salt: Any, transfer: Any, other: dict[str, Any]
) -> None:
    body = {**other, "cache_salt": cache_salt, "kv_transfer_params": transfer}
    try:
        arrival = read_body(json.dumps(body).encode())
    except BadRequest:
        return
    assert arrival.cache_salt is None or isinstance(arrival.cache_salt, str)
    # what the gateway accepted, the server admits or refuses with a reason, nothing else
    try:
        tenant = arrival.params.tenant_salt if arrival.params is not None else ""
        admission = RULES.admit(None, arrival.cache_salt, tenant)
    except TransferParamsError:
        return
    assert Admission.verified(admission.signed(SECRET), SECRET) == admission


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=MAX_DEPTH + 1, max_value=20_000))
def test_deep_nesting_is_a_400_at_any_depth(depth: int) -> None:
    body = b'{"kv_transfer_params": ' + b"[" * depth + b"]" * depth + b"}"
    try:
        read_body(body)
    except BadRequest as exc:
        assert "nests deeper" in str(exc)
    else:
        raise AssertionError("accepted")


pieces = st.builds(
    PieceSpec,
    small_ints,
    st.integers(min_value=1, max_value=50),
    st.lists(small_ints, max_size=3).map(tuple),
    st.lists(small_ints, max_size=3).map(tuple),
    st.booleans(),
)


@st.composite
def valid_params(draw: st.DrawFn, server: bool = False) -> TransferParams:
    """Params a client may send: a load run from 0 without gaps, or one save (and
    where ``server``, what the server's hook writes too: own pieces, computed
    pieces, an own save)."""
    load, position = [], 0
    for piece in draw(st.lists(pieces, max_size=4)):
        own = piece.own and server
        computed = server and not own and draw(st.booleans())
        load.append(PieceSpec(position, piece.rows, piece.tail, piece.lead, own, computed))
        position += piece.rows
    save = draw(st.lists(st.builds(PieceSpec, small_ints, st.integers(1, 50)), max_size=1))
    return TransferParams(
        tuple(load),
        tuple(save),
        draw(st.booleans()),
        draw(st.text(max_size=20)),
        None,
        draw(st.booleans()),
        draw(st.booleans()) and bool(save),
        draw(st.booleans()) and bool(save) and server,
    )


@settings(max_examples=300, deadline=None)
@given(valid_params())
def test_params_a_client_may_send_go_through_a_request_unchanged(params: TransferParams) -> None:
    sent = json.loads(json.dumps(params.as_request()))
    assert TransferParams.from_request(sent) == params
    assert read_body(json.dumps({"kv_transfer_params": sent}).encode()).params == params


@settings(max_examples=200, deadline=None)
@given(valid_params(server=True))
def test_a_client_names_nothing_of_a_requests_private_namespace(params: TransferParams) -> None:
    """Issue 59 hole 2: a client's own ``"private": true`` save (or private load) was
    stored in its private namespace and never deleted; only the server's hook
    writes those fields (and computed pieces: a request's own texts), and the
    connector reads them back (the hook's own)."""
    sent = json.loads(json.dumps(params.as_request()))
    assert TransferParams.from_request(sent) == params  # (the hook's, to the connector)
    body = json.dumps({"kv_transfer_params": sent}).encode()
    if params.own_save or any(piece.own or piece.computed for piece in params.load):
        with pytest.raises(BadRequest, match="the server's to write"):
            read_body(body)
    else:
        assert read_body(body).params == params


@settings(max_examples=300, deadline=None)
@given(ours_objects | json_values)
def test_any_params_parse_or_are_refused_with_a_reason(ours: Any) -> None:
    try:
        params = TransferParams.from_request({PARAMS_KEY: ours})
    except TransferParamsError as exc:
        assert str(exc)
        return
    assert params is None or TransferParams.from_request(params.as_request()) == params


@settings(max_examples=200, deadline=None)
@given(
    namespace=st.text(max_size=10),
    role=st.sampled_from(["read", "write", "admin"]),
    field=st.sampled_from(["tenant", "role", "keeps", "own", "key", "name", "prompt", "expires"]),
    value=json_values,
)
def test_an_admission_verifies_only_as_signed(
    namespace: str, role: str, field: str, value: Any
) -> None:
    admission = RULES.admit(Grant(namespace, role, "digest"), None).bound([1, 2, 3])
    signed = admission.signed(SECRET)
    assert Admission.verified(signed, SECRET) == admission
    assert Admission.verified(signed, b"another-secret") is None
    changed = {**signed, field: value}
    if changed[field] != signed[field]:
        assert Admission.verified(changed, SECRET) is None


@settings(max_examples=200, deadline=None)
@given(
    user=st.text(min_size=1, max_size=30),
    field=st.sampled_from(["user", "prompt_cache_key", "safety_identifier"]),
)
def test_fields_that_are_no_secret_never_make_a_tenant(user: str, field: str) -> None:
    arrival = read_body(json.dumps({"prompt": "hi", field: user}).encode())
    admission = RULES.admit(None, arrival.cache_salt)
    assert admission.tenant.salt.startswith(ANON_SALT_PREFIX) and not admission.keeps
    assert admission.tenant.namespace == "" and admission.own is not None
    with_salt = RULES.admit(None, "team-" + user)
    assert with_salt.tenant == Tenant.of_salt("team-" + user) and with_salt.keeps


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(small_ints, min_size=1, max_size=8),
    other=st.lists(small_ints, min_size=1, max_size=8),
    waited=st.floats(min_value=0, max_value=1200.0),
)
def test_an_admission_counts_for_its_request_until_it_expires(
    prompt: list[int], other: list[int], waited: float
) -> None:
    """Issue 59 hole 7: a signed admission bound no request, prompt or expiry, so it
    replayed on any other request. Bound to its prompt's ids (every engine request
    of one API request has them: ``n`` > 1, a beam's step is signed again for its
    own) and an expiry, it verifies for that prompt alone, until it expires."""
    rules = ClientPolicy(False, "write", 4096, SECRET)
    signed = rules.admit(None, None).bound(prompt, now=1000.0).signed(SECRET)
    now = 1000.0 + waited
    from kvrag_integrations.vllm.admission import ADMISSION_TTL_S

    if waited <= ADMISSION_TTL_S:
        assert rules.verified(signed, prompt, now=now).tenant.salt
    else:
        with pytest.raises(TransferParamsError, match="expired"):
            rules.verified(signed, prompt, now=now)
    if other != prompt:
        with pytest.raises(TransferParamsError, match="another request"):
            rules.verified(signed, other, now=1000.0)
