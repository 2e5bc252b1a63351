"""A prompt as a list of segments, and as the tokenized pieces they become.

``Text`` is prefilled normally; ``Chunk`` is a retrieved passage whose KV cache
may be reused. ``Piece`` and ``TokenizedPrompt`` are the prompt once tokenized
(``prompting.tokenize``: each chunk and each run of text alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvrag_integrations.errors import InvalidChunkError

DEFAULT_INSTRUCTION = (
    "Answer the question using the documents below. Answer briefly, with a few words."
)


@dataclass(frozen=True)
class Text:
    """Prompt text, always prefilled.

    Attributes:
        text: the text; tokenized literally (special-token strings in it stay text).
        markup: the text is chat-template markup whose special-token strings are
            control tokens (``render_chat`` sets it on the template's own text;
            set it yourself only for text you wrote, never for user input).

    Examples:
        >>> Text("Question: who?").text
        'Question: who?'
    """

    text: str
    markup: bool = field(default=False, repr=False)


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
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidChunkError(
            f"a chunk must be valid Unicode text: {exc.reason} at index {exc.start}"
        ) from None
    return text


def check_text(text: Any, what: str) -> str:
    """Return ``text`` if it is a str that UTF-8 can encode, else a typed error naming it.

    Examples:
        >>> check_text("abc\\ud800", "question")
        Traceback (most recent call last):
        ...
        ValueError: question must be valid Unicode text: surrogates not allowed at index 3
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} must be valid Unicode text: {exc.reason} at index {exc.start}"
        ) from None
    return text


PieceKind = Literal["text", "chunk", "prefix"]
PIECE_KINDS: tuple[PieceKind, ...] = ("text", "chunk", "prefix")

# How a chunk is encoded for its entry: "alone" (TurboRAG: from position 0, its
# first token its own attention sink) or "sink" (behind the model's BOS token,
# whose K/V are dropped: CacheBlend's reference encoding, so that no chunk token
# plays a sink the full prompt does not have). Part of the entries' fingerprint;
# a piece read from such an entry has ``stored_at`` 1.
CHUNK_CONTEXTS = ("alone", "sink")
DEFAULT_CHUNK_CONTEXT = "alone"


def check_texts(texts: Any, what: str) -> list[str]:
    """``texts`` as a list of str; one str, or an item that is not one, is a TypeError.

    Examples:
        >>> check_texts(["a", 3], "documents")
        Traceback (most recent call last):
        ...
        TypeError: documents[1] must be a str, got int
    """
    if isinstance(texts, str):
        raise TypeError(f"{what} must be a list of strings, not one string")
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(f"{what}[{i}] must be a str, got {type(text).__name__}")
    return out


@dataclass
class Piece:
    """One tokenized segment, of one ``kind``:

    - ``"text"``: prefilled (or recomputed) on every request;
    - ``"chunk"``: a retrieved chunk, its K/V from the chunk store;
    - ``"prefix"``: the prompt's leading text when it is cached too (see
      ``cache_leading_text``), its K/V from the prefix store.

    ``stored_ids``: the ids a chunk's store entry holds when they are more than
    ``ids`` (the chunk followed by the engine's chunk suffix); ``ids`` is then a
    prefix of them, and the piece takes the first ``len(ids)`` rows.
    ``stored_at``: the position the entry's first row was encoded at (the length
    of the engine's chunk encoding context; 0 for chunks encoded alone and for
    the leading text): assembly moves its keys from there.

    Examples:
        >>> p = Piece(torch.tensor([1, 2]), "prefix", "System: ...")
        >>> p.is_cached, p.is_chunk, p.is_prefix
        (True, False, True)
    """

    ids: torch.Tensor  # int64 [n]
    kind: PieceKind
    text: str
    stored_ids: torch.Tensor | None = None
    stored_at: int = 0

    def __post_init__(self) -> None:
        if self.kind not in PIECE_KINDS:
            raise ValueError(f"Piece.kind must be one of {PIECE_KINDS}, got {self.kind!r}")

    @property
    def is_chunk(self) -> bool:
        """A retrieved chunk (never the cached leading text)."""
        return self.kind == "chunk"

    @property
    def is_prefix(self) -> bool:
        """The prompt's cached leading text."""
        return self.kind == "prefix"

    @property
    def is_cached(self) -> bool:
        """Its K/V come from a store: a chunk or the cached leading text."""
        return self.kind != "text"

    @property
    def entry_ids(self) -> torch.Tensor:
        """The token ids of the store entry this piece reads (its cache key's ids)."""
        return self.ids if self.stored_ids is None else self.stored_ids


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
        """The retrieved chunks, in order (not the cached leading text)."""
        return [p for p in self.pieces if p.is_chunk]

    @property
    def cached_pieces(self) -> list[Piece]:
        """Pieces whose K/V come from a store (chunks and the leading text), in order:
        the order of the caches a strategy takes."""
        return [p for p in self.pieces if p.is_cached]


def cache_leading_text(prompt: TokenizedPrompt) -> TokenizedPrompt:
    """Mark the text before the first chunk as cacheable, like a chunk.

    Nothing precedes it, so its cache encoded alone is exactly what a full
    prefill computes (prefix caching): the system prompt, chat-template header
    and instruction are then reused across requests instead of prefilled. Only
    done when a chunk follows, so one-off prompts do not fill the store.
    """
    pieces = prompt.pieces
    if len(pieces) < 2 or pieces[0].is_cached or not any(p.is_chunk for p in pieces):
        return prompt
    head = pieces[0]
    return TokenizedPrompt([Piece(head.ids, "prefix", head.text), *pieces[1:]])


def rag_user_segments(
    question: str, chunks: Sequence[str], instruction: str = DEFAULT_INSTRUCTION
) -> list[Segment]:
    """The default RAG layout: instruction, each chunk, then the question.

    Examples:
        >>> [type(s).__name__ for s in rag_user_segments("Who?", ["A.", "B."])]
        ['Text', 'Chunk', 'Text', 'Chunk', 'Text']
    """
    check_text(question, "question")
    segments: list[Segment] = []
    lead = f"{instruction}\n\n" if instruction else ""
    for i, text in enumerate(chunks):
        segments.append(Text(lead if i == 0 else "\n\n"))
        segments.append(Chunk(text))
    tail = f"\n\nQuestion: {question}" if chunks else f"{lead}Question: {question}"
    segments.append(Text(tail))
    return [s for s in segments if not (isinstance(s, Text) and not s.text)]
