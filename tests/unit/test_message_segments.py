"""spans.message_segments: message content split at known chunks (engine.messages and
the LangChain adapter's content blocks both go through it)."""

from __future__ import annotations

import pytest

from kvrag_integrations.engine.prompting.segments import Chunk, Text
from kvrag_integrations.engine.prompting.spans import ChunkIndex, message_segments

A = "Ada Lovelace wrote the first algorithm for a machine."
B = "Charles Babbage designed the Analytical Engine."


def test_a_string_is_split_at_indexed_and_known_chunks() -> None:
    index = ChunkIndex()
    index.add(A)
    got = message_segments(f"Context: {A}\n{B}\nQ?", index, known_chunks=[B])
    assert got == [Text("Context: "), Chunk(A), Text("\n"), Chunk(B), Text("\nQ?")]


def test_consecutive_strings_are_joined_before_splitting() -> None:
    index = ChunkIndex()
    index.add(A)
    half = len(A) // 2
    got = message_segments(["Context: ", A[:half], A[half:], Chunk(B), "Q?"], index)
    assert got == [Text("Context: "), Chunk(A), Chunk(B), Text("Q?")]


def test_segments_are_kept_and_empty_strings_vanish() -> None:
    got = message_segments(["", Text("t", markup=True), Chunk(A), ""], ChunkIndex())
    assert got == [Text("t", markup=True), Chunk(A)]


@pytest.mark.parametrize("bad", [3, None, [Text("a"), 3], {"text": "a"}])
def test_other_content_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="message content"):
        message_segments(bad, ChunkIndex())
