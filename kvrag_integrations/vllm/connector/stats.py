"""What the connector counts, for the server's log and ``/metrics``.

An operator must see when a tenant's writes are refused (its quota, its pool
or the store full) and when requests are refused (an admission that does not
hold). vLLM carries a connector's counts from the engine's processes to the
API server's (``KVConnectorBase_V1.get_kv_connector_stats``, aggregated over
the workers and the scheduler), logs them with its own periodic lines ("KV
Transfer metrics: ...") and hands them to the connector's Prometheus metrics
(``build_prom_metrics``): ``kvrag:store_writes_refused_total`` by the writer's
kind of namespace (``shared``, ``key``, ``salt``, ``private``, ``unreadable``),
``kvrag:store_entries_evicted_total`` and ``kvrag:requests_refused_total``,
which ``/metrics`` serves (an admin key reads it). Counts only, by kind: no
tenant's name.

vLLM is imported only where it is installed: the unit tier builds and sums
these counts without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:  # vLLM's base classes where it is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine
except ImportError:  # the unit tier: the same counts, without vLLM
    KVConnectorStats = object  # type: ignore[assignment,misc]
    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]

REFUSED = "writes_refused:"  # + the writer's kind of namespace
EVICTED = "entries_evicted"
REQUESTS_REFUSED = "requests_refused"
KINDS = ("shared", "key", "salt", "private", "unreadable")


@dataclass
class KVRAGStats(KVConnectorStats):  # type: ignore[misc,valid-type]
    """Counts since the last report (``data``: name -> count), summed over the
    workers and the scheduler.

    Examples:
        >>> a = KVRAGStats({"writes_refused:key": 2})
        >>> a.aggregate(KVRAGStats({"writes_refused:key": 1, "entries_evicted": 4})).data
        {'writes_refused:key': 3, 'entries_evicted': 4}
    """

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> KVRAGStats:
        merged = dict(self.data)
        for name, count in getattr(other, "data", {}).items():
            merged[name] = merged.get(name, 0) + count
        return KVRAGStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def budget_counts(budget: Any) -> dict[str, int]:
    """A worker's store budget's refused writes (by kind) and evictions since the last
    call (``StoreBudget.take_counts``; none without a budget)."""
    refused, evicted = budget.take_counts() if budget is not None else ({}, 0)
    return {**{REFUSED + kind: n for kind, n in refused.items()}, EVICTED: evicted}


def counted(counts: dict[str, int]) -> KVRAGStats | None:
    """The stats of ``counts`` (None: nothing to report)."""
    kept = {name: n for name, n in counts.items() if n}
    return KVRAGStats(kept) if kept else None


class KVRAGPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
    """The connector's counters in vLLM's Prometheus registry (see the module
    docstring), per engine as vLLM labels its own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        refused = self._counter_cls(
            name="kvrag:store_writes_refused",
            documentation="Entries the store's budget refused (no room within the "
            "writer's quota, pool or the store), by the writer's kind of namespace.",
            labelnames=[*labelnames, "kind"],
        )
        self.refused = {
            engine: {kind: refused.labels(*values, kind) for kind in KINDS}
            for engine, values in per_engine_labelvalues.items()
        }
        evicted = self._counter_cls(
            name="kvrag:store_entries_evicted",
            documentation="Entries the store's budget evicted to make room.",
            labelnames=labelnames,
        )
        self.evicted = create_metric_per_engine(evicted, per_engine_labelvalues)
        requests = self._counter_cls(
            name="kvrag:requests_refused",
            documentation="Requests whose params the connector refused (an admission "
            "that does not hold, a save it may not make): computed exactly.",
            labelnames=labelnames,
        )
        self.requests = create_metric_per_engine(requests, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, count in transfer_stats_data.items():
            if name.startswith(REFUSED) and name[len(REFUSED) :] in KINDS:
                self.refused[engine_idx][name[len(REFUSED) :]].inc(count)
            elif name == EVICTED:
                self.evicted[engine_idx].inc(count)
            elif name == REQUESTS_REFUSED:
                self.requests[engine_idx].inc(count)
