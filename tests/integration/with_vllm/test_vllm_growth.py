"""A server started at its defaults stays within a budget it sizes from its store.

One server (``python -m kvrag_integrations.vllm.serve``) on a Redis of 48 MB
``maxmemory`` (``noeviction``: Redis would refuse a write past it rather than
hide an overflow), with no ``--max-store-bytes``: the server sizes its budget
from ``maxmemory`` and says so at start. Tenant ``keep`` ingests passages;
tenant ``flood`` then sends 60 distinct prompts over the learn threshold,
each learned as an entry of ~1.9 MB (three times the budget in all, six times
its namespace's quota). The store
(entries and the content index's log) never passes the budget, the flood stays
within its namespace's quota, and ``keep``'s entries survive.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from redis_helpers import RedisServer
from vllm_helpers import VLLMServer, needs_vllm

from kvrag_integrations.bench.redis_cluster import find_binary
from kvrag_integrations.matching import RedisIndexLog
from kvrag_integrations.store import RedisKVStore
from kvrag_integrations.store.quotas import namespace_of
from kvrag_integrations.store.sizing import REDIS_FRACTION
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine
from kvrag_integrations.vllm.trust import Tenant

needs_vllm()

MAXMEMORY = 48 * 2**20
PROMPTS = 60  # ~1.9 MB each: 3x the budget
KEYS = {
    "keys": {
        "sk-keep": {"namespace": "keep", "role": "write"},
        "sk-flood": {"namespace": "flood", "role": "write"},
    },
    "anonymous": "read",  # (the readiness probe has no key)
}


def prompt(i: int) -> str:
    """A distinct prompt of 60-odd tokens (over the test's learn threshold of 32) that
    shares no run of 16 tokens with another (nothing for detection to load)."""
    rng = random.Random(i)
    return "Add up: " + " ".join(str(rng.randint(100, 999)) for _ in range(20))


@pytest.fixture(scope="module")
def redis_48mb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = find_binary("redis-server")
    if binary is None:
        pytest.skip("redis-server not found")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis-48mb")).start()
    store = RedisKVStore(server.url)
    store.client.config_set("maxmemory", str(MAXMEMORY))
    store.client.config_set("maxmemory-policy", "noeviction")
    store.close()
    yield server
    server.stop()


def held(store: RedisKVStore, log: RedisIndexLog) -> int:
    return sum(i.nbytes for i in store.entries()) + log.nbytes()


def test_a_flood_of_learned_prompts_stays_within_the_default_budget(
    redis_48mb: RedisServer, tmp_path: Path, private_vllm_server: Callable[..., VLLMServer]
) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    extra = ["--tenant-keys", str(keys), "--learn-min-tokens", "32"]  # no --max-store-bytes
    server = private_vllm_server(redis_48mb.url, *extra)  # its own store, flooded
    store = RedisKVStore(redis_48mb.url)
    log = RedisIndexLog(store.client, store.prefix)
    try:
        said = re.search(r"kvrag: store budget (\d+) bytes: (.*)", server.log.read_text())
        assert said is not None, "the budget is said at start"
        budget = int(said.group(1))
        assert budget == int(REDIS_FRACTION * MAXMEMORY) and "maxmemory" in said.group(2)
        keep = Tenant.of_key_namespace("keep", b"ids-do-not-depend-on-it").namespace
        flood = Tenant.of_key_namespace("flood", b"ids-do-not-depend-on-it").namespace
        with VLLMEngine.connect(server.url, api_key="sk-keep") as client:
            refs = client.encode_chunks(
                [f"Passage {k} kept by tenant keep: {prompt(10_000 + k)}" for k in range(3)],
                show_progress=False,
            )
        kept = {i.key for i in store.entries() if namespace_of(i.fingerprint) == keep}
        assert len(kept) == len(refs) == 3
        http = httpx.Client(base_url=f"{server.url}/v1", timeout=120)
        headers = {"Authorization": "Bearer sk-flood"}
        model = http.get("/models", headers=headers).json()["data"][0]["id"]
        most = stored_flood = 0
        for i in range(PROMPTS):
            body = {"model": model, "prompt": prompt(i), "max_tokens": 1, "temperature": 0}
            reply = http.post("/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            if i % 10 == 9:
                most = max(most, held(store, log))
        time.sleep(2)  # the last learned prompts are written after their answers
        most = max(most, held(store, log))
        entries = list(store.entries())
        stored_flood = sum(i.nbytes for i in entries if namespace_of(i.fingerprint) == flood)
        flood_count = sum(namespace_of(i.fingerprint) == flood for i in entries)
        print(
            f"budget {budget}, most held {most}, flood holds {stored_flood} "
            f"in {flood_count} entries, index log {log.nbytes()} bytes"
        )
        assert most <= budget
        assert 0 < stored_flood <= budget // 2  # learned, within its quota
        assert 5 <= flood_count < PROMPTS  # learned, and evicted to make room
        assert kept <= {i.key for i in entries}  # the other tenant's entries survived
        http.close()
    finally:
        log.close()
        store.close()
        server.stop()
