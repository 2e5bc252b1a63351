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
it were valid. A computed piece reads nothing: a blend load's ``BlendOp`` computes
its rows over the run; a turbo load's are computed alone, as their entries would
have been encoded, every load's of the step in one forward (``compute_texts``).

Saving (after the step's forward): the piece's K/V are read back out of the
blocks (``PagedLayout``), under the key of its ids in the namespace the piece
names (its request's tenant's, or the request's own private one), and handed
to the store (``entry_writer.EntryWriter``: its budget, the content index).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvrag_integrations.chunk_kv import ChunkKV, cache_key
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.store import KVStore
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.connector.entry_writer import EntryWriter
from kvrag_integrations.vllm.connector.messages import LoadOp, PieceOp, SaveOp
from kvrag_integrations.vllm.connector.paged import PagedLayout, layer_index
from kvrag_integrations.vllm.trust import Tenant

logger = logging.getLogger(__name__)

_TOUCH_EVERY_S = 60.0  # how often a hot entry's use is recorded in the store
_READ_THREADS = 4  # entries of one load read at once (I/O and hashing release the GIL)


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
        self.writes = EntryWriter(store, precision, budget, index_log)
        self._touched: dict[str, float] = {}
        self.fingerprint = fingerprint
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
        self._texts: list[tuple[LoadOp, PieceOp]] = []  # computed pieces, until compute_texts

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
        return self.slots_at(block_ids, torch.arange(lo, hi))

    def slots_at(self, block_ids: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """The cache slots of prompt ``positions``."""
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
            if piece.computed:  # (its rows: the blend op's, or ``compute_texts``)
                continue
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
            else:  # a turbo load's computed pieces: after every load of the step
                texts = [p for p in op.pieces if p.computed and p.end > op.lo and p.start < hi]
                if any(p.start < op.lo for p in texts):  # (its start is in vLLM's cache)
                    raise RuntimeError("a computed piece is cut by the load's start")
                self._texts += [(op, p) for p in texts]
        except Exception:
            logger.exception("loading request %s failed; its blocks are recomputed", op.request_id)
            failed_at = op.lo
        if failed_at is None:
            return op.hi - op.lo
        return self._failed(op, failed_at)

    def compute_texts(self) -> None:
        """The computed pieces of the step's turbo loads (``load``), each text over
        itself only, in one forward (``BlendRunner.compute_alone``); where that does
        not run, their loads are misses (vLLM recomputes them)."""
        pending, self._texts = self._texts, []
        if not pending:
            return
        try:
            if self.blender is None:
                raise RuntimeError("no model attached")
            spans = [(op, p, min(p.end, op.hi)) for op, p in pending]
            ids = [i for _, p, end in spans for i in p.entry_ids[: end - p.start]]
            self.blender.compute_alone(
                torch.tensor(ids, dtype=torch.long),
                torch.cat([torch.arange(p.start, end) for _, p, end in spans]),
                torch.cat([self.slots(op.block_ids, p.start, end) for op, p, end in spans]),
                torch.cat([torch.full((end - p.start,), n) for n, (_, p, end) in enumerate(spans)]),
            )
        except Exception:
            logger.exception("computing %d texts failed; their loads are recomputed", len(pending))
            for op in {id(op): op for op, _ in pending}.values():
                self._failed(op, op.lo)

    def _failed(self, op: LoadOp, failed_at: int) -> int:
        """Report ``op``'s blocks from ``failed_at`` on as failed loads (vLLM recomputes
        them); how many of its positions stand."""
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
        pieces = list({_entry_of(p): p for p in op.pieces if not p.computed}.values())
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
        lo = op.lo
        lay = self.layout
        cache_dtype = next(iter(self.caches.values())).dtype
        device = next(iter(self.caches.values())).device  # moved and rotated where vLLM runs
        spans = []  # (entry, its rows a..b, the buffer's row they start at)
        deltas, positions = [], []
        n = 0  # rows written (a computed piece's are not: its blend op computes them)
        sources: dict[int, ChunkKV] = {}  # an entry read once per op is moved once
        for piece, kv in ready:
            first, last = max(lo, piece.start) - piece.start, min(hi, piece.end) - piece.start
            if last > first:
                if id(kv) not in sources:
                    sources[id(kv)] = _readable(kv, device)
                a, b = piece.offset + first, piece.offset + last  # the entry's rows
                spans.append((sources[id(kv)], a, b, n))
                shift = piece.start - piece.offset  # entry row r lands at r + shift
                deltas.append(torch.full((last - first,), shift, dtype=torch.long))
                positions.append(torch.arange(piece.start + first, piece.start + last))
                n += last - first
        computed = sum(max(0, min(hi, p.end) - max(lo, p.start)) for p in op.pieces if p.computed)
        if n + computed != hi - lo:
            raise ValueError(f"the pieces do not cover positions {lo}..{hi} once each")
        if not n:
            return  # (all of it computed)
        delta = torch.cat(deltas)
        slots = self.slots_at(op.block_ids, torch.cat(positions))
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
                    stored += self.writes.later(op.request_id, kv, op.indexed)
                else:
                    stored += self.writes.store(op.request_id, kv, op.indexed)
            except Exception:
                logger.exception("request %s: entry not stored", op.request_id)
        return stored

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
