"""A server's store is bounded by default: budget, namespace quotas, the index log counted.

Real disk stores and index logs in a temp folder, synthetic entries (no model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvrag_integrations.chunk_kv import ChunkKV, cache_key
from kvrag_integrations.matching import DiskIndexLog
from kvrag_integrations.store import DiskKVStore, MemoryKVStore
from kvrag_integrations.store.namespaces import namespace_id, namespace_kind
from kvrag_integrations.store.quotas import Quotas, namespace_of
from kvrag_integrations.store.sizing import DISK_FRACTION, store_budget
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.config import ConnectorSettings, parse_store_bytes
from kvrag_integrations.vllm.keys import KeyFile, namespace_quotas
from kvrag_integrations.vllm.serve import main as serve_main
from kvrag_integrations.vllm.trust import ANON_SALT_PREFIX, Tenant

BASE = "model-fp"
A, B = (Tenant.of_key_namespace(name, b"secret") for name in ("team-a", "team-b"))


def make_kv(seed: int, fingerprint: str, n: int = 16) -> ChunkKV:
    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn((2, 2, n, 8), generator=gen) for _ in range(2))
    ids = torch.arange(seed * 1000, seed * 1000 + n)
    return ChunkKV(ids, keys, values, fingerprint)


def write(store: DiskKVStore, budget: StoreBudget, log: DiskIndexLog, kv: ChunkKV) -> bool:
    """What the connector's worker does with an entry it stores."""
    if not budget.allow_write(kv.nbytes + 4096, kv.fingerprint):
        return False
    store.put(kv)
    log.append(kv.fingerprint, kv.token_ids.tolist())
    return True


def held(store: DiskKVStore, log: DiskIndexLog) -> int:
    return sum(i.nbytes for i in store.entries()) + log.nbytes()


def test_a_flood_of_one_tenant_keeps_the_store_in_budget_and_spares_the_others(
    tmp_path: Path,
) -> None:
    store, log = DiskKVStore(tmp_path), DiskIndexLog(tmp_path)
    one = make_kv(0, BASE).nbytes + 4096
    max_bytes = 24 * one
    quotas = Quotas(0.5, {A.namespace: 0, B.namespace: 0})
    budget = StoreBudget(store, max_bytes, quotas=quotas, index_log=log)
    ingested = [make_kv(10_000 + i, B.fingerprint(BASE)) for i in range(6)]
    for kv in ingested:
        assert write(store, budget, log, kv)
    most = 0
    for i in range(200):  # 200 distinct prompts of tenant A, learned one by one
        assert write(store, budget, log, make_kv(i, A.fingerprint(BASE)))
        most = max(most, held(store, log))
    assert most <= max_bytes  # never past the budget, the index log counted
    assert all(store.contains(kv.key) for kv in ingested)  # B's entries survived
    flooded = [i for i in store.entries() if namespace_of(i.fingerprint) == A.namespace]
    assert sum(i.nbytes for i in flooded) <= max_bytes // 2  # A within its quota
    assert budget.evicted >= 150
    # the log holds no record of an evicted entry once compacted: what is live
    live = {i.key for i in store.entries()}
    records = DiskIndexLog(tmp_path).read_new()
    keys = [cache_key(ns, ids.tolist()) for ns, ids in records]
    assert set(keys) == live and len(keys) <= len(live) + 0.25 * len(live) + 6


def test_a_namespace_id_says_its_kind_and_no_kind_names_another() -> None:
    salt, key = Tenant.of_salt("team-a"), Tenant.of_key_namespace("team-a", b"secret")
    own = Tenant.of_request("anonymous", "0f" * 16)
    tenants = (Tenant(), key, salt, own)
    kinds = [namespace_kind(namespace_of(t.fingerprint(BASE))) for t in tenants]
    assert kinds == ["shared", "key", "salt", "private"]  # read from what is stored
    assert len({salt.namespace, key.namespace, own.namespace, ""}) == 4
    assert own.salt == ANON_SALT_PREFIX + "0f" * 16  # the request's own salt
    quotas = Quotas()
    assert [quotas.pool(t.namespace) for t in tenants] == [None, None, "salt", "private"]
    for stale in ("0123456789abcdef01234567", "salt-xyz", "key-" + "0" * 25):
        assert namespace_kind(stale) is None and quotas.group(f"{BASE}+ns-{stale}") == "?"
    assert quotas.group(None) == "?"
    with pytest.raises(ValueError, match="kind"):
        namespace_id("team", "a")


