"""A Redis Cluster for the integration tier: 3 primaries and 3 replicas on loopback.

One cluster serves the whole run (the ``redis_cluster`` session fixture in
tests/integration/conftest.py): each test keeps to its own key prefix, and a
test that kills, pauses or reshards a node leaves the cluster healthy again
(``healed``). The cluster itself is ``kvrag_integrations.bench.redis_cluster``'s,
which the ``cluster`` benchmark starts too.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster, find_binary
from kvrag_integrations.chunk_kv import ChunkKV

PASSWORD = "cluster-test-secret"  # every node asks for it: the URL's password is used
FP = "fp-cluster-test"


def make_kv(seed: int = 0, n: int = 16, width: int = 8) -> ChunkKV:
    """An entry of random K/V (its key, a sha256 of its ids, spreads as a chunk's would)."""
    gen, shape = torch.Generator().manual_seed(seed), (2, 2, n, width)
    keys, values = (torch.randn(shape, generator=gen) for _ in range(2))
    return ChunkKV(torch.randint(0, 32000, (n,), generator=gen), keys, values, FP)


def same(a: ChunkKV | None, b: ChunkKV) -> bool:
    """``a`` is ``b`` bit for bit."""
    return a is not None and all(
        torch.equal(getattr(a, name), getattr(b, name)) for name in ("token_ids", "keys", "values")
    )


def replicated(cluster: LocalRedisCluster) -> None:
    """Wait until every primary's writes reached its replica (``WAIT``)."""
    for port in cluster.primary_ports():
        cluster.client(port).execute_command("WAIT", cluster.replicas, 10_000)


def cluster_binaries() -> str | None:
    """Why the cluster cannot start here (None: it can)."""
    missing = [name for name in ("redis-server", "redis-cli") if find_binary(name) is None]
    return f"{' and '.join(missing)} not found (apt-get install redis-server)" if missing else None


def entries_per_primary(store: RedisKVStore) -> Counter[str]:
    """How many of the store's entries each primary holds, by asking each primary
    directly (SCAN on that node), not by the client's slot map."""
    counts: Counter[str] = Counter()
    for node in store.client.get_primaries():
        for raw in store.client.scan_iter(match=f"{store.prefix}*", target_nodes=node):
            if store._entry_key(raw.decode()) is not None:
                counts[node.name] += 1
    return counts


@contextlib.contextmanager
def healed(cluster: LocalRedisCluster) -> Iterator[LocalRedisCluster]:
    """Whatever the test does to nodes, restart the killed ones and wait for a
    healthy cluster (every primary with its replica) before the next test."""
    try:
        yield cluster
    finally:
        for node in cluster.nodes:
            if node.proc is None:
                cluster.restart(node.port)
        cluster.wait_healthy(120)
