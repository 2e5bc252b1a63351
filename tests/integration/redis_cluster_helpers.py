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

from kvrag_integrations import RedisKVStore
from kvrag_integrations.bench.redis_cluster import LocalRedisCluster, find_binary

PASSWORD = "cluster-test-secret"  # every node asks for it: the URL's password is used


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
