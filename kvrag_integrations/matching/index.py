"""``ContentIndex``: find, inside a prompt, the runs of ids that stored entries hold.

Entries (token-id sequences) are kept concatenated in one int32 buffer. Each
entry indexes the hashes of its k-grams at offsets 0, k, 2k, ... (``k <=
(min_run + 1) // 2``, so every common run of ``min_run`` ids holds one of
them); a prompt hashes the k-gram at every position and looks them all up at
once (``table.GramTable``). Each hit is checked against the ids and extended
both ways, once per (entry, diagonal) region, so the work is linear in the
prompt (plus the runs found). A second table keys each entry's first
``min_head`` ids, for the short template heads a prompt may start with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvrag_integrations.matching import hashing
from kvrag_integrations.matching.runs import RawRun, Run, agree, greedy_cover
from kvrag_integrations.matching.table import GramTable, Growable

_MAX_ID = 2**31 - 1  # ids are stored as int32
_K_MAX = 8


class ContentIndex:
    """An in-memory index of token-id sequences, per namespace.

    Entries of different namespaces never match each other. Not thread-safe
    (``SyncedIndex`` holds a lock around it).

    Args:
        min_run: the shortest run ``cover`` reports (bar the head, below).
        min_head: a run at prompt position 0 and entry offset 0 counts from this
            length (a short template head).
        max_hits: at most this many entries are tried per prompt position (the
            oldest first): a k-gram shared by thousands of entries (a common
            template) cannot make a lookup slow. Runs through such text are
            still found, from the oldest entries holding it or from the k-grams
            an entry does not share.
        max_period: k-grams repeating with a period up to this (one id over
            and over, "| - | - |") are not indexed: a long repetitive stretch
            would otherwise propose a diagonal per position. A run is still
            found, and extended through such stretches, from any other k-gram
            it holds; a run made only of them is not (0: index every k-gram).

    Examples:
        >>> index = ContentIndex()
        >>> index.add("m", list(range(100, 140)))
        True
        >>> [(r.start, r.length, r.offset) for r in index.cover("m", [1, 2, *range(110, 130)])]
        [(2, 20, 10)]
    """

    def __init__(
        self, *, min_run: int = 16, min_head: int = 4, max_hits: int = 64, max_period: int = 4
    ) -> None:
        if min_run < 1 or min_head < 1 or max_hits < 1 or max_period < 0:
            raise ValueError("min_run, min_head, max_hits must be >= 1, max_period >= 0")
        self.min_run, self.min_head, self.max_hits = min_run, min_head, max_hits
        self.max_period = max_period
        self.k = max(1, min(_K_MAX, (min_run + 1) // 2))
        self._clear()

    def _clear(self) -> None:
        self._tokens = Growable(np.int32, 1 << 16)
        self._starts = Growable(np.int64)
        self._lengths = Growable(np.int32)
        self._spaces = Growable(np.int32)  # namespace number of each entry
        self._alive = Growable(np.bool_)
        self._exact: dict[int, Any] = {}  # digest -> entry number (a list on a collision)
        self._space_ids: dict[str, int] = {}
        self._salts: list[np.uint64] = []
        self._grams = GramTable()
        self._heads = GramTable()  # first min_head ids (only when min_head < k)
        self._live = 0
        self._dead_tokens = 0
        self._batch: list[tuple[int, np.ndarray]] = []  # see add_many

    # ------------------------------------------------------------- entries
    def __len__(self) -> int:
        return self._live

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
            return False
        space = self._space_ids.get(item[0])
        try:
            ids = _as_ids(item[1])
        except (TypeError, ValueError):
            return False
        return space is not None and self._find(space, ids)[1] is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the numpy buffers (ids, entry table, k-gram tables)."""
        arrays = (self._tokens, self._starts, self._lengths, self._spaces, self._alive)
        held = sum(a.view.nbytes for a in arrays)
        return held + self._grams.nbytes + self._heads.nbytes

    def cost(self, length: int) -> int:
        """About the bytes an entry of ``length`` ids takes here: its ids, its row of
        the entry table, its k-gram rows (key, entry, offset) and their share of
        the tables' directories."""
        return 4 * length + 20 * (length // self.k + 2) + 17

    @property
    def live_nbytes(self) -> int:
        """About the bytes the live entries take (``cost`` of each): removed
        entries do not count, though their rows stay until ``compact``."""
        tokens = len(self._tokens) - self._dead_tokens
        return 4 * tokens + 20 * (tokens // self.k + 2 * self._live) + 17 * self._live

    def clear(self) -> None:
        """Forget every entry (and namespace)."""
        self._clear()

    def add(self, namespace: str, ids: Sequence[int] | np.ndarray) -> bool:
        """Index ``ids`` under ``namespace``; False if that sequence is there already.

        Raises:
            ValueError: ``ids`` is empty, not 1-D, or holds an id outside [0, 2**31).
        """
        return self.add_many([(namespace, ids)]) == 1

    def add_many(self, records: Iterable[tuple[str, Sequence[int] | np.ndarray]]) -> int:
        """Index many sequences at once (hashed in one pass); how many were new.

        Raises:
            ValueError: as ``add``; the records before the bad one are indexed.
        """
        base = len(self._starts)
        self._batch = []  # (space, ids) of the new entries, until appended
        try:
            for namespace, ids in records:
                space = self._space(namespace)
                arr = _as_ids(ids)
                digest, found = self._find(space, arr)
                if found is None:
                    self._remember(digest, base + len(self._batch))
                    self._batch.append((space, arr))
        finally:
            batch, self._batch = self._batch, []
            if batch:
                self._append_entries(base, batch)
        return len(batch)

    def _append_entries(self, base: int, batch: list[tuple[int, np.ndarray]]) -> None:
        arrays = [arr for _, arr in batch]
        lengths = np.fromiter((len(a) for a in arrays), np.int64, len(arrays))
        firsts = np.cumsum(lengths) - lengths  # where each entry starts in ``joined``
        joined = np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
        self._starts.append(firsts + len(self._tokens))
        self._tokens.append(joined)
        self._lengths.append(lengths)
        self._spaces.append(np.fromiter((space for space, _ in batch), np.int32, len(batch)))
        self._alive.append(np.ones(len(batch), np.bool_))
        self._live += len(batch)
        self._index_rows(np.arange(base, base + len(batch)), joined, lengths, firsts)

    def remove(self, namespace: str, ids: Sequence[int] | np.ndarray) -> bool:
        """Forget an entry (e.g. evicted from the store); False if it was not there."""
        space = self._space_ids.get(namespace)
        if space is None:
            return False
        arr = _as_ids(ids)
        digest, number = self._find(space, arr)
        if number is None:
            return False
        self._forget(digest, number)
        self._alive.view[number] = False
        self._live -= 1
        self._dead_tokens += len(arr)
        # Dead rows stay in the tables until they outweigh the live ones.
        if self._dead_tokens > max(1 << 20, len(self._tokens) // 2):
            self.compact()
        return True

    def flush(self) -> None:
        """Sort rows added since the last lookup into the tables now (else the
        next ``cover`` does it: after a bulk add, a fraction of a second)."""
        self._grams.flush()
        self._heads.flush()

    def compact(self) -> None:
        """Rebuild without removed entries (order, hence tie-breaking, is kept)."""
        starts, lengths = self._starts.view, self._lengths.view
        spaces, alive, tokens = self._spaces.view, self._alive.view, self._tokens.view
        names = {number: name for name, number in self._space_ids.items()}
        live = [
            (names[int(spaces[e])], tokens[starts[e] : starts[e] + lengths[e]].copy())
            for e in np.flatnonzero(alive)
        ]
        self._clear()
        self.add_many(live)

    # ------------------------------------------------------------- cover
    def cover(
        self,
        namespace: str,
        prompt: Sequence[int] | np.ndarray,
        accept: Callable[[tuple[int, ...], int], bool] | None = None,
    ) -> list[Run]:
        """The greedy cover of ``prompt`` by runs it shares with entries of ``namespace``.

        Runs are maximal (extended both ways as far as the ids agree), at least
        ``min_run`` long, or ``min_head`` long at prompt 0 and entry offset 0.
        From ``c = 0`` the run covering ``c`` that reaches furthest right (ties:
        the earliest-added entry) gives the piece ``[c, its end)``; where no run
        covers ``c`` the cover jumps to the next run's start. Pieces are sorted,
        non-overlapping and verified id by id. ``accept(entry, offset)``, where
        given, vets each maximal run before the cover (one that starts inside an
        entry can be refused for what the entry holds before it).
        """
        space = self._space_ids.get(namespace)
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (len(ids) and ids.dtype.kind not in "iu"):
            raise ValueError(f"prompt must be a 1-D sequence of ints, got {ids.dtype} {ids.shape}")
        if space is None or not self._live or not len(ids):
            return []
        ids = ids.astype(np.int64, copy=False)
        salt = self._salts[space]
        runs: set[RawRun] = set()
        if len(ids) >= self.k:
            keys = hashing.kgram_hashes(ids, self.k) ^ salt
            self._extend_hits(ids, space, *self._grams.lookup(keys, self.max_hits), runs)
        if self.min_head < self.k and len(ids) >= self.min_head:
            keys = hashing.kgram_hashes(ids[: self.min_head], self.min_head) ^ salt
            self._extend_hits(ids, space, *self._heads.lookup(keys, self.max_hits), runs)
        kept = [
            r
            for r in runs
            if r[1] >= self.min_run or (r[0] == 0 and r[3] == 0 and r[1] >= self.min_head)
        ]
        tokens, starts = self._tokens.view, self._starts.view
        entries: dict[int, tuple[int, ...]] = {}

        def entry(number: int) -> tuple[int, ...]:  # built only for runs looked at
            if number not in entries:
                first = int(starts[number])
                stop = first + int(self._lengths.view[number])
                entries[number] = tuple(tokens[first:stop].tolist())
            return entries[number]

        if accept is not None:
            kept = [r for r in kept if accept(entry(r[2]), r[3])]
        return [Run(s, n, entry(e), o) for s, n, e, o in greedy_cover(kept)]

    def _extend_hits(
        self,
        ids: np.ndarray,
        space: int,
        query: np.ndarray,
        entries: np.ndarray,
        positions: np.ndarray,
        runs: set[RawRun],
    ) -> None:
        """Check each hit (prompt position, entry, offset) and add its maximal run;
        hits inside a run already found on the same entry and diagonal are skipped."""
        if not len(query):
            return
        ok = self._alive.view[entries] & (self._spaces.view[entries] == space)
        query, entries, positions = query[ok], entries[ok], positions[ok]
        diagonal = query - positions
        order = np.lexsort((query, diagonal, entries))
        tokens, starts, lengths = self._tokens.view, self._starts.view, self._lengths.view
        n = len(ids)
        last: tuple[int, int] | None = None
        covered = 0
        for p, e, d in zip(
            query[order].tolist(), entries[order].tolist(), diagonal[order].tolist()
        ):
            if (e, d) == last and p < covered:
                continue  # inside the run found on this diagonal
            last = (e, d)
            first, size, at = int(starts[e]), int(lengths[e]), p - d
            right = min(n - p, size - at)
            right = agree(ids[p : p + right], tokens[first + at : first + at + right])
            left = min(p, at)
            if left:
                left = agree(ids[p - left : p][::-1], tokens[first + at - left : first + at][::-1])
            covered = p + max(right, 1)
            if left + right:
                runs.add((p - left, left + right, e, at - left))

    # ------------------------------------------------------------- internals
    def _space(self, namespace: str) -> int:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        space = self._space_ids.get(namespace)
        if space is None:
            space = self._space_ids[namespace] = len(self._salts)
            self._salts.append(hashing.namespace_salt(namespace))
        return space

    def _digest(self, space: int, ids: np.ndarray) -> int:
        h = hashlib.blake2b(space.to_bytes(4, "little"), digest_size=8)
        h.update(ids.tobytes())
        return int.from_bytes(h.digest(), "little")

    def _find(self, space: int, ids: np.ndarray) -> tuple[int, int | None]:
        """``(digest, entry number)`` of this exact sequence (``None``: not held)."""
        digest = self._digest(space, ids)
        held = self._exact.get(digest)
        for number in [held] if isinstance(held, int) else held or []:
            # The digest only proposes: the ids decide (a collision is not a hit).
            held_space, stored = self._entry(number)
            if held_space == space and np.array_equal(stored, ids):
                return digest, number
        return digest, None

    def _entry(self, number: int) -> tuple[int, np.ndarray]:
        """Entry ``number``'s namespace number and ids."""
        held = len(self._starts)
        if number >= held:  # added by the ``add_many`` under way
            return self._batch[number - held]
        first = int(self._starts.view[number])
        ids = self._tokens.view[first : first + int(self._lengths.view[number])]
        return int(self._spaces.view[number]), ids

    def _remember(self, digest: int, number: int) -> None:
        held = self._exact.get(digest)
        if held is None:
            self._exact[digest] = number
        else:
            self._exact[digest] = [*([held] if isinstance(held, int) else held), number]

    def _forget(self, digest: int, number: int) -> None:
        held = self._exact[digest]
        rest = [] if isinstance(held, int) else [n for n in held if n != number]
        if not rest:
            del self._exact[digest]
        else:
            self._exact[digest] = rest[0] if len(rest) == 1 else rest

    def _index_rows(
        self, numbers: np.ndarray, joined: np.ndarray, lengths: np.ndarray, firsts: np.ndarray
    ) -> None:
        """Add the k-gram rows (and head rows) of new entries, hashed in one pass."""
        k, head = self.k, self.min_head
        salts = np.asarray(self._salts, dtype=np.uint64)[self._spaces.view[numbers]]
        counts = np.where(lengths >= k, (lengths - k) // k + 1, 0)
        if counts.sum():
            which = np.repeat(np.arange(len(lengths)), counts)
            offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            offsets *= k
            starts = firsts[which] + offsets
            if self.max_period:  # repetitive k-grams are not indexed (see hashing.periodic)
                keep = ~hashing.periodic(joined, starts, k, self.max_period)
                which, offsets, starts = which[keep], offsets[keep], starts[keep]
            keys = hashing.kgram_hashes(joined, k, starts) ^ salts[which]
            self._grams.add(keys, numbers[which].astype(np.int32), offsets.astype(np.int32))
        if head < k:
            has = np.flatnonzero(lengths >= head)
            if len(has):
                keys = hashing.kgram_hashes(joined, head, firsts[has]) ^ salts[has]
                zeros = np.zeros(len(has), np.int32)
                self._heads.add(keys, numbers[has].astype(np.int32), zeros)


def _as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a fresh-or-owned 1-D int32 array; raises ValueError on bad input."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not len(arr):
        raise ValueError("an entry must be a non-empty 1-D sequence of token ids")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or (np.iinfo(arr.dtype).max > _MAX_ID and arr.max() > _MAX_ID):
        raise ValueError(f"token ids must be in [0, {_MAX_ID}]")
    return arr.astype(np.int32, copy=False)
