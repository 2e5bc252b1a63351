"""What the connector's scheduler side tells its workers each step, and what they tell back.

vLLM carries them between processes as the connector's metadata: the
scheduler's ``build_connector_meta`` returns a ``KVRAGConnectorMetadata`` of
the step's ``StepOps`` (loads before the forward, saves after it), and each
worker's ``build_connector_worker_meta`` a ``KVRAGWorkerMetadata`` of the
requests whose load failed. Everything a worker needs is in the op (each
piece's entry ids and the namespace its entry is in): it keys entries itself,
by its own rank's fingerprint.

vLLM is imported only where it is installed: the unit tier builds and reads
these messages without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrag_integrations.engine.blend_settings import BlendSettings

try:  # the metadata vLLM carries: its own base classes where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # the unit tier: the same messages, without vLLM
    KVConnectorMetadata = object  # type: ignore[assignment,misc]
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class PieceOp:
    """One piece for the workers: its prompt span, its entry's ids, the entry row
    the span starts at (the scheduler side resolves them against the prompt:
    prompt positions ``start ..`` are entry rows ``offset ..``), and the
    namespace the entry is in (its request's tenant's, or the request's own).
    A ``computed`` piece reads no entry: a blend load's ``BlendOp`` computes its
    rows, a turbo load's are computed alone (``WorkerSide.compute_texts``);
    ``entry_ids`` still starts with its prompt ids."""

    start: int
    rows: int
    entry_ids: tuple[int, ...]
    offset: int = 0
    namespace: str = ""
    computed: bool = False

    @property
    def end(self) -> int:
        return self.start + self.rows


@dataclass(frozen=True)
class BlendOp:
    """Recompute part of a loaded run (``blend.BlendRunner``): with ``settings``, over
    the run's ``chunks`` (``(lo, hi)`` prompt spans: the candidates), its ``texts``
    (spans always recomputed), after its exact leading ``exact`` positions (the
    cached leading text: never recomputed); ``tail``: the prompt's ids after the run
    (the question, whose attention query-driven selection follows)."""

    settings: BlendSettings
    exact: int
    chunks: tuple[tuple[int, int], ...]
    texts: tuple[tuple[int, int], ...] = ()
    tail: tuple[int, ...] = ()

    @property
    def recomputed(self) -> int:
        """How many of the run's rows are recomputed: every text row, each chunk's first
        ``recompute_first``, and the ratio's share of the chunk rows among the rest
        (``CacheBlend``'s rule: known before any selection runs).

        Examples:
            >>> op = BlendOp(BlendSettings(recompute_ratio=0.5, recompute_first=2), 4,
            ...              ((4, 14), (16, 26)), ((14, 16),))
            >>> op.recomputed  # 2 text + 2 x 2 starts + half of 20 chunk rows
            16
        """
        first = self.settings.recompute_first
        chunk_rows = sum(hi - lo for lo, hi in self.chunks)
        starts = sum(min(first, hi - lo) for lo, hi in self.chunks)
        picked = min(round(self.settings.recompute_ratio * chunk_rows), chunk_rows - starts)
        return sum(hi - lo for lo, hi in self.texts) + starts + picked


@dataclass(frozen=True)
class LoadOp:
    """Write prompt positions ``lo .. hi`` of a request from its pieces (then, for a
    blend load, recompute part of them: ``blend``)."""

    request_id: str
    block_ids: tuple[int, ...]
    lo: int
    hi: int
    pieces: tuple[PieceOp, ...]
    blend: BlendOp | None = None


@dataclass(frozen=True)
class SaveOp:
    """Store each piece of a request's prompt (prefilled by now) as an entry."""

    request_id: str
    block_ids: tuple[int, ...]
    pieces: tuple[PieceOp, ...]
    background: bool = False  # stored after the step (a deferred save: nothing waits)
    indexed: bool = True  # announced in the content index (not: a private entry)


@dataclass
class StepOps:
    """A step's work for the workers."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


class KVRAGConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,valid-type]
    """One step's ``StepOps``, sent from the scheduler to the workers."""

    def __init__(self, ops: StepOps) -> None:
        self.ops = ops


class KVRAGWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,valid-type]
    """Sent from the workers to the scheduler after a step: requests whose load
    failed, and the prompt position vLLM recomputes each from; and, for blend
    loads, how many loaded tokens each recomputed.

    Examples:
        >>> a, b = KVRAGWorkerMetadata({"r": 64}), KVRAGWorkerMetadata({"r": 32, "s": 16})
        >>> a.aggregate(b).failed_loads  # tensor-parallel ranks: the earliest wins
        {'r': 32, 's': 16}
        >>> KVRAGWorkerMetadata({}, {"r": 9}).aggregate(KVRAGWorkerMetadata({}, {"r": 9})).blended
        {'r': 9}
    """

    def __init__(self, failed_loads: dict[str, int], blended: dict[str, int] | None = None) -> None:
        self.failed_loads = failed_loads
        self.blended = blended or {}

    def aggregate(self, other: KVRAGWorkerMetadata) -> KVRAGWorkerMetadata:
        merged = dict(self.failed_loads)
        for request_id, position in getattr(other, "failed_loads", {}).items():
            merged[request_id] = min(position, merged.get(request_id, position))
        # Every rank recomputes the same rows (their scores are summed): one count.
        return KVRAGWorkerMetadata(merged, {**getattr(other, "blended", {}), **self.blended})