def test_a_key_quota_from_the_key_file_bounds_its_namespace(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": {
                    "sk-a": {"namespace": "team-a", "role": "write", "quota_bytes": 3000},
                    "sk-a2": {"namespace": "team-a", "role": "read", "quota_bytes": 9000},
                    "sk-b": {"namespace": "team-b", "role": "write"},
                },
                "anonymous": "none",
            }
        )
    )
    quotas = namespace_quotas(KeyFile.load(keys))
    assert quotas == {A.namespace: 9000, B.namespace: 0}  # the largest of its keys
    assert namespace_of(A.fingerprint(BASE)) == A.namespace  # what entries carry
    settings = ConnectorSettings("disk:/tmp/x", namespace_quotas=quotas)
    assert (
        Quotas(settings.namespace_share, settings.namespace_quotas).limit(A.namespace, 10**6)
        == 9000
    )
    keys.write_text(json.dumps({"keys": {"sk": {"namespace": "a", "quota_bytes": -1}}}))
    with pytest.raises(ValueError, match="quota_bytes"):
        KeyFile.load(keys)


def test_where_keys_write_the_shared_namespace_strangers_read_by_default(
    tmp_path: Path,
) -> None:
    """A stranger's write counts in the shared namespace's quota, beside what its
    writers ingested: where a key writes it, anonymous callers read unless the
    file says otherwise."""
    keys = tmp_path / "keys.json"

    def anonymous(**raw) -> str:
        keys.write_text(json.dumps(raw))
        return KeyFile.load(keys).anonymous

    writer = {"sk-ops": {"namespace": "", "role": "write"}}
    reader = {"sk-ops": {"namespace": "", "role": "read"}}
    tenant = {"sk-a": {"namespace": "team-a", "role": "write"}}
    assert anonymous(keys=writer) == "read"
    assert anonymous(keys={**tenant, "sk-root": {"namespace": "", "role": "admin"}}) == "read"
    assert anonymous(keys=writer, anonymous="write") == "write"  # the operator's say
    assert anonymous(keys=reader) == anonymous(keys=tenant) == "write"


