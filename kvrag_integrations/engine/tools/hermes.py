"""Hermes-style calls: ``<tool_call>{json}</tool_call>`` (Qwen2.5, Qwen3, Hermes), and
the fallback prompt that asks any model for them where its template has no tools.

As vLLM's ``hermes`` parser reads them: the text before the first
``<tool_call>`` is the content; each block holds one JSON object
``{"name", "arguments"}``. A block that holds no call to a bound tool is an
``InvalidToolCall`` carrying the block's raw text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.family import ToolFamily, read_call_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# <tool_call> then a JSON object with a "name": what lies between in the template's
# source (whitespace, \n, quotes, jinja's {{ }} and +) skipped, quotes maybe escaped
_GLUE = r"""(?:\s|\\n|['"+]|-?\}\}|\{\{-?)*"""
_JSON_CALL = re.compile(rf'<tool_call>{_GLUE}\{{{_GLUE}\\?"name\\?"')
RESULT_OPEN, RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"

FALLBACK_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The system prompt's tool part where the chat template has none (Qwen2.5's wording)."""


class HermesFamily(ToolFamily):
    """``<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>`` blocks."""

    name: ClassVar[str] = "hermes"
    markers: ClassVar[tuple[str, ...]] = (OPEN,)
    opening: ClassVar[str] = OPEN + "\n"
    closing: ClassVar[str] = "\n" + CLOSE
    markup: ClassVar[tuple[str, ...]] = (OPEN, CLOSE, RESULT_OPEN.strip(), RESULT_CLOSE.strip())

    @classmethod
    def matches(cls, template: str) -> bool:
        # <tool_call> opening a JSON object (GLM's "<tool_call>name" and
        # Qwen3-Coder's "<tool_call><function=" are other formats)
        return _JSON_CALL.search(template) is not None

    def _lead_scan(self, names: Collection[str]) -> None:
        return None  # every call is marked

    def _marked(
        self, text: str, marker: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        calls: list[dict[str, Any]] = []
        invalid: list[tuple[str | None, str, str]] = []
        for block in text.split(OPEN)[1:]:
            body, closed, _ = block.partition(CLOSE)
            raw = OPEN + body + (CLOSE if closed else "")
            found, bad = read_call_objects(body, names, ("arguments",), raw, OPEN)
            calls += found
            invalid += bad
        return calls, invalid


class FallbackFamily(HermesFamily):
    """Templates without tools: ``FALLBACK_TOOL_PROMPT`` in the system message asks
    for Hermes calls; earlier calls are written as text, tool results as
    ``<tool_response>`` blocks where the template has no tool role."""

    name: ClassVar[str] = "fallback"
    native: ClassVar[bool] = False

    @classmethod
    def matches(cls, template: str) -> bool:
        return False  # chosen where the template renders no tools (``family_for``)

    @staticmethod
    def system_text(tools: Sequence[dict[str, Any]]) -> str:
        """``FALLBACK_TOOL_PROMPT`` for ``tools`` (one JSON schema a line)."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return FALLBACK_TOOL_PROMPT.format(tools=listed)

    @staticmethod
    def result_wrapping() -> tuple[str, str]:
        """What a tool result is wrapped in as a user turn (Qwen2.5's wording)."""
        return RESULT_OPEN, RESULT_CLOSE
