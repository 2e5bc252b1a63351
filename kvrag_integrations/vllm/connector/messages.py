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
    namespace the entry is in (its request's tenant's, or the request's own)."""

    start: int
    rows: int
    entry_ids: tuple[int, ...]
    offset: int = 0
    namespace: str = ""

    @property
    def end(self) -> int:
        return self.start + self.rows


@dataclass(frozen=True)
class LoadOp:
    """Write prompt positions ``lo .. hi`` of a request from its pieces."""

    request_id: str
    block_ids: tuple[int, ...]
    lo: int
    hi: int
    pieces: tuple[PieceOp, ...]


@dataclass(frozen=True)
class SaveOp:
    """Store each piece of a request's prompt (prefilled by now) as an entry."""

    request_id: str
    block_ids: tuple[int, ...]
    pieces: tuple[PieceOp, ...]
    background: bool = False  # stored after the step (a learned prompt: nothing waits)
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
    failed, and the prompt position vLLM recomputes each from.

    Examples:
        >>> a, b = KVRAGWorkerMetadata({"r": 64}), KVRAGWorkerMetadata({"r": 32, "s": 16})
        >>> a.aggregate(b).failed_loads  # tensor-parallel ranks: the earliest wins
        {'r': 32, 's': 16}
    """

    def __init__(self, failed_loads: dict[str, int]) -> None:
        self.failed_loads = failed_loads

    def aggregate(self, other: KVRAGWorkerMetadata) -> KVRAGWorkerMetadata:
        merged = dict(self.failed_loads)
        for request_id, position in getattr(other, "failed_loads", {}).items():
            merged[request_id] = min(position, merged.get(request_id, position))
        return KVRAGWorkerMetadata(merged)
