"""Turning segments into token ids: each chunk alone, each run of text alone.

Prompt ids are always the concatenation of each chunk's own ids and of each
run of text between chunks (tokenized alone, without special tokens added):
re-tokenizing the joined string could merge tokens across a boundary, and then
no cached chunk would line up.

Text is literal: a structural token's string inside a chunk, a question, a
tool result or a message (``<|im_end|>`` say) is tokenized as the characters it
is made of, never as the control token, so a retrieved document cannot open a
system turn or forge a tool call. Structural tokens (``structural_tokens``) are
the special ones and the added tokens that the chat template or the tool markup
writes, special or not (Qwen2.5's tool-call tag is added with
``special: false``), and any tool family's markup (``tools.plan.TOOL_MARKUP``:
the fallback prompt may ask a model for markup its template never writes).
Only markup (``Text(..., markup=True)``: what the chat template itself writes)
has their strings turned into control tokens.
"""

from __future__ import annotations

import contextlib
import json
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvrag_integrations.engine.prompting.segments import (
    Chunk,
    Piece,
    Segment,
    Text,
    TokenizedPrompt,
    check_text,
    validate_chunk_text,
)
from kvrag_integrations.engine.tools.plan import TOOL_MARKUP

_NO_IDS = torch.zeros(0, dtype=torch.long)  # a text piece's until its ids are made


# Per tokenizer: (markup backend, literal backend), private copies of its Rust
# tokenizer. transformers' ``split_special_tokens`` flips a flag on the shared
# backend for each call, which races between threads; copies with the flag
# fixed never change, so a literal text is literal whatever other threads do.
_BACKENDS: weakref.WeakKeyDictionary[Any, tuple[str, Any, Any]] = weakref.WeakKeyDictionary()

_BACKENDS_LOCK = threading.Lock()
_SLOW_LOCK = threading.Lock()  # tokenizers without a Rust backend: one call at a time


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def structural_tokens(tokenizer: Any) -> set[str]:
    """The added-token strings that are structure, kept out of literal text: the
    special tokens, and added tokens the chat template or tool markup writes."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    template = _template_text(tokenizer)
    out = set()
    for token in decoder.values():
        content = getattr(token, "content", str(token))
        if content and (
            getattr(token, "special", True) or content in template or content in TOOL_MARKUP
        ):
            out.add(content)
    return out


def _backends(tokenizer: Any) -> tuple[Any, Any] | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    template = _template_text(tokenizer)
    with _BACKENDS_LOCK:
        try:
            cached = _BACKENDS.get(tokenizer)
        except TypeError:  # not weak-referenceable: build the copies each time
            cached = None
        if cached is None or cached[0] != template:  # a new template: new structure
            from tokenizers import Tokenizer

            spec = backend.to_str()
            markup = Tokenizer.from_str(spec)
            literal = Tokenizer.from_str(_as_special(spec, structural_tokens(tokenizer)))
            for copy in (markup, literal):  # a copy keeps truncation set by past calls
                copy.no_truncation()
                copy.no_padding()
            markup.encode_special_tokens = False
            literal.encode_special_tokens = True  # no special token from literal text
            cached = (template, markup, literal)
            with contextlib.suppress(TypeError):  # not weak-referenceable: not cached
                _BACKENDS[tokenizer] = cached
    return cached[1], cached[2]


def _as_special(spec: str, structural: set[str]) -> str:
    """A tokenizer's JSON with its structural added tokens marked special, so the
    literal copy (``encode_special_tokens``) writes them as their characters."""
    data = json.loads(spec)
    for token in data.get("added_tokens", []):
        if token.get("content") in structural:
            token["special"] = True
    return json.dumps(data)


def control_token_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's added-token strings (e.g. ``<|im_end|>``), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    strings = {getattr(t, "content", str(t)) for t in decoder.values()}
    return sorted((s for s in strings if s), key=len, reverse=True)


def _encode(tokenizer: Any, text: str, literal: bool) -> list[int]:
    if not text:
        return []
    pair = _backends(tokenizer)
    if pair is not None:
        return list(pair[literal].encode(text, add_special_tokens=False).ids)
    if literal and any(c in text for c in structural_tokens(tokenizer)):
        with _SLOW_LOCK:
            out = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return list(out["input_ids"])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_text(tokenizer: Any, text: str, *, markup: bool = False) -> torch.Tensor:
    """Token ids of ``text`` alone, with no special tokens added.

    The text is literal (special-token strings in it are ordinary text) unless
    ``markup`` is true: then they become the control tokens.

    Examples:
        >>> tok = lambda text, add_special_tokens=False: {"input_ids": [len(text)]}
        >>> tokenize_text(tok, "four").tolist()
        [4]
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return torch.tensor(_encode(tokenizer, text, literal=not markup), dtype=torch.long)


