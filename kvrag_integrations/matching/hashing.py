"""Hashes of k-grams of token ids, vectorised with numpy (uint64 wraparound).

A hash only proposes candidates: ``ContentIndex`` compares the ids themselves
before it reports a run, so a collision costs time, never a wrong answer (the
tests replace ``kgram_hashes`` by a constant to check exactly that). Callers
look the function up on this module at call time for that reason.
"""

from __future__ import annotations

import hashlib

import numpy as np

_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd: multiplication by it is a bijection mod 2**64
_MIX = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constant
_POWERS: dict[int, np.ndarray] = {}


def _powers(k: int) -> np.ndarray:
    if k not in _POWERS:
        powers = [pow(_BASE, k - 1 - j, 1 << 64) & _MASK for j in range(k)]
        _POWERS[k] = np.array(powers, dtype=np.uint64)
    return _POWERS[k]


def kgram_hashes(ids: np.ndarray, k: int, starts: np.ndarray | None = None) -> np.ndarray:
    """The uint64 hash of ``ids[i:i + k]`` for every ``i`` in ``starts`` (default:
    every ``i`` from 0 to ``len(ids) - k``). ``starts`` must leave k ids after each.

    Examples:
        >>> h = kgram_hashes(np.array([1, 2, 3, 1, 2, 3]), 3)
        >>> len(h), bool(h[0] == h[3]), bool(h[0] == h[1])
        (4, True, False)
        >>> bool((kgram_hashes(np.array([1, 2, 3, 1, 2, 3]), 3, np.array([3])) == h[3]).all())
        True
    """
    x = np.asarray(ids)
    # int64 is reinterpreted (negatives wrap; they are never stored, so never match).
    x = x.view(np.uint64) if x.dtype == np.int64 else x.astype(np.uint64)
    powers = _powers(k)
    if starts is None:  # every position: k passes over the ids (no n-by-k temporary)
        n = len(x) - k + 1
        if n <= 0:
            return np.empty(0, dtype=np.uint64)
        h = x[:n] * powers[0]
        for j in range(1, k):
            h += x[j : j + n] * powers[j]  # wraps mod 2**64
    elif len(starts) < 512:  # a few positions (one entry's): one small gather
        rows = x[np.asarray(starts)[:, None] + np.arange(k)]
        h = (rows * powers).sum(axis=1, dtype=np.uint64)
    else:  # many (a bulk add): k flat gathers, faster than one 2-D gather
        at = np.asarray(starts)
        h = x[at] * powers[0]
        for j in range(1, k):
            h += x[at + j] * powers[j]
    # The polynomial's top bits are weak; the table buckets rows by them.
    h ^= h >> np.uint64(31)
    h *= _MIX
    h ^= h >> np.uint64(29)
    return h


def periodic(ids: np.ndarray, starts: np.ndarray, k: int, max_period: int) -> np.ndarray:
    """Whether ``ids[s:s + k]`` repeats with a period of at most ``max_period`` (and
    at most ``k // 2``: the pattern fits twice), for each ``s`` in ``starts``.

    Such k-grams (one id repeated, "| - | - |", an indentation pattern) recur at
    every shift in long repetitive stretches: indexed, one such stretch in a
    prompt would propose hundreds of diagonals per entry.

    Examples:
        >>> x = np.array([7, 7, 7, 7, 1, 2, 1, 2, 1, 2, 3, 4])
        >>> periodic(x, np.array([0, 4, 6, 8]), 4, 2).tolist()
        [True, True, True, False]
    """
    top = min(max_period, k // 2)
    out = np.zeros(len(starts), dtype=bool)
    if top < 1:
        return out
    at = np.asarray(starts)
    for begin in range(0, len(at), 1 << 16):  # bounded temporaries on a bulk add
        rows = ids[at[begin : begin + (1 << 16), None] + np.arange(k)]
        hit = out[begin : begin + len(rows)]
        for period in range(1, top + 1):
            hit |= (rows[:, : k - period] == rows[:, period:]).all(axis=1)
    return out


def namespace_salt(namespace: str) -> np.uint64:
    """A 64-bit value XORed into every key of ``namespace``: keys of two namespaces
    (almost) never meet, so a lookup rarely even proposes another namespace's rows."""
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=8, person=b"kvrag-ns")
    return np.uint64(int.from_bytes(digest.digest(), "little"))
