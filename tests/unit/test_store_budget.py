"""In-memory tiers are sized from the memory free where they keep entries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.engine.modeling.model import LoadedModel
from kvrag_integrations.store import DiskKVStore, TieredKVStore, budget


def near_share(got: int, share: float) -> bool:
    """``got`` is ``share`` of the host's available memory (which moves a little)."""
    free = budget.available_host_memory()
    assert free is not None, "this host says how much memory is available"
    return abs(got - max(budget.MIN_BYTES, share * free)) <= 0.1 * share * free


def test_default_engine_store_is_a_share_of_free_host_memory(tiny_loaded: LoadedModel) -> None:
    engine = KVRAGEngine(tiny_loaded)
    assert near_share(engine.store.max_bytes, budget.HOST_FRACTION)


def test_tiered_memory_tier_is_sized_the_same_way(tmp_path: Path) -> None:
    store = TieredKVStore(DiskKVStore(tmp_path))
    assert near_share(store.memory.max_bytes, budget.HOST_FRACTION)
    assert TieredKVStore(DiskKVStore(tmp_path), max_bytes=1 << 20).memory.max_bytes == 1 << 20
    assert store.pin_memory is torch.cuda.is_available()


def test_budget_never_below_the_minimum() -> None:
    assert budget.memory_budget("cpu") >= budget.MIN_BYTES
    assert budget.memory_budget(None) == pytest.approx(budget.memory_budget("cpu"), rel=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_budget_is_a_share_of_free_device_memory() -> None:
    free, _ = torch.cuda.mem_get_info()
    got = budget.memory_budget("cuda")
    assert abs(got - budget.DEVICE_FRACTION * free) <= 0.05 * free
