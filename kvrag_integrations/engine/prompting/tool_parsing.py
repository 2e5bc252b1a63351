"""Tool calls read from generated text, in the formats of the tool-calling families.

As vLLM's tool parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``)
read them, without vLLM (the in-process engine cannot depend on it):

- Hermes / Qwen2.5 / Qwen3 (and the fallback prompt): ``<tool_call>{json}</tool_call>``;
- Llama 3.1+: ``<|python_tag|>`` or a bare ``{"name": .., "parameters": ..}``
  (several separated by ``;``);
- Mistral: ``[TOOL_CALLS][{"name": .., "arguments": ..}, ...]``;
- Gemma 3: a fenced ```` ```tool_code ```` block of Python calls
  (``f(a=1)``), a fenced ```` ```json ```` call object, or a bare Python list
  of calls (``[f(a=1), g(b="x")]``, vLLM's ``pythonic`` format, which its
  Gemma 3 tool template asks for).

``parse_tool_calls`` returns the text left around the calls and the calls; a
call whose JSON does not parse is left in the text (as vLLM does).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any

from kvrag_integrations.engine.prompting.tools import ToolCall

_DECODER = json.JSONDecoder()
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"```(tool_code|tool_call|json)?\s*\n(.*?)(?:```|$)", re.DOTALL)
_MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of generated ``text``; ``calls`` empty if there are none.

    Examples:
        >>> content, calls = parse_tool_calls(
        ...     'Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
        ... )
        >>> content, calls[0].name, calls[0].arguments
        ('Sure.', 'f', {'x': 1})
        >>> parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}]')[1][0].name
        'f'
        >>> parse_tool_calls('{"name": "f", "parameters": {"q": "a"}}')[1][0].arguments
        {'q': 'a'}
        >>> parse_tool_calls("```tool_code\\nf(q='a', k=2)\\n```")[1][0].arguments
        {'q': 'a', 'k': 2}
        >>> parse_tool_calls('[f(q="a"), g()]')[1][1].name
        'g'
        >>> parse_tool_calls("Paris.")
        ('Paris.', [])
    """
    found: list[dict[str, Any]] = []
    content = text
    if "<tool_call>" in text:
        content = _HERMES.sub(lambda m: "" if _take(m.group(1), found) else m.group(0), text)
    elif any(marker in text for marker in _MARKERS):
        head, _, rest = _split_marker(text)
        content = head if _take(rest, found) else text
    elif "```" in text:
        content = _FENCED.sub(
            lambda m: "" if _fenced(m.group(1), m.group(2), found) else m.group(0), text
        )
    elif text.lstrip().startswith(("{", "[")):
        pythonic = text.lstrip().startswith("[")  # JSON calls, else a list of Python calls
        content = "" if _take(text, found) or (pythonic and _python_calls(text, found)) else text
    calls = [_call(c) for c in found]
    return content.strip() if calls else text, calls


def _split_marker(text: str) -> tuple[str, str, str]:
    at = min(text.find(m) for m in _MARKERS if m in text)
    marker = next(m for m in _MARKERS if text.startswith(m, at))
    return text[:at], marker, text[at + len(marker) :]


def _take(body: str, found: list[dict[str, Any]]) -> bool:
    """Append the call objects in ``body`` (JSON values, ``;``- or space-separated)
    to ``found``; False (nothing appended) unless all of ``body`` is calls."""
    calls: list[dict[str, Any]] = []
    rest = body.strip()
    while rest:
        try:
            value, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return False
        items = value if isinstance(value, list) else [value]
        if not items or not all(_is_call(v) for v in items):
            return False
        calls += items
        rest = rest[end:].lstrip().lstrip(";").lstrip()
    found += calls
    return bool(calls)


def _fenced(kind: str | None, body: str, found: list[dict[str, Any]]) -> bool:
    if kind in ("tool_code", None) and not body.lstrip().startswith(("{", "[")):
        return _python_calls(body, found)
    return _take(body, found)


def _python_calls(body: str, found: list[dict[str, Any]]) -> bool:
    """Python call expressions (``f(a=1)``, one a line or a list), literals only."""
    try:
        tree = ast.parse(body.strip(), mode="exec")
    except SyntaxError:
        return False
    exprs = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return False
        value = stmt.value
        exprs += value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    calls = []
    for expr in exprs:
        if not (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name)) or expr.args:
            return False
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in expr.keywords if kw.arg}
        except ValueError:
            return False
        calls.append({"name": expr.func.id, "arguments": args})
    found += calls
    return bool(calls)


def _is_call(value: Any) -> bool:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return False
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return False
    return isinstance(args, dict)


def _call(value: dict[str, Any]) -> ToolCall:
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    call_id = value.get("id")
    if not isinstance(call_id, str):
        call_id = f"call_{uuid.uuid4().hex[:24]}"
    return ToolCall(value["name"], args, call_id)
