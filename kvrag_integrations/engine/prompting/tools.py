"""Tool calling: tools and ``tool_choice`` checked, their call format, the fallback prompt.

Tools are OpenAI function schemas (``{"type": "function", "function": {"name",
"description", "parameters"}}``), the neutral form LangChain's
``convert_to_openai_tool``, LlamaIndex's ``to_openai_tool`` and vLLM all use.
A chat template that renders tools (``tools`` in it: Qwen2.5/3, Llama 3.1+,
Mistral) gets them as ``apply_chat_template(..., tools=)``; one that does not
(the bundled SmolLM2, Google's Gemma templates) gets ``FALLBACK_TOOL_PROMPT``
in its system message and writes its calls as Hermes-style
``<tool_call>{json}</tool_call>`` (a template that refuses system or tool
messages gets them as user turns: ``prompts._user_turn_roles``). Mistral's
templates take only 9-character call ids (``mistral_call_id``).

``ToolFormat`` is how the model writes a call (its opening and closing markup
and the arguments' key), read off the template; ``ToolPlan`` is one request's
tools, choice and, where a call is forced ("required" or a named tool), the
text the prompt ends with (the call's opening) and what the call may be.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CHOICES = ("auto", "required", "none")

FALLBACK_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The system prompt's tool part where the chat template has none (Qwen2.5's wording)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the tool's name, its arguments and an id.

    ``arguments`` is the decoded JSON object; ``id`` is made up where the model
    wrote none (``call_<random hex>``), as vLLM's parsers do.
    """

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` item (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a call: ``opening`` + ``{"name": .., <args_key>: {..}}`` + ``closing``.

    ``native``: the template renders tools itself (else the fallback prompt).
    """

    name: str
    opening: str
    closing: str
    args_key: str = "arguments"
    native: bool = True


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS][", "]")
LLAMA = ToolFormat("llama", "", "", "parameters")
JSON_CALL = ToolFormat("json", "", "")
FALLBACK = ToolFormat("fallback", "<tool_call>\n", "\n</tool_call>", native=False)


def tool_format(tokenizer: Any) -> ToolFormat:
    """The call format of ``tokenizer``'s chat template (``FALLBACK`` without tools)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the tool one, else default
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return FALLBACK
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "ipython" in template or "<|python_tag|>" in template:
        return LLAMA
    return JSON_CALL


def check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    """``tools`` as OpenAI function tools (a bare function schema is wrapped).

    Raises:
        TypeError: not a list of mappings.
        ValueError: a tool without a function name, or two with one name.
    """
    if tools is None:
        return ()
    if isinstance(tools, Mapping) or not isinstance(tools, Sequence) or isinstance(tools, str):
        raise TypeError("tools must be a list of OpenAI function schemas (dicts)")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise TypeError(f"each tool must be a dict, got {type(tool).__name__}")
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else {}
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool must be an OpenAI function schema with a name, got {tool!r}")
        params = function.get("parameters") or {"type": "object", "properties": {}}
        entry = {"name": name, "description": function.get("description", ""), "parameters": params}
        out.append({"type": "function", "function": entry})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return tuple(out)


def check_tool_choice(choice: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """``"auto"``, ``"required"``, ``"none"`` or a tool's name (None: auto).

    Takes OpenAI's named form (``{"type": "function", "function": {"name": ..}}``),
    LangChain's ``"any"`` (required) and a bare name; a name not among ``tools``
    is a ``ValueError``.
    """
    if choice is None:
        return None
    if isinstance(choice, Mapping):
        function = choice.get("function")
        choice = function.get("name") if isinstance(function, Mapping) else choice.get("name")
    if choice == "any":
        choice = "required"
    if not isinstance(choice, str):
        raise TypeError(f"tool_choice must be a str or a named tool, got {type(choice).__name__}")
    if choice in TOOL_CHOICES:
        if choice == "required" and not tools:
            raise ValueError('tool_choice="required" needs tools')
        return choice
    names = [t["function"]["name"] for t in tools]
    if choice not in names:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools {names}")
    return choice


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools: how they are rendered, and the call a forced choice opens.

    Attributes:
        tools: the OpenAI function tools (empty with ``tool_choice="none"``).
        format: the model's call format.
        forced: tool names the call must name ("required": all; a named tool:
            one); empty when the model may answer in text.
        prompt_tail: text the prompt ends with when a call is forced (the
            call's opening markup), computed text: reuse is unaffected.
    """

    tools: tuple[dict[str, Any], ...]
    format: ToolFormat
    forced: tuple[str, ...] = ()
    prompt_tail: str = ""
    schemas: dict[str, Any] = field(default_factory=dict)

    @property
    def call_schema(self) -> dict[str, Any] | None:
        """The JSON schema of one forced call object (vLLM's structured outputs);
        None when no call is forced."""
        if not self.forced:
            return None
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    self.format.args_key: self.schemas[name],
                },
                "required": ["name", self.format.args_key],
            }
            for name in self.forced
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}


def plan_tools(tokenizer: Any, tools: Any, tool_choice: Any) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None: no tools, or ``tool_choice="none"``)."""
    checked = check_tools(tools)
    choice = check_tool_choice(tool_choice, checked)
    if not checked or choice == "none":
        return None
    fmt = tool_format(tokenizer)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in checked}
    forced: tuple[str, ...] = ()
    if choice == "required":
        forced = tuple(schemas)
    elif choice not in (None, "auto"):
        forced = (choice,)
    return ToolPlan(checked, fmt, forced, fmt.opening if forced else "", schemas)


def fallback_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """``FALLBACK_TOOL_PROMPT`` for ``tools`` (one JSON schema a line)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return FALLBACK_TOOL_PROMPT.format(tools=listed)


def call_text(fmt: ToolFormat, calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant's earlier calls written as the model writes them (fallback
    templates render no ``tool_calls``: the calls become the message's text)."""
    parts = []
    for call in calls:
        function = call.get("function", call)
        args = function.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        body = json.dumps({"name": function.get("name"), fmt.args_key: args}, ensure_ascii=False)
        parts.append(f"{fmt.opening}{body}{fmt.closing}")
    return "\n".join(parts)


def template_tool_calls(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Calls as chat templates read them: OpenAI's form with arguments as a dict
    (templates write ``arguments | tojson``)."""
    out = []
    for call in calls:
        function = dict(call.get("function", call))
        args = function.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        item = {
            "type": "function",
            "function": {"name": function.get("name"), "arguments": args},
        }
        if call.get("id"):
            item["id"] = call["id"]
        out.append(item)
    return out


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id(call_id: str) -> str:
    """``call_id`` as Mistral's templates take it: 9 letters or digits (they raise
    "Tool call IDs should be alphanumeric strings with length 9!" otherwise).
    Another id (OpenAI's ``call_...``, ours) maps onto one by its hash, so a
    call and the tool message answering it keep the same id.

    Examples:
        >>> mistral_call_id("a1B2c3D4e"), len(mistral_call_id("call_0123456789abcdef"))
        ('a1B2c3D4e', 9)
    """
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


def template_ids(fmt: ToolFormat, extra: dict[str, Any]) -> dict[str, Any]:
    """A message's ``tool_calls`` ids and ``tool_call_id`` in the form ``fmt``'s
    templates require (Mistral's: ``mistral_call_id``; others as given)."""
    if fmt is not MISTRAL:
        return extra
    out = dict(extra)
    if isinstance(out.get("tool_call_id"), str):
        out["tool_call_id"] = mistral_call_id(out["tool_call_id"])
    if "tool_calls" in out:
        out["tool_calls"] = [
            {**c, "id": mistral_call_id(c["id"])} if isinstance(c.get("id"), str) else c
            for c in out["tool_calls"]
        ]
    return out


def forced_start(plan: ToolPlan) -> tuple[str, list[str], str]:
    """A forced call's start written into the prompt past its opening markup, what
    may follow it before the arguments, and the arguments' start it wrote
    (``modeling.tool_constraint`` checks the rest).

    One tool: ``{"name": "<tool>", "<args key>": `` and, where its schema
    requires properties, ``{"<first>": `` (and ``"`` if it is a string: a
    small model then fills in a value rather than copying the schema); several:
    ``{"name": "`` and each
    ``<tool>", "<args key>": ``.

    Examples:
        >>> schema = {"properties": {"q": {"type": "string"}}, "required": ["q"]}
        >>> forced_start(ToolPlan((), HERMES, ("search",), schemas={"search": schema}))
        ('{"name": "search", "arguments": {"q": "', [''], '{"q": "')
    """
    key = plan.format.args_key
    heads = [f'{json.dumps(name)[1:-1]}", "{key}": ' for name in plan.forced]
    if len(heads) > 1:
        return '{"name": "', heads, ""
    schema = plan.schemas.get(plan.forced[0]) or {}
    required = schema.get("required") if isinstance(schema, Mapping) else None
    args = ""
    if isinstance(required, list) and required and isinstance(required[0], str):
        args = "{" + json.dumps(required[0]) + ": "
        prop = (schema.get("properties") or {}).get(required[0])
        if isinstance(prop, Mapping) and prop.get("type") == "string":
            args += '"'  # a string value: its quote written, the model writes the text
    return '{"name": "' + heads[0] + args, [""], args
