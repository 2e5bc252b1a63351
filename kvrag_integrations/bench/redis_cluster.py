"""A throwaway Redis Cluster on loopback, for the ``cluster`` suite and the tests.

Each node is a ``redis-server`` with ``cluster-enabled yes`` and no persistence
(only its ``nodes.conf``, so a killed node restarts as the same node); they are
joined by ``redis-cli --cluster create`` with ``--cluster-replicas``. Nodes can
be killed, paused and restarted, and slots moved (``redis-cli --cluster
reshard``), as a deployment's would be.

Examples:
    >>> cluster = LocalRedisCluster(Path("/tmp/c"), primaries=3, replicas=1)  # doctest: +SKIP
    >>> cluster.start().url  # doctest: +SKIP
    'redis+cluster://127.0.0.1:40001,127.0.0.1:40002,...'
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrag_integrations.bench.ports import free_port

NODE_TIMEOUT_MS = 1000  # failure detection: a primary is failed over ~2-3 s after it stops
PORT_TRIES = 3  # draws of a node's ports before the cluster is joined


def find_binary(name: str) -> str | None:
    """``redis-server`` or ``redis-cli`` on PATH (or in /usr/bin, /usr/sbin), if any."""
    candidates = [shutil.which(name), f"/usr/bin/{name}", f"/usr/sbin/{name}"]
    return next((p for p in candidates if p and Path(p).is_file()), None)


def answers_ping(
    port: int, proc: subprocess.Popen, timeout: float = 20, password: str | None = None
) -> bool:
    """Whether the redis-server ``proc`` just started on ``port`` answers a ping
    within ``timeout`` seconds (False: it exited, or never answered). Every
    starter of a redis-server (the cluster's nodes, the benches', the tests')
    waits here."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    deadline = time.monotonic() + timeout
    # One short try per ping: a port another process holds may accept and never answer.
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        password=password,
        socket_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return True
            time.sleep(0.05)
        return False
    finally:
        client.close()


class PortTaken(RuntimeError):
    """A node's port was bound by another process before the node bound it."""


@dataclass
class Node:
    """One ``redis-server`` of the cluster (``proc`` is None while it is down)."""

    port: int
    bus_port: int
    workdir: Path
    proc: subprocess.Popen | None = None
    log_offset: int = 0  # where this run's lines start in its appended redis.log


class LocalRedisCluster:
    """``primaries`` primaries with ``replicas`` replicas each, on loopback.

    Args:
        workdir: a folder of the cluster's own (one sub-folder per node).
        primaries: how many primaries serve the slots (``redis-cli --cluster
            create`` needs 3 or more; one primary is assigned every slot by hand).
        replicas: how many replicas each primary has.
        password: ``requirepass`` and ``masterauth`` of every node (None: none).
        maxmemory: each node's ``maxmemory`` in bytes (None: unlimited), with
            ``noeviction``: a write past it is Redis's OOM error.
        full_coverage: ``cluster-require-full-coverage`` (no: the other primaries
            keep serving while one is failed over; what docs/deployment.md advises).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        primaries: int = 3,
        replicas: int = 1,
        password: str | None = None,
        maxmemory: int | None = None,
        full_coverage: bool = False,
    ) -> None:
        self.server, self.cli = find_binary("redis-server"), find_binary("redis-cli")
        if self.server is None or self.cli is None:
            raise FileNotFoundError("redis-server and redis-cli are needed (apt redis-server)")
        if primaries < 1 or (primaries < 3 and replicas) or (1 < primaries < 3):
            raise ValueError("a cluster of 1 primary (no replica) or of 3 primaries or more")
        self.workdir, self.password, self.maxmemory = Path(workdir), password, maxmemory
        self.primaries, self.replicas, self.full_coverage = primaries, replicas, full_coverage
        count = primaries * (1 + replicas)
        self.nodes = [Node(0, 0, self.workdir / f"node-{i}") for i in range(count)]
        for node in self.nodes:
            self._draw_ports(node)

    @property
    def url(self) -> str:
        """The store URL naming every node (``redis+cluster://[:password@]h:p,...``)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis+cluster://{auth}" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    # ----------------------------------------------------------------- life
    def start(self, *, join: bool = True) -> LocalRedisCluster:
        """Start every node and (``join``) make them one cluster serving every slot;
        else they stay cluster nodes of no cluster, serving no slot."""
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            for _ in range(PORT_TRIES - 1):
                with contextlib.suppress(PortTaken):
                    self._wait_up(node)
                    break
                self._draw_ports(node)
                self._spawn(node)
            else:
                self._wait_up(node)
        if not join:
            return self
        if self.primaries == 1:
            self.client(self.nodes[0].port).execute_command("CLUSTER ADDSLOTSRANGE", 0, 16383)
        else:
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            self._cli("--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas))
        self.wait_healthy()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node.port)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _draw_ports(self, node: Node) -> None:
        """New client and bus ports for ``node``, distinct from every node's (a node
        not yet joined only: a cluster's nodes.conf names its ports)."""
        taken = {port for n in self.nodes for port in (n.port, n.bus_port)}
        for field in ("port", "bus_port"):
            port = free_port()
            while port in taken:
                port = free_port()
            setattr(node, field, port)
            taken.add(port)
        (node.workdir / "nodes.conf").unlink(missing_ok=True)

    def _spawn(self, node: Node) -> None:
        node.workdir.mkdir(parents=True, exist_ok=True)
        log = node.workdir / "redis.log"
        node.log_offset = log.stat().st_size if log.exists() else 0
        args = ["--port", str(node.port), "--cluster-port", str(node.bus_port)]
        args += ["--bind", "127.0.0.1", "--dir", str(node.workdir)]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
        args += ["--cluster-require-full-coverage", "yes" if self.full_coverage else "no"]
        args += ["--save", "", "--appendonly", "no"]  # a killed node's data is lost
        args += ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.maxmemory:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "noeviction"]
        with open(node.workdir / "redis.log", "ab") as log:
            node.proc = subprocess.Popen([self.server, *args], stdout=log, stderr=log)

    def _wait_up(self, node: Node, timeout: float = 20) -> None:
        if node.proc is not None and answers_ping(node.port, node.proc, timeout, self.password):
            return
        with open(node.workdir / "redis.log", "rb") as file:
            file.seek(node.log_offset)
            log = file.read().decode(errors="replace")[-2000:]
        if "Address already in use" in log:
            raise PortTaken(f"port {node.port} or {node.bus_port} was taken:\n{log}")
        raise RuntimeError(f"redis-server did not come up on {node.port}:\n{log}")

    def _cli(self, *args: str) -> str:
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        done = subprocess.run(
            [self.cli, *auth, *args, "--cluster-yes"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    # ------------------------------------------------------------ topology
    def client(self, port: int) -> Any:
        """A plain ``redis.Redis`` on one node (no cluster routing)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=5)

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def topology(self) -> dict[int, dict[str, Any]]:
        """Per live node's port: ``id``, ``role`` (primary/replica), ``primary`` (its
        primary's id), ``slots`` (how many), ``failed``, from a live node's view."""
        for node in self.nodes:
            if node.proc is None:
                continue
            with contextlib.suppress(Exception):
                return _parse_nodes(self.client(node.port).execute_command("CLUSTER NODES"))
        raise RuntimeError("no node of the cluster answers")

    def primary_ports(self) -> list[int]:
        """The ports of the live primaries that serve slots."""
        return sorted(
            port
            for port, n in self.topology().items()
            if n["role"] == "primary" and n["slots"] and not n["failed"]
        )

    def wait_healthy(self, timeout: float = 60, *, replicas: bool = True) -> float:
        """Wait until every live node says ``cluster_state:ok``, ``primaries`` live
        primaries serve every slot and (``replicas``) each has its replicas linked;
        returns the seconds waited."""
        started = time.monotonic()
        while True:
            with contextlib.suppress(Exception):
                if self._healthy(replicas):
                    return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"the cluster is not healthy after {timeout} s")
            time.sleep(0.1)

    def _healthy(self, replicas: bool) -> bool:
        live = [n for n in self.nodes if n.proc is not None]
        for node in live:
            info = self.client(node.port).execute_command("CLUSTER INFO")
            if info.get("cluster_state") != "ok":
                return False
        topology = self.topology()
        primaries = [p for p, n in topology.items() if n["role"] == "primary" and n["slots"]]
        if len(primaries) != self.primaries or any(topology[p]["failed"] for p in primaries):
            return False
        if not replicas:
            return True
        for port, n in topology.items():
            if n["role"] == "replica" and not n["failed"]:
                link = self.client(port).info("replication").get("master_link_status")
                if link != "up":
                    return False
        linked = [n for n in topology.values() if n["role"] == "replica" and not n["failed"]]
        return len(linked) == self.primaries * self.replicas

    # -------------------------------------------------------------- faults
    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (a crash: its data is gone, its config kept)."""
        node = self.node(port)
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(timeout=10)
        node.proc = None

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins (as a replica, if it was failed over)."""
        node = self.node(port)
        self._spawn(node)
        self._wait_up(node)

    def reshard(self, source: int, target: int, slots: int) -> subprocess.Popen:
        """Start moving ``slots`` slots from the primary on ``source`` to the one on
        ``target`` (``redis-cli --cluster reshard``); returns the running process
        (its output goes to ``workdir/reshard.log``)."""
        topology = self.topology()
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        args = [self.cli, *auth, "--cluster", "reshard", f"127.0.0.1:{source}"]
        args += ["--cluster-from", topology[source]["id"], "--cluster-to", topology[target]["id"]]
        args += ["--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "10"]
        # To a file: a line per slot would fill a pipe nobody reads, and block it.
        with open(self.workdir / "reshard.log", "ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def _parse_nodes(nodes: dict[str, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``CLUSTER NODES`` (as redis-py parses it) by port."""
    out = {}
    for address, info in nodes.items():
        flags = str(info["flags"]).split(",")
        primary = info.get("master_id", "-")
        port = int(address.split("@")[0].rsplit(":", 1)[1])
        slots = sum(int(r[-1]) - int(r[0]) + 1 for r in info.get("slots", []))
        out[port] = {
            "id": info["node_id"],
            "role": "primary" if "master" in flags else "replica",
            "primary": None if primary == "-" else primary,
            "slots": slots,
            "failed": "fail" in flags or "fail?" in flags,
        }
    return out
