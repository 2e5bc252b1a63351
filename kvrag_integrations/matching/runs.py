"""Runs of agreeing ids, and the greedy left-to-right cover of a prompt by them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (prompt start, length, entry number, entry offset): the index's internal run.
RawRun = tuple[int, int, int, int]


@dataclass(frozen=True)
class Run:
    """``prompt[start:start + length] == entry[offset:offset + length]`` (ids compared).

    ``entry`` is the whole stored sequence the piece comes from: what names its
    KV cache in the store.
    """

    start: int
    length: int
    entry: tuple[int, ...]
    offset: int

    @property
    def end(self) -> int:
        """One past the last prompt position of the piece."""
        return self.start + self.length


def agree(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids of ``a`` and ``b`` (same length) are equal.

    Compares in growing blocks, so a mismatch near the start costs little and
    a long agreement costs a handful of numpy calls.
    """
    n, done, step = len(a), 0, 32
    while done < n:
        end = min(n, done + step)
        differ = np.flatnonzero(a[done:end] != b[done:end])
        if len(differ):
            return done + int(differ[0])
        done, step = end, step * 4
    return n


def greedy_cover(runs: list[RawRun]) -> list[RawRun]:
    """Sorted, non-overlapping pieces of ``runs`` covering what they can, greedily.

    From ``c = 0``: among the runs with ``start <= c < end`` the one reaching
    furthest right (ties: the lower entry number, then the lower ``offset -
    start``) gives the piece ``[c, end)``; then ``c = end``. Where no run covers
    ``c``, ``c`` jumps to the next run's start.

    Examples:
        >>> greedy_cover([(0, 10, 1, 0), (5, 10, 0, 0), (5, 10, 2, 3), (30, 4, 0, 8)])
        [(0, 10, 1, 0), (10, 5, 0, 5), (30, 4, 0, 8)]
    """
    ordered = sorted(runs)
    out: list[RawRun] = []
    best: tuple[int, int, int] | None = None  # (-end, entry, offset - start): min is best
    best_run: RawRun | None = None
    c = i = 0
    while True:
        while i < len(ordered) and ordered[i][0] <= c:
            start, length, entry, offset = ordered[i]
            if start + length > c:
                key = (-(start + length), entry, offset - start)
                if best is None or key < best:
                    best, best_run = key, ordered[i]
            i += 1
        if best_run is None:
            if i == len(ordered):
                return out
            c = ordered[i][0]  # a gap: no run covers c
            continue
        start, length, entry, offset = best_run
        end = start + length
        out.append((c, end - c, entry, offset + (c - start)))
        # Every run seen so far ends at or before ``end``: none covers the new c.
        c, best, best_run = end, None, None