def tokenize_texts(tokenizer: Any, texts: Sequence[Text]) -> torch.Tensor:
    """Ids of a run of ``Text`` segments, tokenized as their joined string would be.

    Markup is cut only at its control tokens; everything else (markup text and
    literal text alike) is joined and tokenized literally. Since tokenizers split
    at control tokens first anyway, the ids equal those of the joined string
    tokenized normally, except that no control token can come from literal text.
    """
    return torch.tensor(_text_ids(tokenizer, texts), dtype=torch.long)


def _text_ids(tokenizer: Any, texts: Sequence[Text]) -> list[int]:
    controls = control_token_strings(tokenizer)
    ids: list[int] = []
    plain = ""
    for seg in texts:
        check_text(seg.text, "Text.text")
        if not seg.markup or not controls:
            plain += seg.text
            continue
        for part in _split_controls(seg.text, controls):
            if part in controls:
                ids += _encode(tokenizer, plain, literal=True)
                ids += _encode(tokenizer, part, literal=False)
                plain = ""
            else:
                plain += part
    ids += _encode(tokenizer, plain, literal=True)
    return ids


def _split_controls(text: str, controls: Sequence[str]) -> list[str]:
    """``text`` cut before and after every occurrence of a control string."""
    out: list[str] = []
    start = i = 0
    while i < len(text):
        hit = next((c for c in controls if text.startswith(c, i)), None)
        if hit is None:
            i += 1
            continue
        out += [text[start:i], hit]
        i = start = i + len(hit)
    out.append(text[start:])
    return [p for p in out if p]


def tokenize_segments(
    tokenizer: Any,
    segments: Sequence[Segment],
    chunk_tokens: Callable[[str], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> TokenizedPrompt:
    """Tokenize each chunk alone and each run of text between chunks alone, in order.

    Consecutive ``Text`` segments form one piece (empty runs are dropped).
    ``chunk_tokens`` (``ChunkTokens.get``) gives a chunk's ids and its entry's,
    as ``tokenize_text`` and ``entries.entry_ids`` make them, remembered: a known
    chunk is not tokenized again. Without it, chunks are tokenized here.
    """
    pieces: list[Piece] = []
    text_ids: list[list[int]] = []  # the text pieces' ids, in order
    run: list[Text] = []

    def flush() -> None:
        if run:
            ids = _text_ids(tokenizer, run)
            if ids:
                text_ids.append(ids)
                pieces.append(Piece(_NO_IDS, "text", "".join(t.text for t in run)))
            run.clear()

    for seg in segments:
        if isinstance(seg, Chunk):
            flush()
            validate_chunk_text(seg.text)
            if chunk_tokens is None:
                ids, stored = tokenize_text(tokenizer, seg.text), None
            else:
                ids, stored = chunk_tokens(seg.text)
            if ids.numel():
                pieces.append(Piece(ids, "chunk", seg.text, None if stored is ids else stored))
        elif isinstance(seg, Text):
            check_text(seg.text, "Text.text")
            run.append(seg)
        else:
            raise TypeError(f"segments must be Text or Chunk, got {type(seg).__name__}")
    flush()
    if text_ids:  # one tensor for all text pieces (views of it): no op per piece
        flat = torch.tensor([i for ids in text_ids for i in ids], dtype=torch.long)
        parts = iter(flat.split([len(ids) for ids in text_ids]))
        for piece in pieces:
            if piece.kind == "text":
                piece.ids = next(parts)
    return TokenizedPrompt(pieces)
