"""on_miss="auto": encode on the request path when measured costs say it is no
dearer than a full prefill, else defer; the cost model's fits; the prior."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from corpus import REEF, TOWER
from corpus import TOWER_QUESTION as QUESTION

from kvrag_integrations import KVRAGEngine, MemoryKVStore
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.engine.scheduling.costs import (
    CostModel,
    ForwardFit,
    encode_batches,
    prefill_features,
)
from kvrag_integrations.engine.scheduling.forward_lock import ForwardLock
from kvrag_integrations.engine.scheduling.miss_policy import Misses, decide
from kvrag_integrations.engine.scheduling.threads import per_thread_threads


class Fed(CostModel):
    """Measured costs, given: full prefill ``full_s`` per 1000 tokens, encoding
    ``encode_s`` per 1000 chunk tokens, turbo ``reuse_s`` per 1000 prompt tokens."""

    def __init__(self, full_s: float, encode_s: float, reuse_s: float) -> None:
        super().__init__("cpu")
        self.rates = full_s, encode_s, reuse_s

    def full_s(self, n: int) -> float:
        return self.rates[0] * n / 1000

    def encode_s(self, lengths, batch_size: int = 8) -> float:
        return self.rates[1] * sum(lengths) / 1000

    def reuse_s(self, strategy: str, n: int, computed: int) -> float:
        return self.rates[2] * n / 1000


def fed(full_s: float, encode_s: float, reuse_s: float) -> CostModel:
    return Fed(full_s, encode_s, reuse_s)


NEW = Misses(new=[300, 300])


def plan(costs: CostModel, misses: Misses = NEW, policy: str = "auto", **kw):
    return decide(policy, misses, costs, strategy="turbo", prompt_tokens=700,
                  computed_tokens=100, **kw)  # fmt: skip


def test_auto_encodes_when_measured_cheaper_and_defers_when_dearer() -> None:
    cheap = plan(fed(full_s=1.0, encode_s=0.5, reuse_s=0.1))
    assert cheap.reuse and "<= full prefill" in cheap.reason
    dear = plan(fed(full_s=1.0, encode_s=1.1, reuse_s=0.1))
    assert not dear.reuse and "> full prefill" in dear.reason


def test_prior_before_any_measurement_defers_on_cpu_and_encodes_on_cuda() -> None:
    cpu = plan(CostModel("cpu"))
    assert not cpu.reuse and "not measured" in cpu.reason and "defer" in cpu.reason
    assert plan(CostModel("cuda")).reuse
    partly = CostModel("cpu")
    for _ in range(2):  # the first forward of a kind is a warm-up, not fitted
        partly.record_full(700, 1.0)
    assert partly.full_s(700) == pytest.approx(1.0)
    assert not plan(partly).reuse  # turbo not measured yet: still the prior


def test_queued_encodings_are_owed_and_taken_over() -> None:
    """Queued chunks are encoded whoever does it, so they drop out of the
    comparison: taken over even where encoding costs more than a full prefill."""
    dear = fed(full_s=1.0, encode_s=3.0, reuse_s=0.1)
    queued = plan(dear, Misses(queued=[300, 300]))
    assert queued.reuse and "owed" in queued.reason
    assert plan(CostModel("cpu"), Misses(queued=[300])).reuse  # unmeasured: taken over too
    assert plan(dear, Misses(in_flight=[600], queued=[300])).reuse  # in flight: owed too
    # Only where the reuse forward itself is dearer than a full prefill.
    assert not plan(fed(1.0, 0.5, 1.1), Misses(queued=[300])).reuse
    # New chunks besides: their encoding counts.
    assert not plan(fed(1.0, 3.0, 0.1), Misses(new=[300], queued=[300])).reuse
    assert plan(fed(1.0, 0.5, 0.1), Misses(new=[300], in_flight=[300])).reuse


def test_explicit_policies_and_a_held_lock() -> None:
    costs = fed(full_s=1.0, encode_s=0.1, reuse_s=0.1)
    assert not plan(costs, policy="defer").reuse  # new chunks: never on the request path
    assert plan(fed(1.0, 9.0, 0.1), policy="encode").reuse
    assert plan(costs, Misses(queued=[300]), policy="defer").reuse  # owed: taken over
    held = plan(costs, Misses(in_flight=[300]), can_wait=False)
    assert not held.reuse and "lock is held" in held.reason
    assert plan(costs, Misses()).reuse


def test_fits_recover_a_quadratic_cost_robustly_and_plan_batches() -> None:
    def seconds(n: int) -> float:  # 1 ms per token, attention quadratic, 10 ms per forward
        return 1e-3 * n + 2e-7 * n * (n + 1) / 2 + 0.01

    costs = CostModel()
    for n in (250, 500, 1000, 2000, 4000, 250, 500):
        costs.record_full(n, seconds(n))
    costs.record_full(1000, 10 * seconds(1000))  # a burst of load: not the cost
    assert costs.full_s(3000) == pytest.approx(seconds(3000), rel=0.02)
    # Chunk encoding is the same forward: 4 chunks of 500 alone cost 4 prefills of 500.
    assert costs.encode_s([500] * 4, batch_size=4) == pytest.approx(
        4 * seconds(500) - 3 * 0.01, rel=0.02
    )
    one = ForwardFit(4)
    one.add(prefill_features(1, 512), 1.0)  # one length: a per-token cost, not a constant
    assert one.predict(prefill_features(1, 1024)) == pytest.approx(2.0)
    assert encode_batches([10, 50, 30, 20], 2) == [(2, 50), (2, 20)]
    fresh = CostModel()
    assert fresh.full_s(100) is None and fresh.encode_s([]) == 0.0
    fresh.record_full(1000, 60.0)  # the first of a kind: a warm-up, not fitted
    assert fresh.full_s(1000) is None
    fresh.record_full(1000, 2.0)
    assert fresh.full_s(500) == pytest.approx(1.0)
    assert fresh.reuse_s("turbo", 1000, 10) is None  # this forward's shape: not yet


@pytest.fixture()
def loaded(engine: KVRAGEngine) -> LoadedModel:
    return dataclasses.replace(engine.loaded, costs=None)


def test_engine_auto_follows_the_measured_costs(loaded: LoadedModel) -> None:
    kw = dict(question=QUESTION, chunks=[TOWER, REEF], max_new_tokens=1)
    e = KVRAGEngine(loaded, store=MemoryKVStore())  # the default: on_miss="auto"
    assert e.on_miss == "auto"
    first = e.generate(**kw)  # nothing measured on these weights yet: the CPU prior
    assert first.fallback == "uncached" and first.miss_policy == "auto"
    assert "not measured" in first.miss_reason
    assert e.wait_for_encoding(timeout=30)
    loaded.costs = fed(full_s=100.0, encode_s=0.1, reuse_s=0.1)
    cheap = KVRAGEngine(loaded, store=MemoryKVStore()).generate(**kw)
    assert cheap.fallback is None and cheap.encoded_chunks == 2, cheap.miss_reason
    assert "<= full prefill" in cheap.miss_reason
    loaded.costs = fed(full_s=0.01, encode_s=10.0, reuse_s=0.1)
    dear = KVRAGEngine(loaded, store=MemoryKVStore()).generate(**kw)
    assert dear.fallback == "uncached" and dear.deferred_chunks == 2
    assert "> full prefill" in dear.miss_reason


def test_requests_measure_their_forwards(loaded: LoadedModel) -> None:
    e = KVRAGEngine(loaded, store=MemoryKVStore(), on_miss="encode")
    e.generate(question=QUESTION, chunks=[TOWER, REEF], max_new_tokens=1)
    e.generate(question=QUESTION, chunks=[TOWER, REEF], max_new_tokens=1, strategy="full")
    costs = e.loaded.costs
    assert costs.counts["full"] == 1 and costs.counts["encode"] >= 1
    assert costs.counts["turbo"] == 1
    e.generate(question=QUESTION, chunks=[TOWER], max_new_tokens=1, strategy="full")
    e.generate(question=QUESTION, chunks=[TOWER], max_new_tokens=1)
    assert costs.full_s(200) > 0 and costs.encode_s([100]) > 0
    assert costs.reuse_s("turbo", 200, 20) > 0


@pytest.mark.skipif(not per_thread_threads(), reason="no per-thread OpenMP setting here")
def test_background_threads_are_fewer_and_leave_other_threads_alone() -> None:
    lock = ForwardLock("cpu")
    lock.foreground_threads = 2
    seen: dict[str, int] = {}

    def background() -> None:
        with lock.background(), lock:
            seen["inside"] = torch.get_num_threads()
            other = threading.Thread(target=lambda: seen.update(new=torch.get_num_threads()))
            other.start()
            other.join()
        seen["after"] = torch.get_num_threads()

    before = torch.get_num_threads()
    t = threading.Thread(target=background)
    t.start()
    t.join(30)
    assert seen["inside"] == 1 and seen["after"] == 2
    assert seen["new"] == before == torch.get_num_threads()  # the process default is untouched
