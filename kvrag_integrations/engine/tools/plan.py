"""A request's tools: checked, their family picked once, and what a forced choice opens.

Tools are OpenAI function schemas (``{"type": "function", "function": {"name",
"description", "parameters"}}``), the neutral form LangChain's
``convert_to_openai_tool``, LlamaIndex's ``to_openai_tool`` and vLLM all use.
``plan_tools`` checks them and ``tool_choice`` and picks the request's
``ToolFamily`` from the tokenizer's chat template (``family_for``): a template
that renders tools (``tools`` in it) gets them as ``apply_chat_template(...,
tools=)`` and its family's format; one that does not (the bundled SmolLM2,
Google's Gemma templates) gets the fallback prompt (``hermes.FallbackFamily``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvrag_integrations.engine.tools.family import ToolFamily
from kvrag_integrations.engine.tools.hermes import FallbackFamily, HermesFamily
from kvrag_integrations.engine.tools.llama import LlamaFamily
from kvrag_integrations.engine.tools.mistral import MistralFamily
from kvrag_integrations.engine.tools.pythonic import PythonicFamily

TOOL_CHOICES = ("auto", "required", "none")

FAMILIES: tuple[type[ToolFamily], ...] = (
    HermesFamily,
    MistralFamily,
    PythonicFamily,
    LlamaFamily,
    ToolFamily,  # a template with tools in no known call syntax: bare JSON call objects
)
"""The families a template with tools is matched against, in order (the first whose
``matches`` holds: each looks for its call syntax, so the order only settles a
template that shows two)."""


TOOL_MARKUP: frozenset[str] = frozenset(
    m for cls in (FallbackFamily, *FAMILIES) for m in cls.markup
)
"""Every family's markup strings (structural wherever they are added tokens)."""


def family_for(tokenizer: Any) -> ToolFamily:
    """The tool family of ``tokenizer``'s chat template (``FallbackFamily`` without tools).

    Examples:
        >>> class Tok:
        ...     chat_template = '{% for t in tools %}<tool_call>{"name": ...}{% endfor %}'
        >>> family_for(Tok()).name
        'hermes'
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the tool one, else default
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return FallbackFamily()
    return next(cls for cls in FAMILIES if cls.matches(template))()


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
    """One request's tools: their family, and the call a forced choice opens.

    Attributes:
        tools: the OpenAI function tools.
        family: the model's call format (``family_for``), picked once.
        forced: tool names the call must name ("required": all; a named tool:
            one); empty when the model may answer in text.
        schemas: each tool's parameters schema, by name.
        parallel: whether several calls may come back (``parallel_tool_calls``;
            False: the first only, as vLLM and OpenAI do).
    """

    tools: tuple[dict[str, Any], ...]
    family: ToolFamily
    forced: tuple[str, ...] = ()
    schemas: dict[str, Any] = field(default_factory=dict)
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        """The bound tools' names: a call names one of these, or it is no call."""
        return tuple(self.schemas)

    @property
    def prompt_tail(self) -> str:
        """What the prompt ends with when a call is forced (the family's opening
        markup; computed text, reuse is unaffected); empty otherwise."""
        return self.family.opening if self.forced else ""

    @property
    def call_schema(self) -> dict[str, Any] | None:
        """The JSON schema of one forced call object (vLLM's structured outputs);
        None when no call is forced."""
        if not self.forced:
            return None
        key = self.family.args_key
        options = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, key: self.schemas[name]},
                "required": ["name", key],
            }
            for name in self.forced
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def forced_start(self) -> tuple[str, list[str], str]:
        """The forced call's JSON start, heads and written arguments
        (``ToolFamily.forced_start``)."""
        return self.family.forced_start(self.forced, self.schemas)


def plan_tools(
    tokenizer: Any, tools: Any, tool_choice: Any, parallel_tool_calls: Any = None
) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None: no tools, or ``tool_choice="none"``).

    ``parallel_tool_calls``: None or True, every call the model writes; False, the
    first only; anything else is a ``TypeError``.
    """
    checked = check_tools(tools)
    choice = check_tool_choice(tool_choice, checked)
    parallel = check_parallel(parallel_tool_calls)
    if not checked or choice == "none":
        return None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in checked}
    forced: tuple[str, ...] = ()
    if choice == "required":
        forced = tuple(schemas)
    elif choice not in (None, "auto"):
        forced = (choice,)
    return ToolPlan(checked, family_for(tokenizer), forced, schemas, parallel)


def check_parallel(parallel_tool_calls: Any) -> bool:
    """``parallel_tool_calls`` checked: None (not given) and True allow several calls."""
    if parallel_tool_calls is None:
        return True
    if not isinstance(parallel_tool_calls, bool):
        raise TypeError(
            f"parallel_tool_calls must be a bool, got {type(parallel_tool_calls).__name__}"
        )
    return parallel_tool_calls
