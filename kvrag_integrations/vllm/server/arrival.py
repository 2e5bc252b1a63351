"""What a request brings to the server's door, read once, and the admission made of it.

The gateway reads a JSON body once (``read_body``): the fields the server acts on
(``cache_salt``, our ``kv_transfer_params["kvrag"]``) are checked here, and a
body that is not JSON, is nested deeper than any request needs, or has a wrong
type in one of them is refused with the reason (``BadRequest``: HTTP 400) before
any of vLLM's routes sees it. What else a body holds is vLLM's to check; a
field outside our schema (another connector's ``kv_transfer_params`` key, a
client's ``user``, ``prompt_cache_key`` or ``safety_identifier``) is ignored,
never a reason to skip admission.

The request's admission and its parsed params then ride with its handling in
a context variable (``ARRIVAL``): vLLM's handlers run inside the gateway's call
(and the tasks they start copy it), so the server's hook reads them where the
request reaches the model (``current``), and parses nothing again. One API
request may reach the model several times (a beam search calls it once per
beam and step): the hook plans it once, at the first, and keeps the plan with
its arrival (``Planned``).
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvrag_integrations.errors import KVRAGError, TransferParamsError
from kvrag_integrations.vllm.admission import Admission
from kvrag_integrations.vllm.params import PARAMS_KEY, SERVER_FIELDS, PieceSpec, TransferParams
from kvrag_integrations.vllm.trust import MAX_SALT_CHARS

MAX_DEPTH = 64  # nesting of a request body's JSON: far more than any request needs


class BadRequest(KVRAGError, ValueError):
    """A request body the server refuses (HTTP 400), with the reason."""


@dataclass
class Planned:
    """The hook's plan of one admitted request, made at its first call of the
    engine client (its prompt's ids, the load planned for them), and set (``ready``)
    once made: a later call of the same request waits for it and reuses the load
    where its prompt starts with those ids."""

    ids: tuple[int, ...] = ()
    load: tuple[PieceSpec, ...] = ()
    ready: asyncio.Event | None = None  # None: not planned yet


@dataclass(frozen=True)
class Arrival:
    """What the server acts on in a request, and its admission.

    Attributes:
        cache_salt: the client's ``cache_salt`` (None: none).
        params: our ``kv_transfer_params["kvrag"]`` (None: the client sent none).
        admission: what the request may do (``admission.ClientPolicy.admit``).
        plan: the hook's plan of it, made once (``Planned``).
        caller: who sent it, for its share of the engine (``shares.caller_of``).
    """

    cache_salt: str | None = None
    params: TransferParams | None = None
    admission: Admission | None = None
    caller: str = ""
    plan: Planned = field(default_factory=Planned, compare=False, repr=False)


ARRIVAL: ContextVar[Arrival | None] = ContextVar("kvrag_arrival", default=None)
"""The arrival of the request being handled (set by the gateway for its call)."""


def current() -> Arrival | None:
    """The arrival of the request being handled (None: none passed the gateway)."""
    return ARRIVAL.get()


def read_body(body: bytes) -> Arrival:
    """The fields of a JSON request body the server acts on.

    Raises:
        BadRequest: the body is not JSON, nests deeper than ``MAX_DEPTH``, or a
            field we read has the wrong type or form.

    Examples:
        >>> read_body(b'{"prompt": "hi", "cache_salt": "team-a"}').cache_salt
        'team-a'
        >>> read_body(b'{"kv_transfer_params": {"kvrag": {"detect": false}}}').params.detect
        False
        >>> read_body(b'[' * 100 + b']' * 100)
        Traceback (most recent call last):
        ...
        kvrag_integrations.vllm.server.arrival.BadRequest: the body nests deeper than 64 levels
    """
    try:
        data = json.loads(body) if body.strip() else None
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # (UnicodeDecodeError is one)
        raise BadRequest(f"the body is not JSON: {exc}") from None
    _check_depth(data)
    if not isinstance(data, dict):
        return Arrival()  # vLLM answers a body that is no object
    salt = data.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT_CHARS):
        raise BadRequest(f"cache_salt is a string of 1 to {MAX_SALT_CHARS} characters")
    transfer = data.get("kv_transfer_params")
    if transfer is not None and not isinstance(transfer, dict):
        raise BadRequest("kv_transfer_params is an object")
    ours = transfer.get(PARAMS_KEY) if transfer is not None else None
    written = sorted(set(ours) & set(SERVER_FIELDS)) if isinstance(ours, dict) else []
    if written:  # an admission, a request's private namespace: the server's alone
        raise BadRequest(f"{', '.join(written)}: the server's to write, not a client's")
    try:
        params = TransferParams.from_request(transfer)
    except TransferParamsError as exc:
        raise BadRequest(f"kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from None
    return Arrival(salt, params)


def _check_depth(data: Any) -> None:
    """Refuse JSON nested deeper than ``MAX_DEPTH`` (iteratively: the check itself
    cannot run out of stack)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
