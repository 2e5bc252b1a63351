"""Redis connections for the stores: one server, or a Redis Cluster behind one URL.

``redis://`` and ``rediss://`` name one server (redis-py's ``Redis.from_url``).
``redis+cluster://`` and ``rediss+cluster://`` name a Redis Cluster by one or
more of its nodes, ``redis+cluster://[user:password@]host:port[,host:port...]``
(the scheme the Celery and Go Redis ecosystems write; redis-py's
``RedisCluster.from_url`` takes one node only), with the query options of
``redis://`` (``ssl_*``, ``socket_timeout``, ...). The client is redis-py's own
``RedisCluster``: it follows the slot map, ``MOVED`` and ``ASK`` by itself.

On a cluster, what is read or written together must live in one hash slot:
``slot_key`` wraps a name in a hash tag (``prefix{name}``), so an entry, its
parts and the content index's log keys each stay in one slot.
"""

from __future__ import annotations

import logging
from typing import Any

from kvrag_integrations.errors import StoreURLError

try:  # the optional ``redis`` extra: the package imports without it
    import redis as redis_lib
    from redis.backoff import NoBackoff
    from redis.cluster import REDIS_ALLOWED_KEYS, ClusterNode, RedisCluster
    from redis.exceptions import (
        AskError,
        ClusterError,
        RedisClusterException,
        TryAgainError,
    )
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only where redis is not installed
    redis_lib = None

logger = logging.getLogger(__name__)

#: Cluster URL schemes and the one-server scheme whose options they take.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DEFAULT_PORT = 6379


