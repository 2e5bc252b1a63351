"""What a request tells the vLLM connector: the schema, its checks, the turbo salt.

No vLLM here: the client side writes these wherever it runs.
"""

from __future__ import annotations

import pytest

from kvrag_integrations.errors import KVRAGError
from kvrag_integrations.vllm.params import (
    PARAMS_KEY,
    PieceSpec,
    TransferParams,
    TransferParamsError,
)
from kvrag_integrations.vllm.reply import Reply
from kvrag_integrations.vllm.trust import TURBO_SALT_PREFIX as SALT_PREFIX

RUN = (PieceSpec(0, 41), PieceSpec(41, 590), PieceSpec(631, 582, (1116,)))


def test_params_round_trip_through_a_request() -> None:
    params = TransferParams(load=RUN, save=(PieceSpec(0, 7),), overwrite=True)
    sent = params.as_request()
    assert set(sent) == {PARAMS_KEY}
    assert TransferParams.from_request(sent) == params
    assert params.load_end == 1213
    assert RUN[2].entry_ids(list(range(2000)))[-2:] == [1212, 1116]


def test_a_request_without_ours_carries_none() -> None:
    assert TransferParams.from_request(None) is None
    assert TransferParams.from_request({"other_connector": {"x": 1}}) is None


@pytest.mark.parametrize(
    ("ours", "match"),
    [
        ("load", "must be an object"),
        ({"loads": []}, "unknown fields"),
        ({"load": [[0, 5]]}, r"\[start, rows, \[tail ids\]\]"),
        ({"load": [[0, 0, []]]}, "rows must be an integer >= 1"),
        ({"load": [[0, 5, [-1]]]}, "tail id must be an integer >= 0"),
        ({"load": [[0, 5, []], [6, 5, []]]}, "piece 1 starts at 6, not 5"),
        ({"load": [[0, True, []]]}, "rows must be an integer"),
        ({"save": [[0, 5, []]], "overwrite": "yes"}, "overwrite must be true or false"),
        ({"load": [[0, 1, []]] * 5000}, "at most 1024 pieces"),
        ({"load": [[0, 1, list(range(8193))]]}, "at most 8192 ids each"),
        ({"load": [[0, 1, [], list(range(8193))]]}, "at most 8192 ids each"),
        ({"load": [[0, 1, list(range(8000)), list(range(8000))]] * 5}, "at most 65536 edge ids"),
        ({"save": [[0, 1, [], [5]]]}, "a save piece has no lead"),
        ({"tenant": 7}, "tenant must be a string"),
        ({"admission": "admin"}, "admission must be an object"),
        ({"grant": "admin"}, "unknown fields"),
        ({"load": [[0, 5, []]], "private_load": [1]}, "private_load lists load pieces"),
    ],
)
def test_malformed_params_are_refused_with_a_reason(ours: object, match: str) -> None:
    with pytest.raises(TransferParamsError, match=match) as caught:
        TransferParams.from_request({PARAMS_KEY: ours})
    assert isinstance(caught.value, KVRAGError)  # one base class for users to catch


def test_pieces_beyond_the_prompt_are_refused() -> None:
    params = TransferParams(load=RUN)
    params.check_prompt(1213)
    with pytest.raises(TransferParamsError, match="beyond the 1212-token prompt"):
        params.check_prompt(1212)


def test_the_salt_names_the_layout_not_only_the_tokens() -> None:
    salt = TransferParams(load=RUN).salt()
    assert salt is not None and salt.startswith(SALT_PREFIX)
    assert TransferParams(load=RUN).salt() == salt  # stable: the same layout shares blocks
    moved = (PieceSpec(0, 41), PieceSpec(41, 589), PieceSpec(630, 583, (1116,)))
    assert TransferParams(load=moved).salt() != salt  # same tokens, other boundaries
    assert TransferParams(load=RUN[:2]).salt() != salt
    assert TransferParams().salt() is None  # an exact request has none
    tenant = TransferParams(load=RUN, tenant_salt="team-a").salt()
    assert tenant != salt and tenant.startswith(SALT_PREFIX)  # tenants never share blocks
    assert TransferParams(tenant_salt="team-a").salt() == "team-a"  # its exact requests: its salt


def test_the_reply_is_read_back_from_an_output() -> None:
    reply = Reply("fp+kv-float16", loaded=1213, keys=["a" * 64], stored=1, refused="no")
    assert Reply.from_output(reply.as_params()) == reply
    assert Reply.from_output(None) is None
    assert Reply.from_output({PARAMS_KEY: {"loaded": 3}}) is None  # no fingerprint: not ours
