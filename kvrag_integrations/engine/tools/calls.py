"""Tool calls as values: what a model called, what it tried to call, and earlier turns' calls.

``ToolCall`` is a call to a bound tool with decoded arguments; ``InvalidToolCall``
is output in the family's call format that is no valid call (LangChain's
``invalid_tool_calls``): its raw text, the name where one was read, and why.
``Parsed`` is one answer read by a family's parser. ``message_tool_fields`` and
``template_tool_calls`` take an earlier assistant message's calls in any form
the frameworks hand them (LangChain's ``{"name", "args", "id"}``, OpenAI's
``{"id", "function": {"name", "arguments"}}``, pydantic objects) into the form
chat templates read, tolerating arguments that are no JSON object.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrag_integrations.engine.tools.json_text import load_json

logger = logging.getLogger("kvrag_integrations.engine.tools")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a bound tool's name, its arguments and an id.

    ``id`` is the model's own where its format has one (Mistral's), else drawn
    from the request and answer (``ToolFamily.call_id``): the same answer gets
    the same ids, streamed or not.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` item (arguments as a JSON string:
        strict JSON, as the parsers read only finite numbers).

        Raises:
            ValueError: arguments with a non-finite number (no parser makes one).
        """
        args = json.dumps(self.arguments, allow_nan=False)
        function = {"name": self.name, "arguments": args}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class InvalidToolCall:
    """Output in the family's call format that is no valid call.

    ``arguments`` is the raw text the model wrote for it, its markup included
    (so LangChain's partial-JSON reading of a streamed chunk never turns it into
    a call); ``name`` the tool name read from it, if any; ``error`` why it is
    not a call.
    """

    name: str | None
    arguments: str
    id: str
    error: str


@dataclass(frozen=True)
class Parsed:
    """An answer read by a family: its text besides the calls, the calls, the invalid ones."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    invalid: tuple[InvalidToolCall, ...] = field(default=())


def hashed_id(seed: bytes, index: int, alphabet: str, length: int) -> str:
    """``length`` characters of ``alphabet`` drawn from ``seed`` and ``index`` (deterministic)."""
    digest = hashlib.sha256(seed + index.to_bytes(4, "little")).digest()
    return "".join(alphabet[b % len(alphabet)] for b in digest[:length])


def call_arguments(args: Any) -> Any:
    """An earlier call's arguments as a template reads them: a dict as is, a JSON
    object's text decoded, anything else (malformed text a model wrote) as it is.

    Examples:
        >>> call_arguments('{"q": "a"}'), call_arguments('{"q": '), call_arguments(None)
        ({'q': 'a'}, '{"q": ', {})
    """
    if args is None:
        return {}
    if isinstance(args, str):
        if not args.strip():
            return {}
        value = load_json(args)
        if isinstance(value, dict):
            return value
        logger.info("an earlier tool call's arguments are no JSON object; kept as written")
        return args
    if isinstance(args, Mapping):
        return dict(args)
    return args


def call_object(
    value: Any, names: Collection[str], arg_keys: Sequence[str], bare: bool
) -> dict[str, Any] | None:
    """``value`` (decoded JSON) as a call ``{"name", "arguments", "id"}`` to one of
    ``names``, or None: its name a string naming a bound tool, its arguments a
    JSON object (or its text) under the first of ``arg_keys`` it holds.

    ``bare``: an object that is the whole answer, which might be a JSON answer
    rather than a call: it must hold its arguments and no keys but ``name``,
    ``arg_keys`` and ``id`` (vLLM's ``llama3_json`` parser likewise reads an
    object without arguments as text). A call inside the family's markup may
    leave its arguments out (``{}``).

    Examples:
        >>> call_object({"name": "f", "arguments": {"q": 1}}, ["f"], ["arguments"], bare=True)
        {'name': 'f', 'arguments': {'q': 1}, 'id': None}
        >>> call_object({"name": "f"}, ["f"], ["arguments"], bare=True) is None
        True
        >>> call_object({"name": ["f"], "arguments": {}}, {"f"}, ["arguments"], bare=False) is None
        True
    """
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    key = next((k for k in arg_keys if k in value), None)
    if bare and (key is None or set(value) - {"name", "id", *arg_keys}):
        return None
    args = {} if key is None else call_arguments(value[key])
    if not isinstance(args, dict):
        return None
    return {"name": name, "arguments": args, "id": value.get("id")}


def _call_dict(call: Any) -> Mapping[str, Any]:
    if hasattr(call, "model_dump"):  # OpenAI SDK / LlamaIndex objects
        call = call.model_dump()
    if not isinstance(call, Mapping):
        raise TypeError(f"a tool call must be a dict, got {type(call).__name__}")
    return call


def template_tool_calls(calls: Sequence[Any]) -> list[dict[str, Any]]:
    """Calls as chat templates read them: OpenAI's form with arguments as a dict
    (templates write ``arguments | tojson``), from OpenAI's or LangChain's form.

    Examples:
        >>> template_tool_calls([{"name": "f", "args": {"q": 1}, "id": "c1"}])
        [{'type': 'function', 'function': {'name': 'f', 'arguments': {'q': 1}}, 'id': 'c1'}]
    """
    out = []
    for raw in calls:
        call = _call_dict(raw)
        function = call.get("function")
        if isinstance(function, Mapping):
            name, args = function.get("name"), function.get("arguments")
        else:  # LangChain's ToolCall
            name, args = call.get("name"), call.get("args", call.get("arguments"))
        item: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": call_arguments(args)},
        }
        if call.get("id"):
            item["id"] = call["id"]
        out.append(item)
    return out


def message_tool_fields(
    calls: Sequence[Any] | None, tool_call_id: Any = None, name: Any = None
) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` or a tool message's ``tool_call_id``
    and ``name``, as the engine's message keys (both adapters' one mapping).

    Examples:
        >>> message_tool_fields([{"name": "f", "args": {}, "id": "c1"}])["tool_calls"][0]["id"]
        'c1'
        >>> message_tool_fields(None, "c1", "search")
        {'tool_call_id': 'c1', 'name': 'search'}
    """
    if calls:
        return {"tool_calls": template_tool_calls(calls)}
    out: dict[str, Any] = {}
    if tool_call_id:
        out["tool_call_id"] = str(tool_call_id)
        if name:
            out["name"] = str(name)
    return out
