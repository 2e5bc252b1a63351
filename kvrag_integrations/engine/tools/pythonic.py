"""Pythonic calls: the whole answer a Python list of calls, ``[f(a=1), g(b="x")]``.

As vLLM's ``pythonic`` parser reads them (its Gemma 3 and Llama 3.2 tool
templates ask for this): the answer is a list of calls to bound tools with
keyword arguments whose values are Python literals. An answer that starts with
``[`` but is no such list (``[1] The tower...``) is text, released as soon as
it cannot be one; a list of calls to bound tools whose arguments are no
literals (``[f(q={[1]: 2})]``) is an ``InvalidToolCall``. A forced call is the
JSON call object every family's constraint writes.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.family import MAYBE, ToolFamily

_IDENT_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
_IDENT = _IDENT_START + "0123456789"
_OPEN, _CLOSE = "([{", ")]}"


class PythonicFamily(ToolFamily):
    """``[name(key=literal, ...), ...]`` as the whole answer."""

    name: ClassVar[str] = "pythonic"

    @classmethod
    def matches(cls, template: str) -> bool:
        return "func_name1(" in template  # vLLM's pythonic templates' example call

    def _leading(
        self, text: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]] | str | None:
        shape = _call_list_shape(text.lstrip(), names)
        if shape is None or shape == MAYBE:
            return shape
        try:
            return _read_calls(text.strip()), []
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as exc:
            error = f"a Python list of calls to {shape!r} whose arguments are no literals: {exc}"
            return [], [(shape, text.strip(), error[:300])]


def _call_list_shape(text: str, names: Collection[str]) -> str | None:
    """Whether ``text`` is shaped as ``[name(...), ...]`` with bound names: the first
    name once complete, ``MAYBE`` while a prefix, None where it cannot be one.
    Brackets and quotes inside the calls are only balanced here (``ast`` reads
    them at the end); no recursion, one pass."""
    if not text:
        return MAYBE
    if text[0] != "[":
        return None
    i, n = 1, len(text)
    first: str | None = None
    while True:
        while i < n and text[i].isspace():
            i += 1
        start = i
        if i < n and text[i] not in _IDENT_START:
            return None
        while i < n and text[i] in _IDENT:
            i += 1
        ident = text[start:i]
        if i == n:
            return MAYBE if any(name.startswith(ident) for name in names) else None
        if ident not in names or text[i] != "(":
            return None
        first = first or ident
        i = _past_parens(text, i)
        if i < 0:
            return MAYBE
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return MAYBE
        if text[i] == "]":
            return first if not text[i + 1 :].strip() else None
        if text[i] != ",":
            return None
        i += 1


def _past_parens(text: str, i: int) -> int:
    """The index past the bracket group opening at ``text[i]``; -1 while unclosed."""
    depth, quote, n = 0, "", len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _read_calls(text: str) -> list[dict[str, Any]]:
    """The calls of a list shaped as ``[name(key=literal), ...]`` (``ast``, literals only)."""
    tree = ast.parse(text, mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("not a list")
    calls = []
    for expr in tree.elts:
        if not isinstance(expr, ast.Call) or not isinstance(expr.func, ast.Name):
            raise ValueError("an item is no call of a name")
        if expr.args or any(kw.arg is None for kw in expr.keywords):
            raise ValueError("arguments must be keywords")
        args = {kw.arg: ast.literal_eval(kw.value) for kw in expr.keywords}
        json.dumps(args)  # a set or bytes is no JSON argument (TypeError)
        calls.append({"name": expr.func.id, "arguments": args, "id": None})
    return calls
