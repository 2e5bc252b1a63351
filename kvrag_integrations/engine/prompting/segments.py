"""A prompt as a list of segments, and turning it into token ids.

``Text`` is prefilled normally; ``Chunk`` is a retrieved passage whose KV cache
may be reused. Prompt ids are always the concatenation of each chunk's own ids
and of each run of text between chunks (tokenized alone, without special
tokens added): re-tokenizing the joined string could merge tokens across a
boundary, and then no cached chunk would line up.

Text is literal: a special-token string inside a chunk, a question or a message
(``<|im_end|>`` say) is tokenized as the characters it is made of, never as the
control token, so a retrieved document cannot open a system turn. Only markup
(``Text(..., markup=True)``: what the chat template itself writes) has its
special-token strings turned into control tokens.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
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
_NO_IDS = torch.zeros(0, dtype=torch.long)  # a text piece's until its ids are made


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


# Per tokenizer: (markup backend, literal backend), private copies of its Rust
# tokenizer. transformers' ``split_special_tokens`` flips a flag on the shared
# backend for each call, which races between threads; copies with the flag
# fixed never change, so a literal text is literal whatever other threads do.
_BACKENDS: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()
_SLOW_LOCK = threading.Lock()  # tokenizers without a Rust backend: one call at a time


def _backends(tokenizer: Any) -> tuple[Any, Any] | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    with _BACKENDS_LOCK:
        try:
            pair = _BACKENDS.get(tokenizer)
        except TypeError:  # not weak-referenceable: build the copies each time
            pair = None
        if pair is None:
            from tokenizers import Tokenizer

            markup, literal = (Tokenizer.from_str(backend.to_str()) for _ in range(2))
            for copy in (markup, literal):  # a copy keeps truncation set by past calls
                copy.no_truncation()
                copy.no_padding()
            markup.encode_special_tokens = False
            literal.encode_special_tokens = True
            pair = (markup, literal)
            with contextlib.suppress(TypeError):  # not weak-referenceable: not cached
                _BACKENDS[tokenizer] = pair
    return pair


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
    if literal and any(c in text for c in control_token_strings(tokenizer)):
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
