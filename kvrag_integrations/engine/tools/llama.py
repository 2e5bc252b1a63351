"""Llama 3.1+ calls: a bare ``{"name": .., "parameters": ..}`` answer, or ``<|python_tag|>``.

As vLLM's ``llama3_json`` parser reads them: Llama 3.1's template asks for a
JSON object ``{"name": function name, "parameters": {..}}`` as the whole
answer (several separated by ``;``); the model may also open its calls with the
``<|python_tag|>`` token. A bare object that names no bound tool, holds no
arguments or keys a call has not, or is followed by prose, is text (a user who
asked for JSON gets it: ``bare.BareCalls``); prose after marked calls is
dropped, as vLLM drops it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.family import ToolFamily, read_call_objects

PYTHON_TAG = "<|python_tag|>"
# '{"name": function name, "parameters": ...' (quotes maybe escaped in the template)
_PARAMETERS_CALL = re.compile(r'\{\s*\\?"name\\?":\s*[^,"{}]*,\s*\\?"parameters\\?"')


class LlamaFamily(ToolFamily):
    """Llama 3.1+ JSON calls (``parameters``), bare or after ``<|python_tag|>``."""

    name: ClassVar[str] = "llama"
    args_key: ClassVar[str] = "parameters"
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)
    arg_keys: ClassVar[tuple[str, ...]] = ("parameters", "arguments")
    markup: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "<|eom_id|>")

    @classmethod
    def matches(cls, template: str) -> bool:
        # its call syntax: <|python_tag|>, or the JSON call with "parameters" its
        # templates ask for; not the "ipython" role, which Llama 3.2's pythonic
        # template also has
        return PYTHON_TAG in template or _PARAMETERS_CALL.search(template) is not None

    def _marked(
        self, text: str, marker: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        body = text[len(marker) :]
        return read_call_objects(body, names, self.arg_keys, text, PYTHON_TAG, prose_after=True)