def down_errors() -> tuple[type[BaseException], ...]:
    """What a Redis that is unreachable, slow, failing over or resharding raises:
    a miss on read (never a damaged entry to delete), a failed write."""
    if redis_lib is None:  # pragma: no cover
        return ()
    return (
        redis_lib.ConnectionError,  # refused, reset, loading (BusyLoadingError)
        redis_lib.TimeoutError,
        ClusterError,  # CLUSTERDOWN, MASTERDOWN
        AskError,  # MOVED / ASK left after redis-py's redirections
        TryAgainError,  # a multi-key command on a slot being migrated
        RedisClusterException,  # no node reachable, slot not covered
    )


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a cluster client (keys then need hash tags)."""
    return redis_lib is not None and isinstance(client, RedisCluster)


def slot_key(prefix: str, name: str, *, cluster: bool) -> str:
    """The Redis key of ``name`` under ``prefix``: in one hash slot with every key
    that starts with it on a cluster (``prefix{name}``), ``prefix + name`` on one server.

    Examples:
        >>> slot_key("kvrag:", "index", cluster=True), slot_key("kvrag:", "index", cluster=False)
        ('kvrag:{index}', 'kvrag:index')
    """
    return f"{prefix}{{{name}}}" if cluster else prefix + name


def check_prefix(prefix: str, *, cluster: bool) -> None:
    """A cluster's key prefix holds no brace: a hash tag in it would put every key
    in one slot (or split an entry from its parts)."""
    if cluster and ("{" in prefix or "}" in prefix):
        raise ValueError(f"a Redis Cluster store's prefix cannot hold '{{' or '}}': {prefix!r}")


def split_cluster_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """The nodes a cluster URL lists and a one-server URL with its options.

    Returns:
        ``([(host, port), ...], "redis://[userinfo@]host:port[/0][?query]")``:
        the first node in a URL that redis-py parses for the options
        (password, TLS, timeouts).

    Raises:
        StoreURLError: not a cluster URL, no node, a bad port, a database other than 0.

    Examples:
        >>> split_cluster_url("rediss+cluster://:pw@a:7000,b,[::1]:7002/0?ssl_cert_reqs=none")
        ([('a', 7000), ('b', 6379), ('::1', 7002)], 'rediss://:pw@a:7000/0?ssl_cert_reqs=none')
    """
    scheme, sep, rest = url.strip().partition("://")
    base = CLUSTER_SCHEMES.get(scheme.lower())
    if not sep or base is None:
        raise StoreURLError(f"not a Redis Cluster URL: expected {' or '.join(CLUSTER_SCHEMES)}://")
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    netloc, tail = (rest, "") if end < 0 else (rest[:end], rest[end:])
    userinfo, at, hosts = netloc.rpartition("@")
    nodes = [_host_port(part) for part in hosts.split(",")]
    path = tail.split("?", 1)[0].split("#", 1)[0]
    if path.strip("/") not in ("", "0"):
        raise StoreURLError(f"a Redis Cluster has database 0 only, the URL names {path!r}")
    host, port = nodes[0]
    host = f"[{host}]" if ":" in host else host
    return nodes, f"{base}://{userinfo}{at}{host}:{port}{tail}"


def _host_port(part: str) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):  # [IPv6]:port
        host, _, port = part[1:].partition("]")
        port = port[1:] if port.startswith(":") else port
    else:
        host, _, port = part.partition(":")
    if not host:
        raise StoreURLError(f"a Redis Cluster URL lists a node without a host: {part!r}")
    if not port:
        return host, DEFAULT_PORT
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise StoreURLError(f"a Redis Cluster URL lists a bad port: {part!r}")
    return host, int(port)


def open_client(url: str, socket_timeout: float) -> Any:
    """A client for ``url``: ``redis.Redis`` (nothing connected until used) or, for a
    cluster URL, a ``RedisCluster`` connected and checked now (see ``open_cluster``).

    One quick retry covers a pooled connection the server dropped (a restart, a
    failover); more, with backoff (redis-py's default), would stall requests for
    seconds where a miss costs only a recomputation.
    """
    if is_cluster_url(url):
        return open_cluster(url, socket_timeout)
    return redis_lib.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 1),
    )


def open_cluster(url: str, socket_timeout: float = 1.0) -> Any:
    """A ``RedisCluster`` for a cluster URL, its slot map read and checked.

    Messages name nodes (``host:port``), never the URL: it may hold a password.

    Raises:
        StoreURLError: a bad URL or option; no listed node reachable (a down
            cluster); a listed node that is no cluster node or one of another
            cluster; slots no primary serves; a cluster whose state is not ``ok``.
            A listed node that does not answer while others do is only logged:
            a replica of ours must start while one Redis node is down.
    """
    nodes, first = split_cluster_url(url)
    try:
        options = redis_lib.connection.parse_url(first)
    except ValueError as exc:
        raise StoreURLError(f"bad Redis Cluster URL option: {exc}") from None
    unknown = sorted(set(options) - set(REDIS_ALLOWED_KEYS))
    if unknown:
        raise StoreURLError(f"unknown Redis Cluster URL option(s): {', '.join(unknown)}")
    try:
        client = RedisCluster(
            url=first,
            startup_nodes=[ClusterNode(host, port) for host, port in nodes[1:]],
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 1),
            require_full_coverage=True,
        )
    except (RedisClusterException, redis_lib.RedisError) as exc:
        raise StoreURLError(_why_not(nodes, exc)) from None
    try:
        _check_nodes(client, nodes, options)
        state = client.cluster_info().get("cluster_state")
        if state != "ok":
            raise StoreURLError(f"the Redis Cluster is down (cluster_state: {state})")
    except StoreURLError:
        client.close()
        raise
    except (RedisClusterException, redis_lib.RedisError) as exc:
        client.close()
        raise StoreURLError(f"the Redis Cluster cannot be read: {exc}") from None
    return client


def _why_not(nodes: list[tuple[str, int]], exc: Exception) -> str:
    listed = ", ".join(f"{host}:{port}" for host, port in nodes)
    text = str(exc)
    if "not enabled" in text:
        return f"{listed}: no Redis Cluster node (cluster mode disabled: use redis://)"
    if "not covered" in text:
        return f"the Redis Cluster at {listed} does not serve every hash slot ({text})"
    if any(word in text for word in ("username-password", "WRONGPASS", "NOAUTH", "uthenticat")):
        return f"the Redis Cluster at {listed} refused the URL's credentials: {text}"
    if "cannot be connected" in text:
        return f"no Redis Cluster node answers at {listed} (a down cluster, or wrong nodes): {text}"
    return f"the Redis Cluster at {listed}: {text}"


def _check_nodes(client: Any, nodes: list[tuple[str, int]], options: dict) -> None:
    """Each listed node is one of this cluster's (by node id), or does not answer."""
    ids = {info.get("node_id") for info in client.cluster_nodes().values()}
    kwargs = {k: v for k, v in options.items() if k not in ("host", "port", "db")}
    for host, port in nodes:
        if client.get_node(host, port) is not None:
            continue
        one = redis_lib.Redis(host=host, port=port, socket_timeout=1, **kwargs)
        try:
            info = one.info("cluster")
            myid = one.execute_command("CLUSTER MYID") if info.get("cluster_enabled") else None
        except redis_lib.ConnectionError as exc:
            logger.warning("Redis Cluster node %s:%s does not answer (%s)", host, port, exc)
            continue
        finally:
            one.close()
        if myid is None:
            raise StoreURLError(f"{host}:{port} is a Redis server without cluster mode")
        if (myid.decode() if isinstance(myid, bytes) else myid) not in ids:
            raise StoreURLError(f"{host}:{port} is a node of another Redis Cluster")


def primaries_memory(client: Any) -> dict[str, dict[str, int]]:
    """Each primary's ``maxmemory``, ``used_memory`` and ``total_system_memory``
    (``INFO memory``), by node name (``host:port``); one entry for a single server."""
    if not is_cluster(client):
        info = client.info("memory")
        return {"": {k: int(info.get(k, 0) or 0) for k in _MEMORY_FIELDS}}
    out = {}
    for node in client.get_primaries():  # one by one: one primary's reply is not keyed
        info = client.info("memory", target_nodes=node)
        out[node.name] = {k: int(info.get(k, 0) or 0) for k in _MEMORY_FIELDS}
    return out


_MEMORY_FIELDS = ("maxmemory", "used_memory", "total_system_memory")


EVICTION_POLICY = "noeviction"
"""The ``maxmemory-policy`` a server's store needs: the store's budget evicts (by
namespace and quota); a Redis that evicts by itself past ``maxmemory`` drops
entries, parts of entries and the index log past every quota."""


def check_eviction_policy(client: Any) -> None:
    """Refuse a Redis whose primaries evict keys by themselves.

    Raises:
        StoreURLError: a primary's ``maxmemory-policy`` is not ``noeviction``, named
            (a primary that does not answer now is logged and left unchecked: the
            store was reached at start; a replica must start while a node is slow).
    """
    found = {}
    try:
        if not is_cluster(client):
            found["redis"] = str(client.info("memory").get("maxmemory_policy", ""))
        else:
            for node in client.get_primaries():
                info = client.info("memory", target_nodes=node)
                found[node.name] = str(info.get("maxmemory_policy", ""))
    except down_errors() as exc:
        logger.warning("kvrag: Redis's maxmemory-policy not read (%s): not checked", exc)
    evicting = {name: policy for name, policy in found.items() if policy != EVICTION_POLICY}
    if evicting:
        said = ", ".join(f"{name}: {policy}" for name, policy in sorted(evicting.items()))
        raise StoreURLError(
            f"the store's Redis evicts keys by itself ({said}): it would drop entries, "
            f"their parts and the index log past every quota; set maxmemory-policy "
            f"{EVICTION_POLICY} (CONFIG SET maxmemory-policy {EVICTION_POLICY}): the "
            "server's budget evicts"
        )
