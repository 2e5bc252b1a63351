"""Finding known chunks inside flat prompt text.

Frameworks hand the LLM a flat prompt (LlamaIndex's synthesizers) or chat
messages (LangChain) with the retrieved chunks pasted in. To reuse their
caches we find where each known chunk sits and split the text into ``Text``
and ``Chunk`` segments. Text that a synthesizer altered (re-split, truncated)
simply does not match and is prefilled normally: the answer stays correct.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvrag_integrations.engine.prompting.segments import Chunk, Segment, Text, check_text

_ANCHOR = 32  # characters that index a chunk: long enough to be selective


class ChunkIndex:
    """A bounded set of chunk texts, searchable inside longer text.

    Chunks are indexed by their first ``_ANCHOR`` characters, so finding them
    in a prompt costs one dictionary look-up per prompt character, whatever the
    number of chunks.

    Examples:
        >>> index = ChunkIndex()
        >>> index.add("Paris is the capital of France.")
        >>> [type(s).__name__ for s in index.split("Context: Paris is the capital of France. Q?")]
        ['Text', 'Chunk', 'Text']
    """

    def __init__(self, max_chunks: int = 200_000) -> None:
        self.max_chunks = max_chunks
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._by_anchor: dict[str, set[str]] = {}
        self._anchor_lengths: set[int] = set()  # < _ANCHOR only for very short chunks
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: object) -> bool:
        return text in self._texts

    def add(self, text: str) -> None:
        """Remember ``text`` (the least recently added texts go past ``max_chunks``)."""
        if not text.strip():
            return
        with self._lock:
            if text in self._texts:
                self._texts.move_to_end(text)
                return
            self._texts[text] = None
            self._by_anchor.setdefault(text[:_ANCHOR], set()).add(text)
            self._anchor_lengths.add(min(len(text), _ANCHOR))
            while len(self._texts) > self.max_chunks:
                old, _ = self._texts.popitem(last=False)
                bucket = self._by_anchor.get(old[:_ANCHOR], set())
                bucket.discard(old)
                if not bucket:
                    self._by_anchor.pop(old[:_ANCHOR], None)

    def find(self, text: str) -> list[str]:
        """This index's chunks that occur verbatim in ``text``, in order, each once.

        Examples:
            >>> index = ChunkIndex()
            >>> index.add("Paris is the capital of France.")
            >>> index.find("Context: Paris is the capital of France. Q?")
            ['Paris is the capital of France.']
        """
        return list(dict.fromkeys(chunk for _, chunk in sorted(self._matches(text, ()))))

    def split(self, text: str, extra: Iterable[str] = ()) -> list[Segment]:
        """Split ``text`` into segments at this index's chunks and at ``extra`` chunks."""
        return split_at_chunks(text, self._matches(text, extra))

    def _matches(self, text: str, extra: Iterable[str]) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []
        for chunk in {c for c in extra if isinstance(c, str) and c.strip()}:
            start = text.find(chunk)
            while start != -1:
                found.append((start, chunk))
                start = text.find(chunk, start + len(chunk))
        with self._lock:
            lengths = sorted(self._anchor_lengths) if self._by_anchor else []
            for i in range(len(text)):
                for n in lengths:
                    for chunk in self._by_anchor.get(text[i : i + n], ()):
                        if text.startswith(chunk, i):
                            found.append((i, chunk))
        return found


def message_segments(
    content: Any, index: ChunkIndex, known_chunks: Iterable[str] = ()
) -> list[Segment]:
    """A chat message's content as prompt segments, split at known chunks.

    ``content`` is a string, or a list of strings and ``Text`` / ``Chunk``
    segments (what the adapters build from content blocks). Strings, each run of
    consecutive ones joined, are split wherever a chunk of ``index`` or one of
    ``known_chunks`` appears; segments are kept as they are.

    Examples:
        >>> index = ChunkIndex()
        >>> index.add("Paris is the capital of France.")
        >>> message_segments(["Context: ", "Paris is the capital of France.", Chunk("B.")], index)
        [Text(text='Context: '), Chunk(text='Paris is the capital of France.'), Chunk(text='B.')]
    """
    if isinstance(content, str):
        return index.split(check_text(content, "content"), known_chunks)
    if not isinstance(content, (list, tuple)) or not all(
        isinstance(item, (str, Text, Chunk)) for item in content
    ):
        raise TypeError(
            "message content must be a string or a list of strings and Text/Chunk segments"
        )
    known = list(known_chunks)
    out: list[Segment] = []
    run: list[str] = []
    for item in [*content, None]:  # None: the end, flushing the last run
        if isinstance(item, str):
            run.append(item)
            continue
        if run:
            out += index.split(check_text("".join(run), "content"), known)
            run.clear()
        if item is not None:
            out.append(item)
    return out


def split_at_chunks(text: str, matches: Iterable[tuple[int, str]]) -> list[Segment]:
    """Segments of ``text`` given ``(start, chunk)`` matches; overlaps keep the longest.

    Examples:
        >>> split_at_chunks("a XY b", [(2, "XY")])
        [Text(text='a '), Chunk(text='XY'), Text(text=' b')]
    """
    chosen: list[tuple[int, str]] = []
    end = 0
    for start, chunk in sorted(matches, key=lambda m: (m[0], -len(m[1]))):
        if start >= end:
            chosen.append((start, chunk))
            end = start + len(chunk)
    out: list[Segment] = []
    cursor = 0
    for start, chunk in chosen:
        if start > cursor:
            out.append(Text(text[cursor:start]))
        out.append(Chunk(chunk))
        cursor = start + len(chunk)
    if cursor < len(text):
        out.append(Text(text[cursor:]))
    return out


# How many recently retrieved texts an adapter's process-wide registry keeps.
MAX_RECENT_CHUNKS = 4096
