"""The connector in a vLLM worker: stored pieces into the paged cache, prefilled ones out.

Loading (before the step's forward): each piece's entry is read (once per load,
on threads where the store waits on I/O) and verified by the store (integrity
code, key, fingerprint; the worker's memory tier holds verified entries),
checked against this worker's layout (layers, KV heads, head size), its rows
gathered per layer into one token-major buffer (cast from the stored form on
the way), its keys moved from the entry row the piece starts at (0, or inside
an entry: a passage found in a stored prompt) to the piece's start
(``RotaryShift``, the same rotation the in-process engine applies, in float32),
and written per layer as the attention backend writes (``PagedLayout.write``:
its own write op, or a strided copy of whole blocks where the probe found the
op to be one). A piece that cannot be loaded (missing since the lookup,
corrupt, foreign, another shape) is a miss: its blocks and every later one of
the request are reported as failed loads, and vLLM recomputes them
(``kv_load_failure_policy="recompute"``). Nothing of it reaches the cache as if
it were valid.

Saving (after the step's forward): the piece's K/V are read back out of the
blocks (``PagedLayout``), stored in the configured precision under the key of
its ids, in the namespace the piece names (its request's tenant's, or the
request's own private one). A write the store's budget or
its namespace's quota cannot hold (``StoreBudget``: least recently used
entries are evicted first) is skipped. A failed write is logged; the piece is then a miss for later
requests. A stored entry is announced in the content index's log, where the
OpenAI server's detection (``detection``) finds it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvrag_integrations.chunk_kv import ChunkKV, cache_key
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.errors import StoreWriteError
from kvrag_integrations.store import KVStore
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.connector.messages import LoadOp, PieceOp, SaveOp
from kvrag_integrations.vllm.connector.paged import PagedLayout
from kvrag_integrations.vllm.trust import Tenant

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TOUCH_EVERY_S = 60.0  # how often a hot entry's use is recorded in the store
_MAX_LATER = 4  # deferred saves copied out of the cache, waiting for the writer
_READ_THREADS = 4  # entries of one load read at once (I/O and hashing release the GIL)


def layer_index(name: str) -> int:
    """The decoder layer of an attention layer's name (``model.layers.3.self_attn.attn``)."""
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise ValueError(f"cannot tell the decoder layer of {name!r}")
    return int(match.group(1))


