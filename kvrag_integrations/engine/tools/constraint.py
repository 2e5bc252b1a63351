"""A forced tool call's decoding: only tokens that keep the call valid JSON.

With ``tool_choice="required"`` or a named tool, the in-process engine ends the
prompt with the call's start (``ToolFamily.forced_start``: the family's opening
markup, ``{"name": "`` and, for one tool, its name and the arguments' key) and
decodes the rest under ``ForcedCall``: a tool's name where several may be
called, then one JSON object (the arguments), then the closing ``}``; decoding
stops there. Each step keeps the likeliest tokens whose text continues a valid
prefix (checked on the text, so any tokenizer works); a small model then writes
a call that parses, whatever it would have written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvrag_integrations.engine.tools.json_scan import json_object_end

_WS = " \t\n\r"
_BAD, _MORE, _DONE = "bad", "more", "done"


def call_state(
    text: str,
    heads: Sequence[str],
    one_key: bool = False,
    keys: Sequence[Sequence[str] | None] | None = None,
) -> str:
    """``"done"``, ``"more"`` (a valid prefix) or ``"bad"``: is ``text`` one of
    ``heads``, then a JSON object, then ``}``? ``keys[i]``: the keys the object
    may hold after ``heads[i]`` (``schema_keys``; None: any).

    Examples:
        >>> heads = ['search", "arguments": ']
        >>> call_state('sea', heads), call_state('search", "arguments": {"q": 1}}', heads)
        ('more', 'done')
        >>> call_state('find', heads)
        'bad'
    """
    for h, head in enumerate(heads):
        allowed = keys[h] if keys is not None else None
        if len(text) <= len(head):
            if head.startswith(text):
                return _MORE
            continue
        if not text.startswith(head):
            continue
        rest = text[len(head) :]
        end = json_object_end(rest, one_key or (allowed is not None and len(allowed) == 1), allowed)
        if end is None:
            return _MORE
        if end == -1:
            continue
        tail = rest[end:].lstrip(_WS)
        if tail == "":
            return _MORE
        if tail == "}":
            return _DONE
    return _BAD


def schema_keys(schema: Any) -> tuple[str, ...] | None:
    """The keys a tool's arguments may hold: its schema's properties (none: only
    ``{}``), unless it allows additional properties; None: any keys.

    Examples:
        >>> schema_keys({"properties": {"q": {}}}), schema_keys({"properties": {}})
        (('q',), ())
        >>> schema_keys({"type": "object"}), schema_keys({"additionalProperties": True})
        (None, None)
    """
    if not isinstance(schema, Mapping):
        return None
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    if extra not in (None, False) or (props is None and extra is None):
        return None
    return tuple(props or ())


class ForcedCall:
    """Masks logits so the decoded text stays a valid call (``call_state``).

    Args:
        tokenizer: the model's tokenizer.
        heads: what may come first (``ToolFamily.forced_start``): a tool's
            name and the arguments' key, or ``""`` when the prompt holds them.
        greedy: keep only the likeliest valid token (else the valid ones of the
            ``width`` likeliest).
        written: the arguments' start the prompt already holds.
        one_key: the arguments hold one key (the tool's schema has one property).
        keys: per head, the keys its arguments may hold (``schema_keys``).
    """

    def __init__(
        self,
        tokenizer: Any,
        heads: Sequence[str],
        greedy: bool,
        written: str = "",
        one_key: bool = False,
        width: int = 64,
        keys: Sequence[Sequence[str] | None] | None = None,
    ) -> None:
        self.one_key = one_key
        self.keys = keys
        self.tokenizer = tokenizer
        self.heads = list(heads)
        self.greedy = greedy
        self.width = width
        self.text = written  # what the prompt already wrote of it
        self.done = False
        self._ref = (tokenizer.encode("a", add_special_tokens=False) or [0])[-1]
        self._ref_text = tokenizer.decode([self._ref], skip_special_tokens=False)
        self._pieces: dict[int, str] = {}

    def _piece(self, token: int) -> str:
        """A token's text as it reads after other text (sentencepiece's leading space
        kept), decoded once."""
        piece = self._pieces.get(token)
        if piece is None:
            both = self.tokenizer.decode([self._ref, token], skip_special_tokens=False)
            piece = both[len(self._ref_text) :]
            self._pieces[token] = piece
        return piece

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token that would break the call at ``-inf``."""
        allowed: list[int] = []
        for width in (self.width, 4096, logits.numel()):
            order = torch.topk(logits.float(), min(width, logits.numel())).indices.tolist()
            for token in order:
                piece = self._piece(token)
                if not piece or "\ufffd" in piece:
                    continue
                if call_state(self.text + piece, self.heads, self.one_key, self.keys) != _BAD:
                    allowed.append(token)
                    if self.greedy:
                        break
            if allowed:
                break
        out = torch.full_like(logits, float("-inf"))
        index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        out[index] = logits[index]
        return out

    def push(self, token: int) -> bool:
        """Record the chosen token; True once the call is complete (decoding stops)."""
        self.text += self._piece(token)
        self.done = call_state(self.text, self.heads, self.one_key, self.keys) == _DONE
        return self.done
