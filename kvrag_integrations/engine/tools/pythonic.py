"""Pythonic calls: the whole answer a Python list of calls, ``[f(a=1), g(b="x")]``.

As vLLM's ``pythonic`` parser reads them (its Gemma 3 and Llama 3.2 tool
templates ask for this): the answer is a list of calls to bound tools with
keyword arguments whose values are Python literals. An answer that starts with
``[`` but is no such list (``[1] The tower...``) is text, released as soon as
it cannot be one; text after the list makes it text too (as vLLM's parser
reads it); a list of calls to bound tools whose arguments are no literals
(``[f(q={[1]: 2})]``) or no JSON values (``[f(q=1e999)]``, a set) is an
``InvalidToolCall``. A forced call is the JSON call object every family's
constraint writes.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Collection
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.detect import CALLS, MAYBE, LeadScan
from kvrag_integrations.engine.tools.family import ToolFamily

_IDENT_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
_IDENT = re.compile(r"[A-Za-z0-9_]*")
_WS = re.compile(r"\s*")
_PLAIN = re.compile(r"[^'\"()\[\]{}]*")  # inside a call: what is no quote or bracket
_QUOTED = {"'": re.compile(r"[^'\\]*"), '"': re.compile(r'[^"\\]*')}
_OPEN = "([{"


class PythonicFamily(ToolFamily):
    """``[name(key=literal, ...), ...]`` as the whole answer."""

    name: ClassVar[str] = "pythonic"

    @classmethod
    def matches(cls, template: str) -> bool:
        # a Python list of calls with keyword arguments, as the template asks for
        # them ("[func_name1(params_name1=params_value1, ...)]" in vLLM's)
        return _CALL_LIST_EXAMPLE.search(template) is not None

    def _lead_scan(self, names: Collection[str]) -> CallList:
        return CallList(names)


_CALL_LIST_EXAMPLE = re.compile(r"\[[A-Za-z_]\w*\([A-Za-z_]\w*=")


class CallList(LeadScan):
    """The answer shaped as ``[name(...), ...]`` with bound names,
    read as it grows. Brackets and quotes inside the calls are only balanced here
    (``ast`` reads them in ``result``); no recursion, each character read once."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self.i = 0
        self.step = "open"  # open, ident, name, args, next, tail
        self.ident_at = 0
        self.depth, self.quote = 0, ""
        self.first = ""

    def result(self, text: str) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        try:
            return _read_calls(text.strip()), []
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as exc:
            error = f"a Python list of calls to {self.first!r} with arguments no literals: {exc}"
            return [], [(self.first, text.strip(), error[:300])]

    def _read(self, text: str) -> str | None:
        n = len(text)
        while True:
            step = self.step
            if step in ("open", "ident", "next", "tail"):
                self.i = _WS.match(text, self.i).end()
                if self.i == n:
                    return CALLS if step == "tail" else MAYBE
                c = text[self.i]
                if step == "tail" or (step == "open" and c != "["):
                    return None  # text after the list, or no list
                if step == "open":
                    self.i += 1
                    self.step = "ident"
                elif step == "ident":
                    if c not in _IDENT_START:
                        return None
                    self.ident_at, self.step = self.i, "name"
                elif c == "]":  # step "next": after a call
                    self.i += 1
                    self.step = "tail"
                elif c == ",":
                    self.i += 1
                    self.step = "ident"
                else:
                    return None
            elif step == "name":
                self.i = _IDENT.match(text, self.i).end()
                ident = text[self.ident_at : self.i]
                if self.i == n:
                    return MAYBE if any(name.startswith(ident) for name in self.names) else None
                if ident not in self.names or text[self.i] != "(":
                    return None
                self.first = self.first or ident
                self.step = "args"
            elif not self._past_parens(text, n):  # step "args"
                return MAYBE

    def _past_parens(self, text: str, n: int) -> bool:
        """Read on in a call's bracket group; True once it closed."""
        i = self.i
        while i < n:
            if self.quote:
                i = _QUOTED[self.quote].match(text, i).end()
                if i >= n:
                    break
                if text[i] == "\\":
                    i += 2
                    continue
                self.quote = ""
            else:
                i = _PLAIN.match(text, i).end()
                if i >= n:
                    break
                c = text[i]
                if c in "'\"":
                    self.quote = c
                elif c in _OPEN:
                    self.depth += 1
                elif self.depth <= 1:  # the call's own closing bracket
                    self.i, self.depth, self.step = i + 1, 0, "next"
                    return True
                else:
                    self.depth -= 1
            i += 1
        self.i = i
        return False


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
        # a set or bytes is no JSON argument (TypeError), 1e999 or nan no JSON number (ValueError)
        json.dumps(args, allow_nan=False)
        calls.append({"name": expr.func.id, "arguments": args, "id": None})
    return calls
