"""Mistral calls: ``[TOOL_CALLS][{"name": .., "arguments": .., "id": ..}, ..]``.

As vLLM's ``mistral`` parser reads them (the v3 tokenizer's format): the
``[TOOL_CALLS]`` control token, then a JSON list of call objects; the text
before it is the content. Mistral's templates take only 9-character call ids
("Tool call IDs should be alphanumeric strings with length 9!"): a call's own
such id is kept, others are made in that form, and ids going back into the
template are mapped onto it (``template_call_id``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from typing import Any, ClassVar

from kvrag_integrations.engine.tools.calls import hashed_id
from kvrag_integrations.engine.tools.family import ToolFamily, read_call_objects

TOOL_CALLS = "[TOOL_CALLS]"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def mistral_call_id(call_id: str) -> str:
    """``call_id`` as Mistral's templates take it: 9 letters or digits. Another id
    (OpenAI's ``call_...``) maps onto one by its hash, so a call and the tool
    message answering it keep the same id.

    Examples:
        >>> mistral_call_id("a1B2c3D4e"), len(mistral_call_id("call_0123456789abcdef"))
        ('a1B2c3D4e', 9)
    """
    if _ID.fullmatch(call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


class MistralFamily(ToolFamily):
    """``[TOOL_CALLS]`` and a JSON list of calls with 9-character ids."""

    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    opening: ClassVar[str] = TOOL_CALLS + "["
    closing: ClassVar[str] = "]"
    markup: ClassVar[tuple[str, ...]] = (
        TOOL_CALLS,
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
    )

    @classmethod
    def matches(cls, template: str) -> bool:
        return TOOL_CALLS in template

    def _leading(self, text: str, names: Collection[str]) -> None:
        return None  # every call is marked

    def _marked(
        self, text: str, marker: str, names: Collection[str]
    ) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        body = text[len(marker) :]
        return read_call_objects(body, names, ("arguments",), text, TOOL_CALLS)

    def call_id(self, seed: bytes, index: int) -> str:
        return hashed_id(seed, index, _ALNUM, 9)

    def valid_own_id(self, call_id: Any) -> bool:
        return isinstance(call_id, str) and _ID.fullmatch(call_id) is not None

    def template_call_id(self, call_id: str) -> str:
        return mistral_call_id(call_id)
