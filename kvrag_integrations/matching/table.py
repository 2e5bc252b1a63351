"""A multimap from uint64 keys to ``(entry, position)`` rows, built for bulk lookups.

Rows live in numpy arrays sorted by key (then by entry: adds come in entry
order and sorts are stable), in two tiers: a large ``main`` tier and a small
``delta`` tier holding recent adds. New rows wait, unsorted, in a pending
buffer until the next lookup; the delta tier absorbs them with one merge
(O(delta)), and is merged into main (O(main)) once it outgrows a share of it,
so an add stays cheap and a lookup never scans an unsorted list.

Each tier has a directory indexed by the top bits of the key (about one bucket
per two rows), so a lookup of n keys reads one directory slot and a bucket or
two per key: far fewer cache misses than ``np.searchsorted`` on a large array.
"""

from __future__ import annotations

import numpy as np

# Buckets bigger than this (one key shared by many rows) are searched, not scanned.
_SCAN_LIMIT = 16
# Merge delta into main once it holds this share of main (or this many rows).
_DELTA_SHARE = 8
_DELTA_MIN = 1 << 16


class Growable:
    """A numpy array that grows by a quarter (amortised O(1) appends; at most a
    quarter of it unused: these hold most of the index's memory)."""

    def __init__(self, dtype: type | np.dtype, capacity: int = 1024) -> None:
        self._data = np.empty(capacity, dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def view(self) -> np.ndarray:
        """The filled part (a view: valid until the next append)."""
        return self._data[: self._size]

    def append(self, values: np.ndarray | int) -> None:
        values = np.atleast_1d(values)
        end = self._size + len(values)
        if end > len(self._data):
            grown = np.empty(max(end, len(self._data) * 5 // 4), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : end] = values
        self._size = end

    def clear(self) -> None:
        self._size = 0


class _Tier:
    """Rows sorted by key, with a directory of bucket starts by the key's top bits."""

    def __init__(self, keys: np.ndarray, entries: np.ndarray, positions: np.ndarray) -> None:
        self.keys, self.entries, self.positions = keys, entries, positions
        bits = max(4, len(keys).bit_length() - 1)
        self.shift = np.uint64(64 - bits)
        counts = np.bincount((keys >> self.shift).astype(np.intp), minlength=1 << bits)
        index_type = np.int32 if len(keys) < 2**31 else np.int64
        self.directory = np.zeros((1 << bits) + 1, dtype=index_type)
        np.cumsum(counts, out=self.directory[1:])

    @classmethod
    def empty(cls) -> _Tier:
        return cls(np.empty(0, np.uint64), np.empty(0, np.int32), np.empty(0, np.int32))

    def __len__(self) -> int:
        return len(self.keys)

    def merged(self, keys: np.ndarray, entries: np.ndarray, positions: np.ndarray) -> _Tier:
        """A tier with these rows (sorted by key, later entries than ours) added."""
        # side="right": equal keys keep entry order (ours first, they are older).
        at = np.searchsorted(self.keys, keys, side="right")
        return _Tier(
            np.insert(self.keys, at, keys),
            np.insert(self.entries, at, entries),
            np.insert(self.positions, at, positions),
        )

    def find(self, queries: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """``(query index, row)`` for every row whose key equals a query, at most
        ``cap`` rows (the oldest entries') per query; grouped by query."""
        if not len(self.keys) or not len(queries):
            return np.empty(0, np.intp), np.empty(0, np.intp)
        bucket = (queries >> self.shift).astype(np.intp)
        lo, hi = self.directory[bucket], self.directory[bucket + 1]
        big = hi - lo > _SCAN_LIMIT
        if big.any():  # a popular key: its exact range, capped
            sel = np.flatnonzero(big)
            lo[sel] = np.searchsorted(self.keys, queries[sel], side="left")
            hi[sel] = np.searchsorted(self.keys, queries[sel], side="right")
            hi[sel] = np.minimum(hi[sel], lo[sel] + cap)
        counts = hi - lo
        total = int(counts.sum())
        if not total:
            return np.empty(0, np.intp), np.empty(0, np.intp)
        query = np.repeat(np.arange(len(queries)), counts)
        ends = np.cumsum(counts)
        rows = np.arange(total) - np.repeat(ends - counts - lo, counts)
        hit = self.keys[rows] == queries[query]
        return query[hit], rows[hit]


class GramTable:
    """Rows ``(key, entry, position)`` added in entry order; looked up in bulk.

    Not thread-safe: a lookup may merge pending rows (callers hold one lock).
    """

    def __init__(self) -> None:
        self._main = _Tier.empty()
        self._delta = _Tier.empty()
        self._pending = (Growable(np.uint64), Growable(np.int32), Growable(np.int32))

    def __len__(self) -> int:
        return len(self._main) + len(self._delta) + len(self._pending[0])

    @property
    def nbytes(self) -> int:
        tiers = (self._main, self._delta)
        rows = sum(t.keys.nbytes + t.entries.nbytes + t.positions.nbytes for t in tiers)
        return rows + sum(t.directory.nbytes for t in tiers)

    def add(self, keys: np.ndarray, entries: np.ndarray, positions: np.ndarray) -> None:
        """Queue rows; their entries must be newer than every row's already added."""
        for buffer, values in zip(self._pending, (keys, entries, positions)):
            buffer.append(values)

    def lookup(self, queries: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(query index, entry, position)`` of the rows matching each query key:
        per query at most ``cap`` rows, those of the oldest entries, oldest first."""
        self.flush()
        found = []
        for tier in (self._main, self._delta):
            query, rows = tier.find(queries, cap)
            if len(query):
                found.append((query, tier.entries[rows], tier.positions[rows]))
        if not found:
            empty = np.empty(0, np.intp)
            return empty, empty, empty
        if len(found) == 1:
            query, entries, positions = found[0]
        else:
            query, entries, positions = (np.concatenate(parts) for parts in zip(*found))
        order = np.lexsort((entries, query))  # by query, then entry (oldest first)
        query, entries, positions = query[order], entries[order], positions[order]
        if len(found) > 1 or cap < _SCAN_LIMIT:  # a query may have more than cap rows
            starts = np.flatnonzero(np.r_[True, query[1:] != query[:-1]])
            rank = np.arange(len(query)) - np.repeat(starts, np.diff(np.r_[starts, len(query)]))
            keep = rank < cap
            query, entries, positions = query[keep], entries[keep], positions[keep]
        return query, entries, positions

    def flush(self) -> None:
        """Sort the pending rows into the delta tier (and delta into main when big)."""
        keys, entries, positions = (buffer.view for buffer in self._pending)
        if not len(keys):
            return
        order = np.argsort(keys, kind="stable")  # stable: equal keys stay in entry order
        rows = keys[order], entries[order], positions[order]
        del keys, entries, positions
        # Fresh buffers: a bulk add's would otherwise keep their capacity for ever.
        self._pending = (Growable(np.uint64), Growable(np.int32), Growable(np.int32))
        if not len(self._main) and not len(self._delta):  # the first bulk add: one tier
            self._main = _Tier(*rows)
            return
        self._delta = self._delta.merged(*rows)
        if len(self._delta) > max(_DELTA_MIN, len(self._main) // _DELTA_SHARE):
            delta, self._delta = self._delta, _Tier.empty()
            self._main = self._main.merged(delta.keys, delta.entries, delta.positions)
