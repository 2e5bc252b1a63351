"""A prompt as a list of segments, and turning it into token ids.

``Text`` is prefilled normally; ``Chunk`` is a retrieved passage whose KV cache
may be reused. Prompt ids are always the concatenation of each segment's own ids
(tokenized alone, without special tokens): re-tokenizing the joined string could
merge tokens across a boundary, and then no cached chunk would line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.errors import InvalidChunkError

DEFAULT_INSTRUCTION = (
    "Answer the question using the documents below. Answer briefly, with a few words."
)


@dataclass(frozen=True)
class Text:
    """Plain prompt text, always prefilled.

    Examples:
        >>> Text("Question: who?").text
        'Question: who?'
    """

    text: str


@dataclass(frozen=True)
class Chunk:
    """A retrieved passage whose KV cache is precomputed and reused.

    Examples:
        >>> Chunk("Paris is the capital of France.").text
        'Paris is the capital of France.'
    """

    text: str

    def __post_init__(self) -> None:
        validate_chunk_text(self.text)


Segment = Text | Chunk


def validate_chunk_text(text: Any) -> str:
    """Return ``text`` if it can be a chunk, else raise InvalidChunkError."""
    if not isinstance(text, str):
        raise InvalidChunkError(f"a chunk must be a str, got {type(text).__name__}")
    if not text.strip():
        raise InvalidChunkError("a chunk must contain non-whitespace text")
    return text


@dataclass
class Piece:
    """One tokenized segment.

    ``is_chunk`` pieces take their K/V from the store. ``is_prefix`` marks the
    prompt's leading text when it is cached too (see ``cache_leading_text``).
    """

    ids: torch.Tensor  # int64 [n]
    is_chunk: bool
    text: str
    is_prefix: bool = False


@dataclass
class TokenizedPrompt:
    """The prompt as tokenized pieces, in order."""

    pieces: list[Piece]

    @property
    def input_ids(self) -> torch.Tensor:
        if not self.pieces:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([p.ids for p in self.pieces])

    @property
    def num_tokens(self) -> int:
        return sum(p.ids.numel() for p in self.pieces)

    @property
    def chunk_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if p.is_chunk]


def cache_leading_text(prompt: TokenizedPrompt) -> TokenizedPrompt:
    """Mark the text before the first chunk as cacheable, like a chunk.

    Nothing precedes it, so its cache encoded alone is exactly what a full
    prefill computes (prefix caching): the system prompt, chat-template header
    and instruction are then reused across requests instead of prefilled. Only
    done when a chunk follows, so one-off prompts do not fill the store.
    """
    pieces = prompt.pieces
    if len(pieces) < 2 or pieces[0].is_chunk or not any(p.is_chunk for p in pieces):
        return prompt
    head = pieces[0]
    return TokenizedPrompt([Piece(head.ids, True, head.text, is_prefix=True), *pieces[1:]])


def tokenize_text(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids of ``text`` alone, with no special tokens added."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def tokenize_segments(tokenizer: Any, segments: Sequence[Segment]) -> TokenizedPrompt:
    """Tokenize each segment alone and keep them in order (empty Text is dropped)."""
    pieces = []
    for seg in segments:
        if isinstance(seg, Chunk):
            pieces.append(Piece(tokenize_text(tokenizer, seg.text), True, seg.text))
        elif isinstance(seg, Text):
            if not isinstance(seg.text, str):
                raise TypeError(f"Text.text must be a str, got {type(seg.text).__name__}")
            if seg.text:
                pieces.append(Piece(tokenize_text(tokenizer, seg.text), False, seg.text))
        else:
            raise TypeError(f"segments must be Text or Chunk, got {type(seg).__name__}")
    return TokenizedPrompt([p for p in pieces if p.ids.numel() > 0])


def rag_user_segments(
    question: str, chunks: Sequence[str], instruction: str = DEFAULT_INSTRUCTION
) -> list[Segment]:
    """The default RAG layout: instruction, each chunk, then the question.

    Examples:
        >>> [type(s).__name__ for s in rag_user_segments("Who?", ["A.", "B."])]
        ['Text', 'Chunk', 'Text', 'Chunk', 'Text']
    """
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    segments: list[Segment] = []
    lead = f"{instruction}\n\n" if instruction else ""
    for i, text in enumerate(chunks):
        segments.append(Text(lead if i == 0 else "\n\n"))
        segments.append(Chunk(text))
    tail = f"\n\nQuestion: {question}" if chunks else f"{lead}Question: {question}"
    segments.append(Text(tail))
    return [s for s in segments if not (isinstance(s, Text) and not s.text)]


_SENTINEL = "\x00kvrag-chunk-{}\x00"


Message = tuple[str, Sequence[Segment]]  # (role, content segments)


def render_chat(tokenizer: Any, messages: Sequence[Message]) -> list[Segment]:
    """Render chat messages with the model's template, keeping chunks intact.

    The template is rendered with a sentinel in place of each chunk and the result
    is split at the sentinels, so chunks stay separate segments whose ids match
    their stored caches. The generation prompt for the assistant is appended.

    Args:
        tokenizer: a tokenizer with ``chat_template``.
        messages: ``(role, segments)`` pairs, e.g. ``[("user", [Text("Q"), Chunk(c)])]``.
    """
    chunks: dict[int, Chunk] = {}
    rendered_messages = []
    for role, content in messages:
        text = ""
        for seg in content:
            if isinstance(seg, Chunk):
                chunks[len(chunks)] = seg
                text += _SENTINEL.format(len(chunks) - 1)
            else:
                text += seg.text
        rendered_messages.append({"role": role, "content": text})
    rendered = tokenizer.apply_chat_template(
        rendered_messages, tokenize=False, add_generation_prompt=True
    )
    return split_rendered(rendered, chunks)


def split_rendered(rendered: str, chunks: dict[int, Chunk]) -> list[Segment]:
    """Split a rendered prompt at chunk sentinels into Text and Chunk segments."""
    out: list[Segment] = []
    rest = rendered
    for i, chunk in chunks.items():
        marker = _SENTINEL.format(i)
        before, found, rest = rest.partition(marker)
        if not found:
            raise ValueError("the chat template dropped or altered a chunk placeholder")
        out += [Text(before), chunk]
    out.append(Text(rest))
    return [s for s in out if not (isinstance(s, Text) and not s.text)]