def test_a_write_larger_than_its_quota_is_refused(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path)
    one = make_kv(0, BASE).nbytes + 4096
    budget = StoreBudget(store, 10 * one, quotas=Quotas(0.5, {A.namespace: one // 2}))
    assert not budget.allow_write(one, A.fingerprint(BASE))
    assert budget.allow_write(one, BASE)


def test_no_budget_means_auto_and_unbounded_must_be_named(tmp_path: Path) -> None:
    assert ConnectorSettings("disk:/tmp/x").max_store_bytes == "auto"
    assert ConnectorSettings("disk:/tmp/x", max_store_bytes="none").max_store_bytes == "none"
    for bad in (0, "0", -5, "lots", 1.5):
        with pytest.raises(ValueError):
            parse_store_bytes(bad)
    assert parse_store_bytes("64000000") == 64_000_000


def test_serve_refuses_a_zero_budget_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--store", "disk:/tmp/kv", "--print-command"]
    with pytest.raises(SystemExit):
        serve_main([*base, "--max-store-bytes", "0"])
    assert "no longer means no budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main([*base, "--namespace-share", "1.5"])


def test_serve_refuses_a_store_url_of_no_known_form_before_vllm_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bare path was refused only by each worker, after vLLM had loaded the model."""
    with pytest.raises(SystemExit) as exited:
        serve_main(["--store", "/tmp/kv-as-a-path"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown store URL '/tmp/kv-as-a-path'" in err and "disk:DIR" in err
    with pytest.raises(SystemExit):
        serve_main(["--store", "disk:"])
    assert "names no directory" in capsys.readouterr().err


def test_auto_budget_of_a_disk_store_is_half_of_what_its_disk_could_give(
    tmp_path: Path,
) -> None:
    store = DiskKVStore(tmp_path / "kv")  # not made yet: sized from its parent's disk
    nbytes, why = store_budget(store)
    free = shutil.disk_usage(tmp_path).free
    assert abs(nbytes - DISK_FRACTION * free) <= 0.01 * free and "free" in why
    store.put(make_kv(1, BASE))
    held_now = sum(i.nbytes for i in store.entries())
    again, _ = store_budget(store)
    free = shutil.disk_usage(tmp_path).free
    assert abs(again - DISK_FRACTION * (free + held_now)) <= 0.01 * free
    assert store_budget(MemoryKVStore(max_bytes=2**30))[0] == 2**30


def test_a_budget_without_quotas_evicts_the_least_recently_used_of_any_tenant() -> None:
    store = MemoryKVStore(max_bytes=None)
    one = make_kv(0, BASE).nbytes
    budget = StoreBudget(store, 3 * one, low_water=1.0)  # no quotas: one group
    older = make_kv(1, A.fingerprint(BASE))
    for kv in (older, make_kv(2, B.fingerprint(BASE)), make_kv(3, BASE)):
        assert budget.allow_write(kv.nbytes, kv.fingerprint)
        store.put(kv)
    assert budget.allow_write(one, Tenant.of_salt("s").fingerprint(BASE))
    assert not store.contains(older.key) and len(store) == 2


def test_a_writer_over_the_budget_evicts_what_fits_it_not_its_whole_group() -> None:
    """Issue 59 hole 5: a write that took the store past its budget evicted the
    writer's own entries until the store held the low-water mark, its whole group
    where others hold the rest within their quotas, though one eviction would do.
    It evicts its own until the write fits, and at most a low-water share more."""
    store = MemoryKVStore(max_bytes=None)
    one = make_kv(0, BASE).nbytes
    budget = StoreBudget(store, 10 * one, quotas=Quotas(0.5))
    others = [make_kv(10 + i, (A if i < 4 else B).fingerprint(BASE)) for i in range(8)]
    mine = [make_kv(20 + i, BASE) for i in range(2)]
    for kv in [*mine, *others]:  # the shared namespace 2, team-a 4, team-b 4: all within quota
        assert budget.allow_write(kv.nbytes, kv.fingerprint)
        store.put(kv)
    assert budget.allow_write(one, BASE)  # an 11th: one of its own has to go
    assert [kv.key for kv in mine if not store.contains(kv.key)] == [mine[0].key]
    assert all(store.contains(kv.key) for kv in others)


def test_a_private_entry_past_its_time_goes_at_the_next_measurement(tmp_path: Path) -> None:
    """Issue 59 hole 11: the private entries of a server killed mid-request stayed
    until idle eviction under pressure (no expiry). They expire: every measurement
    of the budget deletes those unused for ``PRIVATE_TTL_S`` (Redis expires them
    itself: ``test_store_redis.py``)."""
    import os
    import time

    from kvrag_integrations.store.namespaces import PRIVATE_TTL_S

    store = DiskKVStore(tmp_path)
    left = make_kv(1, Tenant.of_request("anonymous", "killed").fingerprint(BASE))
    fresh = make_kv(2, Tenant.of_request("anonymous", "running").fingerprint(BASE))
    for kv in (left, fresh):
        store.put(kv)
    stamp = time.time() - PRIVATE_TTL_S - 60
    os.utime(tmp_path / left.key[:2] / f"{left.key}.safetensors", (stamp, stamp))
    budget = StoreBudget(store, 10**9, quotas=Quotas(0.5))
    assert budget.allow_write(make_kv(3, BASE).nbytes, BASE)  # the first write measures
    assert not store.contains(left.key) and store.contains(fresh.key)