class WorkerSide:
    """Loads and saves one worker's share of the KV cache.

    Args:
        store: where entries live (the worker's tier in front of the shared store).
        fingerprint: this worker's storage fingerprint (its rank's heads).
        precision: how saved entries are stored.
        layout: the model's layout (layers, KV heads per rank, head size, rotary).
        budget: the store's budget (None: unbounded).
        index_log: the content index's log (``matching.IndexLog``): every entry
            stored is appended, so the OpenAI server finds it inside plain
            requests (None: not indexed; tensor-parallel ranks but the first).
    """

    def __init__(
        self,
        store: KVStore,
        fingerprint: str,
        precision: str,
        layout: ModelLayout,
        budget: StoreBudget | None = None,
        index_log: Any = None,
    ):
        self.store = store
        self.budget = budget
        self.index_log = index_log  # where stored entries are announced (``matching``)
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None  # stores deferred saves
        self._waiting = 0
        self._touched: dict[str, float] = {}
        self.fingerprint = fingerprint
        self.precision = precision
        self.layout = layout
        self.caches: dict[int, torch.Tensor] = {}  # decoder layer -> its paged cache
        self.layers: dict[int, Any] = {}  # decoder layer -> vLLM's attention layer
        self.names: dict[int, str] = {}  # decoder layer -> its attention layer's name
        self.blender: Any = None  # blend.BlendRunner, once the model is attached
        self.blended: dict[str, int] = {}  # request -> loaded tokens blend recomputed
        self.paged: PagedLayout | None = None
        self.failed_blocks: set[int] = set()
        self.failed_loads: dict[str, int] = {}  # request -> where vLLM recomputes from
        self.scheduler_block_size = 0  # vLLM's cache config block size (the connector sets it)
        self._readers: ThreadPoolExecutor | None = None  # entry reads, made at first need

    def register(self, kv_caches: Mapping[str, torch.Tensor], attention: Mapping[str, Any]) -> None:
        """Note each layer's paged cache and attention layer (by decoder layer)."""
        for name, cache in kv_caches.items():
            index = layer_index(name)
            self.caches[index] = cache
            self.layers[index] = attention[name]
            self.names[index] = name
        if sorted(self.caches) != list(range(self.layout.num_layers)):
            raise ValueError(
                f"the model has {self.layout.num_layers} layers, vLLM's cache "
                f"{len(self.caches)}: the connector cannot place entries"
            )

    def paged_layout(self) -> PagedLayout:
        """How K/V sit in a block of this worker's caches (probed at first use)."""
        return self._paged()

    def _paged(self) -> PagedLayout:
        # Probed at first use: the backend sets up its layers after the caches exist.
        if self.paged is None:
            self.paged = PagedLayout.probe(self.layers[0], self.caches[0], self.layout.head_dim)
            direct = self.paged.direct is not None and self.caches[0].is_contiguous()
            logger.info(
                "paged cache probed: blocks of %d tokens; loads write whole blocks %s",
                self.paged.block_size,
                "by strided copies" if direct else "with the backend's op",
            )
        return self.paged

    def slots(self, block_ids: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """The cache slots of prompt positions ``lo .. hi`` (in scheduler blocks of
        ``scheduler_block_size`` tokens; kernel blocks split them in order)."""
        positions = torch.arange(lo, hi)
        blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
        size = self.scheduler_block_size
        return blocks[positions // size] * size + positions % size

    # ---------------------------------------------------------------- load
    def load(self, op: LoadOp) -> int:
        """Write ``op``'s positions; return how many were written.

        From the first piece that cannot be read on, the request's blocks are
        reported as failed loads (vLLM recomputes them); so is the whole op if
        writing fails midway (an error here must not stop the engine).
        """
        ready: list[tuple[PieceOp, ChunkKV]] = []
        failed_at: int | None = None
        read = self._read_entries(op)
        for piece in op.pieces:
            kv = read[_entry_of(piece)]
            if kv is None:
                failed_at = max(piece.start, op.lo)
                break
            ready.append((piece, kv))
        hi = op.hi if failed_at is None else failed_at
        try:
            if hi > op.lo:
                self._write(op, ready, hi)
            if op.blend is not None:  # a blend load: all of it, or none (computed exactly)
                if failed_at is not None or self.blender is None or op.lo:
                    why = "no model attached" if self.blender is None else "a partial load"
                    raise RuntimeError(f"blend needs the whole run loaded ({why})")
                ids = torch.tensor(_run_ids(op), dtype=torch.long)
                slots = self.slots(op.block_ids, 0, op.hi)
                self.blended[op.request_id] = self.blender.run(op.blend, ids, slots)
        except Exception:
            logger.exception("loading request %s failed; its blocks are recomputed", op.request_id)
            failed_at = op.lo
        if failed_at is None:
            return op.hi - op.lo
        size = self.scheduler_block_size
        first = failed_at // size  # vLLM recomputes from this block's first token
        self.failed_blocks.update(op.block_ids[first : -(-op.hi // size)])
        self.failed_loads[op.request_id] = min(
            first * size, self.failed_loads.get(op.request_id, op.hi)
        )
        return max(0, first * size - op.lo)

    def _read_entries(self, op: LoadOp) -> dict[tuple[int, ...], ChunkKV | None]:
        """Each entry of ``op``'s pieces, read and verified once (pieces of one entry
        share it); on threads where the store waits on I/O (a disk or Redis read
        of a 6k-token prompt's entries takes half the time on two)."""
        pieces = list({_entry_of(piece): piece for piece in op.pieces}.values())
        if len(pieces) > 1 and self.store.parallel_reads:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(_READ_THREADS, "kvrag-read")
            entries = list(self._readers.map(self._entry, pieces))
        else:
            entries = [self._entry(piece) for piece in pieces]
        return {_entry_of(piece): kv for piece, kv in zip(pieces, entries)}

    def _fingerprint(self, namespace: str) -> str:
        return Tenant(namespace).fingerprint(self.fingerprint)

    def _entry(self, piece: PieceOp) -> ChunkKV | None:
        fingerprint = self._fingerprint(piece.namespace)
        key = cache_key(fingerprint, list(piece.entry_ids))
        try:
            kv = self.store.get(key, fingerprint)  # verified; a bad entry is a miss
        except Exception as exc:  # a store that cannot be reached: a miss
            logger.warning("entry %s not read (%s); recomputed", key[:16], exc)
            return None
        if kv is None:
            logger.info("entry %s missing; recomputed", key[:16])
            return None
        layers, heads, n, dim = kv.keys.shape
        lay = self.layout
        if (layers, heads, dim) != (lay.num_layers, lay.kv_heads, lay.head_dim) or n < len(
            piece.entry_ids
        ):
            # Under this model's key, yet not its shape: never usable; dropped so
            # that it is encoded again (as the in-process engine's lookup does).
            logger.warning("entry %s has another shape %s; recomputed", key[:16], kv.keys.shape)
            self.store.delete(key)
            return None
        self._used(key)
        return kv

    def _used(self, key: str) -> None:
        """Record a use in the store (what its budget evicts by), once a minute per entry."""
        now = time.monotonic()
        if now - self._touched.get(key, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S:
            if len(self._touched) > 65536:
                self._touched.clear()
            self._touched[key] = now
            self.store.touch(key)

    def _write(self, op: LoadOp, ready: list[tuple[PieceOp, ChunkKV]], hi: int) -> None:
        """Per layer: the rows of every piece in ``lo .. hi`` gathered token-major into
        one buffer (cast from the stored form as they are copied), keys moved in
        place, one write. The buffers are a layer's size, reused for every layer
        (they stay in the CPU's cache), and no entry is copied whole first."""
        lo, n = op.lo, hi - op.lo
        lay = self.layout
        cache_dtype = next(iter(self.caches.values())).dtype
        device = next(iter(self.caches.values())).device  # moved and rotated where vLLM runs
        spans = []  # (entry, its rows a..b, the buffer's row they start at)
        deltas = []
        sources: dict[int, ChunkKV] = {}  # an entry read once per op is moved once
        for piece, kv in ready:
            first, last = max(lo, piece.start) - piece.start, min(hi, piece.end) - piece.start
            if last > first:
                if id(kv) not in sources:
                    sources[id(kv)] = _readable(kv, device)
                a, b = piece.offset + first, piece.offset + last  # the entry's rows
                spans.append((sources[id(kv)], a, b, piece.start + first - lo))
                shift = piece.start - piece.offset  # entry row r lands at r + shift
                deltas.append(torch.full((last - first,), shift, dtype=torch.long))
        if sum(b - a for _, a, b, _ in spans) != n:
            raise ValueError(f"the pieces do not cover positions {lo}..{hi} once each")
        delta = torch.cat(deltas)
        slots = self.slots(op.block_ids, lo, hi)
        paged = self._paged()
        # float32 while keys move (as the in-process engine's assembly does); values
        # are only copied, straight into the cache's dtype
        keys = torch.empty((n, lay.kv_heads, lay.head_dim), dtype=torch.float32, device=device)
        values = torch.empty(keys.shape, dtype=cache_dtype, device=device)
        rotations = {}
        for kind, rot in lay.rotary.items():
            # one per token and head, made once: the rotation then runs on tensors of
            # one shape (a broadcast over heads in each op runs 2x slower)
            shape = (n, lay.kv_heads, -1)
            cos, sin = (
                t.unsqueeze(1).expand(shape).contiguous() for t in rot.rotation(delta, device)
            )
            rotations[kind] = (cos, sin)
        for index, cache in self.caches.items():
            for kv, a, b, row in spans:
                keys[row : row + b - a].copy_(kv.keys[index, :, a:b].transpose(0, 1))
                values[row : row + b - a].copy_(kv.values[index, :, a:b].transpose(0, 1))
            cos, sin = rotations[lay.layer_types[index]]
            lay.rotary_of(index).rotate(keys, cos, sin, keys)
            paged.write(self.layers[index], cache, slots, keys, values)

    # ---------------------------------------------------------------- save
    def save(self, op: SaveOp) -> int:
        """Store each piece of ``op`` from its blocks; return how many were stored
        (a piece that fails is logged and left a miss). A background op's pieces are
        copied out of the cache here and stored by a thread (counted as stored)."""
        stored = 0
        for piece in op.pieces:
            try:
                kv = self._read(op, piece)
                if op.background:
                    stored += self._later(op.request_id, kv, op.indexed)
                else:
                    stored += self._store(op.request_id, kv, op.indexed)
            except Exception:
                logger.exception("request %s: entry not stored", op.request_id)
        return stored

    def _later(self, request_id: str, kv: ChunkKV, indexed: bool = True) -> int:
        """Store ``kv`` on the writer thread (at most ``_MAX_LATER`` waiting: a deferred save is
        best effort, the cache's memory is not)."""
        with self._lock:
            if self._waiting >= _MAX_LATER:
                logger.info("request %s: deferred entry dropped (writer busy)", request_id)
                return 0
            self._waiting += 1
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvrag-store-writer")
        self._writer.submit(self._store_later, request_id, kv, indexed)
        return 1

    def _store_later(self, request_id: str, kv: ChunkKV, indexed: bool) -> None:
        try:
            self._store(request_id, kv, indexed)
        except Exception:
            logger.exception("request %s: entry not stored", request_id)
        finally:
            with self._lock:
                self._waiting -= 1

    def _store(self, request_id: str, kv: ChunkKV, indexed: bool = True) -> int:
        try:
            kv = kv.stored_as(self.precision)
            with self._lock:  # the budget's accounting: one writer at a time
                allowed = self.budget is None or self.budget.allow_write(
                    _entry_bytes(kv), kv.fingerprint, kv.key
                )
                if not allowed:  # (counted too: ``stats.budget_counts``)
                    logger.info("request %s: entry refused: no room within its quota", request_id)
                    return 0
                self.store.put(kv)
        except StoreWriteError as exc:
            logger.warning("request %s: entry not stored (%s)", request_id, exc)
            return 0
        if self.index_log is not None and indexed:  # (a private entry: found by no one)
            self._announce(kv)
        return 1

    def _announce(self, kv: ChunkKV) -> None:
        try:
            self.index_log.append(kv.fingerprint, kv.token_ids.tolist())
        except Exception as exc:  # stored all the same; only detection misses it
            logger.warning("entry not indexed (%s)", exc)

    def _read(self, op: SaveOp, piece: PieceOp) -> ChunkKV:
        paged = self._paged()
        slots = self.slots(op.block_ids, piece.start, piece.end)
        keys, values = [], []
        for index in range(self.layout.num_layers):
            k, v = paged.read(self.caches[index], slots)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        ids = torch.tensor(piece.entry_ids, dtype=torch.long)
        fingerprint = self._fingerprint(piece.namespace)
        return ChunkKV(ids, torch.stack(keys), torch.stack(values), fingerprint)

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def take_failed_loads(self) -> dict[str, int]:
        failed, self.failed_loads = self.failed_loads, {}
        return failed

    def take_blended(self) -> dict[str, int]:
        blended, self.blended = self.blended, {}
        return blended


def _run_ids(op: LoadOp) -> list[int]:
    """The prompt ids of a load's positions ``0 .. hi`` (each piece's span of its entry)."""
    ids: list[int] = []
    for piece in op.pieces:
        ids += piece.entry_ids[piece.offset : piece.offset + piece.rows]
    if len(ids) != op.hi:
        raise ValueError(f"the pieces cover {len(ids)} positions, not {op.hi}")
    return ids


def _entry_of(piece: PieceOp) -> tuple[str, tuple[int, ...]]:
    """What names a piece's entry: its namespace and its ids."""
    return piece.namespace, piece.entry_ids


def _readable(kv: ChunkKV, device: torch.device) -> ChunkKV:
    """The entry as a load gathers from it: on ``device``, float K/V (an int8 entry
    dequantized once, to float32; a float one kept in its stored form, which the
    gather casts as it copies)."""
    return kv.to(device, torch.float32) if kv.is_quantized else kv.to(device)


def _entry_bytes(kv: ChunkKV) -> int:
    """About what an entry takes in the store: its tensors and a header."""
    return kv.nbytes + 4096
